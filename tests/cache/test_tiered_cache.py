"""The tiered adapter cache: single-flight loads, hard constraints under pressure, budgets, L2/L3
tiers (local-dir store and S3 via moto_server), faults, pins/warm policies, and an engine run
where a slow cold load does not delay warm adapters (no head-of-line blocking)."""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex.cache.adapters import TieredAdapterCache
from loraplex.cache.disk import DiskTier
from loraplex.cache.policy import POLICIES
from loraplex.cache.s3 import S3Store
from loraplex.cache.store import LocalDirStore
from loraplex.config import ADAPTER_EVICTION_POLICIES, EngineConfig
from loraplex.engine.adapter_catalog import LocalAdapterCatalog
from loraplex.lora.adapter import LoRAAdapter
from loraplex.lora.digest import digest_safetensors_dir
from loraplex.lora.slots import LoRASlotBank
from loraplex.requests import GenerationRequest, LoRARequest, SamplingParams
from loraplex.testing.sync import EVENT_TIMEOUT_S, wait_until
from loraplex.types import (
    AdapterCapacityError,
    AdapterError,
    AdapterIntegrityError,
    AdapterInUseError,
    AdapterRef,
    AdapterSpec,
    StoreUnavailableError,
)
from tests.s3fixture import TINY_SPEC, fake_aws_env, free_port, run_moto_server, write_adapter

N_ADAPTERS = 8


def adapter_bytes(path: Path) -> int:
    """Host bytes of one converted tiny adapter."""
    probe = make_cache()
    a = resolve(probe, spec("probe", path))
    probe.release(a)
    return a.nbytes


def make_cache(**kw: object) -> TieredAdapterCache:
    """A cache over a CPU slot bank for the tiny 2-layer spec of ``s3fixture``."""
    max_loras = int(kw.pop("max_loras", 2))  # type: ignore[call-overload]
    shapes = {
        (layer, proj): dims
        for layer in range(TINY_SPEC.num_layers)
        for proj, dims in TINY_SPEC.module_shapes.items()
    }
    bank = LoRASlotBank(shapes, max_loras, 8, torch.float32, "cpu")
    kw.setdefault("max_cpu_loras", 4)
    kw.setdefault("load_wait_timeout_s", 2.0)
    return TieredAdapterCache(
        bank, TINY_SPEC, max_loras=max_loras, max_lora_rank=8, dtype=torch.float32, **kw
    )


class StageCounter:
    """A load observer counting (and timing) stages."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, stage: str, seconds: float) -> None:
        with self.lock:
            self.counts[stage] += 1


class CountingStore(LocalDirStore):
    """A local-dir L3 that counts fetches and can be held (``hold``: each fetch waits until
    ``release`` is set) or made to fail."""

    def __init__(self, root: Path, *, hold: bool = False) -> None:
        super().__init__(root)
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.fetching = threading.Event()  # set once a fetch has started
        self.fetches = 0
        self.fail_next: BaseException | None = None
        self.started: list[float] = []
        self.ended: list[float] = []
        self.fingerprints = 0
        self.down = False

    def fingerprint(self, uri):  # type: ignore[no-untyped-def]
        self.fingerprints += 1
        if self.down:
            raise StoreUnavailableError("store down for the test")
        return super().fingerprint(uri)

    def fetch(self, uri, dest):  # type: ignore[no-untyped-def]
        if self.down:
            raise StoreUnavailableError("store down for the test")
        self.fetches += 1
        self.started.append(time.monotonic())
        self.fetching.set()
        try:
            assert self.release.wait(EVENT_TIMEOUT_S), "the test never released the fetch"
            if self.fail_next is not None:
                err, self.fail_next = self.fail_next, None
                raise err
            return super().fetch(uri, dest)
        finally:
            self.ended.append(time.monotonic())


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, str]]:
    root = tmp_path_factory.mktemp("tiered-src")
    return [write_adapter(root / f"a{i}", seed=100 + i) for i in range(N_ADAPTERS)]


@pytest.fixture
def store_root(tmp_path: Path, tiny_adapters: list[tuple[Path, str]]) -> Path:
    root = tmp_path / "store"
    for p, _ in tiny_adapters:
        shutil.copytree(p, root / p.name)
    return root


def spec(
    name: str,
    source: str | Path,
    digest: str | None = None,
    *,
    tenant: str | None = None,
    warm: str = "on-demand",
) -> AdapterSpec:
    """What a catalog hands the cache: the digest (given, as a registry's, or computed from the
    local directory's files), the source and the tenant."""
    if digest is None:
        digest = digest_safetensors_dir(source)
    return AdapterSpec(AdapterRef(name, digest[:12], digest), str(source), tenant, 0, warm)


def resolve(cache: TieredAdapterCache, s: AdapterSpec) -> LoRAAdapter:
    """The host copy of ``s`` with one request reference."""
    return cache.acquire(s)[0]


class Batch:
    """A step's slots as the engine hands them to ``activate``."""

    def __init__(self, slots: dict[int, LoRAAdapter]) -> None:
        self.slots = slots
        self.slot_rows: dict[int, tuple[int, int]] = {}

    def slot_adapters(self) -> dict[int, LoRAAdapter]:
        return self.slots


def hammer(fn, n: int = 100, *, until=None) -> list:  # type: ignore[no-untyped-def]
    """Run ``fn()`` in ``n`` threads released at once; results or exceptions, in order.

    ``until``: called (in this thread) once the threads run, e.g. to wait until all of them
    share one held load and then release it."""
    barrier = threading.Barrier(n)
    out: list = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = fn()
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    if until is not None:
        until()
    for t in threads:
        t.join()
    return out


def share_one_load(cache: TieredAdapterCache, store: CountingStore, digest: str, n: int):  # type: ignore[no-untyped-def]
    """An ``until`` for :func:`hammer`: wait until the held fetch has ``n - 1`` waiters, then
    release it (every caller shares the one load, whatever the machine's speed)."""

    def until() -> None:
        wait_until(
            lambda: store.fetching.is_set() and cache.loader.waiters(digest) == n - 1,
            what=f"{n} callers sharing one load",
        )
        store.release.set()

    return until


# ------------------------------------------------------------------------- single flight


def test_100_concurrent_resolves_of_a_cold_local_adapter_load_once(
    tiny_adapters: list[tuple[Path, str]],
) -> None:
    cache = make_cache()
    stages = StageCounter()
    cache.load_observers.append(stages)
    path, digest = tiny_adapters[0]
    results = hammer(lambda: cache.acquire(spec("a0", path, digest)))
    assert not [r for r in results if isinstance(r, BaseException)]
    assert len({id(a) for a, _ in results}) == 1
    assert stages.counts["disk_load"] == 1
    host = cache.tier_counters()["host"]
    assert host.inserts == 1  # one load; late arrivals hit the fresh copy
    assert cache.stats.cold_requests == host.misses and host.misses + host.hits == 100
    assert sum(not warm for _, warm in results) == host.misses  # cold: shared the one load
    assert cache.request_refs[digest] == 100 and cache.tier_of(digest) == "host"
    for a, _ in results:
        cache.release(a)
    assert cache.is_idle()
    cache.check_invariants()


def test_100_concurrent_resolves_load_once_from_each_tier(
    tmp_path: Path, store_root: Path, tiny_adapters: list[tuple[Path, str]]
) -> None:
    store = CountingStore(store_root, hold=True)
    disk = DiskTier(tmp_path / "l2", 1 << 20)
    cache = make_cache(store=store, disk=disk)
    stages = StageCounter()
    cache.load_observers.append(stages)
    digest = tiny_adapters[1][1]
    r = spec("a1", store_root / "a1", digest)
    results = hammer(lambda: resolve(cache, r), until=share_one_load(cache, store, digest, 100))
    assert all(not isinstance(a, BaseException) for a in results)
    assert store.fetches == 1 and stages.counts["remote_download"] == 1
    assert store.fingerprints == 0  # keyed by digest: the cache never asks if the store changed
    assert digest in disk.entries() and cache.resident_bytes()["disk"][0] == 1
    for a in results:
        cache.release(a)
    cache.evict(digest, tiers=["host"])  # an L1 miss whose digest is on L2
    assert cache.tier_of(digest) == "disk"
    stages.counts.clear()
    results = hammer(lambda: resolve(cache, r))
    assert all(not isinstance(a, BaseException) for a in results)
    assert store.fetches == 1  # L3 untouched
    assert stages.counts["disk_load"] == 1 and stages.counts["remote_download"] == 0
    assert cache.tier_counters()["disk"].hits == 1  # one read of the L2 copy
    for a in results:
        cache.release(a)
    cache.check_invariants()


def test_a_failed_load_fails_all_waiters_and_the_next_request_retries(
    tmp_path: Path, store_root: Path
) -> None:
    store = CountingStore(store_root, hold=True)
    store.fail_next = StoreUnavailableError("store down for the test")
    cache = make_cache(store=store, disk=DiskTier(tmp_path / "l2", 1 << 20))
    r = spec("a2", store_root / "a2")
    results = hammer(
        lambda: resolve(cache, r), n=20, until=share_one_load(cache, store, r.sha256, 20)
    )
    assert all(isinstance(e, StoreUnavailableError) for e in results)
    assert len({id(e) for e in results}) == 1 and store.fetches == 1
    assert cache.stats.load_failures == 1 and cache.is_idle()
    a = resolve(cache, r)  # no negative caching
    assert store.fetches == 2
    cache.release(a)
    cache.check_invariants()


# --------------------------------------------------------------------- hard constraints


def test_count_budget_is_a_hard_cap_on_host_copies(
    tiny_adapters: list[tuple[Path, str]],
) -> None:
    """vLLM's max_cpu_loras holds like the byte budget: with every copy in use, loading one more
    adapter waits (bounded) and then gets AdapterCapacityError; a release lets it in. The
    offline API widens the count for one call (``host_copies_at_least``), then trims back."""
    cache = make_cache(max_loras=1, max_cpu_loras=2, load_wait_timeout_s=0.3)
    held = [resolve(cache, spec(f"a{i}", p)) for i, (p, _) in enumerate(tiny_adapters[:2])]
    with pytest.raises(AdapterCapacityError, match=r"'a2'.*host memory.*in use") as info:
        resolve(cache, spec("a2", tiny_adapters[2][0]))
    assert info.value.tier == "host" and len(cache.host) == 2
    cache.release(held[0])
    a2 = resolve(cache, spec("a2", tiny_adapters[2][0]))
    assert len(cache.host) == 2 and cache.tier_of(tiny_adapters[0][1]) is None
    with cache.host_copies_at_least(4):
        more = [resolve(cache, spec(f"a{i}", tiny_adapters[i][0])) for i in (3, 4)]
        assert len(cache.host) == 4
    assert len(cache.host) == 4  # all of them are still in use
    for a in [held[1], a2, *more]:
        cache.release(a)
    assert len(cache.host) == 2 and cache.tier_counters()["host"].evictions == 3
    cache.check_invariants()


def test_an_adapter_in_use_survives_any_pressure(tiny_adapters: list[tuple[Path, str]]) -> None:
    cache = make_cache(max_loras=1, max_cpu_loras=2, load_wait_timeout_s=0.2)
    (p0, d0), rest = tiny_adapters[0], tiny_adapters[1:]
    held = resolve(cache, spec("a0", p0))
    slot = cache.reserve_slot(held)
    assert slot is not None
    for _ in range(3):
        for i, (p, _) in enumerate(rest):
            a = resolve(cache, spec(f"a{i + 1}", p))
            assert cache.reserve_slot(a) is None  # the only slot is in use
            cache.release(a)
            assert cache.tier_of(d0) == "device" and cache.slot_of[d0] == slot
            assert cache.resident_bytes()["host"][0] <= 2
    assert cache.stats.slot_waits == 3 * len(rest)
    cache.release_slot(slot)
    cache.release(held)
    cache.check_invariants()


def test_resolve_waits_for_room_then_raises_a_clear_capacity_error(
    tiny_adapters: list[tuple[Path, str]],
) -> None:
    one = adapter_bytes(tiny_adapters[0][0])
    cache = make_cache(max_loras=1, max_cpu_lora_bytes=one + one // 2, load_wait_timeout_s=0.3)
    a0 = resolve(cache, spec("a0", tiny_adapters[0][0]))
    t0 = time.monotonic()
    with pytest.raises(AdapterCapacityError, match=r"'a1'.*host memory.*in use") as info:
        resolve(cache, spec("a1", tiny_adapters[1][0]))
    assert time.monotonic() - t0 >= 0.3 and info.value.tier == "host"
    assert isinstance(info.value, AdapterError)
    # woken by a release: the waiting load goes on
    cache.load_wait_timeout_s = 5.0
    threading.Timer(0.2, cache.release, args=(a0,)).start()
    a1 = resolve(cache, spec("a1", tiny_adapters[1][0]))
    assert cache.tier_of(tiny_adapters[0][1]) is None
    assert cache.tier_counters()["host"].evictions == 1 and cache.stats.capacity_waits == 2
    cache.release(a1)
    cache.check_invariants()


def test_idle_slots_give_their_host_copies_room(tiny_adapters: list[tuple[Path, str]]) -> None:
    one = adapter_bytes(tiny_adapters[0][0])
    cache = make_cache(max_loras=2, max_cpu_lora_bytes=2 * one, load_wait_timeout_s=0.2)
    for i in range(2):
        a = resolve(cache, spec(f"a{i}", tiny_adapters[i][0]))
        slot = cache.reserve_slot(a)
        assert slot is not None
        cache.activate(Batch({slot: a}))
        cache.release_slot(slot)
        cache.release(a)
    assert cache.bank.occupied_slots == (0, 1)
    a2 = resolve(cache, spec("a2", tiny_adapters[2][0]))  # both L1 entries held only by idle slots
    assert cache.tier_of(a2.ref.sha256) == "host"
    slot = cache.reserve_slot(a2)  # reuses a retired slot
    assert slot is not None
    batch = Batch({slot: a2})
    cache.activate(batch)  # its stale rows are reset, a2's copied in
    rank = max(w.rank for w in a2.weights.values())
    assert batch.slot_rows[slot] == cache.bank.slot_rows(slot)
    assert batch.slot_rows[slot][1] - batch.slot_rows[slot][0] == rank
    cache.release_slot(slot)
    cache.release(a2)
    cache.check_invariants()


def test_byte_budget_is_never_exceeded(tiny_adapters: list[tuple[Path, str]]) -> None:
    one = adapter_bytes(tiny_adapters[0][0])
    budget = int(2.5 * one)
    cache = make_cache(max_cpu_loras=8, max_cpu_lora_bytes=budget, max_loras=1)
    for _ in range(2):
        for i, (p, _) in enumerate(tiny_adapters):
            a = resolve(cache, spec(f"a{i}", p))
            assert cache.resident_bytes()["host"][1] <= budget
            cache.release(a)
    assert cache.resident_bytes()["host"][0] == 2
    host = cache.tier_counters()["host"]
    assert host.inserts - host.evictions == 2 and host.evictions >= N_ADAPTERS
    with pytest.raises(AdapterCapacityError, match="larger than the tier"):
        resolve(make_cache(max_cpu_lora_bytes=one // 2), spec("a0", tiny_adapters[0][0]))


@pytest.mark.parametrize("policy", ["hybrid", "lru"])
def test_storm_of_loads_and_evictions_leaks_nothing(
    tmp_path: Path, store_root: Path, tiny_adapters: list[tuple[Path, str]], policy: str
) -> None:
    disk_budget = 3 * DiskTier.nbytes_of(tiny_adapters[0][0])
    disk = DiskTier(tmp_path / "l2", disk_budget)
    host_budget = 3 * adapter_bytes(tiny_adapters[0][0])
    cache = make_cache(
        max_loras=2,
        max_cpu_loras=3,
        max_cpu_lora_bytes=host_budget,
        policy=policy,
        store=CountingStore(store_root),
        disk=disk,
        load_wait_timeout_s=0.5,
    )
    sources = [store_root / f"a{i}" for i in range(4)] + [p for p, _ in tiny_adapters[4:]]
    specs = [spec(f"a{i}", src, tiny_adapters[i][1]) for i, src in enumerate(sources)]
    rounds = 150  # a fixed amount of work per thread, whatever the machine's speed
    done = threading.Event()
    errors: list[BaseException] = []
    over: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(rounds):
            i = rng.randrange(len(sources))
            try:
                a = resolve(cache, specs[i])
            except AdapterCapacityError:
                continue
            except BaseException as e:
                errors.append(e)
                return
            time.sleep(rng.random() * 0.005)
            cache.release(a)

    def engine() -> None:  # the only thread touching slots
        rng = random.Random(0)
        for _ in range(rounds):
            i = rng.randrange(len(sources))
            try:
                a = resolve(cache, specs[i])
            except AdapterCapacityError:
                continue
            slot = cache.reserve_slot(a)
            if slot is not None:
                cache.activate(Batch({slot: a}))
                cache.release_slot(slot)
            cache.release(a)

    def monitor() -> None:
        while not done.is_set():
            res = cache.resident_bytes()
            if res["host"][1] > host_budget or res["device"][0] > 2 or res["disk"][1] > disk_budget:
                over.append(repr(res))
            time.sleep(0.001)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    threads += [threading.Thread(target=engine)]
    watch = threading.Thread(target=monitor)
    for t in [*threads, watch]:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watch.join()
    assert not errors and not over
    assert cache.is_idle() and not cache.request_refs
    assert len(cache.host) <= 3  # the cached-copy count once every request is gone
    cache.check_invariants()
    counters = cache.tier_counters()
    assert counters["host"].evictions > 0 and counters["disk"].evictions > 0
    assert 0 <= counters["host"].thrash_ratio <= 1
    assert disk.used_bytes <= disk_budget


# ------------------------------------------------------------------------------ faults


def test_store_down_keeps_serving_known_copies(tmp_path: Path, store_root: Path) -> None:
    store = CountingStore(store_root)
    cache = make_cache(store=store, disk=DiskTier(tmp_path / "l2", 1 << 20))
    known, cold = spec("a0", store_root / "a0"), spec("a1", store_root / "a1")
    first = resolve(cache, known)
    cache.release(first)
    store.down = True
    assert resolve(cache, known) is first  # L1 copy, the store never asked
    cache.release(first)
    cache.evict(known.sha256, tiers=["host"])
    cache.release(resolve(cache, known))  # from L2
    with pytest.raises(StoreUnavailableError):
        resolve(cache, cold)
    assert store.fetches == 1 and store.fingerprints == 0
    cache.check_invariants()


def test_truncated_disk_copy_is_deleted_and_refetched_within_the_request(
    tmp_path: Path, store_root: Path, tiny_adapters: list[tuple[Path, str]]
) -> None:
    """A bad L2 copy never reaches the request: it is deleted and the adapter fetched again from
    the object store in the same load (one status for one cause: only a bad L3 copy fails)."""
    store = CountingStore(store_root)
    disk = DiskTier(tmp_path / "l2", 1 << 20)
    cache = make_cache(store=store, disk=disk)
    digest = tiny_adapters[3][1]
    r = spec("a3", store_root / "a3", digest)
    first = resolve(cache, r)
    want = {k: (w.a.clone(), w.b.clone()) for k, w in first.weights.items()}
    cache.release(first)
    other = resolve(cache, spec("a0", tiny_adapters[0][0]))
    cache.evict(digest, tiers=["host"])
    weights = disk.root / digest / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    again = resolve(cache, r)  # the same request downloads it again
    assert store.fetches == 2 and digest in disk.entries()
    assert cache.stats.bad_copies_replaced == 1 and cache.stats.load_failures == 0
    for k, (a, b) in want.items():
        assert torch.equal(again.weights[k].a, a) and torch.equal(again.weights[k].b, b)
    assert cache.tier_of(other.ref.sha256) == "host"  # others keep being served
    cache.release(again)
    cache.release(other)
    cache.check_invariants()


def test_checksum_mismatch_names_adapter_and_tier(
    tmp_path: Path, store_root: Path, tiny_adapters: list[tuple[Path, str]]
) -> None:
    disk = DiskTier(tmp_path / "l2", 1 << 20)
    cache = make_cache(store=CountingStore(store_root), disk=disk)
    wrong = tiny_adapters[5][1]  # the registry says a5's digest, the store holds a4
    with pytest.raises(AdapterIntegrityError, match=r"'a4'.*object_store.*checksum mismatch"):
        resolve(cache, spec("a4", store_root / "a4", wrong))
    assert not disk.entries() and cache.is_idle()
    # a disk copy that was tampered with (same size, other bytes) is replaced from the store
    digest = tiny_adapters[4][1]
    cache.release(resolve(cache, spec("a4", store_root / "a4")))
    cache.evict(digest, tiers=["host"])
    entry = disk.root / digest
    cfg = entry / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"r": 4', '"r": 5'))
    cache.release(resolve(cache, spec("a4", store_root / "a4", digest)))
    assert digest in disk.entries() and '"r": 4' in cfg.read_text()
    assert cache.stats.bad_copies_replaced == 1
    # a bad object in the store itself (the source of truth) is the request's error
    cache.evict(digest, tiers=["host", "disk"])
    st = store_root / "a4" / "adapter_model.safetensors"
    data = bytearray(st.read_bytes())
    data[-4:] = b"\x00\x00\x80\x7f"  # the last element becomes +inf: other bytes, same size
    st.write_bytes(bytes(data))
    with pytest.raises(AdapterIntegrityError, match=r"'a4'.*object_store.*deleted") as info:
        resolve(cache, spec("a4", store_root / "a4", digest))
    assert info.value.tier == "object_store" and digest not in disk.entries()
    cache.release(resolve(cache, spec("a5", tiny_adapters[5][0])))
    cache.check_invariants()


def test_disk_budget_full_is_a_clear_error_and_others_are_served(
    tmp_path: Path, store_root: Path, tiny_adapters: list[tuple[Path, str]]
) -> None:
    size = DiskTier.nbytes_of(tiny_adapters[0][0])
    small = make_cache(store=CountingStore(store_root), disk=DiskTier(tmp_path / "s", size // 2))
    with pytest.raises(AdapterCapacityError, match=r"'a0'.*disk tier.*larger than the tier"):
        resolve(small, spec("a0", store_root / "a0"))
    small.release(resolve(small, spec("a1", tiny_adapters[1][0])))  # local: no L2 needed
    disk = DiskTier(tmp_path / "l2", size + size // 2)
    cache = make_cache(store=CountingStore(store_root), disk=disk, load_wait_timeout_s=0.1)
    cache.release(resolve(cache, spec("a0", store_root / "a0")))
    d0 = tiny_adapters[0][1]
    cache.pin(d0)
    with pytest.raises(AdapterCapacityError, match=r"'a2'.*disk tier.*pinned"):
        resolve(cache, spec("a2", store_root / "a2"))
    cache.release(resolve(cache, spec("a3", tiny_adapters[3][0])))
    cache.unpin(d0)
    cache.release(resolve(cache, spec("a2", store_root / "a2")))
    assert set(disk.entries()) == {tiny_adapters[2][1]}
    assert cache.tier_counters()["disk"].evictions == 1
    cache.check_invariants()


def test_a_download_waits_while_the_disk_copy_in_its_way_is_being_read(
    tmp_path: Path, store_root: Path, tiny_adapters: list[tuple[Path, str]]
) -> None:
    """Room held only by a copy being read is a short wait, not a 503 (the read ends soon)."""
    size = DiskTier.nbytes_of(tiny_adapters[0][0])
    disk = DiskTier(tmp_path / "l2", size + size // 2)
    cache = make_cache(store=CountingStore(store_root), disk=disk, load_wait_timeout_s=60.0)
    cache.release(resolve(cache, spec("a0", store_root / "a0")))
    d0, d2 = tiny_adapters[0][1], tiny_adapters[2][1]
    with cache._cond:  # a reader of a0's disk copy, as the loader holds it while reading
        assert cache.tiers.hold_disk_copy(d0, count=False)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(resolve(cache, spec("a2", store_root / "a2"))))
    t.start()
    wait_until(lambda: cache.stats.capacity_waits == 1, what="the download to wait for room")
    assert t.is_alive() and set(disk.entries()) == {d0}
    with cache._cond:
        cache.tiers.release("disk", d0)
        cache._cond.notify_all()
    t.join(EVENT_TIMEOUT_S)
    assert not t.is_alive() and isinstance(got[0], LoRAAdapter)
    assert set(disk.entries()) == {d2} and cache.tier_counters()["disk"].evictions == 1
    cache.release(got[0])
    cache.check_invariants()


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("moto-tiered")
    with fake_aws_env(tmp), run_moto_server(tmp) as url:
        yield url


def test_s3_single_flight_and_endpoint_down(
    s3_endpoint: str, tmp_path: Path, tiny_adapters: list[tuple[Path, str]]
) -> None:
    import boto3

    session = boto3.session.Session()
    bucket = f"lp-{uuid.uuid4().hex[:12]}"
    s3 = S3Store(bucket, "adapters", endpoint_url=s3_endpoint, session=session)
    s3._client.create_bucket(Bucket=bucket)
    s3.put_dir(tiny_adapters[6][0], "a6")
    fetches = Counter[str]()
    real_fetch = s3.fetch

    def counted(uri, dest):  # type: ignore[no-untyped-def]
        fetches[uri] += 1
        return real_fetch(uri, dest)

    s3.fetch = counted  # type: ignore[method-assign]
    cache = make_cache(store=s3, disk=DiskTier(tmp_path / "l2", 1 << 20))
    uri = f"s3://{bucket}/adapters/a6"
    d6 = tiny_adapters[6][1]
    results = hammer(lambda: resolve(cache, spec("a6", uri, d6)))
    assert all(not isinstance(a, BaseException) for a in results)
    assert sum(fetches.values()) == 1 and cache.tier_of(d6) == "host"
    for a in results:
        cache.release(a)
    with pytest.raises(AdapterError, match=r"outside|not the store's bucket"):
        resolve(cache, spec("x", "s3://other-bucket/adapters/a6", tiny_adapters[5][1]))

    # offline requests name the URI: the engine's catalog learns its digest once per version
    catalog = LocalAdapterCatalog(s3, fingerprint_ttl_s=0)
    assert catalog.spec(LoRARequest("a6", uri)).sha256 == d6
    assert catalog.spec(LoRARequest("a6", uri)).sha256 == d6 and catalog.hashes == 1
    real_fingerprint = s3.fingerprint

    def down(uri):  # type: ignore[no-untyped-def]
        raise StoreUnavailableError("store down for the test")

    s3.fingerprint = down  # type: ignore[method-assign]
    assert catalog.spec(LoRARequest("a6", uri)).sha256 == d6  # known: keeps being served
    with pytest.raises(StoreUnavailableError):
        LocalAdapterCatalog(s3).spec(LoRARequest("a6", uri))  # unknown: a clear error
    s3.fingerprint = real_fingerprint  # type: ignore[method-assign]

    down = S3Store(bucket, "adapters", endpoint_url=f"http://127.0.0.1:{free_port()}")
    cache2 = make_cache(store=down, disk=DiskTier(tmp_path / "l2b", 1 << 20))
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="unreachable"):
        resolve(cache2, spec("a6", uri, d6))
    assert time.monotonic() - t0 < 60  # a refused connection fails at once, not after retries
    cache2.release(resolve(cache2, spec("a7", tiny_adapters[7][0])))  # others keep being served
    assert cache2.is_idle()
    cache2.check_invariants()


def test_s3_uri_without_a_store_is_a_clear_error(tiny_adapters: list[tuple[Path, str]]) -> None:
    digest = tiny_adapters[0][1]
    with pytest.raises(AdapterError, match="no object store is configured"):
        resolve(make_cache(), spec("x", "s3://bucket/adapters/x", digest))


class WatchedBank(LoRASlotBank):
    """The real slot bank; each weight copy checks that another thread can use the cache."""

    cache: TieredAdapterCache | None = None
    copies = 0

    def replace_lora(self, slot, weights, **kw):  # type: ignore[no-untyped-def]
        assert self.cache is not None
        done: list[object] = []
        other = threading.Thread(target=lambda: done.append(self.cache.tier_of("0" * 64)))
        other.start()
        other.join(EVENT_TIMEOUT_S)
        assert done, "the weights were copied under the cache lock"
        self.copies += 1
        super().replace_lora(slot, weights, **kw)


def test_slots_are_reserved_under_the_lock_and_filled_outside_it(
    tiny_adapters: list[tuple[Path, str]],
) -> None:
    shapes = {
        (layer, proj): dims
        for layer in range(TINY_SPEC.num_layers)
        for proj, dims in TINY_SPEC.module_shapes.items()
    }
    bank = WatchedBank(shapes, 2, 8, torch.float32, "cpu")
    cache = TieredAdapterCache(
        bank, TINY_SPEC, max_loras=2, max_cpu_loras=4, max_lora_rank=8, dtype=torch.float32
    )
    bank.cache = cache
    a0, a1 = (resolve(cache, spec(f"a{i}", tiny_adapters[i][0])) for i in range(2))
    s0, s1 = cache.reserve_slot(a0), cache.reserve_slot(a1)
    assert s0 is not None and s1 is not None and bank.copies == 0  # bookkeeping only
    batch = Batch({s0: a0, s1: a1})
    cache.activate(batch)
    assert bank.copies == 2 and batch.slot_rows == {s: bank.slot_rows(s) for s in (s0, s1)}
    cache.activate(Batch({s0: a0}))  # already in its slot: nothing is copied again
    assert bank.copies == 2
    for s in (s0, s1):
        cache.release_slot(s)
    for a in (a0, a1):
        cache.release(a)
    cache.check_invariants()


# -------------------------------------------------------------- pins, evict, warm policies


def test_prewarm_pins_and_admin_evict(tiny_adapters: list[tuple[Path, str]]) -> None:
    cache = make_cache(max_loras=2, max_cpu_loras=3, load_wait_timeout_s=0.1)
    (p0, d0), (p1, d1), (p2, d2) = tiny_adapters[:3]
    refs = cache.prewarm(
        [spec("a0", p0, warm="device-preferred"), spec("a1", p1, warm="host"), spec("a2", p2)]
    )
    assert [r.sha256 for r in refs] == [d0, d1, d2]
    rows = {r.ref.sha256: r for r in cache.residency()}
    assert rows[d0].tier == "device" and rows[d0].pinned and rows[d0].slot is not None
    assert cache.bank.occupied_slots == (rows[d0].slot,)  # its weights are in the slot
    assert rows[d1].tier == "host" and rows[d1].pinned
    assert rows[d2].tier == "host" and not rows[d2].pinned
    with pytest.raises(ValueError, match="unknown warm policy"):
        cache.prewarm([spec("a0", p0, warm="sometimes")])
    # pressure: only the on-demand adapter may go
    for i in range(3, 6):
        cache.release(resolve(cache, spec(f"a{i}", tiny_adapters[i][0])))
        assert cache.tier_of(d0) == "device" and cache.tier_of(d1) == "host"
    # admin evict: refused while pinned or in use
    with pytest.raises(AdapterInUseError, match="pinned"):
        cache.evict(d1)
    cache.unpin(d1)
    held = resolve(cache, spec("a1", p1))
    with pytest.raises(AdapterInUseError, match="in-flight"):
        cache.evict(d1)
    cache.release(held)
    before = cache.tier_counters()
    assert cache.evict(d1) == ["host"] and cache.tier_of(d1) is None
    assert {r.ref.sha256: r.tier for r in cache.residency()}[d1] == "absent"
    cache.unpin(d0)
    assert cache.evict(d0) == ["device", "host"]
    assert cache.tier_counters() == before  # admin removals are not policy evictions
    assert {r.ref.sha256: r.evictions for r in cache.residency()}[d0] == 2  # slot + host copy
    with pytest.raises(AdapterError, match="not an adapter digest"):
        cache.pin("a0")  # names are no keys
    cache.check_invariants()


class EvictionLog:
    """An eviction listener recording each digest and whether the cache's lock was held."""

    def __init__(self, cache: TieredAdapterCache) -> None:
        self.cache = cache
        self.digests: list[str] = []
        self.under_lock = False

    def __call__(self, digest: str) -> None:
        self.under_lock |= self.cache._lock._is_owned()  # type: ignore[attr-defined]
        self.digests.append(digest)


def test_eviction_listeners_hear_every_host_copy_that_leaves(
    tiny_adapters: list[tuple[Path, str]], caplog: pytest.LogCaptureFixture
) -> None:
    """Each way a host copy leaves host memory (room for a load, the count cap trimmed after
    ``host_copies_at_least``, an admin eviction of the host tier) calls every listener once
    with its digest, outside the cache's lock; a slot-only eviction calls none; a listener that
    raises is logged and neither the cache nor the other listeners notice."""
    cache = make_cache(max_loras=1, max_cpu_loras=2)

    def broken(digest: str) -> None:
        raise RuntimeError("listener bug")

    heard = EvictionLog(cache)
    cache.add_eviction_listener(broken)
    cache.add_eviction_listener(heard)
    (p0, d0), (p1, d1), (p2, _) = tiny_adapters[:3]
    for i, p in enumerate((p0, p1)):
        cache.release(resolve(cache, spec(f"a{i}", p)))
    assert heard.digests == []
    caplog.set_level("ERROR", logger="loraplex.cache.adapters")
    cache.release(resolve(cache, spec("a2", p2)))  # the count cap: one of a0, a1 leaves
    assert len(heard.digests) == 1 and heard.digests[0] in (d0, d1)
    assert cache.tier_of(heard.digests[0]) is None and len(cache.host) == 2
    assert "eviction listener" in caplog.text and "listener bug" in caplog.text
    with cache.host_copies_at_least(4):
        held = [resolve(cache, spec(f"a{i}", tiny_adapters[i][0])) for i in range(4)]
        for a in held:
            cache.release(a)
    assert len(cache.host) == 2 and len(heard.digests) == 3  # trimmed back to two copies
    assert set(heard.digests[1:]).isdisjoint(cache.host)
    kept = sorted(cache.host)
    path = {d: p for p, d in tiny_adapters}[kept[0]]
    a = resolve(cache, spec("kept", path))
    slot = cache.reserve_slot(a)
    assert slot is not None
    cache.activate(Batch({slot: a}))
    cache.release_slot(slot)
    cache.release(a)
    assert cache.evict(kept[0], tiers=["device"]) == ["device"]
    assert len(heard.digests) == 3  # the host copy stays: nothing to forget
    assert cache.evict(kept[0]) == ["host"]
    assert heard.digests[3:] == [kept[0]] and not heard.under_lock
    cache.check_invariants()


def test_more_device_preferred_adapters_than_slots(tiny_adapters: list[tuple[Path, str]]) -> None:
    cache = make_cache(max_loras=1, max_cpu_loras=2)
    with pytest.raises(AdapterCapacityError, match="device slot"):
        cache.prewarm(
            [spec(f"a{i}", tiny_adapters[i][0], warm="device-preferred") for i in range(2)]
        )


def test_policy_names_match_the_config() -> None:
    assert set(ADAPTER_EVICTION_POLICIES) == set(POLICIES)
    with pytest.raises(ValueError, match="adapter_eviction_policy"):
        EngineConfig(model="m", adapter_eviction_policy="mru").validate()
    with pytest.raises(ValueError, match="disk_cache_bytes"):
        EngineConfig(model="m", disk_cache_dir="/tmp/x").validate()
    with pytest.raises(ValueError, match="adapter_store_url"):
        EngineConfig(model="m", adapter_store_url="ftp://x").validate()


# ------------------------------------------------------------------ engine: no HOL blocking


def test_slow_cold_load_does_not_delay_warm_adapters(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.llm_engine import LLMEngine

    root = tmp_path / "store"
    shutil.copytree(adapters["all_r8"], root / "cold")
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model),
            device="cpu",
            dtype="float32",
            max_loras=2,
            max_cpu_loras=4,
            num_kv_blocks=64,
            adapter_store_url=str(root),
            disk_cache_dir=str(tmp_path / "l2"),
            disk_cache_bytes=1 << 24,
        )
    )
    mgr = engine.adapters
    assert mgr is not None and mgr.disk is not None
    slow = CountingStore(root, hold=True)  # the cold load lasts until the test releases it
    mgr.loader.store = slow
    warm = [
        LoRARequest(n, str(adapters[n]))
        for n in ("attn_r4_rslora", "mlp_r16")  # local directories
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    aeng = AsyncEngine(engine)
    aeng.start()

    async def run(rid: str, lora: LoRARequest) -> float:
        prepared = await aeng.prepare(GenerationRequest(rid, [1, 2, 3, 4, 5], params, lora))
        async for out in aeng.generate(prepared):
            if out.finished:
                assert len(out.outputs[0].token_ids) == 8
        return time.monotonic()

    async def main() -> tuple[list[float], float, float]:
        for i, lora in enumerate(warm):  # make them warm
            await run(f"w{i}", lora)
        cold = asyncio.create_task(run("cold", LoRARequest("cold", str(root / "cold"))))
        await asyncio.to_thread(slow.fetching.wait, EVENT_TIMEOUT_S)
        assert slow.fetches == 1  # the cold load is in progress, and stays so
        done = []
        for j in range(3):
            done += await asyncio.gather(*(run(f"w{i}-{j}", w) for i, w in enumerate(warm)))
        released = time.monotonic()
        assert not cold.done()
        slow.release.set()
        return done, released, await cold

    try:
        warm_done, released, cold_done = asyncio.run(main())
    finally:
        slow.release.set()
        aeng.shutdown()
    # every warm request finished while the cold load was still held
    assert max(warm_done) <= released <= slow.ended[0] <= cold_done
    assert mgr.tier_of(digest_safetensors_dir(root / "cold")) in ("device", "host")
    assert mgr.stats.remote_loads == 1 and engine.is_idle()
    mgr.check_invariants()


def test_registered_digest_is_the_key_and_is_verified(tmp_path: Path) -> None:
    """A request naming a registered sha256 is served by that verified copy in memory, whatever
    its path holds now; read from a directory whose files no longer match, it is refused."""
    p1, d1 = write_adapter(tmp_path / "x", seed=1)
    _, d2 = write_adapter(tmp_path / "y", seed=2)
    cache = make_cache()
    a = resolve(cache, spec("x", p1, d1))
    assert a.ref.sha256 == d1
    cache.release(a)
    shutil.rmtree(p1)
    shutil.copytree(tmp_path / "y", p1)  # rev 2's files where rev 1's were
    a = resolve(cache, spec("x", p1, d1))  # rev 1 still resident: served from memory
    assert a.ref.sha256 == d1
    cache.release(a)
    b = resolve(cache, spec("x", p1, d2))  # rev 2 by its own digest
    assert b.ref.sha256 == d2
    cache.release(b)
    cache.evict(d1, tiers=["device", "host"])
    with pytest.raises(AdapterIntegrityError, match="not the registered"):
        resolve(cache, spec("x", p1, d1))  # rev 1 gone from memory; its files changed
    assert cache.is_idle()
    cache.check_invariants()


def test_tenant_host_budget_set_at_run_time(tiny_adapters: list[tuple[Path, str]]) -> None:
    """A tenant budget of one adapter: its second adapter evicts its first, never another
    tenant's copy."""
    cache = make_cache(max_cpu_loras=8)
    (p0, d0), (p1, d1), (p2, d2) = tiny_adapters[:3]
    other = resolve(cache, spec("other", p2, tenant="bravo"))
    cache.release(other)
    one = resolve(cache, spec("a0", p0, tenant="acme"))
    cache.release(one)
    cache.set_tenant_budget("acme", one.nbytes)
    two = resolve(cache, spec("a1", p1, tenant="acme"))
    cache.release(two)
    assert cache.tier_of(d1) == "host" and cache.tier_of(d0) is None
    assert cache.tier_of(d2) == "host"
    cache.set_tenant_budget("acme", None)
    with pytest.raises(ValueError):
        cache.set_tenant_budget("acme", -1)
    cache.check_invariants()
