"""Replay a request trace through stacked tiers — the same TierIndex and policy code the server uses.

Tiers (inclusive, like the server's cache): L0 device slots (count), L1 host memory (bytes and/or
count, optional), L2 local disk (bytes, optional), L3 the object store (always hits). Per
request at time ``t``::

    policy.on_access(key)                       # once per request, shared by every tier
    L0 hit?  -> serve
    else     -> if a load of this adapter is already waiting, join it (single flight)
                look up L1, L2 (first hit is the source; none -> fetch from L3)
                fill the tiers between the source and L0 (plan + commit; a tier with no room
                is bypassed), then admit into L0, first come first served; no room in L0
                (everything in use, pinned or too new) -> wait for a completion
    serve    -> with --service-time > 0 the adapter is in flight (acquired in L0 and L1) until
                t + service_time, so the hard constraints bite

Patience (``--patience``): for up to that long after its first request, an L0 admission is
planned patiently — if the policy finds it better to wait for a busy low-value slot (a cold
adapter still in flight) than to evict a valuable idle one, the load waits. Hybrid does; the
baselines never wait.

Loads are instantaneous in simulated time but each gets a modeled duration (``LoadModel``) that
is reported as load seconds and fed to the policy as the measured reload cost.

Hit ratios: L0 = L0 hits / requests; L1 (L2) = hits / lookups that reached L1 (L2). Reference
lines on the same trace (L0, count capacity): Belady's MIN (offline optimum) and A0 (keep the
C-1 most requested adapters of the whole trace, cycle the last slot) — the best any online
demand-paging policy can do in expectation when requests are independent draws (Aho, Denning &
Ullman 1971), so on Zipf traces it is the realistic ceiling, below Belady.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from loraplex.cache.policy import AdapterInfo, EvictionPolicy, make_policy
from loraplex.cache.residency import AdmissionDeferred, NoRoomError, TierIndex
from loraplex.sim.workloads import Request

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
    load_model: LoadModel = field(default_factory=LoadModel)

    def __post_init__(self) -> None:
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
    bypassed: int


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
    unserved: int

    def tier(self, name: str) -> TierResult | None:
        return next((t for t in self.tiers if t.name == name), None)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def policy_factory(name: str, tier_names: Sequence[str]) -> Callable[[], EvictionPolicy]:
    """A maker of fresh policies by name (hybrid learns the tier order for its reload cost)."""
    make_policy(name)  # validate now: unknown names raise ValueError listing the valid ones
    if name.strip().lower() == "hybrid":
        return lambda: make_policy(name, tier_order=tuple(tier_names))
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
) -> SimResult:
    """Replay ``requests`` (sorted by time) through fresh tiers driven by ``policy``."""
    pol = policy if isinstance(policy, EvictionPolicy) else policy()
    run = _Run(pol, config)
    hot = hot_adapters or frozenset()
    hot_total = hot_hits = 0
    for req in requests:
        run.advance(req.time)
        hit = run.arrive(req)
        if req.adapter in hot:
            hot_total += 1
            hot_hits += hit
    run.finish()
    n = len(requests)
    tiers = [
        TierResult(
            name=t.name,
            lookups=t.counters.hits + t.counters.misses,
            hits=t.counters.hits,
            hit_ratio=t.counters.hit_ratio,
            loads=t.counters.inserts,
            evictions=t.counters.evictions,
            reload_after_eviction=t.counters.reload_after_eviction,
            thrash_ratio=t.counters.thrash_ratio,
            bypassed=run.bypassed[t.name],
        )
        for t in run.tiers
    ]
    return SimResult(
        policy=pol.name,
        requests=n,
        l0_hit_ratio=run.tiers[0].counters.hits / n if n else 0.0,
        hot_hit_ratio=hot_hits / hot_total if hot_total else None,
        hot_requests=hot_total,
        tiers=tiers,
        remote_fetches=run.remote_fetches,
        load_seconds=run.load_seconds,
        waits=run.waits,
        mean_wait_s=run.wait_total / run.waits if run.waits else 0.0,
        unserved=run.unserved,
    )


@dataclass
class _Waiting:
    """Requests for one adapter waiting for an L0 slot (they share one load: single flight)."""

    info: AdapterInfo
    since: float  # first arrival
    source: str  # where its L0 load comes from
    held: tuple[TierIndex, ...]  # the group's reference on its L1 copy, if any
    arrivals: list[float]


class _Run:
    """State of one replay: the tier stack, in-flight completions and waiting requests."""

    def __init__(self, policy: EvictionPolicy, cfg: SimConfig) -> None:
        self.policy = policy
        self.cfg = cfg
        common = dict(
            policy=policy,
            min_residency_s=cfg.min_residency_s,
            thrash_window_s=cfg.thrash_window_s,
        )
        self.tiers = [TierIndex("L0", capacity_bytes=None, capacity_count=cfg.slots, **common)]
        if cfg.has_l1:
            self.tiers.append(
                TierIndex(
                    "L1", capacity_bytes=cfg.host_bytes, capacity_count=cfg.host_count, **common
                )
            )
        if cfg.disk_bytes:
            self.tiers.append(
                TierIndex("L2", capacity_bytes=cfg.disk_bytes, capacity_count=None, **common)
            )
        self.bypassed = {t.name: 0 for t in self.tiers}
        self.remote_fetches = 0
        self.load_seconds = 0.0
        self.now = 0.0
        self._seq = 0
        # (time, seq, key, tiers to release) for completions; key None: a patience timer
        self.completions: list[tuple[float, int, str | None, tuple[TierIndex, ...]]] = []
        self._timers: set[str] = set()
        self.waiting: dict[str, _Waiting] = {}  # FIFO by first arrival (dicts keep order)
        self.waits = 0
        self.wait_total = 0.0

    @property
    def unserved(self) -> int:
        return sum(len(w.arrivals) for w in self.waiting.values())

    # -------------------------------------------------------------------------- events
    def advance(self, t: float) -> None:
        """Complete every request finishing by ``t``; waiting ones get the freed slots."""
        while self.completions and self.completions[0][0] <= t:
            when, _, key, held = heapq.heappop(self.completions)
            self.now = max(self.now, when)
            for tier in held:
                tier.release(key)  # type: ignore[arg-type]
            self._drain()
        self.now = max(self.now, t)
        if self.cfg.min_residency_s > 0:
            self._drain()  # entries may have aged past the minimum residency

    def finish(self) -> None:
        """After the last arrival: run in-flight and waiting requests while that makes progress."""
        while True:
            while self.completions:
                self.advance(self.completions[0][0])
            if not self.waiting or self.cfg.min_residency_s <= 0:
                return
            left = self.unserved
            self.advance(self.now + self.cfg.min_residency_s)
            if self.unserved == left and not self.completions:
                return

    def arrive(self, req: Request) -> bool:
        """Handle one arrival; True if it was an L0 hit."""
        now = self.now
        info = AdapterInfo(
            key=req.adapter,
            size_bytes=req.size,
            tenant=req.tenant,
            priority=req.priority,
            rank=req.rank,
        )
        self.policy.on_access(info.key, info, now)
        if self.tiers[0].lookup(info.key, now):
            self._run_request(info, now, self._hold_l1(info.key))
            return True
        group = self.waiting.get(info.key)
        if group is not None:  # its load is already waiting for a slot: join it
            group.arrivals.append(now)
        else:
            source = self._fill_lower(info, now)
            held = self._hold_l1(info.key)  # a request waiting for a slot keeps its host copy
            self.waiting[info.key] = _Waiting(info, now, "L1" if held else source, held, [now])
            self._drain()
        if info.key in self.waiting:
            self.waits += 1
        return False

    # -------------------------------------------------------------------------- helpers
    def _hold_l1(self, key: str) -> tuple[TierIndex, ...]:
        """Acquire ``key`` in L1 if it is there (in-flight protection); the tiers acquired."""
        held = tuple(t for t in self.tiers[1:2] if t.name == "L1" and t.contains(key))
        for tier in held:
            tier.acquire(key)
        return held

    def _fill_lower(self, info: AdapterInfo, now: float) -> str:
        """Fill the tiers above the nearest one below L0 that holds ``info``; the L0 source."""
        source = "L3"
        missing: list[TierIndex] = []
        for tier in self.tiers[1:]:
            if tier.lookup(info.key, now):
                source = tier.name
                break
            missing.append(tier)
        if source == "L3":
            self.remote_fetches += 1
        for tier in reversed(missing):  # bottom-up: L2 from L3, then L1 from L2
            try:
                tier.admit(info, now)
            except NoRoomError:
                self.bypassed[tier.name] += 1
                continue
            self._record_load(tier, info, source)
            source = tier.name
        return source

    def _drain(self) -> None:
        """Admit waiting adapters into L0 in arrival order, until one finds no room."""
        while self.waiting:
            key, group = next(iter(self.waiting.items()))
            deadline = group.since + self.cfg.patience_s
            try:
                self.tiers[0].admit(group.info, self.now, patient=self.now < deadline)
            except AdmissionDeferred:
                if key not in self._timers:  # wake up when its patience runs out
                    self._timers.add(key)
                    self._seq += 1
                    heapq.heappush(self.completions, (deadline, self._seq, None, ()))
                return
            except NoRoomError:
                return
            self._timers.discard(key)
            self._record_load(self.tiers[0], group.info, group.source)
            del self.waiting[key]
            for i, arrived in enumerate(group.arrivals):
                self.wait_total += self.now - arrived
                if i and group.held:  # the first request inherits the group's reference
                    for tier in group.held:
                        tier.acquire(key)
                self._run_request(group.info, self.now, group.held)

    def _record_load(self, tier: TierIndex, info: AdapterInfo, source: str) -> None:
        seconds = self.cfg.load_model.seconds(source, info.size_bytes)
        if tier.name == "L0" and source != "L1":  # through a transient host buffer
            seconds += self.cfg.load_model.seconds("L1", info.size_bytes)
        self.load_seconds += seconds
        self.policy.record_load_cost(tier.name, info.key, seconds)

    def _run_request(self, info: AdapterInfo, now: float, held: tuple[TierIndex, ...]) -> None:
        """The request runs on its (resident) adapter until now + service time.

        ``held``: tiers where this request already holds a reference; released when it ends.
        """
        if self.cfg.service_time_s <= 0:
            for tier in held:
                tier.release(info.key)
            return
        l0 = self.tiers[0]
        l0.acquire(info.key)
        self._seq += 1
        done = (now + self.cfg.service_time_s, self._seq, info.key, (l0, *held))
        heapq.heappush(self.completions, done)
