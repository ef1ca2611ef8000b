"""Multi-tenant mixes: several tenants' streams at once against one server, each tenant with its
own models, arrival process (open loop at a rate, or closed loop at a concurrency), lengths and
optional vLLM ``priority``; every record is tagged with its tenant and class, so the report can
give TTFT per tenant and class, each tenant's share of the output tokens and Jain's index.

    gold steady, batch bursting over 120 cold adapters:
      --tenant "gold:models=gold,rate=2,priority=-1"
      --tenant "batch:models=batch-*,concurrency=24,priority=1,class=batch"
    two tenants flooding one engine:
      --tenant "a:models=a,concurrency=32" --tenant "b:models=b,concurrency=8"

Spec: ``TENANT:key=value,...`` with keys ``models`` (names joined by ``+``; shell-style
patterns such as ``batch-*`` match the server's model list), ``rate`` (req/s, Poisson) or
``concurrency``, ``prompt`` and ``output`` (``N`` or ``LO:HI`` tokens), ``priority`` (sent as
the request's ``priority`` field), ``class`` (the report's label; default the tenant) and
``start`` (seconds after the run starts). Models are used round robin, so a tenant with many
adapters sweeps them all.
"""

from __future__ import annotations

import asyncio
import fnmatch
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loraplex.tools.bench.serve.client import (
    SERVED_BY_HEADERS,
    BenchResult,
    RequestRecord,
    _auth,
    _send,
)
from loraplex.tools.bench.serve.schedule import BenchError, BenchRequest, LengthDist

_KEYS = ("models", "rate", "concurrency", "prompt", "output", "priority", "class", "start")


@dataclass(frozen=True)
class TenantStream:
    """One tenant's traffic: exactly one of ``rate`` (open loop) and ``concurrency``."""

    tenant: str
    models: tuple[str, ...]
    rate: float | None = None
    concurrency: int | None = None
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist(64, 64))
    output_len: LengthDist = field(default_factory=lambda: LengthDist(32, 32))
    priority: int | None = None
    slo_class: str = ""
    start: float = 0.0

    @property
    def label(self) -> str:
        return self.slo_class or self.tenant

    @classmethod
    def parse(cls, text: str) -> TenantStream:
        """``TENANT:models=a+b,rate=2,...`` (see the module docstring); BenchError if bad."""
        tenant, sep, rest = text.partition(":")
        tenant = tenant.strip()
        if not sep or not tenant:
            raise BenchError(f"bad tenant spec {text!r} (expected TENANT:models=NAME,...)")
        kv: dict[str, str] = {}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            k, eq, v = item.partition("=")
            if not eq or k.strip() not in _KEYS:
                raise BenchError(f"tenant {tenant}: bad item {item!r} (keys: {', '.join(_KEYS)})")
            kv[k.strip()] = v.strip()
        models = tuple(m for m in kv.get("models", "").split("+") if m)
        if not models:
            raise BenchError(f"tenant {tenant}: needs models=NAME[+NAME...]")
        if ("rate" in kv) == ("concurrency" in kv):
            raise BenchError(f"tenant {tenant}: give exactly one of rate= and concurrency=")

        def num(key: str, kind: type, *, positive: bool = True) -> Any:
            try:
                v = kind(kv[key])
            except ValueError:
                raise BenchError(f"tenant {tenant}: {key}={kv[key]!r} is not a number") from None
            if positive and not (v > 0 and math.isfinite(v)):
                raise BenchError(f"tenant {tenant}: {key} must be > 0, got {kv[key]!r}")
            return v

        return cls(
            tenant=tenant,
            models=models,
            rate=num("rate", float) if "rate" in kv else None,
            concurrency=num("concurrency", int) if "concurrency" in kv else None,
            prompt_len=LengthDist.parse(kv.get("prompt", "64")),
            output_len=LengthDist.parse(kv.get("output", "32")),
            priority=num("priority", int, positive=False) if "priority" in kv else None,
            slo_class=kv.get("class", ""),
            start=num("start", float, positive=False) if "start" in kv else 0.0,
        )

    def resolve(self, served: Sequence[str]) -> TenantStream:
        """Patterns in ``models`` expanded against the server's names (in their order);
        BenchError for a name or pattern that matches nothing."""
        out: list[str] = []
        for m in self.models:
            hits = [s for s in served if fnmatch.fnmatchcase(s, m)] if _is_pattern(m) else (
                [m] if m in served else []
            )  # fmt: skip
            if not hits:
                raise BenchError(f"tenant {self.tenant}: the server serves nothing named {m!r}")
            out += [h for h in hits if h not in out]
        return replace(self, models=tuple(out))


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def jain_index(xs: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one has all."""
    sq = sum(x * x for x in xs)
    return None if not xs or sq == 0 else sum(xs) ** 2 / (len(xs) * sq)


async def arun_mixed(
    url: str,
    streams: Sequence[TenantStream],
    *,
    duration: float,
    api_key: str | None = None,
    endpoint: str = "completions",
    timeout: float = 600.0,
    seed: int = 0,
    token_range: tuple[int, int] = (100, 300),
    served_by_headers: Sequence[str] = SERVED_BY_HEADERS,
) -> BenchResult:
    """Run every stream at once for ``duration`` seconds (nothing is sent after it; what is in
    flight completes). Records carry ``tenant`` and ``slo_class``."""
    import httpx

    if not streams:
        raise BenchError("no tenant streams")
    if not duration > 0:
        raise BenchError(f"duration must be > 0, got {duration}")
    records: list[RequestRecord] = []
    width = sum(s.concurrency or max(4, int(s.rate * 4) if s.rate else 4) for s in streams)
    limits = httpx.Limits(max_connections=width + 16, max_keepalive_connections=width + 16)
    counter = iter(range(1 << 62))
    async with httpx.AsyncClient(
        base_url=url.rstrip("/"),
        headers=_auth(api_key),
        timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
        limits=limits,
    ) as client:
        t_start = time.perf_counter()

        def elapsed() -> float:
            return time.perf_counter() - t_start

        async def one(stream: TenantStream, rng: random.Random, k: int) -> None:
            req = BenchRequest(
                model=stream.models[k % len(stream.models)],
                prompt=[rng.randrange(*token_range) for _ in range(stream.prompt_len.sample(rng))],
                max_tokens=stream.output_len.sample(rng),
                time=elapsed(),
                workload_adapter=stream.tenant,
            )
            extra = {} if stream.priority is None else {"priority": stream.priority}
            rec = await _send(
                client, next(counter), req, endpoint, extra, served_by_headers, t_start
            )
            rec.tenant, rec.slo_class = stream.tenant, stream.label
            records.append(rec)

        async def run(i: int, stream: TenantStream) -> None:
            rng = random.Random(seed * 7919 + i)
            if stream.start > 0:
                await asyncio.sleep(stream.start)
            if stream.concurrency is not None:
                sent = iter(range(1 << 62))

                async def worker() -> None:
                    while elapsed() < duration:
                        await one(stream, rng, next(sent))

                await asyncio.gather(*(worker() for _ in range(stream.concurrency)))
                return
            assert stream.rate is not None
            tasks, k, due = [], 0, elapsed()
            while True:
                due += rng.expovariate(stream.rate)
                if due >= duration:
                    break
                if due > elapsed():
                    await asyncio.sleep(due - elapsed())
                tasks.append(asyncio.ensure_future(one(stream, rng, k)))
                k += 1
            await asyncio.gather(*tasks)

        await asyncio.gather(*(run(i, s) for i, s in enumerate(streams)))
    records.sort(key=lambda r: r.sent)
    for i, r in enumerate(records):
        r.index = i
    span = max((r.sent + (r.e2e or 0.0)) for r in records) if records else 0.0
    mode = "tenants " + "; ".join(
        f"{s.tenant}: {len(s.models)} models, "
        + (f"{s.rate:g} req/s" if s.rate is not None else f"concurrency {s.concurrency}")
        + (f", priority {s.priority}" if s.priority is not None else "")
        for s in streams
    )
    return BenchResult(records, span, mode, url, endpoint, meta={"window_s": duration})


def run_mixed(url: str, streams: Sequence[TenantStream], **kw: Any) -> BenchResult:
    """Synchronous :func:`arun_mixed`."""
    return asyncio.run(arun_mixed(url, streams, **kw))
