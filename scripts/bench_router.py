"""Routing policies side by side: home vs residency vs round-robin vs least-loaded, in one run.

Two modes. ``--simulate``: a sweep over fleet shapes (2-8 replicas, uniform and Zipf
popularity, working set below and above the fleet's memory) replayed through the router's own
decision code (``loraplex.router.fleet_sim``: the same ``Picker`` and ``Replica`` objects as
``loraplex route``, simulated LRU replicas), printing the cold-start rate per policy per shape
next to the partition bound (the cold starts of a static partition of the adapters over the
fleet's memory: compulsory misses when the working set fits, else every request outside the
fleet-memory most popular adapters), and whether home's cold starts are at most 1/3 of
round-robin's (``check``: ``ok``, ``MISS``, or ``bound>1/3`` where the partition bound itself
is above that; ``--check`` exits 1 on a ``MISS``). Seconds, no servers:

    .venv/bin/python scripts/bench_router.py --simulate
    .venv/bin/python scripts/bench_router.py --simulate --shape '2x1/4@1=uniform:n=8'
    .venv/bin/python scripts/bench_router.py --simulate --requests 160 --warmup 0  # from empty

Without ``--simulate``, real replicas: starts N ``loraplex serve`` replicas (subprocesses) of
one small model, each with few adapter slots (``--max-loras``) and a small host tier
(``--max-cpu-loras``), all serving the same M adapters; one ``loraplex route`` per policy (subprocesses); then, for each policy in turn (the
order rotating over ``--rounds``), evicts every adapter from every replica (admin API) so each
policy starts from the same empty caches, and sends the same seeded workload (``--workload``, Zipf by default) through that
policy's router with ``loraplex.tools.bench.serve``. Prints cold-start rate (responses whose adapter
was in neither a device slot nor host memory on arrival, from ``x-loraplex-adapter-state``) and
TTFT percentiles per policy, the partition bound of the same requests, and the ratios against
the targets. ``--concurrency 1`` sends the requests one at a time (issue 16's small fleet:
``--replicas 2 --adapters 8 --max-loras 1 --max-cpu-loras 4 --workload uniform --concurrency 1``).

    .venv/bin/python scripts/bench_router.py                         # tiny random model
    .venv/bin/python scripts/bench_router.py --model-dir /tmp/lpcache/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loraplex.router.fleet_sim import FleetShape, partition_bound, simulate_routing
from loraplex.testing.server import free_port
from loraplex.tools.bench.serve import LengthDist, build_requests, run_load, summarize
from loraplex.tools.sim.workloads import generate_workload

POLICIES = ("home", "residency", "round-robin", "least-loaded")
ADMIN = "sk-bench-admin"

# REPLICAS x DEVICE_SLOTS / MEMORY @ CONCURRENCY = WORKLOAD (a loraplex sim workload spec)
DEFAULT_SHAPES = (
    "2x1/4@1=uniform:n=8",  # issue 16's small fleet: 8 adapters in 8 slots of memory
    "2x1/4@1=zipf:s=1,n=8",
    "2x1/4@1=uniform:n=12",  # above the fleet's memory
    "4x2/8@4=uniform:n=24",
    "4x2/8@4=zipf:s=1,n=48",  # above
    "8x2/8@8=uniform:n=48",
    "8x2/8@8=zipf:s=1,n=128",  # above
    "8x2/8@16=zipf:s=1.2,n=32",  # hot adapters under load: they must spread
)
_SHAPE = re.compile(r"^(\d+)x(\d+)/(\d+)@(\d+)=(.+)$")


def parse_shape(text: str) -> tuple[FleetShape, int, str]:
    """``2x1/4@1=uniform:n=8`` -> (fleet shape, concurrency, workload spec)."""
    m = _SHAPE.match(text.strip())
    if m is None:
        raise SystemExit(f"bad --shape {text!r}: expected REPLICASxSLOTS/MEMORY@CONCURRENCY=SPEC")
    r, d, mem, c, spec = m.groups()
    return FleetShape(int(r), int(d), int(mem)), int(c), spec


def with_keys(workload: str, **keys: object) -> str:
    """A sim workload spec with more keys: ``uniform`` -> ``uniform:n=8,...``."""
    extra = ",".join(f"{k}={v}" for k, v in keys.items())
    return f"{workload}{',' if ':' in workload else ':'}{extra}"


TARGET = 1 / 3  # home's cold starts against round-robin's, at most


def verdict(home: float, rr: float, bound: float) -> str:
    """``ok``: home <= TARGET x round-robin; ``MISS``: not, though the partition bound is under
    the target; ``bound>1/3``: the partition bound itself is above the target (too few requests
    per adapter, or the working set over the fleet's memory), so no partition meets it."""
    if home <= TARGET * rr + 1e-12:
        return "ok"
    return "bound>1/3" if bound > TARGET * rr else "MISS"


def simulate_sweep(shapes: list[str], requests: int, warmup: int, seeds: int) -> list[dict]:
    """Every shape through every policy (same traces), cold-start rates averaged over seeds."""
    rows = []
    print(f"{'fleet (replicas x slots/memory)':<32}{'conc':>5}  {'workload':<22}{'set/mem':>8}"
          + "".join(f"{p:>14}" for p in POLICIES)
          + f"{'partition':>11}{'home/rr':>9}{'bound/rr':>9}{'home/bound':>11}  {'check':<10}"
          + f"{'homes/adapter':>14}{'time home/rr':>14}")  # fmt: skip
    for text in shapes:
        shape, conc, spec = parse_shape(text)
        cold = {p: 0.0 for p in POLICIES}
        spread = bound = 0.0
        working = 0
        span = {p: 0.0 for p in POLICIES}
        for seed in range(seeds):
            work = generate_workload(with_keys(spec, requests=warmup + requests, seed=seed))
            trace = [r.adapter for r in work.requests]
            working = max(working, len(set(trace)))
            for p in POLICIES:
                res = simulate_routing(trace, shape, policy=p, warmup=warmup, concurrency=conc)
                cold[p] += res.cold_rate / seeds
                span[p] += res.makespan_s / seeds
                if p == "home":
                    spread += res.replicas_per_adapter / seeds
            bound += partition_bound(trace, shape.fleet_memory, warmup) / requests / seeds
        fleet = f"{shape.replicas} x {shape.device_slots}/{shape.memory}"
        rr = cold["round-robin"]
        ratio = cold["home"] / rr if rr else float("nan")
        check = verdict(cold["home"], rr, bound)
        print(f"{fleet:<32}{conc:>5}  {spec:<22}{f'{working}/{shape.fleet_memory}':>8}"
              + "".join(f"{cold[p]:>14.3f}" for p in POLICIES)
              + f"{bound:>11.3f}{ratio:>9.2f}{bound / rr if rr else float('nan'):>9.2f}"
              + (f"{cold['home'] / bound:>11.2f}" if bound else f"{'-':>11}") + f"  {check:<10}"
              + f"{spread:>14.2f}{span['home'] / span['round-robin']:>14.2f}",
              flush=True)  # fmt: skip
        rows.append({"shape": text, "cold_rate": cold, "partition_bound": bound,
                     "working_set": working, "fleet_memory": shape.fleet_memory,
                     "home_replicas_per_adapter": spread, "makespan_s": span,
                     "check": check})  # fmt: skip
    return rows


def build_model(root: Path, n_adapters: int, rank: int) -> tuple[Path, list[tuple[str, Path]]]:
    """A random Llama (h128, 4 layers) and ``n_adapters`` distinct random adapters."""
    from loraplex.testing import make_random_model

    model = root / "model"
    if not (model / "config.json").is_file():
        make_random_model(model, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                          intermediate_size=384, seed=0)  # fmt: skip
    return model, adapters_for(model, root, n_adapters, rank)


def adapters_for(model_dir: Path, root: Path, n: int, rank: int) -> list[tuple[str, Path]]:
    """``n`` distinct random adapters for ``model_dir`` under ``root/adapters`` (built once)."""
    from loraplex.lora.peft.files import CONFIG_NAME
    from loraplex.testing import make_random_adapter

    out = []
    for i in range(n):
        d = root / "adapters" / f"a{i:02d}"
        if not (d / CONFIG_NAME).is_file():
            make_random_adapter(model_dir, d, r=rank, lora_alpha=2 * rank, seed=100 + i)
        out.append((f"a{i:02d}", d))
    return out


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up in {timeout} s")
        time.sleep(0.5)


def evict_all(replicas: list[str], names: list[str]) -> None:
    """Drop every adapter from device slots and host memory on every replica."""
    h = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(timeout=30, headers=h) as c:
        for url in replicas:
            for n in names:
                r = c.post(f"{url}/v1/evict_lora_adapter",
                           json={"lora_name": n, "tiers": ["device", "host"]})  # fmt: skip
                r.raise_for_status()
            left = [a for a in c.get(f"{url}/v1/adapters").json()["data"]
                    if a["tier"] in ("device", "host")]  # fmt: skip
            if left:
                raise RuntimeError(f"{url}: still resident after eviction: {left}")


def router_counts(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for metric in ("loraplex_router_decisions_total", "loraplex_router_retries_total"):
            if line.startswith(metric + "{"):
                label = line[line.index('"') + 1 : line.rindex('"')]
                key = f"{metric.split('_')[2]}:{label}"
                out[key] = out.get(key, 0.0) + float(line.split()[-1])
    return out


def spread(records: list[Any]) -> dict[str, float]:
    """How many replicas served each adapter (mean, over adapters, and request-weighted)."""
    where: dict[str, set[str]] = {}
    count: dict[str, int] = {}
    for r in records:
        if r.ok:
            where.setdefault(r.model, set()).add(r.served_by)
            count[r.model] = count.get(r.model, 0) + 1
    if not where:
        return {}
    n = sum(count.values())
    return {
        "replicas_per_adapter": sum(len(v) for v in where.values()) / len(where),
        "replicas_per_request": sum(len(where[m]) * c for m, c in count.items()) / n,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", help="HF model directory (default: a random h128 Llama)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--max-cpu-loras", type=int, default=8)
    ap.add_argument("--workload", default="zipf:s=1", help="sim workload kind and keys")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals, req/s")
    ap.add_argument("--prompt-len", default="16")
    ap.add_argument("--output-len", default="8")
    ap.add_argument(
        "--warmup",
        type=int,
        default=200,
        help="requests sent (same workload kind, another seed) before each measured "
        "run and not recorded, so the rates are steady-state",
    )
    ap.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="extra loraplex route flag for every router, e.g. --router-arg=--max-in-flight=4",
    )
    ap.add_argument("--rounds", type=int, default=1, help="repeat all policies, order rotated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop with this many clients (1: one request at a time) instead of "
        "Poisson arrivals at --rate",
    )
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: all)")
    ap.add_argument("--simulate", action="store_true", help="the simulated sweep, no servers")
    ap.add_argument(
        "--shape",
        action="append",
        default=[],
        help="simulated shape REPLICASxSLOTS/MEMORY@CONCURRENCY=WORKLOAD (repeat; default: "
        "the built-in sweep)",
    )
    ap.add_argument("--seeds", type=int, default=3, help="simulated traces per shape")
    ap.add_argument(
        "--check",
        action="store_true",
        help="simulated: exit 1 if a shape misses home <= 1/3 x round-robin's cold starts "
        "while its partition bound is under that target",
    )
    ap.add_argument("--work-dir", default=None, help="keep the model and adapters here")
    ap.add_argument("--json", help="write the summaries here")
    args = ap.parse_args()
    if args.simulate:
        t0 = time.monotonic()
        rows = simulate_sweep(args.shape or list(DEFAULT_SHAPES), args.requests, args.warmup,
                              args.seeds)  # fmt: skip
        print(f"simulated: {args.warmup} warm-up + {args.requests} measured requests per "
              f"shape, policy and seed, {args.seeds} seed(s), mean cold-start rate; "
              f"{time.monotonic() - t0:.0f} s")  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        missed = [r["shape"] for r in rows if r["check"] == "MISS"]
        if missed:
            print(f"home > 1/3 x round-robin's cold starts, partition bound under it: "
                  f"{', '.join(missed)}")  # fmt: skip
        return 1 if missed and args.check else 0
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    if not set(policies) <= set(POLICIES) or not policies:
        raise SystemExit(f"--policies: choose from {', '.join(POLICIES)}")

    root = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-router-"))
    t0 = time.monotonic()
    if args.model_dir:
        model = Path(args.model_dir)
        adapters = adapters_for(model, root, args.adapters, args.rank)
    else:
        model, adapters = build_model(root, args.adapters, args.rank)
    names = [n for n, _ in adapters]
    print(f"model {model}, {len(adapters)} adapters (rank {args.rank}) ready in "
          f"{time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip

    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    try:
        replicas = []
        for _ in range(args.replicas):
            port = free_port()
            cmd = [
                sys.executable, "-m", "loraplex.cli", "serve", str(model), "--port", str(port),
                "--served-model-name", "base", "--enable-lora",
                "--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras),
                "--max-lora-rank", str(args.rank), "--num-threads", "1",
                "--admin-api-key", ADMIN, "--log-level", "warning",
                "--lora-modules", *(f"{n}={p}" for n, p in adapters),
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
            replicas.append(f"http://127.0.0.1:{port}")
        for url, p in zip(replicas, procs, strict=True):
            wait_up(url, p)
        routers = {}
        for policy in policies:
            port = free_port()
            cmd = [sys.executable, "-m", "loraplex.cli", "route", "--policy", policy,
                   "--port", str(port), "--poll-interval", "0.5", "--log-level", "warning",
                   *args.router_arg,
                   *(x for u in replicas for x in ("--replica", u))]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env))
            routers[policy] = f"http://127.0.0.1:{port}"
        for url, p in zip(routers.values(), procs[len(replicas) :], strict=True):
            wait_up(url, p)
        print(f"{args.replicas} replicas and {len(routers)} routers up after "
              f"{time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip

        spec = with_keys(args.workload, n=args.adapters, requests=args.requests, seed=args.seed)
        trace = generate_workload(spec).requests
        reqs = build_requests(
            trace, names, prompt_len=LengthDist.parse(args.prompt_len),
            output_len=LengthDist.parse(args.output_len), rate=args.rate, seed=args.seed,
        )  # fmt: skip
        warm_trace = generate_workload(
            with_keys(
                args.workload, n=args.adapters, requests=max(args.warmup, 1), seed=args.seed + 1
            )
        ).requests
        warm_reqs = build_requests(
            warm_trace, names, prompt_len=LengthDist.parse(args.prompt_len),
            output_len=LengthDist.parse(args.output_len), rate=args.rate, seed=args.seed + 1,
        )[: args.warmup]  # fmt: skip
        results: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        for rnd in range(args.rounds):
            k = rnd % len(policies)
            order = policies[k:] + policies[:k]
            for policy in order:
                evict_all(replicas, names)
                time.sleep(1.0)  # let the routers see the empty caches
                if warm_reqs:
                    run_load(routers[policy], warm_reqs, fetch_ranks=False,
                             concurrency=args.concurrency)  # fmt: skip
                before = router_counts(routers[policy])
                res = run_load(routers[policy], reqs, fetch_ranks=False,
                               concurrency=args.concurrency)  # fmt: skip
                s = summarize(res)
                after = router_counts(routers[policy])
                ok = [r for r in res.records if r.ok]
                cold = sum(r.state == "cold" for r in ok)
                row = {
                    "policy": policy,
                    "round": rnd,
                    "requests": len(res.records),
                    "ok": len(ok),
                    "cold_rate": cold / len(ok) if ok else None,
                    "ttft_p50": s["ttft_s"]["p50"],
                    "ttft_p99": s["ttft_s"]["p99"],
                    "cold_ttft_p50": s["by_state"].get("cold", {}).get("ttft_s", {}).get("p50"),
                    "warm_ttft_p50": s["by_state"].get("warm", {}).get("ttft_s", {}).get("p50"),
                    "by_replica": {k: v["requests"] for k, v in s["by_replica"].items()},
                    "router": {k: after[k] - before.get(k, 0.0) for k in after},
                    "errors": s["error_kinds"],
                    "spread": spread(res.records),
                    "records": [[r.model, r.served_by, r.state, r.ttft] for r in res.records],
                }
                results[policy].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "records"}), flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()

    def best(policy: str, key: str) -> float:
        vals = [r[key] for r in results[policy] if r[key] is not None]
        return min(vals) if vals else float("nan")

    fleet_memory = args.replicas * max(args.max_cpu_loras, args.max_loras)
    models = [r.model for r in warm_reqs] + [r.model for r in reqs]
    bound = partition_bound(models, fleet_memory, warmup=len(warm_reqs)) / len(reqs)
    arrivals = (
        f"closed loop, {args.concurrency} at a time"
        if args.concurrency
        else f"Poisson {args.rate:g} req/s"
    )
    print()
    print(f"{args.replicas} replicas x (--max-loras {args.max_loras}, --max-cpu-loras "
          f"{args.max_cpu_loras}), {args.adapters} adapters rank {args.rank}, {spec}, "
          f"{arrivals}, prompt {args.prompt_len} / output {args.output_len} "
          f"tokens, {args.warmup} warm-up + {args.requests} measured requests per policy, "
          f"{args.rounds} round(s), best round per policy"
          + (f", router flags {' '.join(args.router_arg)}" if args.router_arg else ""))  # fmt: skip
    print(f"{'policy':<14}{'cold-start rate':>16}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}"
          f"{'cold p50 ms':>13}{'warm p50 ms':>13}{'replicas/adapter':>18}")  # fmt: skip
    for p in policies:
        r = min(results[p], key=lambda x: x["cold_rate"] if x["cold_rate"] is not None else 1)

        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x * 1000:.1f}"

        print(f"{p:<14}{r['cold_rate']:>16.3f}{ms(best(p, 'ttft_p50')):>13}"
              f"{ms(best(p, 'ttft_p99')):>13}{ms(r['cold_ttft_p50']):>13}"
              f"{ms(r['warm_ttft_p50']):>13}"
              f"{r['spread'].get('replicas_per_adapter', float('nan')):>18.2f}")  # fmt: skip
    print(f"{'partition':<14}{bound:>16.3f}   (static partition of the adapters over the "
          f"fleet's {fleet_memory} adapters of memory, same requests)")  # fmt: skip
    if "home" in policies and "round-robin" in policies:
        rr = max(best("round-robin", "cold_rate"), 1e-9)
        cold_ratio = best("home", "cold_rate") / rr
        print(f"cold-start rate home / round-robin: {cold_ratio:.2f} (target <= 0.33: "
              f"{verdict(best('home', 'cold_rate'), rr, bound)}; partition bound / "
              f"round-robin {bound / rr:.2f})")  # fmt: skip
    if "home" in policies and "least-loaded" in policies:
        p99_ratio = best("home", "ttft_p99") / best("least-loaded", "ttft_p99")
        print(f"p99 TTFT home / least-loaded: {p99_ratio:.2f} (target <= 1: "
              f"{'met' if p99_ratio <= 1 else 'NOT met'})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
