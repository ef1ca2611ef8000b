"""The live residency dashboard: ``GET /dashboard`` (one self-contained HTML page, no CDN) and
the data it polls besides ``/v1/adapters``: ``GET /v1/dashboard/stats``.

A :class:`DashboardSampler` ticks once a second for the app's lifetime (a worker thread, so
the event loop never waits on the cache's lock): it reads the server's counters and the
residency snapshot, keeps a bounded ring of per-interval samples (requests/s, TTFT p50/p99
warm/cold, distinct adapters per step, per-tier hit ratio, load seconds per stage, evictions,
thrash ratio, KV usage, speculative acceptance) and a bounded strip of events found by diffing
consecutive snapshots (loads, evictions, pins, unpins, promotions, canary changes). Each tick and each poll cost
O(adapters); memory is bounded by ``max_samples`` and ``max_events``. With speculative decoding
each poll also carries its totals since start-up (:meth:`DashboardSampler.speculative`: the
method, acceptance, accepted tokens per draft, per position and per adapter), read from the
server's metrics (:class:`~loraplex.server.metrics.SpecDecodeMetrics`), like every other series.

Scoping follows ``/v1/adapters``: a tenant key sees the occupancy and the events of its own
(and shared) adapters only, and no server-wide series (those are ``/metrics``' data, which
tenant keys may not read either). The page itself carries no data, so it is open like
``/health`` (:data:`~loraplex.server.gate.OPEN_PATHS`): it asks for a key when the data routes
answer 401 and keeps it in the tab's ``sessionStorage``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import astuple, dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse

from loraplex.pages import read_page
from loraplex.registry import Principal
from loraplex.server.auth import inference_principal
from loraplex.server.catalog import ADMIN_KEY, has_scope
from loraplex.server.metrics import SpecCounts
from loraplex.server.state import ServerState, get_state

log = logging.getLogger("loraplex.server.dashboard")

router = APIRouter()

TIER_RANK = {"absent": 0, "disk": 1, "host": 2, "device": 3}
"""Higher is closer to the GPU: moving up is a load, down an eviction."""
TOP_PREFIX_ADAPTERS = 8
"""Adapters listed in the dashboard's prefix-cache cards (the most looked-up ones)."""
TOP_SPEC_ADAPTERS = 16
"""Rows of the dashboard's speculative decoding table (the adapters with the most drafts)."""


@dataclass(frozen=True)
class Event:
    """One change seen between two snapshots."""

    t: float  # wall-clock seconds
    kind: str  # load | evict | pin | unpin | promote | canary
    name: str
    digest: str  # full sha256 (only its first 16 hex digits leave the server)
    detail: str

    def as_json(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "kind": self.kind,
            "name": self.name,
            "sha256": self.digest[:16],
            "detail": self.detail,
        }


def quantile(bounds: list[float], counts: list[float], q: float) -> float | None:
    """The ``q`` quantile of a histogram given as cumulative ``counts`` per upper bound
    (Prometheus buckets, the last one +Inf), linearly interpolated inside its bucket, as
    PromQL's ``histogram_quantile``; None for no observations."""
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lo_bound, lo_count = 0.0, 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= rank:
            if b == float("inf"):
                return lo_bound
            if c == lo_count:
                return b
            return lo_bound + (b - lo_bound) * (rank - lo_count) / (c - lo_count)
        lo_bound, lo_count = b, c
    return lo_bound


def _histograms(metric: Any, label: str) -> dict[str, tuple[list[float], list[float], float]]:
    """label value -> (upper bounds, cumulative counts, sum) of one prometheus Histogram."""
    out: dict[str, tuple[list[float], list[float], float]] = {}
    for family in metric.collect():
        for s in family.samples:
            key = s.labels.get(label, "")
            bounds, counts, _ = out.setdefault(key, ([], [], 0.0))
            if s.name.endswith("_bucket"):
                bounds.append(float(s.labels["le"]))
                counts.append(s.value)
            elif s.name.endswith("_sum"):
                out[key] = (bounds, counts, s.value)
    return out


class DashboardSampler:
    """The dashboard's memory: a ring of samples and a strip of events (see the module
    docstring). ``sample()`` is one tick; ``stats(principal)`` one poll's answer."""

    def __init__(
        self,
        state: ServerState,
        *,
        interval_s: float = 1.0,
        max_samples: int = 300,
        max_events: int = 200,
    ) -> None:
        self.state = state
        self.interval_s = interval_s
        self.samples: deque[dict[str, Any]] = deque(maxlen=max_samples)
        self.events: deque[Event] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._prev: dict[str, Any] | None = None
        self._tiers: dict[str, tuple[str, bool]] = {}  # digest -> (tier, pinned)
        self._serving: dict[str, tuple[str, str | None, float]] = {}  # name -> active, canary
        self._local: dict[str, bool] = {}  # digest -> its source is a local directory

    def _totals(self) -> dict[str, Any]:
        """The cumulative counters a sample is the difference of."""
        state = self.state
        client, m = state.client, state.metrics
        out: dict[str, Any] = {
            "t": time.monotonic(),
            "requests": sum(
                s.value
                for family in m.finished.ours.collect()
                for s in family.samples
                if s.name.endswith("_total")
            ),
            "ttft": _histograms(m.ttft.ours, "adapter_state"),
            "distinct": _histograms(m.distinct_adapters, ""),
            "load": {k: v[2] for k, v in _histograms(m.load_seconds, "stage").items()},
            "tiers": {},
        }
        sh = client.sharing_stats()
        out["sharing"] = (
            sum(sh.queries.values()), sum(sh.hits.values()), sh.base_aligned_hits,
            sh.alora_invoked, sh.alora_not_invoked,
        )  # fmt: skip
        out["spec"] = None if m.spec is None else astuple(m.spec.snapshot().total)
        if client.lora_enabled:
            out["tiers"] = {
                t: (c.hits, c.misses, c.evictions, c.thrash_ratio)
                for t, c in client.tier_counters().items()
            }
        return out

    def sample(self) -> None:
        """One tick: a sample of the last interval and the events since the last tick."""
        now = self._totals()
        wall = time.time()
        events = self._diff(wall)
        with self._lock:
            prev, self._prev = self._prev, now
            self.events.extend(events)
            if prev is not None:
                self.samples.append(self._delta(prev, now, wall))

    def _delta(self, a: dict[str, Any], b: dict[str, Any], wall: float) -> dict[str, Any]:
        dt = max(b["t"] - a["t"], 1e-9)
        ttft: dict[str, dict[str, float | None]] = {}
        for label in ("warm", "cold"):
            bounds, cb, _ = b["ttft"].get(label, ([], [], 0.0))
            _, ca, _ = a["ttft"].get(label, ([], [0.0] * len(cb), 0.0))
            ca = ca if len(ca) == len(cb) else [0.0] * len(cb)
            counts = [y - x for x, y in zip(ca, cb, strict=True)]
            ttft[label] = {
                "p50": quantile(bounds, counts, 0.5),
                "p99": quantile(bounds, counts, 0.99),
            }
        db, da = b["distinct"].get("", ([], [0.0], 0.0)), a["distinct"].get("", ([], [0.0], 0.0))
        steps = (db[1][-1] if db[1] else 0.0) - (da[1][-1] if da[1] else 0.0)
        hit_ratio: dict[str, float | None] = {}
        evictions: dict[str, int] = {}
        thrash: dict[str, float] = {}
        for tier, (h, mi, ev, th) in b["tiers"].items():
            h0, m0, e0, _ = a["tiers"].get(tier, (0, 0, 0, 0.0))
            looked = (h - h0) + (mi - m0)
            hit_ratio[tier] = (h - h0) / looked if looked else None
            evictions[tier] = ev - e0
            thrash[tier] = th
        return {
            "t": wall,
            "requests": b["requests"] - a["requests"],  # completions finished in the interval
            "rps": (b["requests"] - a["requests"]) / dt,
            "ttft": ttft,
            "distinct_adapters": (db[2] - da[2]) / steps if steps else None,
            "steps": steps,
            "hit_ratio": hit_ratio,
            "load_seconds": {k: v - a["load"].get(k, 0.0) for k, v in b["load"].items()},
            "evictions": evictions,
            "thrash_ratio": thrash,
            "kv_usage": self.state.client.kv_cache_usage(),
            **self._sharing_delta(a["sharing"], b["sharing"]),
            "spec": self._spec_delta(a["spec"], b["spec"]),
            "running": self.state.client.num_running,
            "waiting": self.state.client.num_waiting,
        }

    @staticmethod
    def _sharing_delta(a: tuple[int, ...], b: tuple[int, ...]) -> dict[str, Any]:
        """KV sharing over the interval: the prefix-cache hit ratio, the share of the prompt
        tokens looked up that came from base-keyed blocks for adapter requests, and activated
        LoRA requests with and without their invocation."""
        q, h, aligned, found, absent = (y - x for x, y in zip(a, b, strict=True))
        return {
            "prefix": {
                "hit ratio": h / q if q else None,
                "base-aligned": aligned / q if q else None,
            },
            "alora": {"invoked": found, "not invoked": absent},
        }

    @staticmethod
    def _spec_delta(
        a: tuple[int, int, int] | None, b: tuple[int, int, int] | None
    ) -> dict[str, float | None] | None:
        """Speculative decoding over the interval (None: the server runs without): accepted /
        draft tokens and accepted tokens per draft (None where nothing was drafted)."""
        if a is None or b is None:
            return None
        drafts, tokens, accepted = (y - x for x, y in zip(a, b, strict=True))
        return {
            "acceptance rate": accepted / tokens if tokens else None,
            "accepted per draft": accepted / drafts if drafts else None,
        }

    def speculative(self, operator: bool) -> dict[str, Any] | None:
        """Speculative decoding since start-up (None: the server runs without). Everyone sees
        the method; the counts are server-wide, so operators only (a tenant gets None there):
        acceptance rate (accepted / draft tokens), accepted tokens per draft and vLLM's mean
        acceptance length (1 + that: the bonus token), the rate per draft position, and the
        :data:`TOP_SPEC_ADAPTERS` adapter labels with the most drafts."""
        spec = self.state.metrics.spec
        if spec is None:
            return None
        s = spec.snapshot()
        out: dict[str, Any] = {
            "method": s.method,
            "num_speculative_tokens": s.num_speculative_tokens,
            "totals": None,
            "by_adapter": None,
        }
        if not operator:
            return out
        t = s.total
        out["totals"] = {
            **_spec_row(t),
            "accepted_per_draft": t.accepted_tokens / t.drafts if t.drafts else None,
            "mean_acceptance_length": 1 + t.accepted_tokens / t.drafts if t.drafts else None,
            "per_position": [n / t.drafts if t.drafts else None for n in s.accepted_per_pos],
        }
        top = sorted(s.by_adapter.items(), key=lambda kv: (-kv[1].drafts, kv[0]))
        out["by_adapter"] = [
            {"adapter": label, **_spec_row(c)} for label, c in top[:TOP_SPEC_ADAPTERS]
        ]
        return out

    def _prefix_by_adapter(self) -> list[dict[str, Any]]:
        """Prefix-cache queries and hits since start-up of the top adapters by queries (the
        base model under its served name)."""
        state = self.state
        s = state.client.sharing_stats()
        rows = []
        for key, q in s.queries.most_common(TOP_PREFIX_ADAPTERS):
            names = state.catalog.names_of(key) if key not in ("", "other") else []
            name = state.base_names[0] if key == "" else (names[0] if names else key[:12])
            rows.append({"name": name, "queries": q, "hits": s.hits[key]})
        return rows

    def _diff(self, wall: float) -> list[Event]:
        """Events between the last snapshot and now (the first tick records, emits nothing)."""
        state = self.state
        first = not self._tiers and not self._serving
        out: list[Event] = []
        serving = {
            n: (sv.active.sha256, sv.canary.sha256 if sv.canary else None, sv.canary_weight)
            for n, sv in state.catalog.servables().items()
        }
        for name, (active, canary, weight) in serving.items():
            old = self._serving.get(name)
            if first or old is None:
                continue
            if old[0] != active:
                out.append(Event(wall, "promote", name, active, f"{old[0][:12]} -> {active[:12]}"))
            if (old[1], old[2]) != (canary, weight):
                what = f"{canary[:12]} at {weight:g}" if canary else "cleared"
                out.append(Event(wall, "canary", name, canary or active, what))
        self._serving = serving
        if state.client.lora_enabled:
            now = {r.ref.sha256: (r.tier, r.pinned) for r in state.client.residency()}
            self._local = {d: v for d, v in self._local.items() if d in now}
            manifests = {
                m.sha256: m
                for sv in state.catalog.servables().values()
                for m in (sv.active, sv.canary)
                if m is not None
            }
            for d, (tier, pinned) in now.items():
                if tier == "absent" and d in manifests:  # out of memory: disk, as /v1/adapters
                    if d not in self._local:
                        spec = state.adapter_spec(manifests[d])
                        self._local[d] = state.client.is_local_source(spec)
                    if self._local[d]:
                        now[d] = ("disk", pinned)
            for d, (tier, pinned) in now.items():
                was_tier, was_pinned = self._tiers.get(d, ("absent", False))
                if first:
                    continue
                names = state.catalog.names_of(d)
                name = names[0] if names else d[:12]
                if TIER_RANK.get(tier, 0) > TIER_RANK.get(was_tier, 0):
                    out.append(Event(wall, "load", name, d, f"{was_tier} -> {tier}"))
                elif TIER_RANK.get(tier, 0) < TIER_RANK.get(was_tier, 0):
                    out.append(Event(wall, "evict", name, d, f"{was_tier} -> {tier}"))
                if pinned != was_pinned:
                    out.append(Event(wall, "pin" if pinned else "unpin", name, d, tier))
            self._tiers = now
        return out

    def stats(self, principal: Principal) -> dict[str, Any]:
        """One poll's answer for ``principal`` (see the module docstring for the scoping)."""
        state, client = self.state, self.state.client
        operator = principal.tenant is None
        visible: set[str] = set()
        names: set[str] = set()
        for sv in state.catalog.visible(principal):
            visible |= set(sv.digests)
            names.add(sv.name)
        out: dict[str, Any] = {
            "now": time.time(),
            "interval_s": self.interval_s,
            "lora": client.lora_enabled,
            "admin": principal == ADMIN_KEY or has_scope(principal, "admin:pin"),
            "tenant": principal.tenant,
            "policy": client.policy_name if client.lora_enabled else None,
            "occupancy": {},
        }
        if client.lora_enabled:
            used = client.resident_bytes() if operator else client.resident_bytes_of(visible)
            budgets = client.tier_budgets()
            out["occupancy"] = {
                tier: {
                    "count": n,
                    "bytes": b,
                    "count_budget": budgets.get(tier, (None, None))[0],
                    "bytes_budget": budgets.get(tier, (None, None))[1],
                }
                for tier, (n, b) in used.items()
            }
        with self._lock:
            # a tenant's: its names only (two tenants' names may share one digest)
            events = [
                e for e in self.events if operator or (e.name in names and e.digest in visible)
            ]
            samples = list(self.samples) if operator else None
        out["events"] = [e.as_json() for e in reversed(events)]  # newest first
        out["samples"] = samples
        out["prefix_by_adapter"] = self._prefix_by_adapter() if operator else None
        out["speculative"] = self.speculative(operator)
        return out


def _spec_row(c: SpecCounts) -> dict[str, Any]:
    """One row of counts and its acceptance rate (None before any draft token)."""
    return {
        "drafts": c.drafts,
        "draft_tokens": c.draft_tokens,
        "accepted_tokens": c.accepted_tokens,
        "acceptance_rate": c.accepted_tokens / c.draft_tokens if c.draft_tokens else None,
    }


async def sampler_loop(sampler: DashboardSampler) -> None:
    """Tick ``sampler`` every ``interval_s`` for the app's lifetime (in a worker thread)."""
    while True:
        try:
            await asyncio.to_thread(sampler.sample)
        except Exception:  # a hiccup must not end the loop
            log.exception("dashboard sample failed")
        await asyncio.sleep(sampler.interval_s)


def dashboard_html() -> str:
    """The page: one HTML file with its script and styles inline (package data), the head it
    shares with the router's page in place."""
    return read_page("loraplex.server", "static/dashboard.html")


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
def dashboard() -> HTMLResponse:
    """The page; it holds no data (open, like ``/health``), the data routes need a key."""
    return HTMLResponse(dashboard_html(), headers={"Cache-Control": "no-store"})


@router.get("/v1/dashboard/stats")
def dashboard_stats(
    request: Request,
    principal: Principal = Depends(inference_principal),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    """Occupancy against budgets, the eviction policy, the sample ring and the event strip."""
    sampler: DashboardSampler = request.app.state.dashboard
    return sampler.stats(principal)
