"""Driving the live server: the closed-loop client (one :class:`RequestRecord` per request),
the hooks that see which adapter each L2 read and L3 fetch was for, and the attribution of each
cold request to the load that served it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.tools.bench.cache_live.assets import adapter_name, adapter_rank
from loraplex.tools.bench.common import sse_json


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

    def load_verified(digest: str, name: str, **kw: Any) -> Any:
        res = disk_load(digest, name, **kw)
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
