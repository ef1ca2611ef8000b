#!/usr/bin/env python
"""The soak: many concurrent streams over more adapters than device slots, against a real
``loraplex serve``, then a check that nothing leaked.

It builds a tiny random Llama and ``--adapters`` random PEFT adapters in a temp dir (no
downloads), registers them in a SQLite registry (on-demand, so they start cold), starts
``loraplex serve`` in a subprocess with ``--max-loras`` slots and an API key, and sends
``--requests`` streaming completions with ``--streams`` of them in flight at once (closed loop,
``loraplex.tools.bench.serve``'s client), adapters round-robin. Then it waits for the server to go
idle and prints:

- errors by kind (HTTP status, stream errors, timeouts) and requests with short outputs;
- leaks: KV-cache usage, requests waiting or running (``/metrics``), and adapters still
  holding requests or pinned (``in_flight`` in ``/v1/adapters``), after the run;
- latency: TTFT, TPOT and end-to-end p50/p99, overall and warm/cold; throughput; the
  server's RSS before and after.

Exit status 0 when there were no errors and no leaks, else 1. A run takes a few minutes on
two CPU cores with the defaults (200 streams over 32 adapters, 4 slots).

    python scripts/soak.py
    python scripts/soak.py --streams 64 --adapters 16 --max-tokens 32 --json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from loraplex.registry import Registry, RegistryPolicy, base_model_info
from loraplex.testing import ALL_PROJ, make_random_adapter, make_random_model
from loraplex.testing.server import free_port
from loraplex.testing.sync import wait_healthy, wait_until
from loraplex.tools.bench.serve import BenchRequest, percentile, run_load, summarize

KEY = "sk-soak"
BASE = "tiny"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=200, help="streams in flight (default 200)")
    p.add_argument("--requests", type=int, default=None, help="requests in all (default: streams)")
    p.add_argument("--adapters", type=int, default=32, help="distinct adapters (default 32)")
    p.add_argument("--max-loras", type=int, default=4, help="device slots (default 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--rank", type=int, default=8, help="adapter rank (default 8)")
    p.add_argument("--num-threads", type=int, default=1, help="server CPU threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p.parse_args(argv)


def build(tmp: Path, args: argparse.Namespace) -> tuple[Path, str, list[str]]:
    """The model, a registry URL holding ``args.adapters`` active adapters, and their names."""
    model = make_random_model(tmp / "model", num_layers=2, seed=args.seed)
    root = tmp / "adapters"
    url = f"sqlite:///{tmp / 'registry.db'}"
    names = [f"soak{i:03d}" for i in range(args.adapters)]
    base = base_model_info(model, name=BASE)
    with Registry.open(url, policy=RegistryPolicy(allowed_roots=(str(root),))) as reg:
        for i, name in enumerate(names):
            path = make_random_adapter(
                model,
                root / name,
                r=args.rank,
                lora_alpha=2 * args.rank,
                target_modules=ALL_PROJ,
                seed=1000 + i,
            )
            m = reg.register(path, name, base=base, actor="soak")
            reg.activate(name, m.revision, actor="soak")
    return model, url, names


def gauges(url: str) -> dict[str, float]:
    """The engine gauges of ``/metrics`` (queue, running, KV-cache usage)."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    out = {}
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "loraplex_streams_stalled_total",
    ):
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


def leaks(url: str) -> dict[str, Any]:
    """What is still held once the server is idle: KV blocks, queued or running requests,
    adapters with requests in flight or pinned."""
    g = gauges(url)
    rows = httpx.get(
        f"{url}/v1/adapters", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    ).json()["data"]
    return {
        "kv_cache_usage": g["vllm:kv_cache_usage_perc"],
        "requests_waiting": g["vllm:num_requests_waiting"],
        "requests_running": g["vllm:num_requests_running"],
        "adapters_in_flight": {r["name"]: r["in_flight"] for r in rows if r.get("in_flight")},
        "adapters_pinned": sorted(r["name"] for r in rows if r.get("pinned")),
    }


def soak(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loraplex-soak-") as tmp_dir:
        tmp = Path(tmp_dir)
        model, registry_url, names = build(tmp, args)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "loraplex.cli",
            "serve",
            str(model),
            "--port",
            str(port),
            "--served-model-name",
            BASE,
            "--enable-lora",
            "--max-loras",
            str(args.max_loras),
            "--max-lora-rank",
            str(max(8, args.rank)),
            "--registry-url",
            registry_url,
            "--api-key",
            KEY,
            "--num-threads",
            str(args.num_threads),
            "--max-waiting",
            str(max(256, args.streams)),
            "--log-level",
            "warning",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_healthy(proc, url)
            server = psutil.Process(proc.pid)
            rss_before = server.memory_info().rss
            rng = random.Random(args.seed)
            total = args.requests or args.streams
            requests = [
                BenchRequest(
                    names[i % len(names)],
                    [rng.randrange(10, 300) for _ in range(args.prompt_len)],
                    args.max_tokens,
                )
                for i in range(total)
            ]
            t0 = time.perf_counter()
            result = run_load(url, requests, concurrency=args.streams, api_key=KEY)
            wall = time.perf_counter() - t0

            def idle() -> bool:
                g = gauges(url)
                return g["vllm:num_requests_waiting"] == 0 and g["vllm:num_requests_running"] == 0

            wait_until(idle, interval=0.2, what="the server to go idle")
            left = leaks(url)
            rss_after = server.memory_info().rss
            stalled = gauges(url)["loraplex_streams_stalled_total"]
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    s = summarize(result)
    e2e = [r.e2e for r in result.records if r.ok and r.e2e is not None]
    leaked = bool(
        left["kv_cache_usage"]
        or left["requests_waiting"]
        or left["requests_running"]
        or left["adapters_in_flight"]
    )
    return {
        "config": {
            "streams": args.streams,
            "requests": total,
            "adapters": args.adapters,
            "max_loras": args.max_loras,
            "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len,
            "rank": args.rank,
        },
        "wall_s": wall,
        "errors": s["error_kinds"],
        "error_samples": s["error_samples"],
        "short_outputs": s["short_outputs"],
        "streams_stalled": stalled,
        "leaks": left,
        "leaked": leaked,
        "latency": {
            "ttft": s["ttft_s"],
            "tpot": s["tpot_s"],
            "e2e": {"p50": percentile(e2e, 50), "p99": percentile(e2e, 99)},
        },
        "by_state": {
            st: {"requests": g["requests"], "ttft": g["ttft_s"]} for st, g in s["by_state"].items()
        },
        "throughput": {k: s[k] for k in ("requests_per_s", "output_tokens_per_s")},
        "server_rss_mib": {"before": rss_before / 2**20, "after": rss_after / 2**20},
    }


def _ms(d: dict[str, Any] | None, q: str) -> str:
    v = (d or {}).get(q)
    return f"{v * 1000:8.1f} ms" if isinstance(v, int | float) else "       -"


def render(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        f"soak: {c['requests']} requests, {c['streams']} streams in flight, {c['adapters']} "
        f"adapters, {c['max_loras']} slots, {c['max_tokens']} tokens each ({r['wall_s']:.1f} s)",
        f"errors: {r['errors'] or 'none'}"
        + (f"  e.g. {r['error_samples']}" if r["error_samples"] else ""),
        f"short outputs: {r['short_outputs']}  streams aborted as stalled: "
        f"{r['streams_stalled']:g}",
        f"leaks after the run: {'YES' if r['leaked'] else 'none'}  {r['leaks']}",
    ]
    for k, d in r["latency"].items():
        lines.append(f"{k:5s} p50 {_ms(d, 'p50')}   p99 {_ms(d, 'p99')}")
    for st, g in r["by_state"].items():
        lines.append(f"  {st:7s} {g['requests']:4d} requests, ttft p50 {_ms(g['ttft'], 'p50')}")
    t = r["throughput"]
    lines.append(
        f"throughput: {t['requests_per_s']:.1f} requests/s, "
        f"{t['output_tokens_per_s']:.0f} output tokens/s"
    )
    m = r["server_rss_mib"]
    lines.append(f"server RSS: {m['before']:.0f} MiB before, {m['after']:.0f} MiB after")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = soak(args)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 1 if report["errors"] or report["leaked"] else 0


if __name__ == "__main__":
    sys.exit(main())
