"""The adapter loader: an AdapterSpec becomes a verified in-memory copy (a LoRAAdapter).

Where the bytes come from (keys are content digests, never names):

- a **local directory** that is not in the object store: read directly (it is on local disk
  already: stage ``disk_load``); a copy that does not verify is an error of tier ``local``
  (the registered files changed: retrying will not help);
- the **L2 disk tier** (:class:`~loraplex.cache.disk.DiskTier`): verified copies of object-store
  adapters, content-addressed, surviving restarts (stage ``disk_load``). A bad copy heals
  itself: it is deleted and the adapter fetched again from L3 within the same load, so a
  request never fails because of L2;
- **pushed bytes** (``pushed://<sha256>``, :mod:`loraplex.lora.push`): admitted into host
  memory by :meth:`~loraplex.cache.adapters.TieredAdapterCache.push`; once they leave it, only
  the L2 copy written with ``persist=disk`` can bring them back (else: push them again);
- the **L3 object store** (:class:`~loraplex.cache.store.ObjectStore`, the source of truth):
  ``s3://`` URIs, or paths under a configured local store root; downloaded (stage
  ``remote_download``), verified (``disk_load``) and, with a disk tier, admitted into L2
  (policy-chosen evictions *before* the put). A bad copy here is an error of tier
  ``object_store`` (the store holds other bytes than were registered).

Every copy is read once into memory the process owns, hashed, and only then parsed
(:func:`~loraplex.cache.verify.verified_read`): the spec's digest is checked against exactly
the bytes that become the host copy, whatever the source, and no later change to the files can
reach it. A copy known by its digest never needs the store: while the store is unreachable,
every adapter with a copy in memory or on disk keeps being served. The weights are read from
``adapter_model.bin`` (a pickle) only when the spec allows it (``AdapterSpec.allow_pickle``).

Single flight per digest: concurrent requests for one cold adapter share one load
(:meth:`AdapterLoader.join`); a failed load fails all its waiters with the same error and the
next request retries (no negative caching). A waiter waits a bounded time
(:meth:`AdapterLoader.wait`) and then gets :class:`~loraplex.types.AdapterLoadTimeoutError`;
the load itself goes on for later requests. Flights are guarded by the owner's lock (the tiered
cache's, which also covers its host-memory check, so a late arrival never starts a second load).
Loads run in the caller's thread (the server's worker threads), never on the engine loop.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.cache.controller import TierController
from loraplex.cache.disk import DiskTier, DiskTierError
from loraplex.cache.policy import AdapterInfo
from loraplex.cache.residency import NoRoomError
from loraplex.cache.store import LocalDirStore, ObjectStore
from loraplex.cache.verify import fetch_verified, mismatch_cause, verified_read
from loraplex.checkpoint.modules import BaseModelSpec
from loraplex.lora.adapter import LoRAAdapter, build_adapter
from loraplex.lora.peft.files import CONFIG_NAME, SAFETENSORS_NAME
from loraplex.paths import contained
from loraplex.types import (
    AdapterCapacityError,
    AdapterCopyError,
    AdapterError,
    AdapterIntegrityError,
    AdapterLoadTimeoutError,
    AdapterSpec,
    is_pushed_source,
)

log = logging.getLogger(__name__)

STAGE_RESOLVE = "resolve"
STAGE_REMOTE_DOWNLOAD = "remote_download"
STAGE_DISK_LOAD = "disk_load"
STAGE_H2D = "h2d"
STAGE_ACTIVATION = "activation"
TIER_LOCAL = "local"  # the tier name of errors about a local directory's registered files

__all__ = ["AdapterLoader", "Flight", "Source"]


@dataclass(frozen=True)
class Source:
    """Where an adapter's bytes come from: a local directory or a URI of the object store."""

    kind: str  # "local" | "store" | "pushed" (bytes pushed: host memory, else the disk tier)
    path: Path | None = None
    uri: str | None = None


@dataclass
class Flight:
    """One load in progress; requests for the same digest wait on ``event``."""

    count: bool  # the leader's request is counted (hits, misses)
    event: threading.Event = field(default_factory=threading.Event)
    waiters: int = 0
    counted: int = 0  # waiters that are requests (count=True)
    adapter: LoRAAdapter | None = None
    warm: bool = False
    error: BaseException | None = None

    def result(self) -> tuple[LoRAAdapter, bool]:
        """The leader's copy and warmth, or its error raised (once ``event`` is set)."""
        assert self.event.is_set()
        if self.error is not None:
            raise self.error
        assert self.adapter is not None
        return self.adapter, self.warm


class AdapterLoader:
    """Reads, verifies and converts adapters for the tiered cache; see the module docstring.

    ``tiers`` keeps the disk tier's accounting (the loader holds a copy while reading it and
    admits downloads); ``lock`` is the owner's condition, held around every call into ``tiers``
    and around :meth:`join` / :meth:`finish` / :meth:`fail`, and notified whenever a disk copy is
    released. ``room_wait_s`` bounds how long a download waits for room on disk while other
    copies there are being read or written. ``observe(stage, seconds)`` gets every timed stage.
    """

    def __init__(
        self,
        model: BaseModelSpec,
        *,
        tiers: TierController,
        lock: threading.Condition,
        max_lora_rank: int,
        dtype: torch.dtype,
        observe: Callable[[str, float], None],
        disk: DiskTier | None = None,
        store: ObjectStore | None = None,
        room_wait_s: float = 10.0,
    ) -> None:
        self.model = model
        self.room_wait_s = float(room_wait_s)
        self.tiers = tiers
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.disk = disk
        self.store = store
        self._lock = lock
        self._observe = observe
        self._flights: dict[str, Flight] = {}

    # -- single flight (callers hold the owner's lock) ----------------------------------------
    def join(self, digest: str, *, count: bool) -> tuple[Flight, bool]:
        """The load of ``digest`` in progress, joined, or a new one: ``(flight, leader)``."""
        flight = self._flights.get(digest)
        if flight is None:
            flight = self._flights[digest] = Flight(count)
            return flight, True
        flight.waiters += 1
        flight.counted += int(count)
        return flight, False

    def wait(
        self, digest: str, flight: Flight, *, count: bool, timeout: float, name: str
    ) -> tuple[LoRAAdapter, bool]:
        """Wait (at most ``timeout`` seconds) for a flight joined with :meth:`join` as a waiter;
        the leader's copy (its hold already taken for this waiter) or its error.

        On time-out the waiter leaves the flight (the leader takes no hold for it) and gets
        :class:`AdapterLoadTimeoutError`; the load goes on. Call without the owner's lock.
        """
        if not flight.event.wait(timeout):
            with self._lock:
                if not flight.event.is_set():  # finish/fail run under this lock: no race
                    flight.waiters -= 1
                    flight.counted -= int(count)
                    self.tiers.stats.join_timeouts += 1
                    raise AdapterLoadTimeoutError(
                        f"adapter {name!r}: its load (started by another request) did not "
                        f"finish within {timeout:g}s; it goes on, retry later",
                        tier=self.tiers.host_name,
                    )
        return flight.result()

    def finish(self, digest: str, flight: Flight, adapter: LoRAAdapter, warm: bool) -> None:
        """The leader's load is in host memory (its waiters' holds taken): wake them."""
        flight.adapter, flight.warm = adapter, warm
        self._close(digest, flight)

    def fail(self, digest: str, flight: Flight, error: BaseException) -> None:
        """The leader's load failed: every waiter gets ``error``; the next request retries."""
        flight.error = error
        self._close(digest, flight)

    def _close(self, digest: str, flight: Flight) -> None:
        if self._flights.get(digest) is flight:
            del self._flights[digest]
        flight.event.set()

    def waiters(self, digest: str) -> int:
        """Requests waiting for the load of ``digest`` in progress, besides its leader."""
        with self._lock:
            f = self._flights.get(digest)
            return f.waiters if f is not None else 0

    def loads_in_progress(self) -> int:
        with self._lock:
            return len(self._flights)

    # -- sources -------------------------------------------------------------------------------
    def source(self, spec: AdapterSpec) -> Source:
        """Local directory or object-store URI of ``spec`` (store URIs must lie in the store)."""
        raw, name = spec.source_uri, spec.ref.name
        if is_pushed_source(raw):
            return Source("pushed")
        scheme = raw.split("://", 1)[0].lower() if "://" in raw else ""
        if scheme and scheme != "file":
            if self.store is None:
                raise AdapterError(
                    f"adapter {name!r}: {raw!r} is an object-store URI but no object store "
                    "is configured (--adapter-store-url)"
                )
            return Source("store", uri=self.store.uri(raw))
        if isinstance(self.store, LocalDirStore):
            local = Path(raw[len("file://") :] if scheme else raw).expanduser().resolve()
            if contained(local, [self.store.root]):
                return Source("store", uri=self.store.uri(str(local)))
        if scheme:
            raise AdapterError(f"adapter {name!r}: {raw!r} is not under the object store")
        path = Path(raw).expanduser()
        if not path.is_dir():
            raise AdapterError(f"adapter {name!r}: path {raw!r} is not a directory")
        return Source("local", path=path)

    def is_local(self, spec: AdapterSpec) -> bool:
        """True when ``spec`` is read from a local directory (not through the object store)."""
        try:
            return self.source(spec).kind == "local"
        except AdapterError:
            return False

    # -- loading -------------------------------------------------------------------------------
    def load(self, spec: AdapterSpec, *, count: bool = True) -> tuple[LoRAAdapter, float]:
        """A verified, converted copy of ``spec`` and the seconds it took (read + convert).

        Raises AdapterError subclasses: StoreError, AdapterCopyError, DiskTierError,
        :class:`AdapterCapacityError` (no room on disk for a download).
        """
        t0 = time.perf_counter()
        src = self.source(spec)
        if src.kind == "local":
            assert src.path is not None
            config, tensors = self._read_local(spec, src.path)
        elif src.kind == "pushed":
            config, tensors = self._read_pushed(spec, count)
        else:
            assert src.uri is not None
            config, tensors = self._read_store(spec, src.uri, count)
        return self.build(spec, config, tensors), time.perf_counter() - t0

    def build(
        self, spec: AdapterSpec, config: dict, tensors: dict[str, torch.Tensor]
    ) -> LoRAAdapter:
        """Validate and convert ``(config, tensors)``, parsed from owned bytes whose digest is
        ``spec.sha256`` (so no re-hash), for the base model (AdapterError naming the problem)."""
        return build_adapter(
            config,
            tensors,
            self.model,
            path=spec.source_uri,
            name=spec.ref.name,
            revision=spec.ref.revision,
            max_lora_rank=self.max_lora_rank,
            dtype=self.dtype,
            digest=spec.sha256,
        )

    def _read_local(self, spec: AdapterSpec, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
        """The verified copy of a local directory: the registered files, read now. A copy that
        does not verify is an :class:`AdapterCopyError` of tier ``local``."""
        t0 = time.perf_counter()
        name, want = spec.ref.name, spec.sha256
        read = verified_read(path, None, name=name, tier=TIER_LOCAL, allow_pickle=spec.allow_pickle)
        if read.digest != want:
            why = mismatch_cause(read, want, "changed since registration?")
            raise AdapterIntegrityError(
                f"adapter {name!r}: the files in {path} have sha256 {read.digest[:16]}..., "
                f"not the registered {want[:16]}... ({why})",
                name=name,
                tier=TIER_LOCAL,
                path=str(path),
                expected=want,
                actual=read.digest,
            )
        self._observe(STAGE_DISK_LOAD, time.perf_counter() - t0)
        return read.config, read.tensors

    def _read_pushed(self, spec: AdapterSpec, count: bool) -> tuple[dict, dict[str, torch.Tensor]]:
        """The verified L2 copy of pushed bytes (persisted with ``persist=disk``): pushed bytes
        have no other source once they left host memory."""
        got = self._read_disk(spec, count) if self.disk is not None else None
        if got is None:
            where = "host memory or the disk tier" if self.disk is not None else "host memory"
            raise AdapterError(
                f"adapter {spec.ref.name!r} revision {spec.ref.revision}: its pushed bytes are "
                f"no longer in {where}; push it again"
            )
        return got

    def put_pushed(self, spec: AdapterSpec, config_bytes: bytes, weights: bytes) -> None:
        """Write pushed bytes (already verified to be ``spec.sha256``) into the disk tier as
        ``adapter_config.json`` + ``adapter_model.safetensors``, evicting (policy-chosen) first;
        a no-op when it holds them already."""
        assert self.disk is not None
        with self._lock:
            if self.tiers.disk is not None and spec.sha256 in self.tiers.disk:
                return
        with self.disk.staging() as tmp:
            (tmp / CONFIG_NAME).write_bytes(config_bytes)
            (tmp / SAFETENSORS_NAME).write_bytes(weights)
            self._put_disk(spec, tmp, 0.0)

    def _read_store(
        self, spec: AdapterSpec, uri: str, count: bool
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        """The verified L2 copy if the disk tier holds one, else a verified download (also
        when the L2 copy was bad: it is deleted and fetched again here)."""
        if self.disk is not None:
            got = self._read_disk(spec, count)
            if got is not None:
                return got
        return self._download(spec, uri)

    def _read_disk(
        self, spec: AdapterSpec, count: bool
    ) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """The verified L2 copy of ``spec``, or None if the disk tier does not hold a usable one
        (absent, vanished, or bad: a bad copy is deleted and counted, never raised)."""
        assert self.disk is not None
        digest, tier = spec.sha256, self.tiers.disk_name
        with self._lock:
            if not self.tiers.hold_disk_copy(digest, count=count):  # held: not evicted
                return None
        try:
            res = self.disk.load_verified(digest, spec.ref.name, allow_pickle=spec.allow_pickle)
        except (AdapterCopyError, DiskTierError) as e:
            with self._lock:
                self.tiers.release(tier, digest)
                self.tiers.remove(tier, digest)  # another reader holds it: it removes it too
                if isinstance(e, AdapterCopyError):
                    self.tiers.stats.bad_copies_replaced += 1
                self._lock.notify_all()
            if isinstance(e, AdapterCopyError):  # deleted by load_verified: fetch it again
                log.warning("%s; fetching it again from the object store", e)
            return None
        with self._lock:
            self.tiers.release(tier, digest)
            self._lock.notify_all()
        self._observe(STAGE_DISK_LOAD, res.seconds)
        return res.config, res.tensors

    def _download(self, spec: AdapterSpec, uri: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """Fetch from L3, verify, and (with a disk tier) admit the copy into L2."""
        assert self.store is not None
        name, digest = spec.ref.name, spec.sha256
        pickle = spec.allow_pickle
        if self.disk is None:
            with tempfile.TemporaryDirectory(prefix="loraplex-fetch-") as tmp:
                dest = Path(tmp) / "a"
                vf = fetch_verified(self.store, uri, dest, digest, name=name, allow_pickle=pickle)
        else:
            with self.disk.staging() as tmp:
                vf = fetch_verified(self.store, uri, tmp, digest, name=name, allow_pickle=pickle)
                self._put_disk(spec, tmp, vf.fetch.seconds)
        with self._lock:
            self.tiers.stats.remote_loads += 1
        self._observe(STAGE_REMOTE_DOWNLOAD, vf.fetch.seconds)
        self._observe(STAGE_DISK_LOAD, vf.verify_seconds)
        return vf.config, vf.tensors

    def _put_disk(self, spec: AdapterSpec, staged: Path, fetch_s: float) -> None:
        """Admit the download into L2: evict (policy-chosen) entries first, then put."""
        assert self.disk is not None
        digest, tier = spec.sha256, self.tiers.disk_name
        info = AdapterInfo(digest, DiskTier.nbytes_of(staged), tenant=spec.tenant)
        with self._lock:
            deadline = time.monotonic() + self.room_wait_s
            waited = False
            while True:
                if self.tiers.disk is not None and digest in self.tiers.disk:
                    return  # another download put it while we waited
                try:
                    evicted = self.tiers.admit_disk(info)  # held while we put it
                    break
                except NoRoomError as e:
                    # copies being read or written are kept; they are released in moments
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise AdapterCapacityError(
                            f"adapter {spec.ref.name!r}: no room in the disk tier "
                            f"{self.disk.root} after waiting {self.room_wait_s:g}s: "
                            f"{e.reason}; retry later",
                            tier=tier,
                        ) from e
                    if not waited:
                        self.tiers.stats.capacity_waits += 1
                        waited = True
                    self._lock.wait(min(remaining, 0.05))
        try:
            for v in evicted:
                self.disk.remove(v)
            self.disk.put(digest, staged)
        except BaseException:
            with self._lock:
                self.tiers.release(tier, digest)
                self.tiers.remove(tier, digest)
                self._lock.notify_all()
            raise
        with self._lock:
            self.tiers.release(tier, digest)
            self.tiers.record_load(tier, digest, fetch_s)
            self._lock.notify_all()

    def adopt_disk_entries(self) -> None:
        """Index the disk tier's entries from earlier runs (oldest first); drop what won't fit."""
        assert self.disk is not None
        access = self.disk.access_times()
        entries = sorted(self.disk.entries().items(), key=lambda kv: access.get(kv[0], 0))
        for d, nbytes in entries:
            with self._lock:
                try:
                    evicted = self.tiers.admit_disk(AdapterInfo(d, nbytes), hold=False)
                except NoRoomError:
                    evicted = [d]
            for v in evicted:
                self.disk.remove(v)
