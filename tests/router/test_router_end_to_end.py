"""The router end to end: three real ``loraplex serve`` replicas (subprocesses, tiny model) and
the router on loopback. Outputs through the router equal the replica's own; killing a replica
loses and duplicates no request; a replica killed mid-stream gives the client an error event.
Plus the router's parsing of a real vLLM ``/metrics`` page and its CLI errors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loraplex.router.app import RouterConfig, create_router_app
from loraplex.router.replicas import Replica, parse_base_models, parse_metrics, parse_residency
from loraplex.router.scoring import Thresholds, Weights
from loraplex.testing.server import free_port, serve_in_thread
from loraplex.testing.sync import wait_healthy, wait_until

ADAPTERS = ("all_r8", "mlp_r16", "attn_r4_rslora", "qv_r32_regex")
STATUS = "sk-router-status"  # the router's --status-api-key
STATUS_AUTH = {"Authorization": f"Bearer {STATUS}"}


def replica_view(router: str) -> list[dict[str, object]]:
    """``GET /v1/replicas`` with the status key."""
    r = httpx.get(f"{router}/v1/replicas", headers=STATUS_AUTH)
    assert r.status_code == 200, r.text
    return r.json()["data"]  # type: ignore[no-any-return]


@dataclass
class Proc:
    """One ``loraplex serve`` subprocess."""

    url: str
    cmd: list[str]
    proc: subprocess.Popen[str]

    def wait_healthy(self) -> None:
        wait_healthy(self.proc, self.url)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.proc = _popen(self.cmd)


def _popen(cmd: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


@pytest.fixture(scope="module")
def replicas(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[list[Proc]]:
    procs = []
    for _ in range(3):
        port = free_port()
        cmd = [
            sys.executable, "-m", "loraplex.cli", "serve", str(tiny_model), "--port", str(port),
            "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4", "--num-threads", "1",
            "--served-model-name", "tiny", "--log-level", "warning",
            "--lora-modules", *(f"{n}={adapters[n]}" for n in ADAPTERS),
        ]  # fmt: skip
        procs.append(Proc(f"http://127.0.0.1:{port}", cmd, _popen(cmd)))
    try:
        for p in procs:
            p.wait_healthy()
        yield procs
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def router(replicas: list[Proc]) -> Iterator[str]:
    config = RouterConfig(
        replicas=[p.url for p in replicas],
        poll_interval_s=0.2,
        poll_timeout_s=2.0,
        readmit_after=2,
        read_timeout_s=30,
        thresholds=Thresholds(max_waiting=4),
        # no load for device evictions per second: a poll landing right after an adapter's
        # load would otherwise move the next request off its warm replica, by timing alone
        # (that term is tested in test_scoring)
        weights=Weights(evictions=0.0),
        status_api_key=STATUS,
    )
    with serve_in_thread(create_router_app(config)) as url:
        wait_until(
            lambda: all(r["kind"] == "loraplex" for r in replica_view(url)),
            interval=0.05,
            what="the router's first poll of its replicas",
        )
        yield url


def served_requests(url: str) -> float:
    """``loraplex_requests_total{status="200"}`` of one replica."""
    fams = httpx.get(f"{url}/metrics").text
    for line in fams.splitlines():
        if line.startswith('loraplex_requests_total{status="200"}'):
            return float(line.split()[-1])
    return 0.0


def _completion(model: str, **kw: object) -> dict[str, object]:
    return {"model": model, "prompt": "The sky is", "max_tokens": 6, "temperature": 0, **kw}


def _sse(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]


# --------------------------------------------------------------------------------- healthy fleet
def test_outputs_equal_the_replicas_own(router: str) -> None:
    with httpx.Client(timeout=60) as c:
        for model in ("tiny", *ADAPTERS):
            r = c.post(f"{router}/v1/completions", json=_completion(model))
            assert r.status_code == 200, r.text
            replica = r.headers["x-loraplex-replica"]
            direct = c.post(f"{replica}/v1/completions", json=_completion(model))
            assert r.json()["choices"] == direct.json()["choices"]
            assert r.json()["model"] == model
            chat = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5, "temperature": 0}  # fmt: skip
            r = c.post(f"{router}/v1/chat/completions", json=chat)
            direct = c.post(f"{r.headers['x-loraplex-replica']}/v1/chat/completions", json=chat)
            assert r.status_code == 200 and r.json()["choices"] == direct.json()["choices"]
        models = c.get(f"{router}/v1/models").json()["data"]
        assert sorted(m["id"] for m in models) == sorted(["tiny", *ADAPTERS])


def test_an_adapter_stays_where_it_is_warm(router: str) -> None:
    with httpx.Client(timeout=60) as c:
        first = c.post(f"{router}/v1/completions", json=_completion("mlp_r16"))
        home = first.headers["x-loraplex-replica"]
        for _ in range(4):
            r = c.post(f"{router}/v1/completions", json=_completion("mlp_r16"))
            assert r.headers["x-loraplex-replica"] == home
            assert r.headers["x-loraplex-adapter-state"] == "warm"
        view = {v["url"]: v for v in replica_view(router)}
        assert view[home]["tiers"]["mlp_r16"] == "device"
        assert all(v["base_models"] == ["tiny"] for v in view.values())
        metrics = c.get(f"{router}/metrics").text
        assert 'loraplex_router_decisions_total{reason="affinity"}' in metrics


def test_streaming_passthrough(router: str) -> None:
    body = _completion("attn_r4_rslora", stream=True, max_tokens=8,
                       stream_options={"include_usage": True})  # fmt: skip
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{router}/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        direct = c.post(f"{r.headers['x-loraplex-replica']}/v1/completions", json=body)
    ours, theirs = _sse(r.text), _sse(direct.text)
    # one chunk per token (however the client reads), then the usage chunk and [DONE]
    assert ours[-1] == "[DONE]" and len(ours) == len(theirs) == 8 + 2

    def text(events: list[str]) -> str:
        return "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])

    assert text(ours) == text(theirs) and len(text(ours)) > 0
    assert json.loads(ours[-2])["usage"]["completion_tokens"] == 8


def test_errors_pass_through_and_bad_json_is_400(router: str, replicas: list[Proc]) -> None:
    with httpx.Client(timeout=30) as c:
        r = c.post(f"{router}/v1/completions", json=_completion("no-such-adapter"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        for bad in (_completion("tiny", max_tokens=-1), _completion("tiny", temperature="hot")):
            r = c.post(f"{router}/v1/completions", json=bad)
            direct = c.post(f"{replicas[0].url}/v1/completions", json=bad)
            assert r.status_code == direct.status_code == 400
            assert r.json() == direct.json() and r.json()["error"]["message"]
        r = c.post(f"{router}/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = c.get(f"{router}/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()


# --------------------------------------------------------------------------------- failures
def _wait_health(router: str, url: str, healthy: bool) -> None:
    def seen() -> bool:
        view = {v["url"]: v for v in replica_view(router)}
        return view[url]["healthy"] is healthy

    wait_until(seen, interval=0.05, what=f"the router to see {url} healthy={healthy}")


def test_hung_replica_is_ejected_and_readmitted(router: str, replicas: list[Proc]) -> None:
    """SIGSTOP: the replica still accepts connections but never answers; its health checks
    time out, it gets no requests; after SIGCONT it is re-admitted."""
    frozen = replicas[2]
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        _wait_health(router, frozen.url, False)
        with httpx.Client(timeout=30) as c:
            for model in ADAPTERS:
                r = c.post(f"{router}/v1/completions", json=_completion(model))
                assert r.status_code == 200 and r.headers["x-loraplex-replica"] != frozen.url
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    _wait_health(router, frozen.url, True)
    m = httpx.get(f"{router}/metrics").text
    assert f'loraplex_router_ejections_total{{replica="{frozen.url}"}}' in m


def test_failover_loses_and_duplicates_nothing(router: str, replicas: list[Proc]) -> None:
    """Kill the replica holding an adapter: every later request is answered once, elsewhere,
    and the replicas' own counters add up to exactly the requests sent."""
    with httpx.Client(timeout=60) as c:
        before = {p.url: served_requests(p.url) for p in replicas}
        r = c.post(f"{router}/v1/completions", json=_completion("qv_r32_regex"))
        victim = next(p for p in replicas if p.url == r.headers["x-loraplex-replica"])
        expected = c.post(f"{victim.url}/v1/completions", json=_completion("qv_r32_regex"))
        served_by_victim = served_requests(victim.url) - before[victim.url]
        victim.kill()  # SIGKILL: no goodbye; the router learns it from a refused connection
        n, texts, homes = 8, set(), set()
        for i in range(n):
            model = "qv_r32_regex" if i % 2 == 0 else ADAPTERS[i % len(ADAPTERS)]
            r = c.post(f"{router}/v1/completions", json=_completion(model))
            assert r.status_code == 200, r.text
            homes.add(r.headers["x-loraplex-replica"])
            if model == "qv_r32_regex":
                texts.add(r.json()["choices"][0]["text"])
        assert victim.url not in homes
        assert texts == {expected.json()["choices"][0]["text"]}  # same answer elsewhere
        after = {p.url: served_requests(p.url) for p in replicas if p is not victim}
        survivors = sum(after[u] - before[u] for u in after)
        assert served_by_victim == 2  # the routed request and our direct one
        assert survivors == n  # each request served exactly once
        view = {v["url"]: v for v in replica_view(router)}
        assert view[victim.url]["healthy"] is False
        m = c.get(f"{router}/metrics").text
        assert f'loraplex_router_replica_healthy{{replica="{victim.url}"}} 0.0' in m


def test_killed_mid_stream_gives_an_error_event(router: str, replicas: list[Proc]) -> None:
    live = [p for p in replicas if p.proc.poll() is None]
    assert len(live) == 2
    body = _completion("all_r8", stream=True, max_tokens=480, ignore_eos=True)
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", f"{router}/v1/completions", json=body) as r:
            assert r.status_code == 200
            victim = next(p for p in live if p.url == r.headers["x-loraplex-replica"])
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert "choices" in first
            victim.kill()
            rest = [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]
        # (it ended rather than hung: the read timeout of 30 s would have raised)
        assert rest[-1] == "[DONE]"
        err = json.loads(rest[-2])["error"]
        assert err["code"] == "replica_failed" and "incomplete" in err["message"]
        assert all("error" not in json.loads(e) for e in rest[:-2])  # whole events before it
        # the survivor still answers, and health says so
        r = c.post(f"{router}/v1/completions", json=_completion("all_r8"))
        assert r.status_code == 200 and r.headers["x-loraplex-replica"] != victim.url
        assert c.get(f"{router}/health").status_code == 200
        assert "loraplex_router_stream_errors_total" in c.get(f"{router}/metrics").text


def test_no_healthy_replica_is_503(router: str, replicas: list[Proc]) -> None:
    with httpx.Client(timeout=30) as c:
        for p in replicas:
            if p.proc.poll() is None:
                p.kill()
        r = c.post(f"{router}/v1/completions", json=_completion("tiny"))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_healthy_replica"
        wait_until(
            lambda: c.get(f"{router}/health").status_code == 503,
            interval=0.1,
            what="the router's health to turn 503",
        )
        assert c.get(f"{router}/v1/models").status_code == 503


# --------------------------------------------------------------------------------- no replicas needed
# A real vLLM (0.x) /metrics page: the gauges a gateway reads, as vLLM prints them.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4375
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora,fr",waiting_lora_adapters="de"} 1.7516e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora",waiting_lora_adapters=""} 1.7515e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.2345e+05
"""


def test_vllm_metrics_parsing() -> None:
    m = parse_metrics(VLLM_METRICS)
    assert (m.waiting, m.running, m.kv_usage, m.max_lora) == (5, 3, 0.4375, 4)
    assert m.running_adapters == ("sql-lora", "fr")  # the newest info sample
    assert m.waiting_adapters == ("de",)
    assert m.device_evictions is None
    old = VLLM_METRICS.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_metrics(old).kv_usage == 0.4375  # vLLM before the rename
    r = Replica("http://vllm:8000", kind="vllm")
    r.apply_poll(1.0, None, None, m)  # vLLM has no /v1/adapters: residency from the metrics
    v = r.view()
    assert (v.tier_of("sql-lora"), v.tier_of("fr"), v.tier_of("de"), v.tier_of("x")) == (
        "device", "device", "host", "absent",
    )  # fmt: skip
    assert (v.waiting, v.running, r.max_loras) == (5, 3, 4)
    with pytest.raises(ValueError, match="Prometheus"):
        parse_metrics("this is { not metrics")


def test_loraplex_residency_and_eviction_rate() -> None:
    tiers, max_loras, max_cpu = parse_residency(
        {
            "object": "list",
            "max_loras": 2,
            "max_cpu_loras": 4,
            "data": [
                {"name": "a", "tier": "device", "last_access": 5.0},
                {"name": "b", "tier": "device", "last_access": 3.0},
                {"name": "c", "tier": "host"},
                {"name": "d", "tier": "disk"},
                {"name": "e", "tier": "absent"},
            ],
        }
    )
    assert tiers == {"c": "host", "d": "disk", "e": "absent", "b": "device", "a": "device"}
    assert (max_loras, max_cpu) == (2, 4)
    r = Replica("http://r:1")
    text = '# TYPE adapter_evictions_total counter\nadapter_evictions_total{tier="device"} 4.0\n'
    r.apply_poll(10.0, tiers, max_loras, parse_metrics(text), max_cpu)
    assert list(r.device_lru) == ["b", "a"]  # least recently used first
    pending = r.note_dispatch("d")  # sent there: in flight, and counted as served there
    assert (r.in_flight, pending, r.view().tier_of("d"), r.tiers["d"]) == (1, "d", "device", "disk")
    r.note_done(pending)  # refused, say: the hint ends with the request and moved nothing
    assert (r.in_flight, r.pending, r.view().tier_of("d")) == (0, {}, "disk")
    assert list(r.device_lru) == ["b", "a"]
    r.note_served("c", 10.5)  # answered: c is on the device, b (LRU) drops to host
    assert r.tiers["c"] == "device" and r.tiers["b"] == "host"
    r.note_served("d", 10.6)
    r.note_served("e", 10.7)  # 5 in memory > max_cpu_loras 4: b (LRU of host) leaves memory
    assert list(r.device_lru) == ["d", "e"] and list(r.host_lru) == ["a", "c"]
    assert r.tiers["b"] == "absent" and r.tiers["a"] == "host"
    assert r.note_dispatch("no-such-name") is None  # a name no replica reported: no hint
    assert "no-such-name" not in r.view().tiers and r.in_flight == 1
    r.note_done(None)
    r.apply_poll(12.0, tiers, max_loras, parse_metrics(text.replace("4.0", "10.0")))
    assert r.evictions_per_s == pytest.approx(3.0)  # 6 evictions in 2 s
    r.note_served("d", 12.5)
    r.apply_poll(12.2, tiers, max_loras, None)  # a poll begun before the answer keeps it
    assert r.tiers["d"] == "device"
    with pytest.raises(ValueError):
        parse_residency({"data": "nope"})
    models = {"data": [{"id": "base", "parent": None}, {"id": "sql", "parent": "base"}]}
    assert parse_base_models(models) == {"base"}


def test_route_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loraplex.cli import main

    for args, needle in [
        ((), "no replicas"),
        (("--replica", "ftp://x"), "expected a replica URL"),
        (("--replica", "http://a:1", "--policy", "fastest"), "invalid choice"),
        (("--replica", "http://a:1", "--weight", "colour=1"), "NAME=VALUE"),
        (("--replica", "http://a:1", "--max-kv-usage", "2"), "max_kv_usage"),
        (("--replica", "http://a:1", "--weight", "host=2"), "device >= host"),
        (("--replicas-file", str(tmp_path / "missing")), "is not a file"),
        (("--replicas-dns", "nameonly"), "NAME:PORT"),
        (("--config", str(tmp_path / "x.ini")), ".yaml, .yml or .toml"),
        (("--config", str(tmp_path / "none.yaml")), "cannot read"),
    ]:
        try:
            rc = main(["route", *args])
        except SystemExit as e:  # argparse's own errors
            rc = e.code  # type: ignore[assignment]
        err = capsys.readouterr().err
        assert rc == 2, (args, err)
        assert err.startswith("loraplex route: error: ") and needle in err, err
    # and as a user runs it
    p = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "route", "--replica", "http://a:1", "--port", "x"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2 and p.stderr.startswith("loraplex route: error: ")
    assert "Traceback" not in p.stderr


def test_route_config_file_and_precedence(tmp_path: Path) -> None:
    from loraplex.router.cli import RouteConfigError, parse_route_args

    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        "replicas: [http://a:8000, b:8001]\npolicy: least-loaded\npoll-interval: 0.5\n"
        "max_waiting: 9\nweights: {device: 2.0, waiting: 0.3}\n"
    )
    c = parse_route_args(["--config", str(cfg), "--policy", "residency", "--weight", "disk=0.1"],
                         environ={"LORAPLEX_API_KEY": "sk-x"})  # fmt: skip
    assert c.replicas == ["http://a:8000", "http://b:8001"]
    assert c.policy == "residency" and c.poll_interval_s == 0.5  # flag wins, file fills in
    assert c.thresholds.max_waiting == 9 and c.replica_api_key == "sk-x"
    # the status route is off and bodies are capped unless said otherwise
    assert (c.status_api_key, c.max_request_bytes, c.keepalive_expiry_s) == (None, 16 << 20, 2.0)
    s = parse_route_args(["--config", str(cfg), "--max-request-bytes", "1MiB"],
                         environ={"LORAPLEX_ROUTER_STATUS_API_KEY": "sk-status"})  # fmt: skip
    assert s.status_api_key == "sk-status" and s.replica_api_key is None
    assert s.max_request_bytes == 1 << 20
    assert (c.weights.device, c.weights.waiting, c.weights.disk) == (2.0, 0.3, 0.1)
    toml = tmp_path / "router.toml"
    toml.write_text('replicas = ["http://a:1"]\nmax_retries = "many"\n')
    with pytest.raises(RouteConfigError, match="max_retries: expected int"):
        parse_route_args(["--config", str(toml)], environ={})
    toml.write_text('replicas = ["http://a:1"]\ncolour = 1\n')
    with pytest.raises(RouteConfigError, match="unknown setting 'colour'"):
        parse_route_args(["--config", str(toml)], environ={})


BLOCK_HEAVY = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('torch', 'numpy', 'transformers', 'safetensors', 'tokenizers',
                                  'sqlalchemy', 'psutil'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
"""


def test_router_never_imports_torch() -> None:
    """With torch, numpy, transformers, ... unimportable (a ``pip install loraplex[router]``
    without torch), the router still imports, builds its app and parses its flags."""
    code = BLOCK_HEAVY + (
        "import loraplex.router.app as a, loraplex.router.cli as c, loraplex.cli as top\n"
        "app = a.create_router_app(c.parse_route_args(['--replica', 'http://r:1'], environ={}))\n"
        "bad = [m for m in ('loraplex.engine', 'loraplex.model', 'loraplex.lora', "
        "'loraplex.cache', 'loraplex.server', 'loraplex.registry') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "try:\n    top.main(['route', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "--replicas-dns" in p.stdout
