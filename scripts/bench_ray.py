"""Ray Serve routing side by side: loraplex's residency router vs Ray's model multiplexing vs
Ray's default (power-of-two) routing, on a real two-node Ray cluster, the same traces.

A head node and a second node (``ray start`` on loopback, :mod:`loraplex.integrations.ray_serve
.local_cluster`), one ``LoraplexEngine`` replica on each (a tiny random Llama, ``--max-loras``
device slots, ``--max-cpu-loras`` adapters in host memory, the adapters in a shared SQLite
registry, warmed on demand only) and the OpenAI ingress on the head. For every trace and routing
the application is deployed afresh (empty adapter tiers everywhere), the trace is sent through
the ingress (``--concurrency`` clients, requests in trace order), and the answers counted:
cold starts are responses whose ``x-loraplex-adapter-state`` says the adapter was in neither a
device slot nor host memory on arrival; ``2nd half`` counts only the second half of the trace
(how well the routing converged); ``bound`` is the partition bound of the same trace (a static
split of the adapters over the fleet's memory: the compulsory misses when they fit). Traces:
``cycle`` (every adapter in turn, the working set exactly the fleet's host memory) and ``zipf``
(``--zipf-s`` popularity over twice as many adapters: some misses are unavoidable).
``--failover`` then kills the second node (its raylet and workers) in the middle of a residency-routed trace
and reports lost requests (none expected) and failed-over ones.

    .venv/bin/python scripts/bench_ray.py
    .venv/bin/python scripts/bench_ray.py --traces cycle --routings residency,default
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from ray import serve

from loraplex.integrations.ray_serve import RayServeOptions, build_app
from loraplex.integrations.ray_serve.local_cluster import (
    LocalRayCluster,
    RayNode,
    connect,
    deploy,
    local_ray_cluster,
    start_serve,
)
from loraplex.integrations.ray_serve.testbed import TinyFleet, make_tiny_fleet
from loraplex.router.fleet_sim import partition_bound
from loraplex.testing.server import free_port
from loraplex.tools.sim.workloads import generate_workload

ROUTINGS = ("residency", "multiplex", "default")


@dataclass
class Answer:
    status: int
    state: str | None
    replica: str | None
    attempts: int
    seconds: float


def make_trace(kind: str, adapters: list[str], n: int, s: float, seed: int) -> list[str]:
    """``cycle``: adapters in turn; ``zipf``: the simulator's seeded Zipf(s) workload over
    ``adapters`` (its i-th most popular name is ``adapters[i]``)."""
    if kind == "cycle":
        return [adapters[i % len(adapters)] for i in range(n)]
    work = generate_workload(f"zipf:s={s},n={len(adapters)},requests={n},seed={seed}")
    return [adapters[int(r.adapter[1:])] for r in work.requests]


def send(
    url: str,
    trace: list[str],
    concurrency: int,
    max_tokens: int,
    on_answer: Any = None,
) -> list[Answer]:
    """The trace through the ingress, ``concurrency`` clients taking requests in order
    (``on_answer()`` after each answer)."""
    local = threading.local()

    def one(adapter: str) -> Answer:
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=300)
        body = {
            "model": adapter,
            "prompt": "Hello there",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        t0 = time.perf_counter()
        r = local.client.post(f"{url}/v1/completions", json=body)
        answer = Answer(
            r.status_code,
            r.headers.get("x-loraplex-adapter-state"),
            r.headers.get("x-loraplex-replica"),
            int(r.headers.get("x-loraplex-attempts", "0")),
            time.perf_counter() - t0,
        )
        if on_answer is not None:
            on_answer()
        return answer

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, trace))


def options(routing: str) -> RayServeOptions:
    return RayServeOptions(
        routing=routing,
        num_replicas=2,
        engine_actor_options={"num_cpus": 1, "resources": {"lp_engine": 1}},
        ingress_actor_options={"num_cpus": 0, "resources": {"lp_ingress": 0.01}},
        health_check_period_s=1.0,
        health_check_timeout_s=5.0,
    )


def summary(trace: list[str], answers: list[Answer], fleet_memory: int) -> dict[str, Any]:
    half = len(trace) // 2
    cold = [a.state == "cold" for a in answers]
    loads: dict[str, set[str]] = defaultdict(set)  # replica -> adapters loaded cold there
    for adapter, a in zip(trace, answers, strict=True):
        if a.state == "cold" and a.replica:
            loads[a.replica].add(adapter)
    ms = sorted(a.seconds * 1000 for a in answers)
    return {
        "requests": len(answers),
        "errors": sum(a.status != 200 for a in answers),
        "cold": sum(cold),
        "cold_2nd_half": sum(cold[half:]),
        "bound": partition_bound(trace, fleet_memory),
        "bound_2nd_half": partition_bound(trace, fleet_memory, warmup=half),
        "copies": sum(len(v) for v in loads.values()),
        "share": sorted(Counter(a.replica for a in answers).values(), reverse=True),
        "p50_ms": statistics.median(ms),
        "p95_ms": ms[min(len(ms) - 1, int(0.95 * len(ms)))],
    }


def run_failover(
    url: str, cluster: LocalRayCluster, second: RayNode, fleet: TinyFleet, args: argparse.Namespace
) -> None:
    trace = make_trace("cycle", sorted(fleet.adapters)[: 2 * args.max_cpu_loras], 96, 1.0, 0)
    deploy(build_app(fleet.server_config(**tiers(args)), options("residency")))
    quarter = threading.Semaphore(0)
    answers: list[Answer] = []
    t = threading.Thread(
        target=lambda: answers.extend(send(url, trace, args.concurrency, 24, quarter.release))
    )
    t0 = time.perf_counter()
    t.start()
    for _ in range(len(trace) // 4):  # kill once a quarter of the trace is answered
        quarter.acquire()
    cluster.kill_node(second)
    killed = time.perf_counter() - t0
    t.join()
    wall = time.perf_counter() - t0
    ok = sum(a.status == 200 for a in answers)
    over = sum(a.attempts > 1 for a in answers)
    worst = max(a.seconds for a in answers)
    print(
        f"\nfailover (residency, node 2 SIGKILLed (raylet and workers) {killed:.1f} s into a {wall:.1f} s "
        f"trace of {len(trace)} requests, {args.concurrency} clients):"
    )
    print(
        f"  answered 200: {ok}/{len(answers)}  lost: {len(answers) - ok}  "
        f"failed over: {over}  slowest: {worst * 1000:.0f} ms"
    )


def tiers(args: argparse.Namespace) -> dict[str, int]:
    return {"max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-loras", type=int, default=1, help="device slots per replica")
    p.add_argument("--max-cpu-loras", type=int, default=3, help="host-memory adapters per replica")
    p.add_argument("--requests", type=int, default=96, help="requests per trace")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traces", default="cycle,zipf")
    p.add_argument("--routings", default=",".join(ROUTINGS))
    p.add_argument("--failover", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--workdir", type=Path, default=None, help="keep the model here (default: temp)")
    args = p.parse_args(argv)
    routings = [r for r in args.routings.split(",") if r]
    traces = [t for t in args.traces.split(",") if t]
    fleet_memory = 2 * args.max_cpu_loras  # two replicas
    n_adapters = 2 * fleet_memory if "zipf" in traces else fleet_memory

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lpbench-ray-"))
    fleet = make_tiny_fleet(workdir, n_adapters)
    names = sorted(fleet.adapters, key=lambda a: int(a[1:]))
    rows: list[tuple[str, str, dict[str, Any]]] = []
    with local_ray_cluster() as cluster:
        cluster.start_head(num_cpus=2, resources={"lp_ingress": 1, "lp_engine": 1})
        second = cluster.add_node(num_cpus=2, resources={"lp_engine": 1})
        connect(cluster)
        cluster.wait_for_nodes(2)
        url = start_serve(free_port())
        for kind in traces:
            pool = names[:fleet_memory] if kind == "cycle" else names
            trace = make_trace(kind, pool, args.requests, args.zipf_s, args.seed)
            for routing in routings:
                deploy(build_app(fleet.server_config(**tiers(args)), options(routing)))
                answers = send(url, trace, args.concurrency, args.max_tokens)
                serve.delete("loraplex")
                rows.append((kind, routing, summary(trace, answers, fleet_memory)))
                r = rows[-1][2]
                print(
                    f"{kind:6s} {routing:10s} cold {r['cold']:3d}  errors {r['errors']}",
                    file=sys.stderr,
                    flush=True,
                )
        print(
            f"\n2 replicas (one per node), {args.max_loras} device slot(s) + "
            f"{args.max_cpu_loras} host adapters each; {args.requests} requests per trace, "
            f"{args.concurrency} clients, {args.max_tokens} tokens each\n"
        )
        head = (
            "trace",
            "routing",
            "cold",
            "2nd half",
            "bound",
            "copies",
            "vs default",
            "share",
            "p50 ms",
            "p95 ms",
            "errors",
        )
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        base = {k: r["cold"] for k, name, r in rows if name == "default"}
        for kind, routing, r in rows:
            ratio = f"{r['cold'] / base[kind]:.2f}" if base.get(kind) else "-"
            cells = (
                kind,
                routing,
                r["cold"],
                r["cold_2nd_half"],
                f"{r['bound']} ({r['bound_2nd_half']})",
                r["copies"],
                ratio,
                "/".join(map(str, r["share"])),
                f"{r['p50_ms']:.0f}",
                f"{r['p95_ms']:.0f}",
                r["errors"],
            )
            print("| " + " | ".join(map(str, cells)) + " |")
        if args.failover:
            run_failover(url, cluster, second, fleet, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
