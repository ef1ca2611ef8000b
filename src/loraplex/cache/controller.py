"""The tier controller: every residency decision of the adapter cache, as pure bookkeeping.

One :class:`TierController` owns the accounting of the tiers — L0 device slots, L1 host memory,
L2 local disk — as :class:`~loraplex.cache.residency.TierIndex` objects sharing one eviction
policy, and is the only code that consults that policy (``loraplex.cache.policy``). It holds no
adapter bytes, does no I/O, starts no threads and never reads the time: the owner injects a
``clock`` (the server: ``time.monotonic``; ``loraplex sim``: simulated time) and follows the
decisions (keeps or drops its copies, writes or resets slot rows). Not thread-safe: the owner
calls it under one lock (the tiered cache's), which covers multi-step sequences.

Tiers and what lives there (keys are content digests, never names):

- **L0 device** (``slots``): adapters of running requests. A slot's running requests are
  in-flight holds in the L0 index: never evicted. :meth:`reserve_slot` returns None when no
  slot may be freed (the scheduler lets other requests pass). Device residency is inclusive:
  a slotted adapter holds one in-flight hold on its L1 copy. Idle slots are retired when L1
  needs their host copies' room.
- **L1 host** (``host_bytes``, a hard byte budget, and ``max_host_copies``, a hard count: vLLM's
  ``max_cpu_loras``): every live request holds its copy (:meth:`hold_request` ...
  :meth:`release_request`), so an adapter in use is never dropped. :meth:`admit_host` runs
  after the copy was loaded (loads happen before evictions) and raises NoRoomError when either
  limit has no evictable room (every copy in use or pinned); the owner waits for a release and
  retries. Neither limit is ever exceeded; :meth:`set_max_host_copies` changes the count (the
  offline API widens it for one call), copies beyond a lowered count leave once released.
- **L2 disk** (``disk_bytes``): verified copies of object-store adapters. Admission evicts
  (policy-chosen) *before* the put; a copy being read or written is held.

Hard constraints, whatever the policy says (enforced by ``TierIndex``): entries in flight or
pinned are never evicted, nor entries younger than ``min_residency_s``; tenants stay within
their per-tier byte budgets; capacities are never exceeded.

**One eviction path.** Every entry that leaves a tier leaves through :meth:`_evict`: a plan's
victims, count trimming, idle-slot retirement (policy evictions, counted), admin eviction and
corrupt-copy removal (``removal=True``: not counted as evictions). It applies the cascade (a
slot leaving L0 releases its host copy) and records the host copies and disk entries the owner
must drop.

Counting: each index keeps its :class:`~loraplex.cache.stats.TierCounters`; :attr:`stats`
holds them with the events no tier sees; :attr:`usage` the per-adapter numbers. The policy's
``on_access`` is called once per counted request (:meth:`serve_from_host`,
:meth:`admit_host`, or :meth:`access` for an owner without an L1 tier).

Patience (``patience_s``, used by ``loraplex sim``; 0 in the server): for that long after a
request first waited, its slot admission is planned patiently — the policy may prefer waiting
for a busy low-value slot to evicting a valuable idle one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from loraplex.cache.policy import AdapterInfo, EvictionPolicy, HybridPolicy
from loraplex.cache.residency import PIN_OPERATOR, NoRoomError, ResidencyError, TierIndex
from loraplex.cache.stats import AdapterUsage, CacheStats, TierCounters
from loraplex.types import AdapterInUseError

__all__ = ["TIERS", "HostAdmission", "TierController"]

TIER_DEVICE, TIER_HOST, TIER_DISK = "device", "host", "disk"
TIERS = (TIER_DEVICE, TIER_HOST, TIER_DISK)


@dataclass(frozen=True)
class HostAdmission:
    """What :meth:`TierController.admit_host` did."""

    warm: bool  # the copy was resident already (nothing admitted)
    dropped: list[str]  # host copies the owner must drop (victims and count trimming)


class TierController:
    """Residency accounting and decisions for device slots, host memory and disk; see the
    module docstring. ``names`` are the three tiers' names (the simulator uses L0/L1/L2);
    ``host_tier=False`` leaves L1 out (the simulator's flat configuration), ``disk_bytes=None``
    L2."""

    def __init__(
        self,
        policy: EvictionPolicy,
        *,
        slots: int,
        clock: Callable[[], float],
        host_bytes: int | None = None,
        max_host_copies: int | None = None,
        disk_bytes: int | None = None,
        host_tier: bool = True,
        min_residency_s: float = 0.0,
        thrash_window_s: float = 60.0,
        tenant_budgets: Mapping[str, Mapping[str, int]] | None = None,
        patience_s: float = 0.0,
        names: tuple[str, str, str] = TIERS,
    ) -> None:
        self.policy = policy
        self.clock = clock
        self.max_host_copies = max_host_copies
        self.patience_s = float(patience_s)
        self.names = names
        self.device_name, self.host_name, self.disk_name = names
        budgets = tenant_budgets or {}

        def index(name: str, cap_bytes: int | None, cap_count: int | None) -> TierIndex:
            return TierIndex(
                name,
                capacity_bytes=cap_bytes,
                capacity_count=cap_count,
                policy=policy,
                min_residency_s=min_residency_s,
                tenant_budgets=budgets.get(name),
                thrash_window_s=thrash_window_s,
            )

        self.device = index(self.device_name, None, slots)
        self.host = index(self.host_name, host_bytes, max_host_copies) if host_tier else None
        self.disk = index(self.disk_name, disk_bytes, None) if disk_bytes is not None else None
        self._index = {i.name: i for i in (self.device, self.host, self.disk) if i is not None}
        self.stats = CacheStats(
            {n: i.counters for n, i in self._index.items()},
            host_tier=self.host_name,
            device_tier=self.device_name,
        )
        self.usage: dict[str, AdapterUsage] = {}  # digest -> per-adapter counters
        self.request_refs: dict[str, int] = {}  # digest -> live request holds on its L1 copy
        self.slot_digest: list[str | None] = [None] * slots
        self.slot_users = [0] * slots
        self.slot_of: dict[str, int] = {}
        self._dropped: dict[str, list[str]] = {self.host_name: [], self.disk_name: []}

    # -- per request ---------------------------------------------------------------------------
    def access(self, info: AdapterInfo) -> None:
        """One request for ``info`` (for an owner without an L1 tier, whose request path does
        not pass :meth:`serve_from_host` / :meth:`admit_host`)."""
        self.policy.on_access(info.key, info, self.clock())

    def serve_from_host(self, info: AdapterInfo, *, count: bool = True) -> bool:
        """A request finds its copy in host memory: count the hit (``count=False`` for loads
        that are not requests), tell the policy, take one request hold. False (and nothing
        changes) when the copy is not resident."""
        assert self.host is not None
        key = info.key
        if key not in self.host:
            return False
        if count:
            now = self.clock()
            self.host.lookup(key, now)
            self.policy.on_access(key, info, now)
            self._usage(info, now).hits += 1
        self.hold_request(key)
        return True

    def hold_request(self, key: str) -> None:
        """One more live request holds ``key``'s L1 copy (it cannot be evicted)."""
        assert self.host is not None
        self.host.acquire(key)
        self.request_refs[key] = self.request_refs.get(key, 0) + 1

    def release_request(self, key: str) -> list[str]:
        """A live request let go of ``key``'s L1 copy; returns the host copies to drop (the
        count cap applies again once nobody holds it)."""
        assert self.host is not None
        n = self.request_refs.get(key, 0) - 1
        if n < 0:
            raise RuntimeError(f"adapter {key[:12]} released more often than acquired")
        if n == 0:
            del self.request_refs[key]
        else:
            self.request_refs[key] = n
        self.host.release(key)
        if n == 0:
            self._trim_host(self.clock())
        return self._take(self.host_name)

    # -- L1 host -------------------------------------------------------------------------------
    def admit_host(
        self,
        info: AdapterInfo,
        *,
        holds: int = 1,
        counted: int = 1,
        load_seconds: float | None = None,
    ) -> HostAdmission:
        """Admit a loaded copy into L1 for ``counted`` requests (their misses and accesses) and
        ``holds`` request holds; a copy already resident is a hit for each of them.

        Makes room by policy eviction, retiring idle slots whose host copies only their slot
        holds when that is not enough. Raises NoRoomError when no room can be made now (the
        owner waits for a release and retries); nothing is admitted then.
        """
        assert self.host is not None
        host, key, now = self.host, info.key, self.clock()
        warm = key in host
        if not warm:
            while True:
                try:
                    self._admit(host, info, now)
                    break
                except NoRoomError:
                    if not self._retire_idle_slot(now):
                        raise
            if load_seconds is not None:
                self.policy.record_load_cost(host.name, key, load_seconds)
            self._usage(info, now).loads += 1
        for _ in range(counted):
            if warm:
                host.touch(key, now)
            else:
                host.counters.misses += 1
            self.policy.on_access(key, info, now)
        if warm:
            self._usage(info, now).hits += counted
        for _ in range(holds):
            self.hold_request(key)
        self._trim_host(now)
        return HostAdmission(warm, self._take(host.name))

    def host_info(self, key: str) -> AdapterInfo:
        """What the L1 admission of ``key`` recorded (size, tenant, priority, rank)."""
        e = self.host.peek(key) if self.host is not None else None
        if e is None:
            raise RuntimeError(f"adapter {key[:12]} is not held in host memory")
        return e.info

    def set_max_host_copies(self, n: int | None) -> list[str]:
        """Make ``n`` the L1 count cap (None: none). Copies beyond a lowered cap that nobody
        holds are evicted now (returned: the owner drops them), held ones once released."""
        if n is not None and n < 0:
            raise ValueError(f"max_host_copies must be >= 0, got {n}")
        self.max_host_copies = n
        if self.host is None:
            return []
        self.host.capacity_count = n
        self._trim_host(self.clock())
        return self._take(self.host_name)

    def _trim_host(self, now: float) -> None:
        """Evict cached (evictable) L1 copies beyond ``max_host_copies``, lowest score first
        (only after the cap was lowered: admissions never exceed it)."""
        host = self.host
        if host is None or self.max_host_copies is None:
            return
        excess = host.count - self.max_host_copies
        if excess <= 0:
            return
        cands = [k for k in host.entries() if host.evictable(k, now)]
        if len(cands) > 1:
            cands = self.policy.order_victims(cands, host.name, now, by_bytes=host.by_bytes)
        for k in cands[:excess]:
            self._evict(host, k, now)

    def _retire_idle_slot(self, now: float) -> bool:
        """Retire one idle slot whose host copy only the slot holds, so L1 may evict it.

        Policy-ordered among the slots the L0 constraints allow to leave. Bookkeeping only: the
        owner resets the slot's stale rows when it reuses the slot.
        """
        host = self.host
        if host is None:
            return False
        cands = []
        for k in self.slot_of:
            h = host.peek(k)
            if h is None or h.inflight != 1 or h.pinned or not self.device.evictable(k, now):
                continue
            if now - h.inserted_at >= host.min_residency_s:  # L1 may then evict it
                cands.append(k)
        if not cands:
            return False
        victim = self.policy.order_victims(cands, self.device.name, now, by_bytes=False)[0]
        self._evict(self.device, victim, now)
        return True

    # -- L2 disk -------------------------------------------------------------------------------
    def hold_disk_copy(self, key: str, *, count: bool = True) -> bool:
        """Look ``key`` up on disk (a counted lookup with ``count``) and, if it is there, hold it
        while the owner reads it (:meth:`release`). False without a disk tier or a copy."""
        disk = self.disk
        if disk is None:
            return False
        hit = disk.lookup(key, self.clock()) if count else key in disk
        if hit:
            disk.acquire(key)
        return hit

    def admit_disk(
        self, info: AdapterInfo, *, hold: bool = True, load_seconds: float | None = None
    ) -> list[str]:
        """Make room on disk (policy evictions first) and insert ``info``, held while the owner
        writes it (``hold``); returns the disk entries to delete. NoRoomError when impossible."""
        disk = self.disk
        assert disk is not None
        if info.key in disk:
            return []
        self._admit(disk, info, self.clock())
        if hold:
            disk.acquire(info.key)
        if load_seconds is not None:
            self.policy.record_load_cost(disk.name, info.key, load_seconds)
        return self._take(disk.name)

    # -- L0 device slots -----------------------------------------------------------------------
    def reserve_slot(
        self, info: AdapterInfo, *, waiting_since: float | None = None
    ) -> tuple[int, bool] | None:
        """A slot for one more running request of ``info``: ``(slot, fresh)``, ``fresh`` when
        the adapter was just given the slot (its weights must be copied in). None when no slot
        may be freed (every slot in use, pinned or too new): the request waits, others pass.

        ``waiting_since``: when the request first waited; its admission is patient until
        ``patience_s`` after that.
        """
        key, now, device = info.key, self.clock(), self.device
        slot = self.slot_of.get(key)
        if slot is not None:
            device.touch(key, now)
            device.acquire(key)
            self.slot_users[slot] += 1
            return slot, False
        if self.host is not None and key not in self.host:
            raise RuntimeError(f"adapter {key[:12]} is not held in host memory")
        patient = waiting_since is not None and now < waiting_since + self.patience_s
        try:
            self._admit(device, info, now, patient=patient)
        except NoRoomError:
            self.stats.slot_waits += 1
            return None
        device.counters.misses += 1
        slot = self.slot_digest.index(None)
        self.slot_digest[slot] = key
        self.slot_of[key] = slot
        self.slot_users[slot] = 1
        device.acquire(key)
        if self.host is not None:
            self.host.acquire(key)  # inclusive: the slot keeps its host copy
        return slot, True

    def release_slot(self, slot: int) -> bool:
        """A running request left ``slot`` (its adapter stays until the slot is needed); True
        when the slot is idle now."""
        if self.slot_users[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.slot_users[slot] -= 1
        key = self.slot_digest[slot]
        assert key is not None
        self.device.release(key)
        return self.slot_users[slot] == 0

    def cancel_slot(self, slot: int) -> None:
        """Undo a fresh reservation whose weights could not be copied in (removal, uncounted)."""
        key = self.slot_digest[slot]
        assert key is not None and self.slot_users[slot] == 1
        self.release_slot(slot)
        self._evict(self.device, key, self.clock(), removal=True, force=True)

    def forecast(self, limit: int, *, min_requests: float = 1.0) -> list[AdapterInfo]:
        """Adapters to load ahead of demand, most wanted first: the policy's forecast expects
        at least ``min_requests`` of each within its horizon (``hybrid-forecast``; [] for
        policies without a forecast). Those already in a slot are left out."""
        policy = self.policy
        if not isinstance(policy, HybridPolicy) or policy.forecast is None:
            return []
        horizon = policy.forecast_horizon_s
        out = []
        for key, rate in policy.forecast_demand(self.clock(), limit):
            info = policy.info_of(key)
            if info is not None and rate * horizon >= min_requests and key not in self.slot_of:
                out.append(info)
        return out

    def worth_prefetching(self, info: AdapterInfo) -> bool:
        """Would :meth:`prefetch_slot` give ``info`` a slot now? (Asked before loading its host
        copy, so a copy is not fetched for a slot it would not get.) Changes nothing."""
        return self._prefetch_victims(info, self.clock()) is not None

    def _prefetch_victims(self, info: AdapterInfo, now: float) -> list[str] | None:
        """The slots to free for a load-ahead of ``info``, or None when it has a slot, none
        may be freed, or a victim is worth at least as much as ``info``."""
        key, device = info.key, self.device
        if key in self.slot_of:
            return None
        try:
            victims = device.plan_admission(info, now)
        except NoRoomError:
            return None
        if victims:
            score = self.policy.keep_score
            mine = score(key, device.name, now, by_bytes=False)
            if any(score(v, device.name, now, by_bytes=False) >= mine for v in victims):
                return None
        return victims

    def worth_loading_ahead(self, info: AdapterInfo) -> bool:
        """Would a host-memory load-ahead of ``info`` fit without evicting a copy the policy
        values at least as much (keep-score, which for ``hybrid-forecast`` includes predicted
        demand)? False when it is held there already or cannot fit. Changes nothing."""
        host, key, now = self.host, info.key, self.clock()
        if host is None or key in host:
            return False
        try:
            victims = host.plan_admission(info, now)
        except NoRoomError:
            return False
        score = self.policy.keep_score
        mine = score(key, host.name, now)
        return all(score(v, host.name, now) < mine for v in victims)

    def set_waiting(self, counts: Mapping[str, int]) -> None:
        """The requests queued now per adapter (the forecast's queue term; others ignore it)."""
        if isinstance(self.policy, HybridPolicy):
            self.policy.set_waiting(counts)

    def prefetch_slot(self, info: AdapterInfo) -> int | None:
        """Load ahead of demand: an idle slot for ``info`` with no request behind it, when a
        slot is free or every victim it needs scores below ``info`` (the policy's keep-score,
        which for ``hybrid-forecast`` includes predicted demand). None when it has a slot
        already or is not worth one. Uncounted (no hit, no miss, no access); its host copy must
        be resident. The owner writes the slot's weights; then it is an ordinary idle slot."""
        key, now, device = info.key, self.clock(), self.device
        if self.host is not None and key not in self.host:
            raise RuntimeError(f"adapter {key[:12]} is not held in host memory")
        victims = self._prefetch_victims(info, now)
        if victims is None:
            return None
        for victim in victims:
            self._evict(device, victim, now)
        device.insert(info, now)
        slot = self.slot_digest.index(None)
        self.slot_digest[slot] = key
        self.slot_of[key] = slot
        self.slot_users[slot] = 0
        if self.host is not None:
            self.host.acquire(key)  # inclusive: the slot keeps its host copy
        return slot

    # -- holds, loads ---------------------------------------------------------------------------
    def release(self, tier: str, key: str) -> None:
        """End a hold taken by :meth:`hold_disk_copy` or :meth:`admit_disk`."""
        self._index[tier].release(key)

    def record_load(self, tier: str, key: str, seconds: float) -> None:
        """A load of ``key`` into ``tier`` took ``seconds`` (the policy's reload cost)."""
        self.policy.record_load_cost(tier, key, seconds)

    # -- removals, admin eviction, pins --------------------------------------------------------
    def remove(self, tier: str, key: str, *, force: bool = True) -> bool:
        """Drop ``key`` from ``tier`` on request (a corrupt or unwritten copy); False when it is
        in flight (another reader will remove it) or absent."""
        idx = self._index[tier]
        if key not in idx:
            return False
        try:
            self._evict(idx, key, self.clock(), removal=True, force=force)
        except ResidencyError:
            return False
        self._take(tier)
        return True

    def evict(self, key: str, tiers: Iterable[str]) -> list[str]:
        """Admin eviction of ``key`` from ``tiers`` (device first: it holds the host copy);
        returns the tiers it left. Refused, with nothing changed, by :class:`AdapterInUseError`
        while requests use it or it is pinned there."""
        wanted = set(tiers)
        present = [(t, self._index[t]) for t in self.names if t in wanted and t in self._index]
        present = [(t, idx) for t, idx in present if key in idx]
        for t, idx in present:
            e = idx.get(key)
            assert e is not None
            own = int(t == self.host_name and key in self.slot_of and self.device_name in wanted)
            if e.inflight > own:
                raise AdapterInUseError(
                    f"adapter {key[:12]} has in-flight requests in the {t} tier; not evicted"
                )
            if e.pinned:
                raise AdapterInUseError(
                    f"adapter {key[:12]} is pinned in the {t} tier; unpin it first"
                )
        now = self.clock()
        for _, idx in present:
            self._evict(idx, key, now, removal=True)
        for t in (self.host_name, self.disk_name):
            self._take(t)
        return [t for t, _ in present]

    def pin(self, key: str, *, device: bool = False, owner: str = PIN_OPERATOR) -> None:
        """Never evict ``key`` from host memory and disk (and its slot with ``device``); the
        pin applies once it is resident. ``owner``: who pins (see :meth:`TierIndex.pin`)."""
        for idx in (self.host, self.disk):
            if idx is not None:
                idx.pin(key, owner)
        if device:
            self.device.pin(key, owner)

    def unpin(self, key: str, owner: str | None = None) -> None:
        """Remove ``owner``'s pins of ``key`` (None: every pin); other owners' pins stay."""
        for idx in self._index.values():
            idx.unpin(key, owner)

    def is_pinned(self, key: str) -> bool:
        return any(idx.is_pinned(key) for idx in self._index.values())

    def set_tenant_budget(self, tenant: str, host_bytes: int | None) -> None:
        """Cap ``tenant``'s bytes in host memory (None: no cap), for later admissions."""
        if host_bytes is not None and host_bytes < 0:
            raise ValueError(f"tenant {tenant!r}: host byte budget must be >= 0")
        assert self.host is not None
        if host_bytes is None:
            self.host.tenant_budgets.pop(tenant, None)
        else:
            self.host.tenant_budgets[tenant] = host_bytes

    # -- reports -------------------------------------------------------------------------------
    def tier_of(self, key: str) -> str | None:
        """The fastest tier holding ``key`` (L0, then L1, then L2), or None."""
        if key in self.slot_of:
            return self.device_name
        for idx in (self.host, self.disk):
            if idx is not None and key in idx:
                return idx.name
        return None

    def tier_counters(self) -> dict[str, TierCounters]:
        """tier -> a copy of its counters."""
        return {n: replace(c) for n, c in self.stats.tiers.items()}

    def resident_bytes(self) -> dict[str, tuple[int, int]]:
        """tier -> (count, bytes) for every configured tier."""
        return {idx.name: (idx.count, idx.used_bytes) for idx in self._index.values()}

    def is_idle(self) -> bool:
        """No request holds an adapter and no slot has running users."""
        return not self.request_refs and not any(self.slot_users)

    def check_invariants(self) -> None:
        """Cross-check slots and holds against the indexes (tests; raises AssertionError)."""
        assert set(self.slot_of) == set(self.device.entries()), "slots != L0 index"
        for k, s in self.slot_of.items():
            assert self.slot_digest[s] == k
            assert self.device.entries()[k].inflight == self.slot_users[s]
        if self.host is not None:
            for k, e in self.host.entries().items():
                want = self.request_refs.get(k, 0) + (1 if k in self.slot_of else 0)
                assert e.inflight == want, f"L1 in-flight of {k[:12]}: {e.inflight} != {want}"
            assert set(self.request_refs) <= set(self.host.entries())

    # -- internals -----------------------------------------------------------------------------
    def _admit(
        self, idx: TierIndex, info: AdapterInfo, now: float, *, patient: bool = False
    ) -> None:
        """Plan room for ``info`` (NoRoomError / AdmissionDeferred when impossible), evict the
        victims through the one eviction path, insert."""
        for victim in idx.plan_admission(info, now, patient=patient):
            self._evict(idx, victim, now)
        idx.insert(info, now)

    def _evict(
        self, idx: TierIndex, key: str, now: float, *, removal: bool = False, force: bool = False
    ) -> None:
        """The one way an entry leaves a tier: a policy eviction (counted), or with ``removal``
        an admin / corrupt-copy removal (not counted; in-flight entries refused, pinned ones
        unless ``force``). Applies the cascade and records what the owner must drop."""
        if removal:
            idx.remove(key, now, force=force)
        else:
            idx.evict(key, now)
        if idx is self.device:
            slot = self.slot_of.pop(key)
            assert self.slot_users[slot] == 0
            self.slot_digest[slot] = None
            if self.host is not None:
                self.host.release(key)  # the slot's hold on the host copy
        else:
            self._dropped[idx.name].append(key)
        if idx is not self.disk and key in self.usage:
            self.usage[key].evictions += 1

    def _take(self, tier: str) -> list[str]:
        """The entries of ``tier`` dropped since the last take (host copies, disk entries)."""
        out = self._dropped.get(tier)
        if not out:
            return []
        self._dropped[tier] = []
        return out

    def _usage(self, info: AdapterInfo, now: float) -> AdapterUsage:
        u = self.usage.get(info.key)
        if u is None:
            u = self.usage[info.key] = AdapterUsage(info)
        u.last_access = now
        return u
