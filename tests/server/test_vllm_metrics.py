"""vLLM's metric names and labels next to ours, so vLLM's Grafana dashboard works unchanged:
every series it reads exists with ``model_name`` (and ``engine``), and counts agree with
loraplex's own metrics and with what was served."""

from __future__ import annotations

import threading
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.logs import StatsLogger
from loraplex.server.app import create_app
from loraplex.testing import sync
from loraplex.testing.sync import EVENT_TIMEOUT_S, StepGate, wait_until

# the series vLLM's own Grafana dashboard (examples/observability/dashboards) queries, plus the
# Gateway API ones; with the Prometheus suffixes the exposition adds
VLLM_SERIES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket",
    "vllm:request_inference_time_seconds_bucket",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:gpu_cache_usage_perc",
    "vllm:iteration_tokens_total_bucket",
    "vllm:cache_config_info",
]


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(got: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in got.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def test_vllm_series_with_model_name(tiny_model: Path, adapters: dict[str, Path]) -> None:
    config = ServerConfig(
        engine=EngineConfig(model=str(tiny_model), device="cpu", num_threads=1, max_loras=2),
        served_model_name=["base-model"],
        lora_modules=[LoRAModule("sql", str(adapters["all_r8"]))],
    )
    app = create_app(config)
    state = app.state.loraplex
    with TestClient(app) as client:
        for model, n in (("sql", 5), ("base-model", 4), ("sql", 6)):
            body = {"model": model, "prompt": "the same prompt, shared", "max_tokens": n,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            assert client.post("/v1/completions", json=body).status_code == 200
        sync.wait_idle(state.engine, state.aengine)
        state.metrics.sequences.on_step()  # the last step's observations (the loop may be idle)
        text = client.get("/metrics").text
    got = samples(text)
    for name in VLLM_SERIES:
        assert name in got, name
        if name != "vllm:cache_config_info":
            assert all(lab.get("model_name") == "base-model" for lab, _ in got[name]), name
            assert all(lab.get("engine") == "0" for lab, _ in got[name]), name
    # counts agree with what was served and with loraplex's own series
    assert (
        value(got, "vllm:generation_tokens_total")
        == 15
        == value(got, "loraplex_generation_tokens_total")
    )
    prompt = value(got, "vllm:prompt_tokens_total")
    assert prompt == value(got, "loraplex_prompt_tokens_total") > 0
    assert value(got, "vllm:request_success_total", finished_reason="length") == 3
    assert value(got, "vllm:time_to_first_token_seconds_count") == 3
    assert value(got, "vllm:e2e_request_latency_seconds_count") == 3
    # the step observer saw every sequence: queue, prefill, decode, tokens
    assert value(got, "vllm:request_queue_time_seconds_count") == 3
    assert value(got, "vllm:request_prefill_time_seconds_count") == 3
    assert value(got, "vllm:request_decode_time_seconds_count") == 3
    assert value(got, "vllm:request_generation_tokens_sum") == 15
    assert value(got, "vllm:request_prompt_tokens_sum") == prompt
    assert value(got, "vllm:inter_token_latency_seconds_count") == 15 - 3  # gaps after the first
    # the prefix cache: the same prompt's blocks were looked up three times
    assert value(got, "vllm:prefix_cache_queries_total") == prompt
    assert 0 <= value(got, "vllm:prefix_cache_hits_total") <= prompt
    assert value(got, "vllm:num_preemptions_total") == 0
    assert (
        value(got, "vllm:iteration_tokens_total_sum")
        == value(got, "loraplex_prompt_tokens_total")
        - value(got, "vllm:prefix_cache_hits_total")
        + 15
        - 3
    )  # each token computed once
    assert value(got, "vllm:num_requests_running") == 0 == value(got, "vllm:num_requests_waiting")
    info = got["vllm:cache_config_info"][0][0]
    assert (
        info["block_size"] == "16" and int(info["num_gpu_blocks"]) == state.engine.pool.num_blocks
    )
    # ours keep their names and labels
    assert value(got, "time_to_first_token_seconds_count", adapter_state="warm") == 3
    assert state.metrics.sequences.num_tracked == 0  # finished sequences are let go


def test_preemptions_are_counted(tiny_model: Path) -> None:
    """A KV cache too small for two long sequences preempts one; the counter shows it."""
    config = ServerConfig(
        engine=EngineConfig(
            model=str(tiny_model),
            device="cpu",
            num_threads=1,
            enable_lora=False,
            num_kv_blocks=6,
            block_size=16,
            max_model_len=64,
        ),
    )
    app = create_app(config)
    state = app.state.loraplex
    with TestClient(app) as client:
        body = {"model": str(tiny_model), "prompt": "a b c d e f g h", "max_tokens": 40,
                "temperature": 0, "ignore_eos": True, "n": 2}  # fmt: skip
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        sync.wait_idle(state.engine, state.aengine)
        got = samples(client.get("/metrics").text)
    assert value(got, "vllm:num_preemptions_total") == state.engine.scheduler.num_preemptions > 0


def test_token_counters_move_while_a_request_runs(tiny_model: Path) -> None:
    """vLLM counts prompt and generation tokens every step: with a long request still running,
    the counters and the stats line's throughput are already above zero (counted only when a
    request finished, they stayed at 0 for as long as it ran). Steps are let through one
    gate at a time, so the counts are exact on any machine."""
    config = ServerConfig(
        engine=EngineConfig(model=str(tiny_model), device="cpu", num_threads=1, enable_lora=False),
        served_model_name=["base-model"],
    )
    app = create_app(config)
    state = app.state.loraplex
    eng = state.engine
    now = [0.0]
    stats = StatsLogger(app.state.stats.source, clock=lambda: now[0])  # the server's numbers
    prompt = [5, 6, 7, 8, 9, 10, 11]
    body = {"model": "base-model", "prompt": prompt, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    got: dict = {}
    with TestClient(app) as client, StepGate(eng) as gate:
        gate.hold()
        post = threading.Thread(
            target=lambda: got.update(r=client.post("/v1/completions", json=body))
        )
        post.start()
        wait_until(lambda: eng.num_waiting == 1, what="the request in the engine")
        gate.allow(5)  # the prefill with the first token, then four more tokens
        gate.wait_held()
        assert eng.num_running == 1 and eng.requests  # still running: 35 tokens to go
        mid = samples(client.get("/metrics").text)
        now[0] = 2.0
        line = stats.log_once()
        gate.open()
        post.join(EVENT_TIMEOUT_S)
        sync.wait_idle(eng, state.aengine)
        end = samples(client.get("/metrics").text)
    assert value(mid, "vllm:generation_tokens_total") == 5
    assert value(mid, "loraplex_generation_tokens_total") == 5
    assert value(mid, "vllm:prompt_tokens_total") == len(prompt)
    assert value(mid, "vllm:request_generation_tokens_count") == 0  # per request: at the end
    assert line is not None
    assert "Avg prompt throughput: 3.5 tokens/s, Avg generation throughput: 2.5 tokens/s" in line
    assert "Running: 1 reqs" in line
    # at the end: every token counted once, the per-request histograms observed once
    assert got["r"].status_code == 200, got["r"].text
    usage = got["r"].json()["usage"]
    assert usage["completion_tokens"] == 40 and usage["prompt_tokens"] == len(prompt)
    assert value(end, "vllm:generation_tokens_total") == 40
    assert value(end, "vllm:prompt_tokens_total") == len(prompt)
    assert value(end, "vllm:request_generation_tokens_sum") == 40
