"""The tiered adapter cache: device slots (L0), host memory (L1), local disk (L2), object store (L3).

:class:`TieredAdapterCache` composes three parts, each in its own module:

- :class:`~loraplex.cache.controller.TierController` — every residency decision (admissions,
  evictions, pins, holds, tenant budgets, counters); the only consumer of the eviction policy.
  Its docstring is the spec of the tiers and their hard constraints.
- :class:`~loraplex.cache.loader.AdapterLoader` — an :class:`~loraplex.types.AdapterSpec`
  becomes a verified host copy, from a local directory, L2 or L3, single flight per digest.
- the copies themselves: ``host`` (digest -> :class:`~loraplex.lora.adapter.LoRAAdapter`) and
  the :class:`~loraplex.lora.slots.LoRASlotBank` rows of the device slots.

The input is always an AdapterSpec: its ``ref.sha256`` is the key of every tier and is verified
against the bytes read; names and paths are never keys.

Host memory has two hard limits: ``max_cpu_lora_bytes`` and the ``max_cpu_loras`` count (vLLM's
name); neither is exceeded, whatever requests hold (the offline API widens the count for one
call: :meth:`TieredAdapterCache.host_copies_at_least`).

Thread safety: one lock (and its condition) guards the controller, the flights and ``host``.
Loads (file reads, downloads, conversion) run outside it in the caller's thread; a load that
finds no room in host memory waits on the condition (bounded by ``load_wait_timeout_s``, woken
by releases) and then raises :class:`AdapterCapacityError`; a request that joined another's
load waits for it at most as long (:class:`~loraplex.types.AdapterLoadTimeoutError`). The engine thread reserves slots
(:meth:`reserve_slot`, bookkeeping only, never blocks); then :meth:`stage` hands the newly
reserved adapters' weight copies to a background writer (:mod:`loraplex.cache.staging`) and
returns the slots still loading: the engine runs the rest of the batch and those requests wait
(a slot becomes usable between two steps, once its rows are complete). :meth:`activate` is the
blocking form (start-up, tests). Copies run outside the cache lock, timed as ``h2d`` on CUDA or
``activation`` elsewhere. Every load stage is reported to ``load_observers``
(``resolve``, ``remote_download``, ``disk_load``, ``h2d`` / ``activation``).

Pins (``pin``/``unpin``, and the warm policies ``device-preferred``/``host``/``on-demand`` of
``prewarm``) are never evicted.

Eviction listeners (:meth:`TieredAdapterCache.add_eviction_listener`) hear the digest of each
host copy that leaves host memory, outside the lock (speculative drafts learned from an adapter
leave with it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from loraplex.cache.backends import open_store
from loraplex.cache.controller import TIER_DEVICE, TIER_HOST, TIERS, TierController
from loraplex.cache.disk import DiskTier
from loraplex.cache.loader import (
    STAGE_ACTIVATION,
    STAGE_H2D,
    STAGE_RESOLVE,
    AdapterLoader,
    Flight,
)
from loraplex.cache.policy import AdapterInfo, EvictionPolicy, make_policy
from loraplex.cache.residency import PIN_WINDOW, NoRoomError
from loraplex.cache.staging import SlotStager, StagingJob
from loraplex.cache.stats import CacheStats, TierCounters
from loraplex.cache.store import ObjectStore
from loraplex.checkpoint.modules import BaseModelSpec
from loraplex.lora.adapter import AdapterRead, LoRAAdapter
from loraplex.lora.slots import LoRASlotBank
from loraplex.types import (
    AdapterCapacityError,
    AdapterError,
    AdapterInUseError,
    AdapterRef,
    AdapterSpec,
)
from loraplex.warm import WARM_POLICIES

if TYPE_CHECKING:
    from loraplex.config import EngineConfig

WARM_DEVICE, WARM_HOST, WARM_ON_DEMAND = WARM_POLICIES
PIN_PUSH = "push"  # the pin of pushed bytes while their revision may be served (see push)

__all__ = [
    "PIN_PUSH",
    "TIERS",
    "WARM_POLICIES",
    "AdapterCapacityError",
    "AdapterInUseError",
    "AdapterResidency",
    "SlotBatch",
    "TieredAdapterCache",
]

log = logging.getLogger("loraplex.cache.adapters")


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
    last_access: float  # wall-clock seconds
    pinned: bool
    in_flight: int
    slot: int | None
    warm_policy: str = "on-demand"


class SlotBatch(Protocol):
    """What :meth:`TieredAdapterCache.activate` needs of an engine step's batch."""

    slot_rows: dict[int, tuple[int, int]]

    def slot_adapters(self) -> Mapping[int, LoRAAdapter]:
        """slot -> the adapter reserved in it, for every slot the batch uses."""
        ...


def make_cache_policy(name: str) -> EvictionPolicy:
    """The policy instance shared by every tier (hybrid knows the tier order for reload costs)."""
    if name.strip().lower() in ("hybrid", "hybrid-forecast"):
        return make_policy(name, tier_order=TIERS)
    return make_policy(name)


def _is_digest(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


class TieredAdapterCache:
    """Adapters across device slots, host memory, disk and an object store; see the module doc."""

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
        thrash_window_s: float = 60.0,
        tenant_budgets: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        self.bank = bank
        self.spec = spec
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_cpu_lora_bytes = max_cpu_lora_bytes
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.load_wait_timeout_s = float(load_wait_timeout_s)
        self.policy = make_cache_policy(policy) if isinstance(policy, str) else policy
        self.tiers = TierController(
            self.policy,
            slots=max_loras,
            clock=time.monotonic,
            host_bytes=max_cpu_lora_bytes,
            max_host_copies=max_cpu_loras,
            disk_bytes=disk.capacity_bytes if disk is not None else None,
            min_residency_s=min_residency_s,
            thrash_window_s=thrash_window_s,
            tenant_budgets=tenant_budgets,
        )
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # called with (stage, seconds) for every timed load stage
        self.load_observers: list[Callable[[str, float], None]] = []
        self.loader = AdapterLoader(
            spec,
            tiers=self.tiers,
            lock=self._cond,
            max_lora_rank=max_lora_rank,
            dtype=dtype,
            observe=self._observe,
            disk=disk,
            store=store,
            room_wait_s=self.load_wait_timeout_s,
        )
        self.host: dict[str, LoRAAdapter] = {}  # digest -> host copy (L1)
        self._eviction_listeners: list[Callable[[str], None]] = []
        self._evicted: list[str] = []  # host copies dropped, not yet announced (under the lock)
        self.warm_policy: dict[str, str] = {}  # digest -> warm policy given to prewarm/pin
        self._refs: dict[str, AdapterRef] = {}  # digest -> ref of its first host copy
        self._active: list[str | None] = [None] * max_loras  # digest whose rows each slot has
        self._stager = SlotStager(bank)
        self._staging: dict[int, StagingJob] = {}  # slot -> its latest fill (engine thread)
        self._activation_stage = STAGE_H2D if bank.device.type == "cuda" else STAGE_ACTIVATION
        if disk is not None:
            self.loader.adopt_disk_entries()

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

    # -- views -----------------------------------------------------------------------------------
    @property
    def disk(self) -> DiskTier | None:
        return self.loader.disk

    @property
    def store(self) -> ObjectStore | None:
        return self.loader.store

    @property
    def stats(self) -> CacheStats:
        return self.tiers.stats

    @property
    def request_refs(self) -> dict[str, int]:
        return self.tiers.request_refs

    @property
    def slot_of(self) -> dict[str, int]:
        return self.tiers.slot_of

    @property
    def slot_digest(self) -> list[str | None]:
        return self.tiers.slot_digest

    @property
    def slot_users(self) -> list[int]:
        return self.tiers.slot_users

    def _observe(self, stage: str, seconds: float) -> None:
        for fn in self.load_observers:
            fn(stage, seconds)

    @staticmethod
    def _info(adapter: LoRAAdapter, spec: AdapterSpec) -> AdapterInfo:
        return AdapterInfo(
            adapter.ref.sha256,
            adapter.nbytes,
            tenant=spec.tenant,
            priority=spec.priority,
            rank=adapter.rank,
        )

    def add_eviction_listener(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(digest)`` each time an adapter's host copy leaves host memory (evicted
        for room, trimmed to the count cap, or evicted by an admin): what was learned from the
        adapter (speculative drafts keyed by its digest) can go with it. Called outside the
        cache's lock, on whichever thread dropped the copy (a loader thread, the engine's, an
        admin request's); a listener that raises is logged and the cache carries on."""
        with self._lock:
            self._eviction_listeners.append(fn)

    def _drop(self, digests: Iterable[str]) -> None:
        """Forget the host copies the controller dropped (already out of the L1 index); the
        caller announces them (:meth:`_announce_evictions`) once it lets go of the lock."""
        for d in digests:
            if self.host.pop(d, None) is not None:
                self._evicted.append(d)

    def _announce_evictions(self) -> None:
        """Tell the eviction listeners about the host copies dropped since the last call."""
        with self._lock:
            if not self._evicted:
                return
            evicted, self._evicted = self._evicted, []
            listeners = list(self._eviction_listeners)
        for d in evicted:
            for fn in listeners:
                try:
                    fn(d)
                except Exception:
                    log.exception("adapter eviction listener %r failed for %s", fn, d[:12])

    # -- L1 host: requests' references -----------------------------------------------------------
    def acquire(self, spec: AdapterSpec, *, count: bool = True) -> tuple[LoRAAdapter, bool]:
        """The host copy of ``spec`` with one request reference, and whether it was warm
        (already in host memory) — a cold request paid for a load. ``count=False`` for loads
        that are not requests (start-up, admin): they stay out of the hit/miss counters.

        Blocks while the adapter loads (shared with concurrent requests for it; a request that
        joined another's load waits at most ``load_wait_timeout_s``, then gets
        :class:`~loraplex.types.AdapterLoadTimeoutError`) and while host memory has no evictable
        room under its byte budget and its ``max_cpu_loras`` count (bounded by the same
        timeout, then :class:`AdapterCapacityError`). Raises AdapterError subclasses:
        StoreError, AdapterCopyError, DiskTierError, :class:`AdapterCapacityError`.
        """
        return self._acquire(spec, count, lambda: self.loader.load(spec, count=count))

    def _acquire(
        self, spec: AdapterSpec, count: bool, load: Callable[[], tuple[LoRAAdapter, float]]
    ) -> tuple[LoRAAdapter, bool]:
        """:meth:`acquire` whose leader gets its copy from ``load()`` (copy, seconds)."""
        t0 = time.perf_counter()
        d = spec.sha256
        with self._lock:
            hit = self.host.get(d)
            if hit is not None:
                self.tiers.serve_from_host(self._info(hit, spec), count=count)
                return hit, True
            flight, leader = self.loader.join(d, count=count)
        if not leader:
            adapter, warm = self.loader.wait(
                d, flight, count=count, timeout=self.load_wait_timeout_s, name=spec.ref.name
            )
            self._observe(STAGE_RESOLVE, time.perf_counter() - t0)
            return adapter, warm
        try:
            adapter, load_s = load()
            adapter, warm = self._admit(spec, adapter, load_s, flight)
        except BaseException as e:
            with self._lock:
                self.loader.fail(d, flight, e)
                self.stats.load_failures += 1
            raise
        self._observe(STAGE_RESOLVE, time.perf_counter() - t0)
        return adapter, warm

    def _admit(
        self, spec: AdapterSpec, adapter: LoRAAdapter, load_s: float, flight: Flight
    ) -> tuple[LoRAAdapter, bool]:
        """Admit the leader's copy into L1 (waiting for room, bounded) with a reference for the
        leader and each waiter, then wake the waiters."""
        d, info = spec.sha256, self._info(adapter, spec)
        with self._cond:
            deadline = time.monotonic() + self.load_wait_timeout_s
            waited = False
            while True:
                try:
                    adm = self.tiers.admit_host(
                        info,
                        holds=1 + flight.waiters,
                        counted=int(flight.count) + flight.counted,
                        load_seconds=load_s,
                    )
                    break
                except NoRoomError as e:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise AdapterCapacityError(
                            f"adapter {spec.ref.name!r}: no room in host memory (L1) after "
                            f"waiting {self.load_wait_timeout_s:g}s: {e.reason}; retry later",
                            tier=TIER_HOST,
                        ) from e
                    if not waited:
                        self.stats.capacity_waits += 1
                        waited = True
                    self._cond.wait(min(remaining, 0.05))
            self._drop(adm.dropped)
            if adm.warm:
                adapter = self.host[d]
            else:
                self.host[d] = adapter
                self._refs.setdefault(d, adapter.ref)
            self.loader.finish(d, flight, adapter, adm.warm)
        self._announce_evictions()
        return adapter, adm.warm

    def push(self, spec: AdapterSpec, read: AdapterRead, *, persist_disk: bool = False) -> bool:
        """Admit pushed bytes (``read``: :func:`~loraplex.lora.adapter.read_pushed`, whose
        digest is ``spec.sha256``, with a ``pushed://`` source) into host memory, and into the
        disk tier with ``persist_disk``, exactly as a loaded directory is: validated against
        the base model first (:class:`AdapterError`, nothing changes), then admitted
        (waiting for room like a load) and pinned there by :data:`PIN_PUSH` (pushed bytes have
        no file to come back from); :meth:`unpin` (a replaced revision's retirement) lifts it.
        Returns whether a copy was already in host memory."""
        if read.digest != spec.sha256 or read.files is None:
            raise AdapterError(f"adapter {spec.ref.name!r}: the pushed bytes are not {spec.sha256}")
        if persist_disk and self.disk is None:
            raise AdapterError("persist=disk needs a disk tier on this server (--disk-cache-dir)")
        built = self.loader.build(spec, read.config, read.tensors)
        if persist_disk:
            self.loader.put_pushed(spec, read.files.config_bytes, read.files.data)
        adapter, warm = self._acquire(spec, False, lambda: (built, 0.0))
        try:
            with self._cond:
                self.tiers.pin(spec.sha256, owner=PIN_PUSH)
                self.warm_policy.setdefault(spec.sha256, WARM_HOST)
        finally:
            self.release(adapter)
        return warm

    @contextlib.contextmanager
    def host_copies_at_least(self, n: int) -> Iterator[None]:
        """For the block, let host memory hold ``max(max_cpu_loras, n)`` copies (the byte
        budget still holds): the offline ``LLM.generate`` holds every adapter of one call at
        once. Afterwards the count cap is ``max_cpu_loras`` again (copies beyond it that no
        request holds are evicted). Not for concurrent callers (a server never uses it)."""
        with self._cond:
            self._drop(self.tiers.set_max_host_copies(max(self.max_cpu_loras, n)))
        self._announce_evictions()
        try:
            yield
        finally:
            with self._cond:
                self._drop(self.tiers.set_max_host_copies(self.max_cpu_loras))
                self._cond.notify_all()
            self._announce_evictions()

    def retain(self, adapter: LoRAAdapter) -> None:
        """One more request reference on an adapter already held (from :meth:`acquire`)."""
        with self._lock:
            if not self.request_refs.get(adapter.ref.sha256):
                raise RuntimeError(f"adapter {adapter.ref.short} retained without being acquired")
            self.tiers.hold_request(adapter.ref.sha256)

    def release(self, adapter: LoRAAdapter) -> None:
        """Drop a request reference taken by :meth:`acquire` (wakes loads waiting for room)."""
        with self._cond:
            try:
                dropped = self.tiers.release_request(adapter.ref.sha256)
            except RuntimeError:
                raise RuntimeError(
                    f"adapter {adapter.ref.short} released more often than acquired"
                ) from None
            self._drop(dropped)
            self._cond.notify_all()
        self._announce_evictions()

    def is_local_source(self, spec: AdapterSpec) -> bool:
        """True when ``spec`` is read from a local directory (not through the object store), so
        an adapter out of memory still sits on local disk."""
        return self.loader.is_local(spec)

    # -- L0 device slots (engine thread) ---------------------------------------------------------
    def reserve_slot(self, adapter: LoRAAdapter) -> int | None:
        """The slot ``adapter`` runs in for one more running request (bookkeeping only: the
        weights are copied by :meth:`activate`). None when no slot may be freed (all in use or
        pinned): the request waits and others go on. Never blocks."""
        with self._lock:
            d = adapter.ref.sha256
            got = self.tiers.reserve_slot(self.tiers.host_info(d))
        return None if got is None else got[0]

    def release_slot(self, slot: int) -> None:
        """A running request left ``slot``; the adapter stays resident until the slot is needed."""
        with self._cond:
            if self.tiers.release_slot(slot):
                self._cond.notify_all()  # an idle slot may give its host copy's room

    def stage(self, batch: SlotBatch) -> set[int]:
        """Start the weight copies of the adapters newly reserved for ``batch`` (background
        thread) and return the slots whose rows are not complete yet: their requests wait while
        the rest of the batch runs. ``batch.slot_rows`` gets the rows of every ready slot.

        Engine thread only, between steps. A finished copy becomes usable here; a failed one
        raises its error here (the bank is left without that adapter: all or nothing); a copy
        that found the free rows fragmented compacts the bank (moves slots in use, so only
        here) and starts again.
        """
        loading = {slot for slot, a in batch.slot_adapters().items() if not self._ready(slot, a)}
        used = batch.slot_adapters()
        batch.slot_rows = {s: self.bank.slot_rows(s) for s in used if s not in loading}
        return loading

    def wait_staging(self, timeout: float) -> None:
        """Block until a slot copy in progress finishes (or ``timeout``): for an engine whose
        whole batch waits on loads, instead of spinning."""
        self._stager.wait_any(list(self._staging.values()), timeout)

    def activate(self, batch: SlotBatch) -> None:
        """Blocking :meth:`stage`: copy the weights of the adapters newly reserved for ``batch``
        into their slots and wait, then record every slot's rows on ``batch.slot_rows``.

        Engine thread only (it owns the slot fills), never under the cache lock: a slot with
        running requests cannot be retired, so nothing else touches these slots meanwhile.
        """
        used = batch.slot_adapters()
        for slot, adapter in used.items():
            self._activate_now(slot, adapter)
        batch.slot_rows = {slot: self.bank.slot_rows(slot) for slot in used}

    def _activate_now(self, slot: int, adapter: LoRAAdapter) -> None:
        while not self._ready(slot, adapter):
            self._staging[slot].done.wait()

    def _ready(self, slot: int, adapter: LoRAAdapter) -> bool:
        """Whether ``slot``'s rows hold ``adapter``; starts (or collects) its copy if not."""
        d = adapter.ref.sha256
        job = self._staging.get(slot)
        if job is not None and job.done.is_set():
            self._collect(job)  # may raise, or compact and start again
            job = self._staging.get(slot)
        if job is None and self._active[slot] == d:
            return True
        if job is None or job.digest != d:  # a superseded fill is reset by this one
            self._active[slot] = None
            self._staging[slot] = self._stager.submit(slot, d, adapter.slot_source)
        return False

    def _collect(self, job: StagingJob) -> None:
        """Apply a finished fill (engine thread, between steps)."""
        del self._staging[job.slot]
        if job.error is not None:
            raise job.error
        if job.needs_compaction:
            self.bank.compact()
            self._staging[job.slot] = self._stager.submit(job.slot, job.digest, job.weights)
            return
        self._active[job.slot] = job.digest
        with self._lock:
            self.tiers.record_load(TIER_DEVICE, job.digest, job.seconds)
        self._observe(self._activation_stage, job.seconds)

    # -- pins, admin eviction, warm policies -----------------------------------------------------
    @staticmethod
    def _digest(digest: str) -> str:
        if not _is_digest(digest):
            raise AdapterError(f"{digest!r} is not an adapter digest (64 lowercase hex digits)")
        return digest

    def set_tenant_budget(self, tenant: str, host_bytes: int | None) -> None:
        """Cap ``tenant``'s bytes in host memory (None: no cap). Applies to later admissions;
        copies already resident stay until evicted."""
        with self._lock:
            self.tiers.set_tenant_budget(tenant, host_bytes)

    def pin(self, digest: str, *, device: bool = False) -> str:
        """Never evict the adapter ``digest`` from host memory and disk (and its slot with
        ``device``); the pin applies once it is resident. Returns the digest."""
        d = self._digest(digest)
        with self._cond:
            self.tiers.pin(d, device=device)
            self.warm_policy[d] = WARM_DEVICE if device else WARM_HOST
        return d

    def unpin(self, digest: str, owner: str | None = None) -> str:
        """Remove every pin of the adapter, or ``owner``'s alone (e.g. :data:`PIN_PUSH`); once
        none is left it is ``on-demand``. Returns the digest."""
        d = self._digest(digest)
        with self._cond:
            self.tiers.unpin(d, owner)
            if not self.tiers.is_pinned(d):
                self.warm_policy[d] = WARM_ON_DEMAND
            self._cond.notify_all()
        return d

    def load_ahead(
        self, specs: Mapping[str, AdapterSpec], waiting: Mapping[str, int], limit: int
    ) -> list[str]:
        """Forecast load-ahead into host memory: hand the policy the queue (``waiting``: digest
        -> requests waiting), then load the adapters its forecast expects within its horizon
        (``hybrid-forecast``; nothing for other policies) that fit without evicting a copy worth
        as much, at most ``limit``. ``specs`` (digest -> spec) are the adapters that may be
        loaded. Uncounted, like start-up loads. Returns the digests loaded; a failed load is
        logged and skipped. Runs off the engine thread (it loads)."""
        with self._lock:
            self.tiers.set_waiting(waiting)
            todo = [
                info
                for info in self.tiers.forecast(limit)
                if info.key in specs and self.tiers.worth_loading_ahead(info)
            ]
        loaded = []
        for info in todo:
            try:
                adapter, warm = self.acquire(specs[info.key], count=False)
            except AdapterError as e:
                log.warning("forecast load-ahead of adapter %s failed: %s", info.key[:12], e)
                continue
            self.release(adapter)
            if not warm:
                loaded.append(info.key)
        return loaded

    def pin_window(self, digest: str, *, device: bool = False) -> str:
        """A warm window's pin of ``digest`` (as :meth:`pin`), released by
        :meth:`unpin_window` without touching an operator's pin."""
        d = self._digest(digest)
        with self._cond:
            self.tiers.pin(d, device=device, owner=PIN_WINDOW)
        return d

    def unpin_window(self, digest: str) -> str:
        """Release the warm window's pin of ``digest``; pins set by hand stay."""
        d = self._digest(digest)
        with self._cond:
            self.tiers.unpin(d, PIN_WINDOW)
            if not self.tiers.is_pinned(d):
                self.warm_policy[d] = WARM_ON_DEMAND
            self._cond.notify_all()
        return d

    def is_pinned(self, digest: str) -> bool:
        with self._lock:
            return self.tiers.is_pinned(digest)

    def evict(self, digest: str, *, tiers: Iterable[str] = TIERS) -> list[str]:
        """Admin eviction of the adapter ``digest`` from ``tiers``; returns the tiers it left.
        Refused (nothing changes) with :class:`AdapterInUseError` while requests use it or it
        is pinned."""
        d = self._digest(digest)
        with self._cond:
            left = self.tiers.evict(d, tiers)
            if TIER_HOST in left:
                self._drop([d])
            self._cond.notify_all()
        self._announce_evictions()
        if self.disk is not None and self.tiers.disk_name in left:
            self.disk.remove(d)
        return left

    def prewarm(self, specs: Iterable[AdapterSpec]) -> list[AdapterRef]:
        """Start-up warming by each spec's warm policy: ``device-preferred`` (loaded into a slot
        and pinned there and in host memory), ``host`` (pinned in host memory), ``on-demand``
        (loaded and verified, evictable). Call before the engine loop runs (it fills slots)."""
        refs = []
        for spec in specs:
            warm = spec.warm_policy
            if warm not in WARM_POLICIES:
                valid = ", ".join(WARM_POLICIES)
                raise ValueError(f"adapter {spec.name!r}: unknown warm policy {warm!r} ({valid})")
            adapter, _ = self.acquire(spec, count=False)
            try:
                d = adapter.ref.sha256
                if warm != WARM_ON_DEMAND:
                    self.pin(d, device=warm == WARM_DEVICE)
                else:
                    with self._lock:
                        self.warm_policy[d] = WARM_ON_DEMAND
                if warm == WARM_DEVICE:
                    self._prewarm_slot(spec, adapter)
            finally:
                self.release(adapter)
            refs.append(adapter.ref)
        return refs

    def _prewarm_slot(self, spec: AdapterSpec, adapter: LoRAAdapter) -> None:
        slot = self.reserve_slot(adapter)
        if slot is None:
            raise AdapterCapacityError(
                f"adapter {spec.name!r}: no free device slot for a device-preferred "
                f"adapter (more of them than --max-loras {self.max_loras}?)",
                tier=TIER_DEVICE,
            )
        try:
            self._activate_now(slot, adapter)
        except BaseException:
            with self._lock:
                self.tiers.cancel_slot(slot)
            raise
        self.release_slot(slot)

    # -- reports ---------------------------------------------------------------------------------
    def tier_of(self, digest: str) -> str | None:
        """``device``, ``host``, ``disk`` or None (in no tier)."""
        with self._lock:
            return self.tiers.tier_of(digest)

    def tier_counters(self) -> dict[str, TierCounters]:
        """tier -> copy of its counters (hits, misses, inserts, evictions,
        reload_after_eviction; ``thrash_ratio`` and ``hit_ratio`` properties)."""
        with self._lock:
            return self.tiers.tier_counters()

    def loaded(self) -> list[tuple[str, str, bool, int]]:
        """``(digest, tier, pinned, rank)`` of the adapters in a device slot, then of those
        only in host memory: at most slots + host copies rows (a snapshot under the lock)."""
        tiers = self.tiers
        with self._lock:  # the indexes are not thread-safe alone; this takes microseconds
            host = tiers.host.entries() if tiers.host is not None else {}
            rows = [
                (d, tiers.device_name, e.pinned, e.info.rank)
                for d, e in tiers.device.entries().items()
                if d in tiers.slot_of
            ]
            rows += [
                (d, tiers.host_name, e.pinned, e.info.rank)
                for d, e in host.items()
                if d not in tiers.slot_of
            ]
        return rows

    def residency(self) -> list[AdapterResidency]:
        """A snapshot of every adapter loaded since start-up, most recently used first."""
        with self._lock:
            wall_offset = time.time() - self.tiers.clock()  # controller clock -> wall clock
            rows = []
            for d, u in sorted(self.tiers.usage.items(), key=lambda kv: -kv[1].last_access):
                rows.append(
                    AdapterResidency(
                        ref=self._refs[d],
                        tier=self.tiers.tier_of(d) or "absent",
                        rank=u.info.rank,
                        nbytes=u.info.size_bytes,
                        hits=u.hits,
                        loads=u.loads,
                        evictions=u.evictions,
                        last_access=u.last_access + wall_offset,
                        pinned=self.tiers.is_pinned(d),
                        in_flight=self.request_refs.get(d, 0),
                        slot=self.slot_of.get(d),
                        warm_policy=self.warm_policy.get(d, WARM_ON_DEMAND),
                    )
                )
        return rows

    def resident_bytes(self) -> dict[str, tuple[int, int]]:
        """tier -> (count, bytes) for every tier (``disk`` only when configured)."""
        with self._lock:
            return self.tiers.resident_bytes()

    def is_idle(self) -> bool:
        """True when no slot has running users and no request holds an adapter."""
        with self._lock:
            return self.tiers.is_idle()

    def check_invariants(self) -> None:
        """Cross-check the indexes against the copies (tests; raises AssertionError)."""
        with self._lock:
            self.tiers.check_invariants()
            host = self.tiers.host
            assert host is not None and set(self.host) == set(host.entries()), "copies != L1"
            disk, idx = self.disk, self.tiers.disk
            if disk is not None and idx is not None:
                assert set(disk.entries()) == set(idx.entries()), "disk != L2 index"
            assert not self.loader.loads_in_progress(), "loads left in flight"
