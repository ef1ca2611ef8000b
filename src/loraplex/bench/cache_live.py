"""Live-server adapter cache benchmark: more adapters than device slots and host memory.

    python -m loraplex.bench.cache_live [--requests 400] [--adapters 48] [--concurrency 4]
                                        [--seed 0] [--json]

Builds (once, under ``--cache-dir``) a random Llama (hidden 512, 8 layers, like the throughput
bench) and N PEFT adapters (ranks 8/16/64 in turn, all seven projections) in a local object-store
directory. Serves them in-process (``create_app`` + ``serve_in_thread``) with ``--max-loras``
device slots, a host byte budget of about ``--host-adapters`` adapters, and a disk tier (a temp
directory) of about ``--disk-adapters`` adapters, so loads go L3 store -> L2 disk -> L1 host ->
L0 slot. Then:

1. drives a seeded Zipf(s) request stream over the adapters (closed loop, ``--concurrency``
   streams, token-id prompts, ``--max-tokens`` forced tokens) and records per request the
   client-side TTFT (time to the first content chunk), the ``x-loraplex-adapter-state`` header,
   and, for cold requests, whether the load was an L2 disk hit or an L3 fetch;
2. collects the cache's load stage timings (``load_observers``) and per-tier hit counters;
3. times a verified L2 read (``DiskTier.load_verified``: read + sha256 + parse) and the full host
   load (that plus ``build_adapter``) against reading the same files' raw bytes, warm page cache
   (median of ``--repeats``) and cold (pages dropped per file with ``posix_fadvise``), with
   ``hashlib.sha256`` throughput on the same bytes as the floor of any verified read.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loraplex.bench.common import percentile, sse_json
from loraplex.bench.throughput import SHAPE as H512_SHAPE
from loraplex.lora.peft_format import CONFIG_NAME as CONFIG_FILE
from loraplex.lora.peft_format import SAFETENSORS_NAME as WEIGHTS_FILE

SHAPES: dict[str, dict[str, int]] = {
    "h512": dict(H512_SHAPE),
    "tiny": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=512,
    ),
}
RANKS = (8, 16, 64)
STAGES = ("resolve", "remote_download", "disk_load", "h2d", "activation")
BASE_NAME = "base"


# -- assets ----------------------------------------------------------------------------------------
def adapter_name(i: int) -> str:
    return f"a{i:03d}"


def adapter_rank(i: int) -> int:
    return RANKS[i % len(RANKS)]


def build_assets(root: Path, shape: str, n_adapters: int) -> tuple[Path, Path]:
    """(model dir, store dir) under ``root/shape``; built once, reused by later runs.

    One PEFT template adapter per rank comes from ``make_random_adapter``; adapter ``i`` is its
    rank's template with fresh seeded random A and B (same keys and config), written atomically.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from loraplex.testing import ALL_PROJ, make_random_adapter, make_random_model

    base = root / shape
    model = base / "model"
    if not (model / "config.json").is_file():
        make_random_model(model, with_tokenizer=False, seed=0, init_std=0.02, **SHAPES[shape])
    templates = {}
    for r in RANKS:
        t = base / "templates" / f"r{r}"
        if not (t / WEIGHTS_FILE).is_file():
            make_random_adapter(
                model, t, r=r, lora_alpha=2 * r, target_modules=ALL_PROJ, seed=r, std=0.02
            )
        templates[r] = t
    store = base / "store"
    store.mkdir(parents=True, exist_ok=True)
    for i in range(n_adapters):
        dst = store / adapter_name(i)
        if (dst / WEIGHTS_FILE).is_file():
            continue
        t = templates[adapter_rank(i)]
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {
            k: 0.02 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
            for k, v in load_file(str(t / WEIGHTS_FILE)).items()
        }
        tmp = store / f".tmp-{adapter_name(i)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        shutil.copyfile(t / CONFIG_FILE, tmp / CONFIG_FILE)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        os.rename(tmp, dst)
    return model, store


def zipf_stream(
    n_adapters: int, n_requests: int, s: float, seed: int, vocab: int
) -> list[tuple[int, int, list[int]]]:
    """Seeded ``(adapter index, popularity rank, prompt token ids)`` per request.

    Popularity rank k (0-based) has probability ~ 1/(k+1)^s; ranks map to adapters through a
    seeded permutation, so popularity is unrelated to adapter rank or registration order."""
    rng = random.Random(seed)
    perm = list(range(n_adapters))
    rng.shuffle(perm)
    weights = [1.0 / (k + 1) ** s for k in range(n_adapters)]
    ranks = rng.choices(range(n_adapters), weights=weights, k=n_requests)
    lo = min(100, vocab // 4)
    return [
        (perm[k], k, [rng.randrange(lo, vocab) for _ in range(rng.randint(4, 12))]) for k in ranks
    ]


# -- measurements ----------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds, ``perf_counter`` clock)."""

    adapter: str
    popularity: int
    lora_rank: int
    status: int
    state: str  # warm | cold | "" (no header)
    source: str  # L0/L1 (warm), L2, L3, ? (cold, no load seen), error
    ttft: float | None
    e2e: float
    sent: float
    headers_at: float
    tokens: int
    error: str = ""


@dataclass
class LoadEvents:
    """Stage timings from ``load_observers`` and per-adapter L2/L3 loads, by phase."""

    phase: str = "startup"
    stages: list[tuple[str, str, float]] = field(default_factory=list)  # (phase, stage, s)
    loads: list[tuple[str, str, float]] = field(default_factory=list)  # (name, L2|L3, end)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, stage: str, seconds: float) -> None:
        with self.lock:
            self.stages.append((self.phase, stage, seconds))

    def load(self, name: str, kind: str) -> None:
        with self.lock:
            if self.phase == "serve":
                self.loads.append((name, kind, time.perf_counter()))


def instrument(mgr: Any, events: LoadEvents) -> None:
    """Record which adapter each L2 read and L3 fetch was for (wraps two bound methods of the
    server's own disk tier and store instances; timings come from ``load_observers``)."""
    mgr.load_observers.append(events.observe)
    disk_load, fetch = mgr.disk.load_verified, mgr.store.fetch

    def load_verified(digest: str, name: str) -> Any:
        res = disk_load(digest, name)
        events.load(name, "L2")
        return res

    def store_fetch(uri: str, dest: Path) -> Any:
        res = fetch(uri, dest)
        events.load(uri.rstrip("/").rsplit("/", 1)[-1], "L3")
        return res

    mgr.disk.load_verified = load_verified
    mgr.store.fetch = store_fetch


async def _one(
    client: Any, name: str, pop: int, rank: int, prompt: list[int], max_tokens: int
) -> RequestRecord:
    body = {
        "model": name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,  # a chunk per token even without a tokenizer (no text to stream)
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft, tokens, error = None, 0, ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        t_head = time.perf_counter()
        state = r.headers.get("x-loraplex-adapter-state", "")
        if r.status_code != 200:
            error = (await r.aread()).decode(errors="replace")[:200]
        else:
            async for obj in sse_json(r.aiter_lines()):
                if "error" in obj:
                    error = json.dumps(obj["error"])[:200]
                    continue
                for c in obj.get("choices") or []:
                    lp = c.get("logprobs") or {}
                    n = len(lp.get("tokens") or []) or (1 if c.get("text") else 0)
                    if n and ttft is None:
                        ttft = time.perf_counter() - t0
                    tokens += n
    e2e = time.perf_counter() - t0
    status = r.status_code if not error or r.status_code != 200 else 599
    return RequestRecord(name, pop, rank, status, state, "", ttft, e2e, t0, t_head, tokens, error)


async def drive(
    url: str,
    stream: Sequence[tuple[int, int, list[int]]],
    concurrency: int,
    max_tokens: int,
) -> list[RequestRecord]:
    """Closed loop: ``concurrency`` workers each send their next request when one finishes."""
    import httpx

    records: list[RequestRecord] = []
    it = iter(stream)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def worker() -> None:
            for idx, pop, prompt in it:
                records.append(
                    await _one(
                        client, adapter_name(idx), pop, adapter_rank(idx), prompt, max_tokens
                    )
                )

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def classify(records: list[RequestRecord], loads: list[tuple[str, str, float]]) -> None:
    """Set each record's source: warm -> L0/L1; cold -> the kind (L2 disk read or L3 fetch) of
    the last load of its adapter that ended before its headers came: its own load, or a shared
    one (a load that waited for room in L1 may have ended before the request was sent)."""
    by_name: dict[str, list[tuple[str, float]]] = {}
    for name, kind, end in loads:
        by_name.setdefault(name, []).append((kind, end))
    for r in records:
        if r.status != 200:
            r.source = "error"
            continue
        if r.state == "warm":
            r.source = "L0/L1"
            continue
        seen = [(end, k) for k, end in by_name.get(r.adapter, []) if end <= r.headers_at]
        r.source = max(seen)[1] if seen else "?"


def _pct(xs: Sequence[float], q: float) -> float:
    """:func:`~loraplex.bench.common.percentile`, NaN for no data (this report's JSON)."""
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


def _drop_pages(paths: Sequence[Path]) -> None:
    """Evict the files' clean pages from the page cache (no root needed; Linux)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_l2_vs_raw(
    mgr: Any, sample: Sequence[tuple[str, str, int]], repeats: int, cold_repeats: int
) -> dict[str, Any]:
    """Raw read vs read+parse vs verified L2 read vs full host load of the same disk entries.

    ``sample``: ``(digest, name, rank)``. Warm page cache: one untimed pass, then ``repeats``
    interleaved rounds, median per adapter and kind. Cold: the files' pages are dropped with
    ``posix_fadvise(DONTNEED)`` before each timed operation (``cold_repeats`` rounds). Also
    ``hashlib.sha256`` over the same bytes: every verified read must hash every byte.

    Call it from a worker thread, as the server loads adapters: on a busy 2-core machine the
    main thread's OpenMP team made ``build_adapter``'s many small parallel ops ~30x slower."""
    import torch

    from loraplex.lora.adapter import build_adapter, read_adapter_files

    disk = mgr.disk

    def files(d: str) -> list[Path]:
        p = disk.root / d
        return [p / CONFIG_FILE, p / WEIGHTS_FILE]

    def raw(d: str, name: str) -> None:
        for f in files(d):
            f.read_bytes()

    def parse(d: str, name: str) -> None:
        read_adapter_files(disk.root / d)

    def l2(d: str, name: str) -> None:
        disk.load_verified(d, name)

    def host(d: str, name: str) -> None:
        res = disk.load_verified(d, name)
        build_adapter(
            res.config,
            res.tensors,
            mgr.spec,
            path=str(res.path),
            name=name,
            max_lora_rank=mgr.max_lora_rank,
            dtype=mgr.dtype,
            digest=d,
        )

    def host_1t(d: str, name: str) -> None:  # the same with one intra-op thread
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            host(d, name)
        finally:
            torch.set_num_threads(n)

    kinds: dict[str, Callable[[str, str], None]] = {
        "raw": raw,
        "read_parse": parse,
        "l2": l2,
        "host": host,
        "host_1t": host_1t,
    }

    def timed(fn: Callable[[str, str], None], d: str, name: str, cold: bool) -> float:
        if cold:
            _drop_pages(files(d))
        t0 = time.perf_counter()
        fn(d, name)
        return time.perf_counter() - t0

    def rounds(n: int, cold: bool) -> dict[str, dict[str, list[float]]]:
        out: dict[str, dict[str, list[float]]] = {k: {d: [] for d, _, _ in sample} for k in kinds}
        for _ in range(n):
            for d, name, _ in sample:
                for k, fn in kinds.items():
                    out[k][d].append(timed(fn, d, name, cold))
        return out

    nbytes = {d: sum(f.stat().st_size for f in files(d)) for d, _, _ in sample}
    total = sum(nbytes.values())
    rounds(1, cold=False)  # page cache warm, code paths warm
    warm = rounds(repeats, cold=False)
    cold = rounds(cold_repeats, cold=True) if cold_repeats else {}

    # sha256 over the same bytes (in memory): the hashing floor of any verified read
    blobs = [f.read_bytes() for d, _, _ in sample for f in files(d)]
    sha_times = []
    for _ in range(max(10, repeats)):
        t0 = time.perf_counter()
        for b in blobs:
            hashlib.sha256(b).digest()
        sha_times.append(time.perf_counter() - t0)
    sha_s = min(sha_times)

    def agg(res: dict[str, dict[str, list[float]]], how: Callable[[list[float]], float]) -> dict:
        return {k: sum(how(v) for v in per.values()) for k, per in res.items()}

    by_rank: dict[int, dict[str, Any]] = {}
    for d, _, r in sample:
        row = by_rank.setdefault(r, {"adapters": 0, "bytes": 0, **dict.fromkeys(kinds, 0.0)})
        row["adapters"] += 1
        row["bytes"] += nbytes[d]
        for k in kinds:
            row[k] += statistics.median(warm[k][d])
    out: dict[str, Any] = {
        "adapters": len(sample),
        "bytes": total,
        "repeats": repeats,
        "warm_median_s": agg(warm, statistics.median),
        "warm_best_s": agg(warm, min),
        "by_rank_warm_median_s": {str(r): by_rank[r] for r in sorted(by_rank)},
        "sha256_s": sha_s,
        "sha256_MBps": total / sha_s / 1e6,
    }
    w = out["warm_median_s"]
    out["raw_MBps"] = total / w["raw"] / 1e6
    out["ratio_l2_raw"] = w["l2"] / w["raw"]
    out["ratio_host_raw"] = w["host"] / w["raw"]
    out["ratio_host_1t_raw"] = w["host_1t"] / w["raw"]
    out["torch_threads"] = torch.get_num_threads()
    out["ratio_l2_raw_best"] = out["warm_best_s"]["l2"] / out["warm_best_s"]["raw"]
    out["floor_ratio_serial"] = (w["raw"] + sha_s) / w["raw"]  # read, then hash every byte
    out["floor_ratio_overlapped"] = max(w["raw"], sha_s) / w["raw"]
    if cold:
        c = agg(cold, statistics.median)
        out["cold_repeats"] = cold_repeats
        out["cold_median_s"] = c
        out["cold_raw_MBps"] = total / c["raw"] / 1e6
        out["cold_ratio_l2_raw"] = c["l2"] / c["raw"]
        out["cold_ratio_host_raw"] = c["host"] / c["raw"]
    return out


# -- the run ---------------------------------------------------------------------------------------
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


# -- output ----------------------------------------------------------------------------------------
def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:.1f}"  # NaN -> "-"


def format_table(res: dict[str, Any]) -> str:
    c = res["config"]
    mib = 2**20
    lines = [
        f"model {c['shape']}, float32, {c['threads'] or 'default'} threads; "
        f"{c['adapters']} adapters (ranks {'/'.join(map(str, c['ranks']))}, all 7 projections, "
        f"{c['store_bytes'] / mib:.0f} MiB in the local store)",
        f"tiers: L0 {c['max_loras']} slots | L1 {c['host_budget_bytes'] / mib:.0f} MiB "
        f"(~{c['host_adapters']:g} adapters) | L2 {c['disk_budget_bytes'] / mib:.0f} MiB "
        f"(~{c['disk_adapters']:g} adapters) | L3 local dir; policy {c['policy']}",
        f"stream: Zipf s={c['zipf_s']:g}, seed {c['seed']}, {c['requests']} requests, closed loop "
        f"x{c['concurrency']}, {c['max_tokens']} tokens each; start-up (all adapters registered "
        f"and loaded once) {res['startup_s']:.1f} s, run {res['wall_s']:.1f} s, "
        f"{res['n_errors']} errors",
        "",
        f"{'TTFT (ms)':<14}{'requests':>9}{'p50':>9}{'p99':>9}{'mean':>9}{'headers p50':>13}",
    ]
    for k, s in res["ttft_s"].items():
        h = res["headers_s"][k]["p50"]
        lines.append(
            f"{k:<14}{s['n']:>9}{_ms(s['p50']):>9}{_ms(s['p99']):>9}{_ms(s['mean']):>9}{_ms(h):>13}"
        )
    lines.append("(headers: sent once the adapter's host copy is ready, before scheduling)")
    for err in res["errors"]:
        lines.append(f"error: {err}")
    if res["cold_unattributed"]:
        lines.append(f"(cold requests with no L2/L3 load seen: {res['cold_unattributed']})")
    lines += ["", f"{'tier':<8}{'lookups':>9}{'hits':>7}{'hit ratio':>11}{'evictions':>11}"]
    names = {"device": "L0 slot", "host": "L1 host", "disk": "L2 disk"}
    for tier, d in res["tiers"].items():
        looked = d["hits"] + d["misses"]
        hr = "-" if looked == 0 else f"{d['hit_ratio']:.3f}"
        lines.append(
            f"{names.get(tier, tier):<8}{looked:>9}{d['hits']:>7}{hr:>11}{d['evictions']:>11}"
        )
    st = res["stats"]
    lines.append(
        f"L3 fetches {st['remote_loads']}, L2 reads {st['disk_hits']}, cold requests "
        f"{st['cold_requests']}, capacity waits {st['capacity_waits']}, "
        f"slot waits {st['slot_waits']}"
    )
    lines += [
        "",
        f"{'load stage (ms)':<17}{'n':>6}{'p50':>9}{'p99':>9}{'mean':>9}{'total':>10}",
    ]
    for stage, s in res["stages_s"].items():
        if s["n"]:
            lines.append(
                f"{stage:<17}{s['n']:>6}{_ms(s['p50']):>9}{_ms(s['p99']):>9}"
                f"{_ms(s['mean']):>9}{_ms(s['total']):>10}"
            )
    lines.append("(resolve: a request's whole wait for a host copy, load or shared load)")
    lv = res["l2_vs_raw"]
    if lv:
        w = lv["warm_median_s"]
        lines += [
            "",
            f"L2 load vs raw read of the same bytes: {lv['adapters']} disk entries, "
            f"{lv['bytes'] / mib:.1f} MiB, warm page cache, median of {lv['repeats']}",
            f"{'rank':<6}{'MiB':>7}{'raw':>9}{'read+parse':>12}{'L2 verified':>13}"
            f"{'+build':>9}{'+build 1t':>11}{'L2/raw':>8}   (ms)",
        ]
        rows = [(r, row) for r, row in lv["by_rank_warm_median_s"].items()]
        rows.append(("all", {**w, "bytes": lv["bytes"]}))
        for r, row in rows:
            lines.append(
                f"{r:<6}{row['bytes'] / mib:>7.1f}{_ms(row['raw']):>9}"
                f"{_ms(row['read_parse']):>12}{_ms(row['l2']):>13}{_ms(row['host']):>9}"
                f"{_ms(row['host_1t']):>11}{row['l2'] / row['raw']:>8.2f}"
            )
        lines += [
            f"L2 verified / raw = {lv['ratio_l2_raw']:.2f}x (best-of: "
            f"{lv['ratio_l2_raw_best']:.2f}x; target <= 2x); host load (+build_adapter) / raw = "
            f"{lv['ratio_host_raw']:.2f}x with {lv['torch_threads']} torch threads, "
            f"{lv['ratio_host_1t_raw']:.2f}x with 1",
            f"raw read {lv['raw_MBps']:.0f} MB/s; sha256 {lv['sha256_MBps']:.0f} MB/s on the same "
            f"bytes -> floor of a verified read: {lv['floor_ratio_serial']:.2f}x raw (read then "
            f"hash), {lv['floor_ratio_overlapped']:.2f}x (perfectly overlapped)",
        ]
        if "cold_median_s" in lv:
            cm = lv["cold_median_s"]
            lines.append(
                f"cold page cache (posix_fadvise DONTNEED per file, median of "
                f"{lv['cold_repeats']}): raw {_ms(cm['raw'])} ms ({lv['cold_raw_MBps']:.0f} MB/s), "
                f"L2 verified {_ms(cm['l2'])} ms -> {lv['cold_ratio_l2_raw']:.2f}x, +build "
                f"{lv['cold_ratio_host_raw']:.2f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--cache-dir", default=os.path.expanduser("~/.cache/loraplex/bench-cache"),
        help="where the model and the adapter store are built once",
    )  # fmt: skip
    ap.add_argument("--shape", choices=sorted(SHAPES), default="h512")
    ap.add_argument("--adapters", type=int, default=48)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--host-adapters", type=float, default=8, help="L1 budget in mean adapters")
    ap.add_argument("--disk-adapters", type=float, default=24, help="L2 budget in mean adapters")
    ap.add_argument("--policy", default="hybrid")
    ap.add_argument(
        "--load-timeout", type=float, default=300.0,
        help="seconds a request may wait for room in host memory (the server's "
        "--adapter-load-timeout); long, so a slow machine queues instead of answering 503",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="engine intra-op threads")
    ap.add_argument("--sample", type=int, default=6, help="disk entries timed for L2 vs raw")
    ap.add_argument("--repeats", type=int, default=7, help="warm-cache rounds (median kept)")
    ap.add_argument("--cold-repeats", type=int, default=3, help="cold-cache rounds (0: skip)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--records", action="store_true", help="include per-request records (JSON)")
    args = ap.parse_args(argv)
    res = run(args)
    print(json.dumps(res, indent=2) if args.json else format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
