"""Replay a request trace through the server's own tier controller, in simulated time.

The replay drives :class:`loraplex.cache.controller.TierController` — the code the server's
tiered cache runs for every lookup, fill, admission, hold, eviction and counter — with the
simulated clock injected. Only the event queue, simulated time and the load-time model live
here. Tiers: L0 device slots (count), L1 host memory (bytes and/or ``max_cpu_loras``-style
count, optional), L2 local disk (bytes, optional), L3 the object store (always hits). Per
request at time ``t``, as the server handles it::

    L1 hit?  -> hold the host copy (every live request holds its copy)
    else     -> if a load of this adapter waits for room in L1, join it (single flight)
                else read it: L2 hit, or fetch from L3 and admit into L2 (policy evictions
                first; no room: the request is refused, as the server answers 503)
                admit into L1 (no evictable room even after retiring idle slots: wait for a
                release, up to ``load_wait_timeout_s``, then refuse)
    slot     -> reserve an L0 slot (inclusive: a slotted adapter holds its host copy);
                none may be freed (all in use, pinned or too new): wait, others pass
    serve    -> with --service-time > 0 the request holds its slot and host copy until
                t + service_time, so the hard constraints bite

Without L1 (no ``--host-bytes`` / ``--host-count``) the simulator models L0 straight in front
of L2/L3: an L0 miss loads through a transient host buffer (shared by the requests waiting for
the slot). The server always has an L1; ``max_cpu_loras = max_loras`` comes closest.

Patience (``--patience``): for up to that long after a request first waits, its L0 admission
is planned patiently — if the policy finds it better to wait for a busy low-value slot (a cold
adapter still in flight) than to evict a valuable idle one, the load waits. Hybrid does; the
baselines never wait. The server runs with no patience.

Prefetch (``hybrid-forecast``, every ``prefetch_interval_s``): the policy's forecast names the
adapters expected to get at least one request within its horizon; each that is not in a slot is
loaded ahead (host copy, then an idle slot via ``TierController.prefetch_slot``, only over
victims the policy values less). Prefetch loads count as loads and load seconds, never as
requests, hits or misses.

Loads are instantaneous in simulated time but each gets a modeled duration (``LoadModel``) that
is reported as load seconds and fed to the policy as the measured reload cost.

Hit ratios are the server's per-tier counters: L0 = slot reservations that found the adapter
in its slot / requests; L1 = requests that found their copy in host memory / requests; L2 =
disk hits / disk lookups (one per load from below L1). ``bypassed`` counts the requests a tier
refused. Reference lines on the same trace (L0, count capacity): Belady's MIN (offline optimum)
and A0 (keep the C-1 most requested adapters of the whole trace, cycle the last slot) — the best
any online demand-paging policy can do in expectation when requests are independent draws (Aho,
Denning & Ullman 1971), so on Zipf traces it is the realistic ceiling, below Belady.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from loraplex.cache.controller import TierController
from loraplex.cache.policy import AdapterInfo, EvictionPolicy, HybridPolicy, make_policy
from loraplex.cache.residency import NoRoomError
from loraplex.tools.sim.workloads import Request

__all__ = [
    "LoadModel",
    "SimConfig",
    "SimResult",
    "TierResult",
    "a0_hit_ratio",
    "policy_factory",
    "simulate",
]


@dataclass(frozen=True)
class LoadModel:
    """Modeled seconds of one load: overhead + bytes / bandwidth, per source."""

    h2d_bytes_per_s: float = 10e9  # L1 host -> L0 device slot
    h2d_overhead_s: float = 0.002
    disk_bytes_per_s: float = 2e9  # L2 disk -> host
    disk_overhead_s: float = 0.001
    remote_bytes_per_s: float = 200e6  # L3 object store -> host/disk
    remote_overhead_s: float = 0.05

    def seconds(self, source: str, size: int) -> float:
        if source == "L1":
            return self.h2d_overhead_s + size / self.h2d_bytes_per_s
        if source == "L2":
            return self.disk_overhead_s + size / self.disk_bytes_per_s
        return self.remote_overhead_s + size / self.remote_bytes_per_s


@dataclass(frozen=True)
class SimConfig:
    """The simulated tiers and request model."""

    slots: int = 8
    host_bytes: int | None = None
    host_count: int | None = None
    disk_bytes: int | None = None
    service_time_s: float = 0.0
    min_residency_s: float = 0.0
    thrash_window_s: float = 60.0
    patience_s: float = 1.0
    """How long a waiting request lets the policy hold out for a busy low-value slot (hybrid)
    before evicting a more valuable idle adapter; 0 = never hold out."""
    load_wait_timeout_s: float = 10.0
    """How long a load waits for room in host memory before its requests are refused (the
    server's ``--adapter-load-timeout``)."""
    prefetch_interval_s: float = 300.0
    """How often a forecasting policy (``hybrid-forecast``) gets to load ahead of demand."""
    load_model: LoadModel = field(default_factory=LoadModel)

    def __post_init__(self) -> None:
        if not self.prefetch_interval_s > 0:
            raise ValueError("prefetch_interval_s must be > 0")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        for name in ("host_bytes", "host_count", "disk_bytes"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if (
            min(self.service_time_s, self.min_residency_s, self.thrash_window_s, self.patience_s)
            < 0
        ):
            raise ValueError("service time, min residency, thrash window, patience must be >= 0")
        if not self.load_wait_timeout_s > 0:
            raise ValueError("load_wait_timeout_s must be > 0")

    @property
    def has_l1(self) -> bool:
        return self.host_bytes is not None or self.host_count is not None

    @property
    def tier_names(self) -> tuple[str, ...]:
        return ("L0",) + (("L1",) if self.has_l1 else ()) + (("L2",) if self.disk_bytes else ())


@dataclass
class TierResult:
    """Counters of one tier after a run."""

    name: str
    lookups: int
    hits: int
    hit_ratio: float
    loads: int
    evictions: int
    reload_after_eviction: int
    thrash_ratio: float
    bypassed: int  # requests this tier refused (no room: the server answers 503)


@dataclass
class SimResult:
    """One policy's run over one trace."""

    policy: str
    requests: int
    l0_hit_ratio: float
    hot_hit_ratio: float | None
    hot_requests: int
    tiers: list[TierResult]
    remote_fetches: int
    load_seconds: float
    waits: int
    mean_wait_s: float
    unserved: int  # requests refused, or still waiting when the trace ended
    prefetches: int = 0  # slot loads ahead of demand (forecasting policies)

    def tier(self, name: str) -> TierResult | None:
        return next((t for t in self.tiers if t.name == name), None)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def policy_factory(
    name: str, tier_names: Sequence[str], *, epoch_s: float = 0.0
) -> Callable[[], EvictionPolicy]:
    """A maker of fresh policies by name (hybrid learns the tier order for its reload cost;
    ``hybrid-forecast`` its hour buckets from ``epoch_s``, the Unix time of trace time 0)."""
    make_policy(name)  # validate now: unknown names raise ValueError listing the valid ones
    key = name.strip().lower()
    if key == "hybrid":
        return lambda: make_policy(name, tier_order=tuple(tier_names))
    if key == "hybrid-forecast":
        return lambda: make_policy(name, tier_order=tuple(tier_names), epoch_s=epoch_s)
    return lambda: make_policy(name)


def a0_hit_ratio(keys: Sequence[str], capacity: int) -> float:
    """A0 on this trace: the capacity-1 most requested keys stay, the last slot cycles."""
    if not keys:
        return 0.0
    top = {k for k, _ in Counter(keys).most_common(max(capacity - 1, 0))}
    loaded: set[str] = set()
    hits = 0
    last = None
    for k in keys:
        if k in loaded or (capacity > len(top) and k == last):
            hits += 1
        elif k in top:
            loaded.add(k)  # a cold miss, then it stays
        else:
            last = k
    return hits / len(keys)


def simulate(
    requests: Sequence[Request],
    policy: EvictionPolicy | Callable[[], EvictionPolicy],
    config: SimConfig,
    *,
    hot_adapters: frozenset[str] | None = None,
    timeline: list[tuple[float, bool]] | None = None,
    outcomes: list[tuple[Request, bool]] | None = None,
) -> SimResult:
    """Replay ``requests`` (sorted by time) through a fresh tier controller driven by ``policy``.

    ``timeline``: if given, gets one ``(arrival time, L0 hit)`` per served request, in serving
    order (for ``--plot``); ``outcomes`` the same with the request itself."""
    pol = policy if isinstance(policy, EvictionPolicy) else policy()
    run = _Run(pol, config, hot_adapters or frozenset())
    run.timeline = timeline
    run.outcomes = outcomes
    for req in requests:
        run.advance(req.time)
        run.arrive(req)
    run.finish()
    n = len(requests)
    counters = run.ctl.stats.tiers
    tiers = [
        TierResult(
            name=name,
            lookups=c.hits + c.misses,
            hits=c.hits,
            hit_ratio=c.hit_ratio,
            loads=c.inserts,
            evictions=c.evictions,
            reload_after_eviction=c.reload_after_eviction,
            thrash_ratio=c.thrash_ratio,
            bypassed=run.refused[name],
        )
        for name, c in counters.items()
    ]
    return SimResult(
        policy=pol.name,
        requests=n,
        l0_hit_ratio=counters["L0"].hits / n if n else 0.0,
        hot_hit_ratio=run.hot_hits / run.hot_total if run.hot_total else None,
        hot_requests=run.hot_total,
        tiers=tiers,
        remote_fetches=run.ctl.stats.remote_loads,
        load_seconds=run.load_seconds,
        waits=run.waits,
        mean_wait_s=run.wait_total / run.waits if run.waits else 0.0,
        unserved=run.unserved,
        prefetches=run.prefetches,
    )


@dataclass(eq=False)
class _Pending:
    """One request between its arrival and the start of its service."""

    info: AdapterInfo
    arrival: float
    hot: bool
    request: Request
    waited: bool = False  # counted in ``waits`` once


@dataclass(eq=False)
class _Load:
    """A loaded copy waiting for room in host memory, with the requests sharing it."""

    info: AdapterInfo
    seconds: float  # modeled load time into L1
    since: float
    requests: list[_Pending]


class _Run:
    """One replay: the tier controller, the event queue and the waiting requests."""

    def __init__(self, policy: EvictionPolicy, cfg: SimConfig, hot: frozenset[str]) -> None:
        self.cfg = cfg
        self.hot = hot
        self.now = 0.0
        self.ctl = TierController(
            policy,
            slots=cfg.slots,
            clock=lambda: self.now,
            host_bytes=cfg.host_bytes,
            max_host_copies=cfg.host_count,
            disk_bytes=cfg.disk_bytes,
            host_tier=cfg.has_l1,
            min_residency_s=cfg.min_residency_s,
            thrash_window_s=cfg.thrash_window_s,
            patience_s=cfg.patience_s,
            names=("L0", "L1", "L2"),
        )
        self.refused = {name: 0 for name in cfg.tier_names}
        self.load_seconds = 0.0
        self._seq = 0
        # (time, seq, slot, key): a request ends; slot -1 is a timer (patience, load timeout)
        self.events: list[tuple[float, int, int, str]] = []
        self.host_waiting: dict[str, _Load] = {}  # loads waiting for L1 room, FIFO
        self.slot_waiting: list[_Pending] = []  # requests waiting for a slot, FIFO
        self.buffered: dict[str, str] = {}  # without L1: key -> source of its transient copy
        self.waits = 0
        self.wait_total = 0.0
        self.hot_total = self.hot_hits = 0
        self.timeline: list[tuple[float, bool]] | None = None
        self.outcomes: list[tuple[Request, bool]] | None = None
        self.n_refused = 0
        self.prefetches = 0
        self.forecasting = isinstance(policy, HybridPolicy) and policy.forecast is not None
        self.next_prefetch = cfg.prefetch_interval_s

    @property
    def unserved(self) -> int:
        waiting = sum(len(w.requests) for w in self.host_waiting.values())
        return self.n_refused + waiting + len(self.slot_waiting)

    # -------------------------------------------------------------------------- events
    def advance(self, t: float) -> None:
        """Process every event due by ``t`` (and the prefetch rounds due by then)."""
        while self.forecasting and self.next_prefetch <= t:
            self._advance(self.next_prefetch)
            self._prefetch()
            self.next_prefetch += self.cfg.prefetch_interval_s
        self._advance(t)

    def _advance(self, t: float) -> None:
        """Process every event due by ``t``; waiting requests get what was freed."""
        while self.events and self.events[0][0] <= t:
            when, _, slot, key = heapq.heappop(self.events)
            self.now = max(self.now, when)
            if slot >= 0:
                self.ctl.release_slot(slot)
                if self.ctl.host is not None:
                    self.ctl.release_request(key)
            self._drain()
        self.now = max(self.now, t)
        if self.cfg.min_residency_s > 0:
            self._drain()  # entries may have aged past the minimum residency

    def finish(self) -> None:
        """After the last arrival: run in-flight and waiting requests while that makes progress."""
        while True:
            while self.events:
                self.advance(self.events[0][0])
            if not (self.host_waiting or self.slot_waiting) or self.cfg.min_residency_s <= 0:
                return
            left = self.unserved
            self.advance(self.now + self.cfg.min_residency_s)
            if self.unserved == left and not self.events:
                return

    def _timer(self, when: float) -> None:
        self._seq += 1
        heapq.heappush(self.events, (when, self._seq, -1, ""))

    def arrive(self, req: Request) -> None:
        """One arrival, handled as the server does (see the module docstring)."""
        info = AdapterInfo(req.adapter, req.size, req.tenant, req.priority, req.rank)
        p = _Pending(info, self.now, req.adapter in self.hot, req)
        self.hot_total += p.hot
        ctl = self.ctl
        if ctl.host is None:
            ctl.access(info)
            self._to_slot(p)
            return
        if ctl.serve_from_host(info):
            self._to_slot(p)
            return
        waiting = self.host_waiting.get(info.key)
        if waiting is not None:  # its load waits for room in host memory: share it
            self._wait(p)
            waiting.requests.append(p)
            return
        source = self._fill(info)
        if source is None:
            self._refuse([p], "L2")
            return
        load = _Load(info, self.cfg.load_model.seconds(source, info.size_bytes), self.now, [p])
        if not self._admit_host(load):
            self._wait(p)
            self.host_waiting[info.key] = load
            self._timer(self.now + self.cfg.load_wait_timeout_s)

    # -------------------------------------------------------------------------- steps
    def _fill(self, info: AdapterInfo) -> str | None:
        """Read ``info`` from below L1: ``L2`` (a disk hit, or a fetch from L3 admitted into
        L2) or ``L3`` (no disk tier); None when the disk tier refused the download."""
        ctl, key = self.ctl, info.key
        if ctl.disk is None:
            ctl.stats.remote_loads += 1
            return "L3"
        if ctl.hold_disk_copy(key):
            ctl.release("L2", key)
            return "L2"
        ctl.stats.remote_loads += 1
        seconds = self.cfg.load_model.seconds("L3", info.size_bytes)
        try:
            ctl.admit_disk(info, hold=False, load_seconds=seconds)
        except NoRoomError:
            return None
        self.load_seconds += seconds
        return "L2"

    def _admit_host(self, load: _Load) -> bool:
        """Admit a loaded copy into L1 for its requests; False when there is no room yet."""
        n = len(load.requests)
        try:
            self.ctl.admit_host(load.info, holds=n, counted=n, load_seconds=load.seconds)
        except NoRoomError:
            return False
        self.load_seconds += load.seconds
        for p in load.requests:
            self._to_slot(p)
        return True

    def _to_slot(self, p: _Pending) -> bool:
        """Reserve a slot and serve ``p``, or queue it for one; True when it is served."""
        ctl, key, size = self.ctl, p.info.key, p.info.size_bytes
        flat = ctl.host is None
        if flat and key not in ctl.slot_of and key not in self.buffered:
            source = self._fill(p.info)  # the transient host copy an L0 load comes through
            if source is None:
                self._refuse([p], "L2")
                return False
            self.buffered[key] = source
        got = ctl.reserve_slot(p.info, waiting_since=p.arrival)
        if got is None:
            if not p.waited and self.now < p.arrival + ctl.patience_s:
                self._timer(p.arrival + ctl.patience_s)  # plan impatiently from then on
            self._wait(p)
            self.slot_waiting.append(p)
            return False
        slot, fresh = got
        if fresh:
            model = self.cfg.load_model
            seconds = model.seconds("L1", size)
            if flat:
                seconds += model.seconds(self.buffered.pop(key), size)
            self.load_seconds += seconds
            ctl.record_load("L0", key, seconds)
        self._serve(p, slot, hit=not fresh)
        return True

    def _serve(self, p: _Pending, slot: int, *, hit: bool) -> None:
        """``p`` runs in ``slot`` until now + service time (it holds the slot and its copy)."""
        if p.waited:
            self.wait_total += self.now - p.arrival
        self.hot_hits += p.hot and hit
        if self.timeline is not None:
            self.timeline.append((p.arrival, hit))
        if self.outcomes is not None:
            self.outcomes.append((p.request, hit))
        if self.cfg.service_time_s <= 0:
            self.ctl.release_slot(slot)
            if self.ctl.host is not None:
                self.ctl.release_request(p.info.key)
            return
        self._seq += 1
        done = (self.now + self.cfg.service_time_s, self._seq, slot, p.info.key)
        heapq.heappush(self.events, done)

    def _wait(self, p: _Pending) -> None:
        if not p.waited:
            p.waited = True
            self.waits += 1

    def _prefetch(self) -> None:
        """Load the adapters the forecast expects within its horizon ahead of demand."""
        waiting: Counter[str] = Counter(p.info.key for p in self.slot_waiting)
        for load in self.host_waiting.values():
            waiting[load.info.key] += len(load.requests)
        ctl, model = self.ctl, self.cfg.load_model
        ctl.set_waiting(waiting)
        for info in ctl.forecast(self.cfg.slots):
            key = info.key
            size = info.size_bytes
            if not ctl.worth_prefetching(info):
                continue
            if ctl.host is not None and key not in ctl.host:
                if key in self.host_waiting:
                    continue
                source = self._fill(info)
                if source is None:
                    continue
                seconds = model.seconds(source, size)
                try:
                    ctl.admit_host(info, holds=0, counted=0, load_seconds=seconds)
                except NoRoomError:
                    continue
                self.load_seconds += seconds
            slot = ctl.prefetch_slot(info)
            if slot is None:
                continue
            seconds = model.seconds("L1", size)
            if ctl.host is None:
                source = self._fill(info)  # the transient host copy the slot is written from
                if source is None:
                    ctl.remove(ctl.device_name, key)
                    continue
                seconds += model.seconds(source, size)
            self.load_seconds += seconds
            ctl.record_load("L0", key, seconds)
            self.prefetches += 1

    def _refuse(self, requests: list[_Pending], tier: str) -> None:
        """The server answers these requests 503 (no room in ``tier``)."""
        self.refused[tier] += len(requests)
        self.n_refused += len(requests)

    def _drain(self) -> None:
        """Give waiting loads and requests what was freed, in arrival order, until nothing
        more fits (every waiting request is tried: none blocks the ones behind it)."""
        progress = True
        while progress:
            progress = False
            # A load that found no room has retired every idle slot it could: until something is
            # admitted, a load at least as large cannot find room either (the simulated L1 has
            # no tenant budgets), so it is not tried; same outcome, far fewer attempts.
            no_room = None
            for key, load in list(self.host_waiting.items()):
                size = load.info.size_bytes
                if (no_room is None or size < no_room) and self._admit_host(load):
                    del self.host_waiting[key]
                    progress, no_room = True, None
                    continue
                no_room = size if no_room is None else min(no_room, size)
                if self.now >= load.since + self.cfg.load_wait_timeout_s:
                    del self.host_waiting[key]
                    self._refuse(load.requests, "L1")
            waiting, self.slot_waiting = self.slot_waiting, []
            for p in waiting:
                progress |= self._to_slot(p)
