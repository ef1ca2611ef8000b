"""How much a verified L2 read costs over reading the same bytes raw: raw read, read + parse,
``DiskTier.load_verified`` and the full host load, warm and cold page cache, with ``sha256``
(the first, full verification) and BLAKE3 (re-reads of a copy this process verified,
:class:`~loraplex.lora.adapter.KnownFiles`) throughput on the same bytes as the floors."""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loraplex.lora.peft.files import CONFIG_NAME as CONFIG_FILE
from loraplex.lora.peft.files import SAFETENSORS_NAME as WEIGHTS_FILE


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
    ``hashlib.sha256`` and BLAKE3 (one thread, and ``max_threads=AUTO``) over the same bytes
    in memory: every verified read must hash every byte (the timed ``l2`` loads after the first
    take the BLAKE3 fast path).

    Call it from a worker thread, as the server loads adapters: on a busy machine the main
    thread's OpenMP team makes ``build_adapter``'s many small parallel ops much slower."""
    import torch
    from blake3 import blake3

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

    # the hashes over the same bytes (in memory): the hashing floor of any verified read
    blobs = [f.read_bytes() for d, _, _ in sample for f in files(d)]

    def hash_s(fn: Callable[[bytes], object]) -> float:
        best = float("inf")
        for _ in range(max(10, repeats)):
            t0 = time.perf_counter()
            for b in blobs:
                fn(b)
            best = min(best, time.perf_counter() - t0)
        return best

    sha_s = hash_s(lambda b: hashlib.sha256(b).digest())
    b3_s = hash_s(lambda b: blake3(b).digest())
    b3_auto_s = hash_s(lambda b: blake3(b, max_threads=blake3.AUTO).digest())

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
        "blake3_s": b3_s,
        "blake3_MBps": total / b3_s / 1e6,
        "blake3_auto_MBps": total / b3_auto_s / 1e6,
        "target_ratio_l2_raw": 2.0,
    }
    w = out["warm_median_s"]
    out["raw_MBps"] = total / w["raw"] / 1e6
    out["ratio_l2_raw"] = w["l2"] / w["raw"]
    out["ratio_host_raw"] = w["host"] / w["raw"]
    out["ratio_host_1t_raw"] = w["host_1t"] / w["raw"]
    out["torch_threads"] = torch.get_num_threads()
    out["ratio_l2_raw_best"] = out["warm_best_s"]["l2"] / out["warm_best_s"]["raw"]
    # per round (all sampled adapters, read back to back): less exposed to load drifting
    out["ratio_l2_raw_rounds"] = statistics.median(
        sum(warm["l2"][d][i] for d in warm["l2"]) / sum(warm["raw"][d][i] for d in warm["raw"])
        for i in range(repeats)
    )
    # read, then hash every byte; or both perfectly overlapped
    out["floor_ratio_serial"] = (w["raw"] + sha_s) / w["raw"]
    out["floor_ratio_overlapped"] = max(w["raw"], sha_s) / w["raw"]
    out["blake3_floor_ratio_serial"] = (w["raw"] + b3_s) / w["raw"]
    out["blake3_floor_ratio_overlapped"] = max(w["raw"], b3_s) / w["raw"]
    if cold:
        c = agg(cold, statistics.median)
        out["cold_repeats"] = cold_repeats
        out["cold_median_s"] = c
        out["cold_raw_MBps"] = total / c["raw"] / 1e6
        out["cold_ratio_l2_raw"] = c["l2"] / c["raw"]
        out["cold_ratio_host_raw"] = c["host"] / c["raw"]
    return out
