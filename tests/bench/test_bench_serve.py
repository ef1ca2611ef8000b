"""``loraplex bench serve`` against a real in-process loraplex server on the tiny model, and
against a small server that answers with errors (they are counted, the generator goes on)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.app import create_app
from loraplex.testing.server import free_port, serve_in_thread
from loraplex.tools.bench import cli
from loraplex.tools.bench.serve import (
    BenchError,
    BenchRequest,
    LengthDist,
    build_requests,
    map_adapters,
    run_load,
    summarize,
)
from loraplex.tools.sim.workloads import Request as TraceRequest
from loraplex.tools.sim.workloads import zipf_workload

NAMES = ["all_r8", "mlp_r16", "qv_r32_regex"]
RANKS = {"all_r8": 8, "mlp_r16": 16, "qv_r32_regex": 32}


@pytest.fixture(scope="module")
def server(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[str]:
    """One device slot and one host copy for three adapters: switching adapters is a cold load."""
    config = ServerConfig(
        EngineConfig(
            model=str(tiny_model), num_threads=1, max_loras=1, max_cpu_loras=1, max_lora_rank=32
        ),
        served_model_name=["tiny"],
        lora_modules=[LoRAModule(n, str(adapters[n])) for n in NAMES],
        log_level="warning",
    )
    with serve_in_thread(create_app(config), timeout=120) as url:
        yield url


def test_schedule_maps_popularity_onto_names() -> None:
    wl = zipf_workload(n=8, requests=400, seed=3)
    mapping = map_adapters(wl.requests, ["a", "b", "c"])
    assert mapping["z0"] == "a" and mapping["z1"] == "b" and mapping["z2"] == "c"
    assert mapping["z3"] == "a"  # wraps around
    reqs = build_requests(
        wl.requests, ["a", "b", "c"], prompt_len=LengthDist(4, 9), output_len=LengthDist(3, 3),
        rate=50.0, seed=1,
    )  # fmt: skip
    assert len(reqs) == 400
    assert all(4 <= len(r.prompt) <= 9 and r.max_tokens == 3 for r in reqs)
    times = [r.time for r in reqs]
    assert times == sorted(times) and 400 / times[-1] == pytest.approx(50.0, rel=0.2)
    again = build_requests(wl.requests, ["a", "b", "c"], rate=50.0, seed=1,
                           prompt_len=LengthDist(4, 9), output_len=LengthDist(3, 3))  # fmt: skip
    assert again == reqs  # seeded
    trace = [TraceRequest(10.0 + i, "x", "t", 0) for i in range(5)]
    kept = build_requests(trace, ["m"], arrivals="trace")
    assert [r.time for r in kept] == [0.0, 1.0, 2.0, 3.0, 4.0]
    scaled = build_requests(trace, ["m"], arrivals="trace", rate=4.0)
    assert scaled[-1].time == pytest.approx(1.0)
    for bad in ("0", "9:3", "x", "3:"):
        with pytest.raises(BenchError):
            LengthDist.parse(bad)


def test_load_against_loraplex(server: str, tmp_path: Path) -> None:
    wl = zipf_workload(n=3, s=0.5, requests=14, seed=2)
    reqs = build_requests(
        wl.requests, NAMES, prompt_len=LengthDist(4, 8), output_len=LengthDist(5, 5), rate=1.0
    )
    res = run_load(server, reqs, concurrency=2)
    s = summarize(res)
    assert s["requests"] == 14 and s["completed"] == 14 and s["errors"] == 0, s["error_samples"]
    assert s["output_tokens"] == 14 * 5 and s["short_outputs"] == 0
    assert all(r.ttft is not None and r.tpot is not None and r.e2e >= r.ttft for r in res.records)
    assert all(r.adapter_header.startswith(r.model) for r in res.records)
    # one host copy for three adapters: both states occur, and every request reports one
    assert s["by_state"]["warm"]["requests"] > 0 and s["by_state"]["cold"]["requests"] > 0
    assert sum(g["requests"] for g in s["by_state"].values()) == 14
    # ranks come from /v1/adapters once the server has loaded each adapter
    assert res.ranks == RANKS
    by_rank = {k: g["requests"] for k, g in s["by_rank"].items()}
    assert by_rank == {str(RANKS[m]): sum(r.model == m for r in res.records) for m in RANKS if
                       any(r.model == m for r in res.records)}  # fmt: skip
    assert s["requests_per_s"] > 0 and s["ttft_s"]["p50"] <= s["ttft_s"]["p99"]


def test_cli_json_plot_and_table(
    server: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    png, saved = tmp_path / "ttft.png", tmp_path / "run.json"
    argv = [
        "serve", "--url", server, "--adapters-from-server", "--workload", "uniform:n=3",
        "--rate", "20", "--num-requests", "9", "--prompt-len", "3:6", "--output-len", "4",
        "--seed", "5", "--json", "--plot", str(png), "--save", str(saved), "--no-progress",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"summary", "records"} and len(doc["records"]) == 9
    s = doc["summary"]
    for key in ("requests_per_s", "output_tokens_per_s", "ttft_s", "tpot_s", "by_state",
                "by_rank", "error_kinds"):  # fmt: skip
        assert key in s
    assert set(s["ttft_s"]) == {"p50", "p90", "p99", "mean"}
    assert s["completed"] == 9 and s["output_tokens"] == 36
    assert set(s["meta"]["models"]) == set(NAMES)  # adapters only, not the base model
    assert {"index", "model", "ttft", "tpot", "state", "rank", "error_kind"} <= set(
        doc["records"][0]
    )
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(saved.read_text())["summary"]["requests"] == 9
    # the table, chat endpoint (text prompts), closed loop
    argv = [
        "serve", "--url", server, "--model", "tiny", "--model", "all_r8", "--endpoint", "chat",
        "--concurrency", "2", "--num-requests", "4", "--output-len", "3", "--no-progress",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^4/4 requests ok", out, re.M), out
    assert re.search(r"^all\s+4\s+0\s", out, re.M), out


def test_cli_bad_input(server: str, capsys: pytest.CaptureFixture) -> None:
    cases = [
        (["serve", "--url", server, "--model", "nope", "--rate", "1"], "does not serve nope"),
        (["serve", "--url", server, "--model", "tiny", "--rate", "1", "--workload", "zipf:q=1"],
         "unknown key"),
        (["serve", "--url", server, "--model", "tiny", "--concurrency", "0"], "> 0"),
        (["serve", "--url", server, "--model", "tiny", "--rate", "1", "--prompt-len", "9:2"],
         "LO <= HI"),
        (["serve", "--url", f"http://127.0.0.1:{free_port()}", "--adapters-from-server",
          "--rate", "1"], "cannot reach"),
    ]  # fmt: skip
    for argv, msg in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert msg in err, (argv, err)


def _flaky_app() -> FastAPI:
    """Answers request i by i % 4: 0 ok (3 tokens), 1 HTTP 503, 2 an SSE error event, 3 404."""
    app = FastAPI()
    count = {"n": 0}

    @app.post("/v1/completions")
    async def completions(request: Request) -> object:
        body = await request.json()
        i = count["n"]
        count["n"] += 1
        if i % 4 == 1:
            err = {"error": {"message": "busy", "type": "service_unavailable"}}
            return JSONResponse(err, status_code=503)
        if i % 4 == 3:
            err = {"error": {"message": f"model {body['model']} not found"}}
            return JSONResponse(err, status_code=404)

        def events() -> Iterator[bytes]:
            if i % 4 == 2:
                yield b'data: {"error": {"message": "engine step failed"}}\n\n'
            else:
                for t in ("a", "b", "c"):
                    yield f"data: {json.dumps({'choices': [{'text': t}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_errors_are_counted_not_fatal() -> None:
    reqs = [BenchRequest("m", [1, 2, 3], 3) for _ in range(8)]
    with serve_in_thread(_flaky_app()) as url:
        res = run_load(url, reqs, concurrency=1, fetch_ranks=False)
    s = summarize(res)
    assert s["requests"] == 8 and s["completed"] == 2
    assert s["error_kinds"] == {"http_503": 2, "stream": 2, "http_404": 2}
    assert "not found" in s["error_samples"]["http_404"]
    assert s["output_tokens"] == 6 and s["by_state"]["unknown"]["completed"] == 2
    # nothing listening: every request is a connect error, the run still returns
    down = run_load(f"http://127.0.0.1:{free_port()}", reqs[:3], concurrency=2, fetch_ranks=False)
    assert summarize(down)["error_kinds"] == {"connect": 3}


# -- multi-tenant mixes ----------------------------------------------------------------------------
def test_tenant_specs_parse_and_resolve() -> None:
    from loraplex.tools.bench.serve import TenantStream

    s = TenantStream.parse("gold:models=a+b-*,rate=2.5,prompt=16:32,output=8,priority=-1,class=g")
    assert (s.tenant, s.models, s.rate, s.concurrency, s.priority, s.label) == (
        "gold", ("a", "b-*"), 2.5, None, -1, "g")  # fmt: skip
    assert s.prompt_len == LengthDist(16, 32) and s.output_len == LengthDist(8, 8)
    assert s.resolve(["b-2", "a", "b-1", "c"]).models == ("a", "b-2", "b-1")
    with pytest.raises(BenchError, match="serves nothing named 'x-\\*'"):
        TenantStream.parse("t:models=x-*,concurrency=1").resolve(["a"])
    for bad, why in [
        ("t", "expected TENANT:"),
        ("t:rate=1", "needs models"),
        ("t:models=a", "exactly one of rate"),
        ("t:models=a,rate=1,concurrency=2", "exactly one of rate"),
        ("t:models=a,rate=0", "must be > 0"),
        ("t:models=a,concurrency=x", "not a number"),
        ("t:models=a,rate=1,colour=red", "bad item"),
    ]:
        with pytest.raises(BenchError, match=why):
            TenantStream.parse(bad)


def test_jain_index() -> None:
    from loraplex.tools.bench.serve import jain_index

    assert jain_index([5, 5]) == 1.0
    assert jain_index([1, 0, 0, 0]) == 0.25
    assert jain_index([3, 1]) == pytest.approx(16 / 20)
    assert jain_index([]) is None and jain_index([0, 0]) is None


def test_cli_tenant_mix_reports_tenants_classes_and_shares(
    server: str, capsys: pytest.CaptureFixture
) -> None:
    argv = ["serve", "--url", server, "--duration", "0.5", "--no-progress", "--json",
            "--tenant", "a:models=all_r8,concurrency=2,prompt=8,output=4,class=gold",
            "--tenant", "b:models=mlp_*+qv_r32_regex,concurrency=1,prompt=8,output=4"]  # fmt: skip
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    s = doc["summary"]
    assert set(s["by_tenant"]) == {"a", "b"} and set(s["by_class"]) == {"gold", "b"}
    assert s["errors"] == 0 and all(g["completed"] >= 1 for g in s["by_tenant"].values())
    # shares count the requests done within the 0.5 s send window (the drain after it is
    # excluded); recomputed here from the records, whatever the machine's speed
    window = s["meta"]["window_s"]
    assert window == 0.5
    done = {t: sum(r["output_tokens"] for r in doc["records"]
                   if r["tenant"] == t and r["sent"] + r["e2e"] <= window) for t in "ab"}  # fmt: skip
    total = sum(done.values())
    if total:
        assert s["token_shares"] == {t: pytest.approx(n / total) for t, n in done.items()}
        assert s["jain_index"] == pytest.approx(total**2 / (2 * sum(n * n for n in done.values())))
    else:
        assert s["token_shares"] == {} and s["jain_index"] is None
    models_b = {r["model"] for r in doc["records"] if r["tenant"] == "b"}
    assert models_b <= {"mlp_r16", "qv_r32_regex"}
    assert {r["slo_class"] for r in doc["records"]} == {"gold", "b"}
    assert cli.main(["serve", "--url", server, "--tenant", "a:models=all_r8,rate=1"]) == 2
    assert "needs --duration" in capsys.readouterr().err
