"""The tiered adapter cache: device slots (L0), host memory (L1), local disk (L2), object store (L3).

One :class:`TieredAdapterCache` (alias :data:`AdapterManager`) owns every tier and is the only
code that consults the eviction policy. Each tier's accounting is a
:class:`~loraplex.cache.residency.TierIndex` sharing one policy instance; every eviction is chosen
by the policy among the entries the index's hard constraints allow.

Tiers and what lives there (keys are content digests, never names):

- **L0 device** (``max_loras`` slots of the :class:`LoRASlotBank`): adapters of running requests.
  A slot's running requests are in-flight acquisitions in the L0 index: never evicted.
  ``acquire_slot`` returns None when no slot may be freed (the scheduler lets others pass).
  Device residency is inclusive: a slotted adapter holds one in-flight acquisition on its L1
  copy. Idle slots may be retired (bookkeeping only; the engine thread resets the bank rows when
  it reuses the slot) when L1 needs their host copies' room.
- **L1 host** (``max_cpu_lora_bytes``, a hard byte budget, and ``max_cpu_loras``): converted
  adapters. Every live request holds an in-flight acquisition (``resolve``/``retain`` ...
  ``release``), so an adapter in use is never dropped. The new copy is loaded *before* victims
  are evicted (two-phase admission). When the byte budget has no evictable room, ``resolve``
  waits (bounded by ``load_wait_timeout_s``, woken by releases) and then raises
  :class:`AdapterCapacityError`. ``max_cpu_loras`` keeps vLLM's meaning: it caps the *cached*
  copies (policy-chosen evictions on every admission and release); copies held by live requests
  may exceed it (an offline batch may name more adapters than that), never the byte budget.
- **L2 disk** (:class:`~loraplex.cache.disk.DiskTier`, a byte budget): verified copies of
  object-store adapters, content-addressed, surviving restarts. Admission evicts disk entries
  (policy-chosen) *before* the put. Every read is verified against the digest; a bad copy is
  deleted and the error names the adapter and the tier.
- **L3 object store** (:class:`~loraplex.cache.store.ObjectStore`, the source of truth):
  ``s3://`` URIs, or paths under a configured local store root. Local adapter directories that
  are not in a store are read directly (they are already on local disk: stage ``disk_load``).

Loads are single-flight: concurrent ``resolve`` calls for the same cold source (path/URI + change
fingerprint) share one load; a failed load fails all its waiters with the same error and is
retried by the next request (no negative caching). Loads run in the caller's thread (the
server's worker threads), never on the engine loop; the engine thread only calls the
non-blocking slot methods.

Pins (``pin``/``unpin``, and the warm policies ``device-preferred``/``host``/``on-demand`` of
``prewarm``) are never evicted. Every load stage is timed through ``load_observers``
(``resolve``, ``remote_download``, ``disk_load``, ``h2d`` on CUDA or ``activation``).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from loraplex.cache.disk import DiskTier, DiskTierError
from loraplex.cache.policy import AdapterInfo, EvictionPolicy, make_policy
from loraplex.cache.residency import NoRoomError, ResidencyError, TierCounters, TierIndex
from loraplex.cache.store import (
    LocalDirStore,
    ObjectStore,
    StoreUnavailableError,
    open_store,
)
from loraplex.cache.verify import AdapterCopyError, AdapterIntegrityError, fetch_verified
from loraplex.config import WARM_POLICIES
from loraplex.lora.adapter import (
    BaseModelSpec,
    LoRAAdapter,
    build_adapter,
    compute_adapter_digest,
    read_adapter_files,
)
from loraplex.lora.slots import LoRASlotBank
from loraplex.requests import LoRARequest
from loraplex.types import AdapterError, AdapterRef

if TYPE_CHECKING:
    from loraplex.config import EngineConfig

log = logging.getLogger(__name__)

TIER_DEVICE, TIER_HOST, TIER_DISK = "device", "host", "disk"
TIERS = (TIER_DEVICE, TIER_HOST, TIER_DISK)
STAGE_RESOLVE = "resolve"
STAGE_REMOTE_DOWNLOAD = "remote_download"
STAGE_DISK_LOAD = "disk_load"
STAGE_H2D = "h2d"
STAGE_ACTIVATION = "activation"
WARM_DEVICE, WARM_HOST, WARM_ON_DEMAND = WARM_POLICIES

__all__ = [
    "WARM_POLICIES",
    "AdapterCapacityError",
    "AdapterInUseError",
    "AdapterManager",
    "AdapterResidency",
    "AdapterStats",
    "AdapterUsage",
    "TieredAdapterCache",
]


class AdapterCapacityError(AdapterError):
    """No room for an adapter in a tier without breaking a hard constraint (every resident
    adapter in use or pinned), even after waiting. Transient: servers answer 503 + Retry-After."""

    def __init__(self, message: str, *, tier: str = "") -> None:
        super().__init__(message)
        self.tier = tier


class AdapterInUseError(AdapterError):
    """An admin eviction was refused: the adapter has in-flight requests or is pinned (409)."""


@dataclass
class AdapterUsage:
    """Per-adapter counters for the residency view (kept for every digest ever loaded)."""

    ref: AdapterRef
    rank: int
    nbytes: int
    hits: int = 0  # requests that found it in host memory or a slot
    loads: int = 0  # loads into host memory
    evictions: int = 0  # evictions from host memory or a slot
    last_access: float = 0.0  # wall-clock seconds


@dataclass
class AdapterResidency:
    """Where one adapter is now, and its counters (a snapshot)."""

    ref: AdapterRef
    tier: str  # device | host | disk | absent
    rank: int
    nbytes: int
    hits: int
    loads: int
    evictions: int
    last_access: float
    pinned: bool
    in_flight: int
    slot: int | None
    warm_policy: str = "on-demand"


@dataclass
class AdapterStats:
    """Monotonic counters (per-tier hit/miss/eviction counters: :meth:`tier_counters`)."""

    host_hits: int = 0
    host_loads: int = 0
    host_evictions: int = 0
    slot_hits: int = 0
    slot_loads: int = 0
    slot_evictions: int = 0
    cold_requests: int = 0  # requests whose adapter had to be loaded into host memory
    disk_hits: int = 0  # L1 loads served from the disk tier
    disk_evictions: int = 0
    remote_loads: int = 0  # downloads from the object store
    load_failures: int = 0  # failed loads (each fails all the requests that shared it)
    capacity_waits: int = 0  # loads that had to wait for room in host memory
    capacity_errors: int = 0  # AdapterCapacityError raised
    slot_waits: int = 0  # acquire_slot calls answered None (every slot in use or pinned)


@dataclass
class _Source:
    """Where an adapter comes from: a local directory, or a URI of the object store."""

    key: str  # canonical: resolved local path or full store URI
    kind: str  # "local" | "store"
    path: Path | None = None
    uri: str | None = None


@dataclass
class _Flight:
    """One load in progress; requests for the same source wait on ``event``."""

    event: threading.Event = field(default_factory=threading.Event)
    waiters: int = 0
    counted: int = 0  # waiters that are requests (count=True)
    adapter: LoRAAdapter | None = None
    warm: bool = False
    error: BaseException | None = None


def _fingerprint(path: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of the files that define an adapter — changes when it is rewritten."""
    out = []
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        p = path / name
        if p.is_file():
            st = p.stat()
            out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _is_digest(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def _policy_evict(index: TierIndex, key: str, now: float) -> None:
    """Evict one policy-chosen, evictable ``key`` outside an admission, counted like one
    (evictions, reload-after-eviction ghosts, policy hook). TierIndex has no public
    single-key eviction yet; its owner has been asked for one."""
    assert index.evictable(key, now)
    index._evict(key, now)


def make_cache_policy(name: str) -> EvictionPolicy:
    """The policy instance shared by every tier (hybrid knows the tier order for reload costs)."""
    if name.strip().lower() == "hybrid":
        return make_policy(name, tier_order=TIERS)
    return make_policy(name)


class TieredAdapterCache:
    """Adapters across device slots, host memory, disk and an object store; see the module doc.

    Thread safety: everything is guarded by one lock; loads (file reads, downloads, conversion)
    run outside it, in the caller's thread. ``acquire_slot``/``release_slot``/``slot_rows`` are
    for the engine thread (they touch the slot bank) and never wait.
    """

    def __init__(
        self,
        bank: LoRASlotBank,
        spec: BaseModelSpec,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        max_cpu_lora_bytes: int | None = None,
        policy: str | EvictionPolicy = "hybrid",
        min_residency_s: float = 0.0,
        disk: DiskTier | None = None,
        store: ObjectStore | None = None,
        load_wait_timeout_s: float = 10.0,
        fingerprint_ttl_s: float = 2.0,
        thrash_window_s: float = 60.0,
        tenant_budgets: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.bank = bank
        self.spec = spec
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_cpu_lora_bytes = max_cpu_lora_bytes
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.disk = disk
        self.store = store
        self.load_wait_timeout_s = float(load_wait_timeout_s)
        self.fingerprint_ttl_s = float(fingerprint_ttl_s)
        self.policy = make_cache_policy(policy) if isinstance(policy, str) else policy
        budgets = tenant_budgets or {}

        def index(name: str, cap_bytes: int | None, cap_count: int | None) -> TierIndex:
            return TierIndex(
                name,
                capacity_bytes=cap_bytes,
                capacity_count=cap_count,
                policy=self.policy,
                min_residency_s=min_residency_s,
                tenant_budgets=budgets.get(name),
                thrash_window_s=thrash_window_s,
            )

        self._device = index(TIER_DEVICE, None, max_loras)
        self._host = index(TIER_HOST, max_cpu_lora_bytes, None)  # count: _trim_host_count
        self._disk = index(TIER_DISK, disk.capacity_bytes, None) if disk is not None else None
        self.host: dict[str, LoRAAdapter] = {}  # digest -> host copy (L1)
        self.request_refs: dict[str, int] = {}  # digest -> live request references
        self._by_source: dict[str, tuple[Any, str]] = {}  # source key -> (fingerprint, digest)
        self._fp_cache: dict[str, tuple[str, float]] = {}  # store URI -> (fingerprint, when)
        self._fp_locks: dict[str, threading.Lock] = {}
        self._flights: dict[tuple[str, Any, str | None], _Flight] = {}
        self.slot_digest: list[str | None] = [None] * max_loras
        self.slot_users = [0] * max_loras
        self.slot_of: dict[str, int] = {}
        self.stats = AdapterStats()
        self.usage: dict[str, AdapterUsage] = {}
        self.warm_policy: dict[str, str] = {}  # digest -> warm policy given to prewarm/pin
        # called with (stage, seconds) for every timed load stage
        self.load_observers: list[Callable[[str, float], None]] = []
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._activation_stage = STAGE_H2D if bank.device.type == "cuda" else STAGE_ACTIVATION
        if disk is not None:
            self._adopt_disk_entries()

    @classmethod
    def from_config(
        cls, bank: LoRASlotBank, spec: BaseModelSpec, config: EngineConfig, *, dtype: torch.dtype
    ) -> TieredAdapterCache:
        """The cache an engine with ``config`` uses (opens the disk tier and object store)."""
        disk = None
        if config.disk_cache_dir is not None:
            disk = DiskTier(config.disk_cache_dir, config.disk_cache_bytes or 0)
        store = open_store(config.adapter_store_url) if config.adapter_store_url else None
        return cls(
            bank,
            spec,
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            max_lora_rank=config.max_lora_rank,
            dtype=dtype,
            max_cpu_lora_bytes=config.max_cpu_lora_bytes,
            policy=config.adapter_eviction_policy,
            min_residency_s=config.adapter_min_residency_s,
            disk=disk,
            store=store,
            load_wait_timeout_s=config.adapter_load_timeout_s,
        )

    def _adopt_disk_entries(self) -> None:
        """Index the disk tier's entries from earlier runs (oldest first); drop what won't fit."""
        assert self.disk is not None and self._disk is not None
        access = self.disk.access_times()
        for d, nbytes in sorted(self.disk.entries().items(), key=lambda kv: access.get(kv[0], 0)):
            try:
                evicted = self._disk.admit(AdapterInfo(d, nbytes), time.monotonic())
            except NoRoomError:
                self.disk.remove(d)
                continue
            for v in evicted:
                self.disk.remove(v)

    # -- helpers -------------------------------------------------------------------------------
    def _observe(self, stage: str, seconds: float) -> None:
        for fn in self.load_observers:
            fn(stage, seconds)

    def _use(self, adapter: LoRAAdapter) -> AdapterUsage:
        u = self.usage.get(adapter.ref.sha256)
        if u is None:
            u = AdapterUsage(adapter.ref, adapter.rank, adapter.nbytes)
            self.usage[adapter.ref.sha256] = u
        u.last_access = time.time()
        return u

    @staticmethod
    def _info(adapter: LoRAAdapter, req: LoRARequest | None = None) -> AdapterInfo:
        extra = req.extra if req is not None else {}
        return AdapterInfo(
            adapter.ref.sha256,
            adapter.nbytes,
            tenant=extra.get("tenant"),
            priority=int(extra.get("priority") or 0),
            rank=adapter.rank,
        )

    def _take_ref(self, digest: str) -> None:
        self._host.acquire(digest)
        self.request_refs[digest] = self.request_refs.get(digest, 0) + 1

    # -- sources -------------------------------------------------------------------------------
    def _source(self, req: LoRARequest) -> _Source:
        """Local directory or object-store URI of ``req`` (store URIs must lie in the store)."""
        raw = req.path
        scheme = raw.split("://", 1)[0].lower() if "://" in raw else ""
        if scheme and scheme != "file":
            if self.store is None:
                raise AdapterError(
                    f"adapter {req.name!r}: {raw!r} is an object-store URI but no object store "
                    "is configured (--adapter-store-url)"
                )
            uri = self.store.uri(raw)
            return _Source(uri, "store", uri=uri)
        if isinstance(self.store, LocalDirStore):
            local = Path(raw[len("file://") :] if scheme else raw).expanduser()
            if local.resolve().is_relative_to(self.store.root):
                uri = self.store.uri(str(local.resolve()))
                return _Source(uri, "store", uri=uri)
        if scheme:
            raise AdapterError(f"adapter {req.name!r}: {raw!r} is not under the object store")
        path = Path(raw).expanduser()
        if not path.is_dir():
            raise AdapterError(f"adapter {req.name!r}: path {req.path!r} is not a directory")
        return _Source(str(path.resolve()), "local", path=path)

    def is_local_source(self, req: LoRARequest) -> bool:
        """True when ``req`` is read from a local directory (not through the object store), so
        an adapter out of memory still sits on local disk."""
        try:
            return self._source(req).kind == "local"
        except AdapterError:
            return False

    def _fingerprint_of(self, src: _Source) -> Any:
        """Change fingerprint of the source; store answers are cached ``fingerprint_ttl_s``.

        While the store is unreachable, a source whose copy we already know keeps being served.
        """
        if src.kind == "local":
            assert src.path is not None
            return _fingerprint(src.path)
        assert self.store is not None and src.uri is not None
        with self._lock:
            key_lock = self._fp_locks.setdefault(src.key, threading.Lock())
        with key_lock:  # one store round-trip per source at a time (no thundering herd)
            now = time.monotonic()
            cached = self._fp_cache.get(src.key)
            if cached is not None and now - cached[1] < self.fingerprint_ttl_s:
                return cached[0]
            try:
                fp = self.store.fingerprint(src.uri)
            except StoreUnavailableError:
                known = self._by_source.get(src.key)
                if known is None:
                    raise
                log.warning("object store unavailable; serving the cached copy of %s", src.uri)
                return known[0]
            self._fp_cache[src.key] = (fp, time.monotonic())
            return fp

    # -- L1 host tier --------------------------------------------------------------------------
    def resolve(self, req: LoRARequest) -> LoRAAdapter:
        """Host copy for ``req`` (loading and verifying it if needed), with one request reference."""
        return self.resolve_with_state(req)[0]

    def resolve_with_state(
        self, req: LoRARequest, *, count: bool = True
    ) -> tuple[LoRAAdapter, bool]:
        """Like :meth:`resolve`; also says whether the adapter was warm (already in host memory
        or a slot) — a cold request paid for a load. ``count=False`` for loads that are not
        requests (start-up, admin), which stay out of the hit/cold-request counters.

        Blocks while the adapter loads (shared with concurrent requests for it) and while host
        memory has no evictable room (bounded). Raises AdapterError subclasses: StoreError,
        AdapterCopyError, DiskTierError, :class:`AdapterCapacityError`.
        """
        t0 = time.perf_counter()
        expected = req.extra.get("sha256")
        if expected is not None:  # a registry revision: its verified copy in memory serves it
            with self._lock:
                hit = self.host.get(expected)
                if hit is not None:
                    self._count_hit(hit, req, count)
                    self._take_ref(expected)
                    return hit, True
        src = self._source(req)
        fp = self._fingerprint_of(src)
        fkey = (src.key, fp, expected)  # a registered digest is part of what is asked for
        with self._lock:
            known = self._by_source.get(src.key)
            if (
                known is not None
                and known[0] == fp
                and known[1] in self.host
                and expected in (None, known[1])
            ):
                adapter = self.host[known[1]]
                self._count_hit(adapter, req, count)
                self._take_ref(adapter.ref.sha256)
                return adapter, True
            flight = self._flights.get(fkey)
            leader = flight is None
            if flight is None:
                flight = self._flights[fkey] = _Flight()
            else:
                flight.waiters += 1
                flight.counted += int(count)
        if not leader:
            flight.event.wait()
            if flight.error is not None:
                raise flight.error
            assert flight.adapter is not None
            self._observe(STAGE_RESOLVE, time.perf_counter() - t0)
            return flight.adapter, flight.warm
        try:
            adapter, warm = self._load_and_admit(req, src, fp, count, flight)
        except BaseException as e:
            with self._lock:
                flight.error = e
                self._flights.pop(fkey, None)
                self.stats.load_failures += 1
            raise
        finally:
            flight.event.set()
        self._observe(STAGE_RESOLVE, time.perf_counter() - t0)
        return adapter, warm

    def _count_hit(self, adapter: LoRAAdapter, req: LoRARequest | None, count: bool) -> None:
        if not count:
            return
        now = time.monotonic()
        d = adapter.ref.sha256
        self._host.lookup(d, now)
        self.policy.on_access(d, self._info(adapter, req), now)
        self.stats.host_hits += 1
        self._use(adapter).hits += 1

    def _load_and_admit(
        self, req: LoRARequest, src: _Source, fp: Any, count: bool, flight: _Flight
    ) -> tuple[LoRAAdapter, bool]:
        """The leader's load: read (L2/L3/local), convert, admit into L1, hand out references."""
        t0 = time.perf_counter()
        config, tensors, digest = self._read(req, src, fp, count)
        with self._lock:
            existing = self.host.get(digest)  # same content under another path or name
        if existing is None:
            adapter = build_adapter(
                config,
                tensors,
                self.spec,
                path=req.path,
                name=req.name,
                revision=req.revision,
                max_lora_rank=self.max_lora_rank,
                dtype=self.dtype,
                digest=digest,
            )
        else:
            adapter = existing
        load_s = time.perf_counter() - t0
        info = self._info(adapter, req)
        n_refs = 1  # the leader's; the waiters' are added under the lock below
        with self._cond:
            deadline = time.monotonic() + self.load_wait_timeout_s
            waited = False
            while True:
                now = time.monotonic()
                current = self.host.get(digest)
                if current is not None:  # resident already (raced, or other path)
                    adapter, warm, evicted = current, True, []
                    break
                try:
                    victims = self._host.plan_admission(info, now)
                    evicted = self._host.commit_admission(info, victims, now)
                    warm = False
                    break
                except NoRoomError as e:
                    if self._retire_idle_slot(now):
                        continue
                    remaining = deadline - now
                    if remaining <= 0:
                        self.stats.capacity_errors += 1
                        raise AdapterCapacityError(
                            f"adapter {req.name!r}: no room in host memory (L1) after waiting "
                            f"{self.load_wait_timeout_s:g}s: {e.reason}; retry later",
                            tier=TIER_HOST,
                        ) from e
                    if not waited:
                        self.stats.capacity_waits += 1
                        waited = True
                    self._cond.wait(min(remaining, 0.05))
            for v in evicted:
                self._drop_host_copy(v, evicted=True)
            counted = int(count) + flight.counted
            if not warm:
                self.host[digest] = adapter
                self.policy.record_load_cost(TIER_HOST, digest, load_s)
                self.stats.host_loads += 1
                self._use(adapter).loads += 1
            now = time.monotonic()
            for _ in range(counted):
                if warm:
                    self._host.touch(digest, now)
                else:
                    self._host.counters.misses += 1
                self.policy.on_access(digest, info, now)
            if warm:
                self.stats.host_hits += counted
                self._use(adapter).hits += counted
            else:
                self.stats.cold_requests += counted
            self._by_source[src.key] = (fp, digest)
            for _ in range(n_refs + flight.waiters):
                self._take_ref(digest)
            flight.adapter, flight.warm = adapter, warm
            for k, f in list(self._flights.items()):
                if f is flight:
                    del self._flights[k]
            self._trim_host_count(time.monotonic())
        return adapter, warm

    def _trim_host_count(self, now: float) -> None:
        """Evict cached (evictable) L1 copies beyond ``max_cpu_loras``, lowest keep-score first."""
        excess = len(self.host) - self.max_cpu_loras
        if excess <= 0:
            return
        cands = [d for d in self.host if self._host.evictable(d, now)]
        if len(cands) > 1:
            cands = self.policy.order_victims(cands, TIER_HOST, now, by_bytes=self._host.by_bytes)
        for d in cands[:excess]:
            _policy_evict(self._host, d, now)
            self._drop_host_copy(d, evicted=True)

    def _drop_host_copy(self, digest: str, *, evicted: bool) -> None:
        """Forget the L1 copy of ``digest`` (already out of the L1 index)."""
        self.host.pop(digest, None)
        if evicted:
            self.stats.host_evictions += 1
            if digest in self.usage:
                self.usage[digest].evictions += 1

    # -- reading copies (L2 disk, L3 store, local directories) ---------------------------------
    def _read(
        self, req: LoRARequest, src: _Source, fp: Any, count: bool
    ) -> tuple[dict, dict[str, torch.Tensor], str]:
        """``(config, tensors, digest)`` of a verified copy; stages timed."""
        if src.kind == "local":
            t0 = time.perf_counter()
            config, tensors = read_adapter_files(src.path)  # type: ignore[arg-type]
            digest = compute_adapter_digest(config, tensors)
            self._observe(STAGE_DISK_LOAD, time.perf_counter() - t0)
            want = req.extra.get("sha256")
            if want is not None and digest != want:
                raise AdapterIntegrityError(
                    f"adapter {req.name!r}: the files in {src.path} have sha256 {digest[:16]}..., "
                    f"not the registered {want[:16]}... (changed since registration?)",
                    name=req.name,
                    tier="local",
                    path=str(src.path),
                    expected=want,
                    actual=digest,
                )
            return config, tensors, digest
        expected = req.extra.get("sha256")
        if expected is None:
            with self._lock:
                known = self._by_source.get(src.key)
            if known is not None and known[0] == fp:
                expected = known[1]
        if self.disk is not None and expected is not None:
            got = self._read_disk(req, expected, count)
            if got is not None:
                return got
        elif self._disk is not None and count:
            with self._lock:
                self._disk.counters.misses += 1
        return self._download(req, src, expected)

    def _read_disk(
        self, req: LoRARequest, digest: str, count: bool
    ) -> tuple[dict, dict[str, torch.Tensor], str] | None:
        """The verified L2 copy of ``digest``, or None if the disk tier does not hold it."""
        assert self.disk is not None and self._disk is not None
        with self._lock:
            now = time.monotonic()
            hit = self._disk.lookup(digest, now) if count else digest in self._disk
            if not hit:
                return None
            self._disk.acquire(digest)  # not evicted while we read it
        try:
            res = self.disk.load_verified(digest, req.name)
        except (AdapterCopyError, DiskTierError) as e:
            with self._lock:
                self._disk.release(digest)
                try:
                    self._disk.remove(digest, time.monotonic(), force=True)
                except ResidencyError:
                    pass  # another reader holds it; it will fail and remove it too
            if isinstance(e, AdapterCopyError):
                raise  # names adapter and tier; the bad copy was deleted
            return None  # vanished behind our back: fetch it again
        with self._lock:
            self._disk.release(digest)
        self.stats.disk_hits += 1
        self._observe(STAGE_DISK_LOAD, res.seconds)
        return res.config, res.tensors, digest

    def _download(
        self, req: LoRARequest, src: _Source, expected: str | None
    ) -> tuple[dict, dict[str, torch.Tensor], str]:
        """Fetch from L3, verify, and (with a disk tier) admit the copy into L2."""
        assert self.store is not None and src.uri is not None
        if self.disk is None:
            with tempfile.TemporaryDirectory(prefix="loraplex-fetch-") as tmp:
                vf = fetch_verified(self.store, src.uri, Path(tmp) / "a", expected, name=req.name)
        else:
            with self.disk.staging() as tmp:
                vf = fetch_verified(self.store, src.uri, tmp, expected, name=req.name)
                self._put_disk(req, vf.digest, tmp, vf.fetch.seconds)
        self.stats.remote_loads += 1
        self._observe(STAGE_REMOTE_DOWNLOAD, vf.fetch.seconds)
        self._observe(STAGE_DISK_LOAD, vf.verify_seconds)
        return vf.config, vf.tensors, vf.digest

    def _put_disk(self, req: LoRARequest, digest: str, staged: Path, fetch_s: float) -> None:
        """Admit ``digest`` into L2: evict (policy-chosen) entries first, then put."""
        assert self.disk is not None and self._disk is not None
        nbytes = DiskTier.nbytes_of(staged)
        info = AdapterInfo(digest, nbytes, tenant=req.extra.get("tenant"))
        with self._lock:
            now = time.monotonic()
            if digest in self._disk:
                return
            try:
                victims = self._disk.plan_admission(info, now)
                evicted = self._disk.commit_admission(info, victims, now)
            except NoRoomError as e:
                self.stats.capacity_errors += 1
                raise AdapterCapacityError(
                    f"adapter {req.name!r}: no room in the disk tier {self.disk.root}: {e.reason}",
                    tier=TIER_DISK,
                ) from e
            self._disk.acquire(digest)
        try:
            for v in evicted:
                self.disk.remove(v)
                self.stats.disk_evictions += 1
            self.disk.put(digest, staged)
        except BaseException:
            with self._lock:
                self._disk.release(digest)
                self._disk.remove(digest, time.monotonic(), force=True)
            raise
        with self._lock:
            self._disk.release(digest)
        self.policy.record_load_cost(TIER_DISK, digest, fetch_s)

    # -- references ----------------------------------------------------------------------------
    def retain(self, adapter: LoRAAdapter) -> None:
        """One more request reference on an adapter already held (from :meth:`resolve`)."""
        with self._lock:
            if not self.request_refs.get(adapter.ref.sha256):
                raise RuntimeError(f"adapter {adapter.ref.short} retained without being resolved")
            self._take_ref(adapter.ref.sha256)

    def release(self, adapter: LoRAAdapter) -> None:
        """Drop a request reference taken by :meth:`resolve` (wakes loads waiting for room)."""
        with self._cond:
            d = adapter.ref.sha256
            n = self.request_refs.get(d, 0) - 1
            if n < 0:
                raise RuntimeError(f"adapter {adapter.ref.short} released more often than resolved")
            if n == 0:
                del self.request_refs[d]
            else:
                self.request_refs[d] = n
            self._host.release(d)
            if n == 0:
                self._trim_host_count(time.monotonic())
            self._cond.notify_all()

    # -- L0 device slots (engine thread) -------------------------------------------------------
    def acquire_slot(self, adapter: LoRAAdapter) -> int | None:
        """Slot holding ``adapter`` for one more running request, activating it if needed.

        Returns None when no slot may be freed (all in use or pinned): the request waits and
        others go on. Never blocks. A slot is reused in place, so its idle victim is dropped just
        before the new adapter is copied in (a free slot is used first when there is one).
        """
        d = adapter.ref.sha256
        with self._cond:
            now = time.monotonic()
            slot = self.slot_of.get(d)
            if slot is not None:
                self._device.touch(d, now)
                self._device.acquire(d)
                self.slot_users[slot] += 1
                self.stats.slot_hits += 1
                return slot
            if d not in self.host:
                raise RuntimeError(f"adapter {adapter.ref.short} is not held in host memory")
            info = self._info(adapter)
            try:
                victims = self._device.plan_admission(info, now)
            except NoRoomError:
                self.stats.slot_waits += 1
                return None
            self._device.counters.misses += 1
            for v in self._device.commit_admission(info, victims, now):
                self._vacate_slot(v)
            slot = self.slot_digest.index(None)
            if slot in self.bank.occupied_slots:  # stale rows of a retired adapter
                self.bank.reset_lora(slot)
            t0 = time.perf_counter()
            try:
                self.bank.set_lora(slot, adapter.weights)
            except BaseException:
                self._device.remove(d, now, force=True)
                raise
            dt = time.perf_counter() - t0
            self.slot_digest[slot] = d
            self.slot_of[d] = slot
            self.slot_users[slot] = 1
            self._device.acquire(d)
            self._host.acquire(d)  # inclusive: the slot keeps its host copy
            self.stats.slot_loads += 1
            self.policy.record_load_cost(TIER_DEVICE, d, dt)
        self._observe(self._activation_stage, dt)
        return slot

    def release_slot(self, slot: int) -> None:
        """A running request left ``slot``; the adapter stays resident until the slot is needed."""
        with self._cond:
            if self.slot_users[slot] <= 0:
                raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
            self.slot_users[slot] -= 1
            d = self.slot_digest[slot]
            assert d is not None
            self._device.release(d)
            if self.slot_users[slot] == 0:
                self._cond.notify_all()  # an idle slot may give its host copy's room

    def slot_rows(self, slot: int) -> tuple[int, int]:
        return self.bank.slot_rows(slot)

    def _vacate_slot(self, digest: str, *, evicted: bool = True) -> None:
        """Bookkeeping of a slot whose adapter left L0 (bank rows reset on reuse)."""
        slot = self.slot_of.pop(digest)
        assert self.slot_users[slot] == 0
        self.slot_digest[slot] = None
        self._host.release(digest)  # the slot's hold on the host copy
        if evicted:
            self.stats.slot_evictions += 1
            if digest in self.usage:
                self.usage[digest].evictions += 1

    def _retire_idle_slot(self, now: float) -> bool:
        """Retire one idle slot whose host copy only the slot holds, so L1 can evict it.

        Policy-ordered among the slots the L0 constraints allow to leave. Bookkeeping only (safe
        off the engine thread): the slot's stale rows are reset when the engine reuses it.
        """
        cands = []
        for d in self.slot_of:
            h = self._host.get(d)
            if not self._device.evictable(d, now) or h is None or h.inflight != 1 or h.pinned:
                continue
            if now - h.inserted_at >= self._host.min_residency_s:  # L1 may then evict it
                cands.append(d)
        if not cands:
            return False
        victim = self.policy.order_victims(cands, TIER_DEVICE, now, by_bytes=False)[0]
        _policy_evict(self._device, victim, now)
        self._vacate_slot(victim)
        return True

    # -- pins, admin eviction, warm policies ---------------------------------------------------
    def digest_of(self, digest_or_name: str) -> str:
        """The digest for a digest or an adapter name (the most recently used with that name)."""
        if _is_digest(digest_or_name):
            return digest_or_name
        with self._lock:
            named = [u for u in self.usage.values() if u.ref.name == digest_or_name]
        if not named:
            raise AdapterError(f"adapter {digest_or_name!r} is not known to the adapter cache")
        return max(named, key=lambda u: u.last_access).ref.sha256

    def _indexes(self) -> list[TierIndex]:
        return [i for i in (self._device, self._host, self._disk) if i is not None]

    def set_tenant_budget(self, tenant: str, host_bytes: int | None) -> None:
        """Cap ``tenant``'s bytes in host memory (None: no cap). Applies to later admissions;
        copies already resident stay until evicted."""
        if host_bytes is not None and host_bytes < 0:
            raise ValueError(f"tenant {tenant!r}: host byte budget must be >= 0")
        with self._lock:
            if host_bytes is None:
                self._host.tenant_budgets.pop(tenant, None)
            else:
                self._host.tenant_budgets[tenant] = host_bytes

    def pin(self, digest_or_name: str, *, device: bool = False) -> str:
        """Never evict the adapter from host memory and disk (and its slot with ``device``);
        the pin applies once it is resident. Returns the digest."""
        d = self.digest_of(digest_or_name)
        with self._cond:
            self._host.pin(d)
            if self._disk is not None:
                self._disk.pin(d)
            if device:
                self._device.pin(d)
            self.warm_policy[d] = WARM_DEVICE if device else WARM_HOST
        return d

    def unpin(self, digest_or_name: str) -> str:
        """Remove every pin of the adapter (it becomes ``on-demand``). Returns the digest."""
        d = self.digest_of(digest_or_name)
        with self._cond:
            for idx in self._indexes():
                idx.unpin(d)
            self.warm_policy[d] = WARM_ON_DEMAND
            self._cond.notify_all()
        return d

    def is_pinned(self, digest: str) -> bool:
        with self._lock:
            return any(idx.is_pinned(digest) for idx in self._indexes())

    def evict(self, digest_or_name: str, *, tiers: Iterable[str] = TIERS) -> list[str]:
        """Admin eviction from ``tiers``; returns the tiers it left. Refused (nothing changes)
        with :class:`AdapterInUseError` while requests use it or it is pinned."""
        d = self.digest_of(digest_or_name)
        tiers = [t for t in TIERS if t in set(tiers)]  # device first: it holds the host copy
        with self._cond:
            now = time.monotonic()
            chosen = {TIER_DEVICE: self._device, TIER_HOST: self._host, TIER_DISK: self._disk}
            present = [(t, chosen[t]) for t in tiers if chosen[t] is not None and d in chosen[t]]
            for t, idx in present:
                e = idx.get(d)
                assert e is not None
                own = 1 if t == TIER_HOST and d in self.slot_of and TIER_DEVICE in tiers else 0
                if e.inflight > own:
                    raise AdapterInUseError(
                        f"adapter {d[:12]} has in-flight requests in the {t} tier; not evicted"
                    )
                if e.pinned:
                    raise AdapterInUseError(
                        f"adapter {d[:12]} is pinned in the {t} tier; unpin it first"
                    )
            left = []
            for t, idx in present:
                idx.remove(d, now)
                if t == TIER_DEVICE:
                    self._vacate_slot(d)
                elif t == TIER_HOST:
                    self._drop_host_copy(d, evicted=True)
                left.append(t)
            self._cond.notify_all()
        if TIER_DISK in left and self.disk is not None:
            self.disk.remove(d)
            self.stats.disk_evictions += 1
        return left

    def prewarm(self, requests: Iterable[tuple[LoRARequest, str]]) -> list[AdapterRef]:
        """Start-up warming by warm policy: ``device-preferred`` (loaded into a slot and pinned
        there and in host memory), ``host`` (pinned in host memory), ``on-demand`` (loaded and
        verified, evictable). Call before the engine loop runs (it activates slots)."""
        refs = []
        for req, warm in requests:
            if warm not in WARM_POLICIES:
                valid = ", ".join(WARM_POLICIES)
                raise ValueError(f"adapter {req.name!r}: unknown warm policy {warm!r} ({valid})")
            adapter, _ = self.resolve_with_state(req, count=False)
            try:
                d = adapter.ref.sha256
                if warm != WARM_ON_DEMAND:
                    self.pin(d, device=warm == WARM_DEVICE)
                else:
                    with self._lock:
                        self.warm_policy[d] = WARM_ON_DEMAND
                if warm == WARM_DEVICE:
                    slot = self.acquire_slot(adapter)
                    if slot is None:
                        raise AdapterCapacityError(
                            f"adapter {req.name!r}: no free device slot for a device-preferred "
                            f"adapter (more of them than --max-loras {self.max_loras}?)",
                            tier=TIER_DEVICE,
                        )
                    self.release_slot(slot)
            finally:
                self.release(adapter)
            refs.append(adapter.ref)
        return refs

    # -- reports -------------------------------------------------------------------------------
    def tier_of(self, digest: str) -> str | None:
        """``device``, ``host``, ``disk`` or None (in no tier)."""
        with self._lock:
            if digest in self.slot_of:
                return TIER_DEVICE
            if digest in self.host:
                return TIER_HOST
            if self._disk is not None and digest in self._disk:
                return TIER_DISK
        return None

    def tier_counters(self) -> dict[str, TierCounters]:
        """tier -> copy of its counters (hits, misses, inserts, evictions,
        reload_after_eviction; ``thrash_ratio`` and ``hit_ratio`` properties)."""
        with self._lock:
            return {idx.name: replace(idx.counters) for idx in self._indexes()}

    def residency(self) -> list[AdapterResidency]:
        """A snapshot of every adapter loaded since start-up, most recently used first."""
        with self._lock:
            usage = list(self.usage.values())
            refs = dict(self.request_refs)
            slot_of = dict(self.slot_of)
            rows = []
            for u in sorted(usage, key=lambda u: -u.last_access):
                d = u.ref.sha256
                rows.append(
                    AdapterResidency(
                        ref=u.ref,
                        tier=self.tier_of(d) or "absent",
                        rank=u.rank,
                        nbytes=u.nbytes,
                        hits=u.hits,
                        loads=u.loads,
                        evictions=u.evictions,
                        last_access=u.last_access,
                        pinned=self.is_pinned(d),
                        in_flight=refs.get(d, 0),
                        slot=slot_of.get(d),
                        warm_policy=self.warm_policy.get(d, WARM_ON_DEMAND),
                    )
                )
        return rows

    def resident_bytes(self) -> dict[str, tuple[int, int]]:
        """tier -> (count, bytes) for every tier (``disk`` only when configured)."""
        with self._lock:
            return {idx.name: (idx.count, idx.used_bytes) for idx in self._indexes()}

    def is_idle(self) -> bool:
        """True when no slot has running users and no request holds an adapter."""
        with self._lock:
            return not self.request_refs and all(u == 0 for u in self.slot_users)

    def check_invariants(self) -> None:
        """Cross-check the indexes against the copies (tests; raises AssertionError)."""
        with self._lock:
            assert set(self.host) == set(self._host.entries()), "host copies != L1 index"
            assert set(self.slot_of) == set(self._device.entries()), "slots != L0 index"
            for d, s in self.slot_of.items():
                assert self.slot_digest[s] == d
                assert self._device.entries()[d].inflight == self.slot_users[s]
            for d, e in self._host.entries().items():
                want = self.request_refs.get(d, 0) + (1 if d in self.slot_of else 0)
                assert e.inflight == want, f"L1 in-flight of {d[:12]}: {e.inflight} != {want}"
            assert set(self.request_refs) <= set(self.host)
            if self.disk is not None and self._disk is not None:
                assert set(self.disk.entries()) == set(self._disk.entries()), "disk != L2 index"
            assert not self._flights, "loads left in flight"


AdapterManager = TieredAdapterCache
"""The engine's historical name for the tiered cache."""
