"""What ``loraplex serve`` logs, as vLLM does: progress while loading, a start-up summary, one
line per request (unless ``--disable-log-requests``), the ``loraplex.usage`` JSON lines really
emitted, a periodic stats line (triggered directly here, never by waiting), ``--log-format
json``."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.logs import JsonFormatter, StatsLogger, StatsSource, configure_logging
from loraplex.server.app import create_app
from loraplex.server.state import ServerState
from loraplex.testing import sync


def wait_idle(state: ServerState) -> None:
    sync.wait_idle(state.engine, state.aengine)


def make_config(tiny_model: Path, adapters: dict[str, Path], **server: object) -> ServerConfig:
    return ServerConfig(
        engine=EngineConfig(
            model=str(tiny_model), device="cpu", num_threads=1, max_loras=2, max_cpu_loras=2
        ),
        served_model_name=["base"],
        lora_modules=[LoRAModule("sql", str(adapters["all_r8"]))],
        **server,  # type: ignore[arg-type]
    )


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """loraplex's (and uvicorn's) log records as JSON lines, the way serve configures them."""
    stream = io.StringIO()
    setup = configure_logging("info", "json", stream=stream)
    try:
        yield stream
    finally:
        setup.close()


def records(stream: io.StringIO) -> list[dict]:
    lines = [ln for ln in stream.getvalue().splitlines() if ln]
    assert all(ln.isascii() for ln in lines)
    return [json.loads(ln) for ln in lines]


def complete(client: TestClient, model: str, prompt: str = "hello") -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


def test_start_up_summary_request_and_usage_lines(
    tiny_model: Path, adapters: dict[str, Path], captured: io.StringIO
) -> None:
    app = create_app(make_config(tiny_model, adapters))
    with TestClient(app) as client:
        complete(client, "sql")
        complete(client, "base")
        wait_idle(app.state.loraplex)
    got = records(captured)
    messages = [r["message"] for r in got]
    assert any(m.startswith(f"loading model {tiny_model}") for m in messages)
    assert any(m.startswith("model and KV cache ready in") for m in messages)
    summary = " | ".join(
        m for r, m in zip(got, messages, strict=True) if r["logger"] == "loraplex.server.app"
    )
    for part in ("LlamaForCausalLM", "dtype", "KV cache:", "blocks x 16 tokens", "adapter tiers: device 2 slots",
                 "host 2 adapters", "eviction policy hybrid", "adapters at start-up: sql",
                 "ready: serving base on http://127.0.0.1:8000"):  # fmt: skip
        assert part in summary, part
    usage = [r for r in got if r["logger"] == "loraplex.usage"]
    assert [u["adapter"] for u in usage] == ["sql", None]
    assert json.loads(usage[0]["message"]) == {
        k: usage[0][k] for k in json.loads(usage[0]["message"])
    }
    assert usage[0]["prompt_tokens"] > 0 and usage[0]["completion_tokens"] == 3
    lines = [r for r in got if r["logger"] == "loraplex.requests"]
    assert [r["model"] for r in lines] == ["sql", "base"]
    assert lines[0]["adapter"] == "sql" and lines[0]["completion_tokens"] == 3
    assert lines[0]["finish_reasons"] == ["length"] and lines[0]["request_id"].startswith("cmpl-")
    assert "adapter=sql@" in lines[0]["message"] and "completion_tokens=3" in lines[0]["message"]


def test_disable_log_requests_keeps_usage(
    tiny_model: Path, adapters: dict[str, Path], captured: io.StringIO
) -> None:
    app = create_app(make_config(tiny_model, adapters, disable_log_requests=True))
    with TestClient(app) as client:
        complete(client, "sql")
    got = records(captured)
    assert not [r for r in got if r["logger"] == "loraplex.requests"]
    assert [r["adapter"] for r in got if r["logger"] == "loraplex.usage"] == ["sql"]


def test_debug_shows_prompts_up_to_max_log_len(tiny_model: Path, adapters: dict[str, Path]) -> None:
    stream = io.StringIO()
    setup = configure_logging("debug", "text", stream=stream)
    try:
        app = create_app(make_config(tiny_model, adapters, max_log_len=5))
        with TestClient(app) as client:
            complete(client, "base", prompt="abcdefghij")
    finally:
        setup.close()
    text = stream.getvalue()
    assert "prompt 'abcde' (" in text and "abcdef" not in text
    line = next(ln for ln in text.splitlines() if "[loraplex.requests] request cmpl-" in ln)
    assert line.startswith("INFO ") and "model=base" in line and "finish=length" in line


def test_stats_line_from_a_running_server(
    tiny_model: Path, adapters: dict[str, Path], captured: io.StringIO
) -> None:
    app = create_app(make_config(tiny_model, adapters))
    stats: StatsLogger = app.state.stats
    with TestClient(app) as client:
        complete(client, "sql")
        complete(client, "sql")
        wait_idle(app.state.loraplex)
        line = stats.log_once()
    assert line is not None
    assert "Avg prompt throughput: " in line and "Running: 0 reqs, Waiting: 0 reqs" in line
    assert "KV cache usage: 0.0%" in line and "Adapter hit rate: device" in line
    rec = [r for r in records(captured) if r["logger"] == "loraplex.stats"][-1]
    assert rec["prompt_tokens_per_s"] > 0 and rec["generation_tokens_per_s"] > 0
    assert rec["running"] == 0 and rec["adapter_device_hit_rate"] is not None


def test_stats_line_rates_and_idle() -> None:
    totals = {"prompt_tokens": 0.0, "generation_tokens": 0.0, "prefix_queries": 0.0,
              "prefix_hits": 0.0, "preemptions": 0.0, "host_hits": 0.0, "host_misses": 0.0}  # fmt: skip
    gauges = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    now = [100.0]
    stats = StatsLogger(
        StatsSource(lambda: dict(totals), lambda: dict(gauges)), clock=lambda: now[0]
    )
    now[0] += 10
    assert stats.log_once() is None  # a server that has done nothing stays silent

    totals.update(prompt_tokens=500, generation_tokens=100, prefix_queries=400, prefix_hits=100,
                  host_hits=3, host_misses=1, preemptions=2)  # fmt: skip
    gauges.update(running=2, waiting=1, kv_usage=0.25)
    now[0] += 10
    line = stats.log_once()
    assert line == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: "
        "25.0%, Adapter hit rate: host 75.0%, Preemptions: 2"
    )
    gauges.update(running=0, waiting=0, kv_usage=0)
    now[0] += 10
    assert stats.log_once() is not None  # the first idle interval is still reported
    now[0] += 10
    assert stats.log_once() is None  # then silence until something happens
    totals["generation_tokens"] += 5
    now[0] += 10
    assert stats.log_once() is not None


def test_json_formatter_fields_and_exceptions() -> None:
    fmt = JsonFormatter()
    rec = logging.LogRecord("loraplex.x", logging.INFO, "f", 1, "hi \u2028 %s", ("there",), None)
    rec.fields = {"n": 1, "level": "spoofed"}  # type: ignore[attr-defined]
    out = fmt.format(rec)
    assert out.isascii() and "\n" not in out
    obj = json.loads(out)
    assert obj["message"] == "hi \u2028 there" and obj["n"] == 1 and obj["level"] == "INFO"
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.LogRecord("loraplex.x", logging.ERROR, "f", 1, "failed", (), sys.exc_info())
    assert "ValueError: boom" in json.loads(fmt.format(rec))["exception"]


def test_configure_logging_puts_the_loggers_back() -> None:
    logger = logging.getLogger("loraplex")
    before = (logger.level, list(logger.handlers), logger.propagate)
    setup = configure_logging("warning", "text", stream=io.StringIO(), access_log=False)
    assert logger.level == logging.WARNING and not logger.propagate
    assert logging.getLogger("uvicorn.access").level > logging.CRITICAL
    setup.close()
    assert (logger.level, list(logger.handlers), logger.propagate) == before


def test_loading_progress_per_shard(tiny_model: Path, captured: io.StringIO) -> None:
    from loraplex.model.checkpoint_files import iter_checkpoint

    assert list(iter_checkpoint(tiny_model))
    msgs = [
        r["message"] for r in records(captured) if r["logger"] == "loraplex.model.checkpoint_files"
    ]
    assert msgs and msgs[0].startswith("loading weights 1/")
