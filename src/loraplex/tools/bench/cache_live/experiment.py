"""One run of the benchmark: build the assets, serve them in-process, drive the stream, time
L2 vs raw reads; the results as one JSON-able dict."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loraplex.lora.peft.files import CONFIG_NAME as CONFIG_FILE
from loraplex.lora.peft.files import SAFETENSORS_NAME as WEIGHTS_FILE
from loraplex.tools.bench.cache_live.assets import (
    BASE_NAME,
    RANKS,
    SHAPES,
    adapter_name,
    build_assets,
    zipf_stream,
)
from loraplex.tools.bench.cache_live.drive import LoadEvents, classify, drive, instrument
from loraplex.tools.bench.cache_live.l2_vs_raw import measure_l2_vs_raw
from loraplex.tools.bench.common import percentile

STAGES = ("resolve", "remote_download", "disk_load", "h2d", "activation")


def _pct(xs: Sequence[float], q: float) -> float:
    """:func:`~loraplex.tools.bench.common.percentile`, NaN for no data (this report's JSON)."""
    p = percentile(xs, q)
    return float("nan") if p is None else p


def summary(xs: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(xs),
        "p50": _pct(xs, 50),
        "p99": _pct(xs, 99),
        "mean": statistics.fmean(xs) if xs else float("nan"),
        "total": float(sum(xs)),
    }


def tier_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for tier, a in after.items():
        b = before.get(tier)
        d = {
            k: getattr(a, k) - (getattr(b, k) if b is not None else 0)
            for k in ("hits", "misses", "inserts", "evictions", "reload_after_eviction")
        }
        looked = d["hits"] + d["misses"]
        d["hit_ratio"] = d["hits"] / looked if looked else float("nan")
        out[tier] = d
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build assets, serve, drive the stream, measure L2 vs raw; returns the results dict."""
    from loraplex.config import EngineConfig, LoRAModule, ServerConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.server.app import create_app
    from loraplex.testing.server import serve_in_thread
    from loraplex.testing.sync import wait_idle

    model, store = build_assets(Path(args.cache_dir), args.shape, args.adapters)
    names = [adapter_name(i) for i in range(args.adapters)]
    weights_bytes = [(store / n / WEIGHTS_FILE).stat().st_size for n in names]
    file_bytes = [
        w + (store / n / CONFIG_FILE).stat().st_size
        for n, w in zip(names, weights_bytes, strict=True)
    ]
    host_budget = int(args.host_adapters * statistics.fmean(weights_bytes))
    disk_budget = int(args.disk_adapters * statistics.fmean(file_bytes))
    host_budget = max(host_budget, max(weights_bytes))
    disk_budget = max(disk_budget, max(file_bytes))
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-cache-live-"))
    results: dict[str, Any] = {}
    try:
        engine_cfg = EngineConfig(
            model=str(model),
            dtype="float32",
            max_loras=args.max_loras,
            max_cpu_loras=args.adapters,  # the byte budget binds, not the count
            max_lora_rank=max(RANKS),
            max_cpu_lora_bytes=host_budget,
            disk_cache_dir=str(tmp / "l2"),
            disk_cache_bytes=disk_budget,
            adapter_store_url=str(store),
            adapter_eviction_policy=args.policy,
            adapter_load_timeout_s=args.load_timeout,
            skip_tokenizer_init=True,
            kv_cache_memory_bytes=64 << 20,
            max_num_seqs=max(16, args.concurrency),
            num_threads=args.threads,
        )
        config = ServerConfig(
            engine_cfg,
            served_model_name=[BASE_NAME],
            lora_modules=[LoRAModule(n, str(store / n)) for n in names],
            log_level="warning",
        )
        t0 = time.perf_counter()
        engine = LLMEngine(engine_cfg)
        mgr = engine.adapters
        events = LoadEvents()
        instrument(mgr, events)
        app = create_app(config, engine=engine)  # registers (and so loads) every adapter
        startup_s = time.perf_counter() - t0
        stats0 = mgr.stats.snapshot()
        tiers0 = mgr.tier_counters()
        events.phase = "serve"
        stream = zipf_stream(
            args.adapters, args.requests, args.zipf_s, args.seed, SHAPES[args.shape]["vocab_size"]
        )
        with serve_in_thread(app) as url:
            t1 = time.perf_counter()
            records = asyncio.run(drive(url, stream, args.concurrency, args.max_tokens))
            wall = time.perf_counter() - t1
            wait_idle(engine)
            events.phase = "done"
            tiers1 = mgr.tier_counters()
            stats1 = mgr.stats.snapshot()
            resident = mgr.resident_bytes()
        classify(records, events.loads)

        by_digest = {u.ref.sha256: u for u in mgr.residency()}
        on_disk = [d for d in mgr.disk.entries() if d in by_digest]
        sample = []
        for r in RANKS:  # up to --sample adapters, ranks in turn
            sample += [(d, by_digest[d].ref.name, r) for d in on_disk if by_digest[d].rank == r]
        sample.sort(key=lambda x: (RANKS.index(x[2]), x[1]))
        per_rank = max(1, args.sample // len(RANKS))
        picked = [x for r in RANKS for x in [y for y in sample if y[2] == r][:per_rank]]
        l2: dict[str, Any] = {}
        if picked:  # in a worker thread, like the server's loads (the prepare pool)
            with ThreadPoolExecutor(1) as pool:
                l2 = pool.submit(
                    measure_l2_vs_raw, mgr, picked, args.repeats, args.cold_repeats
                ).result()
        mgr.disk.close()

        ok = [r for r in records if r.status == 200]
        groups = {
            "all": ok,
            "warm": [r for r in ok if r.state == "warm"],
            "cold": [r for r in ok if r.state == "cold"],
            "cold L2": [r for r in ok if r.source == "L2"],
            "cold L3": [r for r in ok if r.source == "L3"],
        }
        results = {
            "config": {
                "shape": args.shape,
                "adapters": args.adapters,
                "ranks": list(RANKS),
                "requests": args.requests,
                "concurrency": args.concurrency,
                "max_tokens": args.max_tokens,
                "zipf_s": args.zipf_s,
                "seed": args.seed,
                "max_loras": args.max_loras,
                "host_budget_bytes": host_budget,
                "host_adapters": args.host_adapters,
                "disk_budget_bytes": disk_budget,
                "disk_adapters": args.disk_adapters,
                "store_bytes": sum(file_bytes),
                "policy": args.policy,
                "threads": args.threads,
            },
            "startup_s": startup_s,
            "wall_s": wall,
            "requests_ok": len(ok),
            "errors": [r.error for r in records if r.status != 200][:5],
            "n_errors": len(records) - len(ok),
            "ttft_s": {
                k: summary([r.ttft for r in v if r.ttft is not None]) for k, v in groups.items()
            },
            "headers_s": {
                k: summary([r.headers_at - r.sent for r in v]) for k, v in groups.items()
            },
            "cold_unattributed": sum(1 for r in ok if r.source == "?"),
            "tiers": tier_delta(tiers0, tiers1),
            "stats": {k: stats1[k] - stats0[k] for k in stats1},
            "resident": {t: {"count": n, "bytes": b} for t, (n, b) in resident.items()},
            "stages_s": {
                st: summary([s for ph, st2, s in events.stages if ph == "serve" and st2 == st])
                for st in STAGES
            },
            "startup_stage_counts": {
                st: sum(1 for ph, st2, _ in events.stages if ph == "startup" and st2 == st)
                for st in STAGES
            },
            "l2_vs_raw": l2,
        }
        if args.records:
            results["records"] = [asdict(r) for r in records]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results
