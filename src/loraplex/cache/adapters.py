"""Adapter residency for the engine: host copies (L1) and device slots (L0), keyed by digest.

This is the single owner of residency decisions today; the tiered cache (disk / object store,
pluggable eviction policies) grows out of it. Invariants kept here:
- keys are content digests, never names (a re-registered name is a different adapter);
- an adapter in a slot with running requests is never evicted from the slot;
- a host copy referenced by a live request is never dropped.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.lora.adapter import BaseModelSpec, LoRAAdapter, load_peft_adapter
from loraplex.lora.slots import LoRASlotBank
from loraplex.requests import LoRARequest
from loraplex.types import AdapterError, AdapterRef


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


@dataclass
class AdapterStats:
    host_hits: int = 0
    host_loads: int = 0
    host_evictions: int = 0
    slot_hits: int = 0
    slot_loads: int = 0
    slot_evictions: int = 0
    cold_requests: int = 0  # requests whose adapter had to be loaded into host memory


def _fingerprint(path: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of the files that define an adapter — changes when it is rewritten."""
    out = []
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        p = path / name
        if p.is_file():
            st = p.stat()
            out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


class AdapterManager:
    """Loads PEFT adapters into host memory and activates them into device slots."""

    def __init__(
        self,
        bank: LoRASlotBank,
        spec: BaseModelSpec,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
    ) -> None:
        self.bank = bank
        self.spec = spec
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # digest -> adapter, LRU first
        self.request_refs: dict[str, int] = {}
        self._by_path: dict[str, tuple[tuple, str]] = {}
        self.slot_digest: list[str | None] = [None] * max_loras
        self.slot_users = [0] * max_loras
        self.slot_of: dict[str, int] = {}
        self.idle_slots: OrderedDict[int, None] = (
            OrderedDict()
        )  # resident, no running users; LRU first
        self.stats = AdapterStats()
        self.usage: dict[str, AdapterUsage] = {}
        # called with (stage, seconds) for every timed load stage (disk_load, activation)
        self.load_observers: list[Callable[[str, float], None]] = []
        self._lock = threading.Lock()

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

    # -- host tier -----------------------------------------------------------------------------
    def resolve(self, req: LoRARequest) -> LoRAAdapter:
        """Host copy for ``req`` (loading and verifying it if needed), with one request reference."""
        return self.resolve_with_state(req)[0]

    def resolve_with_state(
        self, req: LoRARequest, *, count: bool = True
    ) -> tuple[LoRAAdapter, bool]:
        """Like :meth:`resolve`; also says whether the adapter was warm (already in host memory
        or a slot) — a cold request paid for a load. ``count=False`` for loads that are not
        requests (start-up, admin), which stay out of the hit/cold-request counters."""
        path = Path(req.path).expanduser()
        if not path.is_dir():
            raise AdapterError(f"adapter {req.name!r}: path {req.path!r} is not a directory")
        key = str(path.resolve())
        fp = _fingerprint(path)
        with self._lock:
            known = self._by_path.get(key)
            if known is not None and known[0] == fp and known[1] in self.host:
                adapter = self.host[known[1]]
                if req.revision is None or adapter.ref.revision == req.revision:
                    self.host.move_to_end(adapter.ref.sha256)
                    if count:
                        self.stats.host_hits += 1
                        self._use(adapter).hits += 1
                    self._retain(adapter.ref.sha256)
                    return adapter, True
        t0 = time.perf_counter()
        adapter = load_peft_adapter(
            path,
            self.spec,
            name=req.name,
            revision=req.revision,
            max_lora_rank=self.max_lora_rank,
            dtype=self.dtype,
        )
        self._observe("disk_load", time.perf_counter() - t0)
        with self._lock:
            digest = adapter.ref.sha256
            warm = digest in self.host
            if warm:  # same content under another path or name
                adapter = self.host[digest]
                self.host.move_to_end(digest)
                if count:
                    self.stats.host_hits += 1
                    self._use(adapter).hits += 1
            else:
                self.host[digest] = adapter
                self.stats.host_loads += 1
                self.stats.cold_requests += int(count)
                self._use(adapter).loads += 1
            self._by_path[key] = (fp, digest)
            self._retain(digest)
            self._evict_host()
            return adapter, warm

    def retain(self, adapter: LoRAAdapter) -> None:
        """One more request reference on an adapter already held (from :meth:`resolve`)."""
        with self._lock:
            if not self.request_refs.get(adapter.ref.sha256):
                raise RuntimeError(f"adapter {adapter.ref.short} retained without being resolved")
            self._retain(adapter.ref.sha256)

    def _retain(self, digest: str) -> None:
        self.request_refs[digest] = self.request_refs.get(digest, 0) + 1

    def release(self, adapter: LoRAAdapter) -> None:
        """Drop a request reference taken by :meth:`resolve`."""
        with self._lock:
            d = adapter.ref.sha256
            n = self.request_refs.get(d, 0) - 1
            if n < 0:
                raise RuntimeError(f"adapter {adapter.ref.short} released more often than resolved")
            if n == 0:
                del self.request_refs[d]
            else:
                self.request_refs[d] = n
            self._evict_host()

    def _evict_host(self) -> None:
        """Drop LRU host copies beyond max_cpu_loras that no request or slot uses."""
        excess = len(self.host) - self.max_cpu_loras
        if excess <= 0:
            return
        for d in list(self.host):
            if excess <= 0:
                break
            if self.request_refs.get(d) or d in self.slot_of:
                continue
            del self.host[d]
            self.stats.host_evictions += 1
            if d in self.usage:
                self.usage[d].evictions += 1
            excess -= 1

    # -- device slots --------------------------------------------------------------------------
    def acquire_slot(self, adapter: LoRAAdapter) -> int | None:
        """Slot holding ``adapter`` for one more running request, loading it if needed.

        Returns None when every slot is held by adapters with running requests (the request
        waits; others go on).
        """
        d = adapter.ref.sha256
        slot = self.slot_of.get(d)
        if slot is not None:
            self.stats.slot_hits += 1
            self.idle_slots.pop(slot, None)
            self.slot_users[slot] += 1
            return slot
        free = next((s for s in range(self.max_loras) if self.slot_digest[s] is None), None)
        if free is None:
            if not self.idle_slots:
                return None
            free, _ = self.idle_slots.popitem(last=False)
            old = self.slot_digest[free]
            assert old is not None and self.slot_users[free] == 0
            self.bank.reset_lora(free)
            del self.slot_of[old]
            self.slot_digest[free] = None
            self.stats.slot_evictions += 1
            if old in self.usage:
                self.usage[old].evictions += 1
        t0 = time.perf_counter()
        self.bank.set_lora(free, adapter.weights)
        self._observe("activation", time.perf_counter() - t0)
        self.slot_digest[free] = d
        self.slot_of[d] = free
        self.slot_users[free] = 1
        self.stats.slot_loads += 1
        return free

    def release_slot(self, slot: int) -> None:
        """A running request left ``slot``; the adapter stays resident until the slot is needed."""
        if self.slot_users[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.slot_users[slot] -= 1
        if self.slot_users[slot] == 0:
            self.idle_slots[slot] = None

    def slot_rows(self, slot: int) -> tuple[int, int]:
        return self.bank.slot_rows(slot)

    # -- reports -------------------------------------------------------------------------------
    def tier_of(self, digest: str) -> str | None:
        """``device``, ``host`` or None (not in memory)."""
        if digest in self.slot_of:
            return "device"
        if digest in self.host:
            return "host"
        return None

    def residency(self) -> list[AdapterResidency]:
        """A snapshot of every adapter loaded since start-up, most recently used first."""
        with self._lock:
            usage = list(self.usage.values())
            refs = dict(self.request_refs)
        slot_of = dict(self.slot_of)
        out = []
        for u in sorted(usage, key=lambda u: -u.last_access):
            d = u.ref.sha256
            out.append(
                AdapterResidency(
                    ref=u.ref,
                    tier=self.tier_of(d) or "absent",
                    rank=u.rank,
                    nbytes=u.nbytes,
                    hits=u.hits,
                    loads=u.loads,
                    evictions=u.evictions,
                    last_access=u.last_access,
                    pinned=False,
                    in_flight=refs.get(d, 0),
                    slot=slot_of.get(d),
                )
            )
        return out

    def resident_bytes(self) -> dict[str, tuple[int, int]]:
        """tier -> (count, bytes) for the in-memory tiers."""
        host = list(self.host.values())
        device = [self.host[d] for d in list(self.slot_of) if d in self.host]
        return {
            "device": (len(device), sum(a.nbytes for a in device)),
            "host": (len(host), sum(a.nbytes for a in host)),
        }

    def is_idle(self) -> bool:
        """True when no slot has running users and no request holds an adapter."""
        return not self.request_refs and all(u == 0 for u in self.slot_users)
