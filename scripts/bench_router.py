"""Routing policies side by side: residency vs round-robin vs least-loaded, in one run.

Starts N ``loraplex serve`` replicas (subprocesses) of one small model, each with few adapter
slots (``--max-loras``) and a small host tier (``--max-cpu-loras``), all serving the same M
adapters; one ``loraplex route`` per policy (subprocesses); then, for each policy in turn (the
order rotating over ``--rounds``), evicts every adapter from every replica (admin API) so each
policy starts from the same empty caches, and sends the same seeded Zipf workload through that
policy's router with ``loraplex.bench.serve``. Prints cold-start rate (responses whose adapter
was in neither a device slot nor host memory on arrival, from ``x-loraplex-adapter-state``) and
TTFT percentiles per policy, and the ratios against the targets.

    .venv/bin/python scripts/bench_router.py                         # tiny random model
    .venv/bin/python scripts/bench_router.py --model-dir /tmp/lpcache/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loraplex.bench.serve import LengthDist, build_requests, run_load, summarize
from loraplex.sim.workloads import generate_workload
from loraplex.testing.server import free_port

POLICIES = ("residency", "round-robin", "least-loaded")
ADMIN = "sk-bench-admin"


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
    from loraplex.lora.peft_format import CONFIG_NAME
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
    ap.add_argument("--work-dir", default=None, help="keep the model and adapters here")
    ap.add_argument("--json", help="write the summaries here")
    args = ap.parse_args()

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
        for policy in POLICIES:
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

        spec = f"{args.workload},n={args.adapters},requests={args.requests},seed={args.seed}"
        trace = generate_workload(spec).requests
        reqs = build_requests(
            trace, names, prompt_len=LengthDist.parse(args.prompt_len),
            output_len=LengthDist.parse(args.output_len), rate=args.rate, seed=args.seed,
        )  # fmt: skip
        warm_trace = generate_workload(
            f"{args.workload},n={args.adapters},requests={max(args.warmup, 1)},seed={args.seed + 1}"
        ).requests
        warm_reqs = build_requests(
            warm_trace, names, prompt_len=LengthDist.parse(args.prompt_len),
            output_len=LengthDist.parse(args.output_len), rate=args.rate, seed=args.seed + 1,
        )[: args.warmup]  # fmt: skip
        results: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
        for rnd in range(args.rounds):
            order = POLICIES[rnd % 3 :] + POLICIES[: rnd % 3]
            for policy in order:
                evict_all(replicas, names)
                time.sleep(1.0)  # let the routers see the empty caches
                if warm_reqs:
                    run_load(routers[policy], warm_reqs, fetch_ranks=False)
                before = router_counts(routers[policy])
                res = run_load(routers[policy], reqs, fetch_ranks=False)
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

    print()
    print(f"{args.replicas} replicas x (--max-loras {args.max_loras}, --max-cpu-loras "
          f"{args.max_cpu_loras}), {args.adapters} adapters rank {args.rank}, {spec}, "
          f"Poisson {args.rate:g} req/s, prompt {args.prompt_len} / output {args.output_len} "
          f"tokens, {args.warmup} warm-up + {args.requests} measured requests per policy, "
          f"{args.rounds} round(s), best round per policy"
          + (f", router flags {' '.join(args.router_arg)}" if args.router_arg else ""))  # fmt: skip
    print(f"{'policy':<14}{'cold-start rate':>16}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}"
          f"{'cold p50 ms':>13}{'warm p50 ms':>13}")  # fmt: skip
    for p in POLICIES:
        r = min(results[p], key=lambda x: x["cold_rate"] if x["cold_rate"] is not None else 1)

        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x * 1000:.1f}"

        print(f"{p:<14}{r['cold_rate']:>16.3f}{ms(best(p, 'ttft_p50')):>13}"
              f"{ms(best(p, 'ttft_p99')):>13}{ms(r['cold_ttft_p50']):>13}"
              f"{ms(r['warm_ttft_p50']):>13}")  # fmt: skip
    cold_ratio = best("residency", "cold_rate") / best("round-robin", "cold_rate")
    p99_ratio = best("residency", "ttft_p99") / best("least-loaded", "ttft_p99")
    print(f"cold-start rate residency / round-robin: {cold_ratio:.2f} (target <= 0.33: "
          f"{'met' if cold_ratio <= 1 / 3 else 'NOT met'})")  # fmt: skip
    print(f"p99 TTFT residency / least-loaded: {p99_ratio:.2f} (target <= 1: "
          f"{'met' if p99_ratio <= 1 else 'NOT met'})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
