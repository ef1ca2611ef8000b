"""Simulator: workloads, trace I/O, replay through TierIndex stacks, CLI, and the policy targets."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from loraplex.cache.policy import belady_hit_ratio
from loraplex.tools.sim.cli import main
from loraplex.tools.sim.simulate import SimConfig, a0_hit_ratio, policy_factory, simulate
from loraplex.tools.sim.workloads import (
    Request,
    WorkloadSpecError,
    generate_workload,
    parse_size,
    parse_workload_spec,
    read_trace,
    write_trace,
)

SRC = Path(__file__).resolve().parents[2] / "src"


def run(spec: str, policy: str, **cfg: object):  # type: ignore[no-untyped-def]
    wl = generate_workload(spec)
    config = SimConfig(**cfg)  # type: ignore[arg-type]
    res = simulate(
        wl.requests, policy_factory(policy, config.tier_names), config, hot_adapters=wl.hot_adapters
    )
    return wl, res


# ------------------------------------------------------------------------------ workloads


def test_workloads_are_deterministic_per_seed() -> None:
    for spec in (
        "zipf:requests=500",
        "uniform:requests=500",
        "tiered:requests=500",
        "hotburst:requests=500",
    ):
        a = generate_workload(spec).requests
        assert a == generate_workload(spec).requests, spec
        assert a != generate_workload(spec + ",seed=7").requests, spec
        assert len(a) == 500
        assert all(x.time <= y.time for x, y in itertools.pairwise(a)), spec


def test_zipf_distribution_and_arrivals() -> None:
    wl = generate_workload("zipf:s=1,n=256,requests=20000,rate=50")
    counts = Counter(r.adapter for r in wl.requests)
    h = sum(1 / i for i in range(1, 257))
    assert counts["z000"] / 20000 == pytest.approx(1 / h, abs=0.012)
    assert counts["z000"] / counts["z001"] == pytest.approx(2.0, rel=0.15)
    assert counts["z000"] / counts["z009"] == pytest.approx(10.0, rel=0.3)
    gaps = [b.time - a.time for a, b in zip(wl.requests, wl.requests[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.1)
    r = wl.requests[0]
    assert (r.size, r.rank, r.priority, r.tenant[0]) == (16 << 20, 16, 0, "t")
    bursty = generate_workload("zipf:requests=20000,arrivals=gamma,cv=2")
    gaps = [b.time - a.time for a, b in zip(bursty.requests, bursty.requests[1:], strict=False)]
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(2.0, rel=0.15)


def test_tiered_and_uniform_shares() -> None:
    wl = generate_workload("tiered:5x12%,5x6%,5x2%,n=256,requests=20000")
    counts = Counter(r.adapter for r in wl.requests)
    assert len(counts) == 15  # the groups take 100%: no tail traffic
    for i, share in [(0, 0.12), (4, 0.12), (5, 0.06), (14, 0.02)]:
        assert counts[f"g{i:03d}"] / 20000 == pytest.approx(share, abs=0.012)
    assert wl.hot_adapters == frozenset(f"g{i:03d}" for i in range(5))
    tail = generate_workload("tiered:groups=2x25%,n=12,requests=20000")
    counts = Counter(r.adapter for r in tail.requests)
    assert counts["g00"] / 20000 == pytest.approx(0.25, abs=0.015)
    assert counts["g11"] / 20000 == pytest.approx(0.05, abs=0.01)  # 50% over 10 tail adapters
    uni = Counter(r.adapter for r in generate_workload("uniform:n=10,requests=20000").requests)
    assert len(uni) == 10 and max(uni.values()) / min(uni.values()) < 1.15


def test_shift_moves_popularity() -> None:
    wl = generate_workload("zipf:s=1,n=64,requests=4000,rate=50,shift=20")
    assert wl.hot_adapters is None
    top = [
        Counter(r.adapter for r in wl.requests if lo <= r.time < lo + 20).most_common(1)[0][0]
        for lo in (0, 20, 40)
    ]
    assert len(set(top)) == 3  # a different favourite in each 20 s epoch
    assert wl.requests == generate_workload("zipf:s=1,n=64,requests=4000,rate=50,shift=20").requests
    with pytest.raises(WorkloadSpecError, match="shift must be >= 0"):
        generate_workload("zipf:shift=-1")


def test_decay_beats_plain_lfu_when_popularity_shifts() -> None:
    spec = "zipf:s=1,n=128,requests=6000,rate=20,shift=60"
    _, lfu = run(spec, "lfu", slots=8)
    _, hybrid = run(spec, "hybrid", slots=8)
    assert hybrid.l0_hit_ratio > lfu.l0_hit_ratio + 0.03


def test_hotburst_shape() -> None:
    wl = generate_workload("hotburst")
    hot = [r for r in wl.requests if r.adapter in wl.hot_adapters]
    cold = [r for r in wl.requests if r.tenant == "batch"]
    assert len(hot) + len(cold) == 20000
    assert len(wl.hot_adapters) == 6 and {r.tenant for r in hot} == {"hot0", "hot1", "hot2"}
    # hot: 20 req/s all the time; cold: 200 req/s half the time -> 20 / (20 + 100)
    assert len(hot) / 20000 == pytest.approx(1 / 6, rel=0.05)
    assert all(r.time % 20.0 < 10.0 for r in cold)  # bursts: 10 s on, 10 s off
    names = [r.adapter for r in cold[:3000]]
    assert names[:3] == ["cold0000", "cold0001", "cold0002"] and len(set(names)) == 2000
    rep = generate_workload("hotburst:sweep_repeat=3,requests=200,cold_priority=-1")
    cold = [r for r in rep.requests if r.tenant == "batch"]
    assert [r.adapter for r in cold[:4]] == ["cold0000"] * 3 + ["cold0001"]
    assert cold[0].priority == -1


def test_spec_parsing_errors() -> None:
    assert parse_workload_spec("zipf:s=1.2,n=10,bytes_per_rank=2MiB") == (
        "zipf",
        {"s": 1.2, "n": 10, "bytes_per_rank": 2 << 20},
    )
    assert parse_workload_spec("tiered:5x12%,groups=1x2.5%")[1]["groups"] == ((5, 12.0), (1, 2.5))
    bad = {
        "lfu:n=3": "unknown workload kind 'lfu'",
        "zipf:q=3": "unknown key 'q' for workload 'zipf'",
        "zipf:n=ten": "bad value 'ten' for 'n'",
        "zipf:s=nan": "bad value 'nan' for 's'",
        "zipf:arrivals=bursty": "arrivals must be poisson or gamma",
        "zipf:requests=0": "requests must be >= 1",
        "tiered:5x12": "bad tiered group '5x12'",
        "tiered:5x30%": "more than 100%",
        "tiered:5x10%,n=5": "no tail",
        "hotburst:duty=2": "0 < duty <= 1",
        "uniform:n=0": "n >= 1",
    }
    for spec, msg in bad.items():
        with pytest.raises(WorkloadSpecError, match=msg):
            generate_workload(spec)


def test_parse_size() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1e6") == 1_000_000
    with pytest.raises(WorkloadSpecError, match="bad size"):
        parse_size("lots")


def test_trace_roundtrip_and_errors(tmp_path: Path) -> None:
    wl = generate_workload("hotburst:requests=300")
    path = tmp_path / "t.jsonl"
    assert write_trace(path, wl.requests) == 300
    assert read_trace(path) == wl.requests
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"time", "adapter", "tenant", "size", "rank", "priority"}
    # unsorted input is sorted; rank/priority optional
    path.write_text(
        '{"time": 2, "adapter": "a", "tenant": "t", "size": 5}\n\n'
        '{"time": 1.5, "adapter": "b", "tenant": "t", "size": 5, "priority": 2}\n'
    )
    assert read_trace(path) == [Request(1.5, "b", "t", 5, 0, 2), Request(2.0, "a", "t", 5, 0, 0)]
    cases = {
        "{nope\n": ":1: not JSON",
        '{"time": 1, "adapter": "a", "tenant": "t"}\n': "missing field 'size'",
        '{"time": "1", "adapter": "a", "tenant": "t", "size": 1}\n': "field 'time' has the wrong type",
        '{"time": 1, "adapter": "a", "tenant": "t", "size": -1}\n': "size >= 0",
        "[1]\n": "expected a JSON object",
    }
    for text, msg in cases.items():
        path.write_text(text)
        with pytest.raises(WorkloadSpecError, match=msg):
            read_trace(path)
    with pytest.raises(WorkloadSpecError, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------------------ replay


def test_replay_accounting_across_tiers() -> None:
    spec = "zipf:s=1,n=64,requests=3000"
    wl, res = run(spec, "lru", slots=4, host_bytes=16 * (16 << 20), disk_bytes=32 * (16 << 20))
    l0, l1, l2 = res.tiers
    assert [t.name for t in res.tiers] == ["L0", "L1", "L2"]
    assert l0.lookups == 3000 and l0.hits == round(res.l0_hit_ratio * 3000)
    assert l1.lookups == 3000  # as in the server, every request looks up its host copy first
    assert l1.hits >= l0.hits  # inclusive: an adapter in a slot keeps its host copy
    assert l2.lookups == l1.lookups - l1.hits
    assert res.remote_fetches == l2.lookups - l2.hits
    assert l0.loads == 3000 - l0.hits  # demand paging: every L0 miss is loaded
    assert l2.loads == res.remote_fetches  # every fetch lands on disk (nothing is in flight)
    assert l2.evictions > 0 and l2.thrash_ratio > 0  # 64 adapters, room for 32
    assert res.remote_fetches >= len({r.adapter for r in wl.requests})
    assert res.waits == 0 and res.unserved == 0 and res.load_seconds > 0
    # without L1/L2 every miss comes from the object store
    _, flat = run(spec, "lru", slots=4)
    assert [t.name for t in flat.tiers] == ["L0"]
    assert flat.remote_fetches == 3000 - flat.tiers[0].hits
    assert flat.l0_hit_ratio == res.l0_hit_ratio  # L0 decisions do not depend on lower tiers (LRU)


def test_replay_with_service_time_serves_everything() -> None:
    for policy in ("lru", "hybrid"):
        _, res = run(
            "hotburst:requests=1500",
            policy,
            slots=8,
            host_bytes=64 << 20,
            service_time_s=0.02,
            min_residency_s=0.01,
        )
        assert res.unserved == 0, policy
        assert res.waits > 0 and res.mean_wait_s > 0, policy  # in-flight protection did bite
        assert res.requests == 1500 and res.hot_requests > 0


def test_host_count_is_a_hard_cap_as_in_the_server() -> None:
    """``host_count`` (the server's --max-cpu-loras) caps host copies even when every copy is
    held by a request in service: a third adapter's load waits for a release (then is served),
    or is refused after ``load_wait_timeout_s``."""
    trace = [Request(0.0, k, "t", 1 << 20) for k in "abc"]
    cfg = dict(slots=3, host_count=2, service_time_s=1.0, patience_s=0.0)
    res = simulate(trace, policy_factory("lru", ("L0", "L1")), SimConfig(**cfg))  # type: ignore[arg-type]
    assert res.waits == 1 and res.unserved == 0  # c waited until a request let go of its copy
    assert res.mean_wait_s == pytest.approx(1.0)
    quick = SimConfig(**cfg, load_wait_timeout_s=0.5)  # type: ignore[arg-type]
    res = simulate(trace, policy_factory("lru", ("L0", "L1")), quick)
    assert res.unserved == 1 and res.tier("L1").bypassed == 1  # type: ignore[union-attr]


def test_patience_protects_the_hot_set_under_concurrency() -> None:
    spec = "hotburst:requests=3000"
    _, eager = run(spec, "hybrid", slots=8, service_time_s=0.005, patience_s=0.0)
    _, patient = run(spec, "hybrid", slots=8, service_time_s=0.005, patience_s=1.0)
    _, lru = run(spec, "lru", slots=8, service_time_s=0.005, patience_s=1.0)
    assert patient.hot_hit_ratio >= 0.95 > eager.hot_hit_ratio  # type: ignore[operator]
    assert patient.mean_wait_s < 0.05  # the price: cold requests wait a few ms for a cold slot
    assert lru.waits == 0  # LRU never holds out


def test_a0_and_belady_references() -> None:
    keys = list("aabacadaeafa")
    # capacity 2: 'a' stays, the other slot cycles: hits on every 'a' after the first
    assert a0_hit_ratio(keys, 2) == pytest.approx(6 / 12)
    assert belady_hit_ratio(keys, 2) >= a0_hit_ratio(keys, 2)
    assert a0_hit_ratio([], 3) == 0.0


# ------------------------------------------------------------------------------ targets


def test_target_hotburst_hybrid_keeps_hot_set_where_lru_loses_it() -> None:
    _, lru = run("hotburst", "lru", slots=8)
    _, hybrid = run("hotburst", "hybrid", slots=8)
    assert lru.hot_hit_ratio < 0.8  # type: ignore[operator]
    assert hybrid.hot_hit_ratio >= 0.95  # type: ignore[operator]


def test_target_zipf_hybrid_near_the_limits() -> None:
    """Zipf s=1 over 256 adapters, 8 slots, 20k requests.

    The issue asks for hybrid within 10% of Belady. Absolute: yes (0.430 vs 0.487). Relative, no
    online policy can: requests are independent draws, for which A0 (keep the 7 most probable,
    cycle 1 slot) is the optimal demand-paging policy, and A0 itself is ~0.88 x Belady here. So
    hybrid is held to A0 (within 2%) and to Belady within 10 points.
    """
    wl, hybrid = run("zipf:s=1,n=256,requests=20000,rate=50", "hybrid", slots=8)
    keys = [r.adapter for r in wl.requests]
    belady = belady_hit_ratio(keys, 8)
    a0 = a0_hit_ratio(keys, 8)
    assert hybrid.l0_hit_ratio >= 0.98 * a0
    assert hybrid.l0_hit_ratio >= belady - 0.10
    assert hybrid.l0_hit_ratio / belady > 0.86


# ------------------------------------------------------------------------------ CLI


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "w.jsonl"
    spec = "zipf:s=1,n=64,requests=2000"
    argv = ["--workload", spec, "--slots", "4", "--host-bytes", "256MiB", "--policy", "lru,hybrid"]
    assert main([*argv, "--write-trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert f"workload: {spec}" in out and "L0 4 slots | L1 256.0 MiB | L3 object store" in out
    lines = out.splitlines()
    assert any(line.startswith("lru ") for line in lines)
    assert any(line.startswith("hybrid ") for line in lines)
    assert any(line.startswith("belady ") for line in lines)
    assert len(read_trace(trace)) == 2000

    assert main(["--trace", str(trace), "--slots", "4", "--json", "--policy", "hybrid,lfu"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in doc["results"]] == ["hybrid", "lfu"]
    assert doc["workload"]["requests"] == 2000 and doc["config"]["slots"] == 4
    assert 0 < doc["results"][0]["l0_hit_ratio"] <= doc["belady_l0_hit_ratio"] <= 1
    assert doc["hot_set"] == "the 3 most requested adapters"
    tiers = doc["results"][0]["tiers"]
    assert tiers[0]["name"] == "L0" and {"hits", "loads", "thrash_ratio"} <= set(tiers[0])

    assert main(["--trace", str(trace), "--slots", "4", "--hot-tenants", "t1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hot_set"].startswith("adapters of tenants t1")


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--workload", "zipf:q=1"], "unknown key 'q'"),
        (["--workload", "nope"], "unknown workload kind 'nope'"),
        (["--workload", "zipf", "--policy", "arc"], "unknown eviction policy 'arc'"),
        (["--workload", "zipf", "--policy", ","], "names no policy"),
        (
            ["--workload", "zipf", "--host-bytes", "lots"],
            "expected a byte size such as 2GiB, 512MiB, 1G or 1073741824, got 'lots'",
        ),
        (["--workload", "zipf", "--slots", "0"], "expected an integer >= 1"),
        (["--workload", "zipf", "--service-time", "-1"], "finite number >= 0"),
        (["--trace", "/nonexistent/trace.jsonl"], "cannot read trace"),
        (["--workload", "zipf:requests=10", "--hot-tenants", "zz"], "no request in the trace"),
        ([], "one of the arguments --trace --workload is required"),
    ],
)
def test_cli_bad_input(argv: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert msg in captured.err and captured.out == ""


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "--workload SPEC" in capsys.readouterr().out


def test_python_m_runs_without_torch(tmp_path: Path) -> None:
    code = (
        "import sys, runpy; sys.argv = ['loraplex.tools.sim', '--workload', 'uniform:n=8,requests=50',"
        " '--slots', '2']\n"
        "try:\n    runpy.run_module('loraplex.tools.sim', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules, 'the simulator imported torch'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "belady" in proc.stdout
