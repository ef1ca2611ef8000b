"""TierController: the residency decisions the server's cache and ``loraplex sim`` share —
inclusive slots, holds, idle-slot retirement, count trimming, one eviction path, patience — on
an injected clock (no threads, no I/O, no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loraplex.cache.controller import TierController
from loraplex.cache.policy import AdapterInfo, LRUPolicy, make_policy
from loraplex.cache.residency import NoRoomError
from loraplex.types import AdapterInUseError


class Clock:
    """Test time: advanced by the test, read by the controller."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def info(key: str, size: int = 10, tenant: str | None = None) -> AdapterInfo:
    return AdapterInfo(key, size, tenant=tenant)


def controller(clock: Clock, **kw: object) -> TierController:
    kw.setdefault("slots", 2)
    return TierController(kw.pop("policy", LRUPolicy()), clock=clock, **kw)  # type: ignore[arg-type]


def load(ctl: TierController, clock: Clock, key: str, size: int = 10) -> list[str]:
    """A request's cold load into host memory (one hold); the host copies dropped for it."""
    clock.now += 1.0
    return ctl.admit_host(info(key, size)).dropped


def test_slots_hold_their_host_copies_and_idle_ones_are_retired_for_room() -> None:
    clock = Clock()
    ctl = controller(clock, slots=2, host_bytes=20)
    for k in ("a", "b"):
        assert load(ctl, clock, k) == []
        assert ctl.reserve_slot(ctl.host_info(k)) == (ctl.slot_of[k], True)
        assert ctl.release_slot(ctl.slot_of[k]) is True  # the request is done: the slot idles
        ctl.release_request(k)  # ... and still holds the host copy
    assert ctl.host.entries()["a"].inflight == 1  # inclusive residency
    busy = ctl.reserve_slot(ctl.host_info("b"))  # b runs again: its slot may not be retired
    assert busy == (ctl.slot_of["b"], False)
    assert load(ctl, clock, "c") == ["a"]  # a's idle slot was retired, then its copy evicted
    assert "a" not in ctl.slot_of and ctl.slot_digest.count(None) == 1
    assert ctl.tier_of("b") == "device" and ctl.tier_of("c") == "host"
    with pytest.raises(NoRoomError, match="in use"):
        load(ctl, clock, "d")  # b runs, c is held by its request: no room, nothing changed
    assert set(ctl.host.entries()) == {"b", "c"}
    c = ctl.tier_counters()
    assert (c["device"].evictions, c["host"].evictions, c["host"].inserts) == (1, 1, 3)
    assert ctl.usage["a"].evictions == 2  # left its slot, then host memory
    ctl.check_invariants()


def test_count_cap_is_hard_even_for_live_copies() -> None:
    """max_host_copies (vLLM's max_cpu_loras) is a limit like the byte budget: with every copy
    held by a live request, one more admission is refused (the owner waits and retries), never
    admitted over the cap; a release makes room, and the policy picks the cached victim."""
    clock = Clock()
    ctl = controller(clock, slots=1, max_host_copies=2)
    load(ctl, clock, "a")
    load(ctl, clock, "b")
    with pytest.raises(NoRoomError, match="in use"):
        load(ctl, clock, "c")  # both copies are held by live requests
    assert set(ctl.host.entries()) == {"a", "b"}
    assert ctl.release_request("a") == []  # at the cap, not over it: a stays cached
    assert load(ctl, clock, "c") == ["a"]  # the cached copy goes, the live one stays
    assert set(ctl.host.entries()) == {"b", "c"} and ctl.host.count == 2
    with pytest.raises(RuntimeError, match="released more often"):
        ctl.release_request("a")
    # a widened cap (the offline API, for one call) admits more; lowering it trims what no
    # request holds at once and the rest as it is released
    assert ctl.set_max_host_copies(3) == []
    load(ctl, clock, "d")
    assert ctl.host.count == 3
    ctl.release_request("b")
    assert ctl.set_max_host_copies(2) == ["b"]
    assert ctl.host.count == 2
    ctl.set_max_host_copies(1)
    assert ctl.host.count == 2  # c and d are still held
    assert ctl.release_request("c") == ["c"] and ctl.host.count == 1
    ctl.check_invariants()


def test_admin_eviction_and_removal_go_through_the_one_path_uncounted() -> None:
    clock = Clock()
    ctl = controller(clock, slots=1, disk_bytes=100)
    load(ctl, clock, "a")
    assert ctl.admit_disk(info("a", 30)) == []  # held while written
    assert ctl.remove("disk", "a") is False  # in flight: a reader removes it later
    ctl.release("disk", "a")
    slot, _ = ctl.reserve_slot(ctl.host_info("a"))  # type: ignore[misc]
    with pytest.raises(AdapterInUseError, match="in-flight requests in the device tier"):
        ctl.evict("a", ["device", "host"])
    ctl.release_slot(slot)
    ctl.pin("a")
    with pytest.raises(AdapterInUseError, match="in-flight requests in the host tier"):
        ctl.evict("a", ["device", "host"])  # the request still holds the copy
    ctl.release_request("a")
    with pytest.raises(AdapterInUseError, match="pinned"):
        ctl.evict("a", ["device", "host", "disk"])
    ctl.unpin("a")
    before = ctl.tier_counters()
    assert ctl.evict("a", ["device", "host", "disk"]) == ["device", "host", "disk"]
    assert ctl.tier_of("a") is None and ctl.slot_digest == [None]
    assert ctl.tier_counters() == before  # removals are not policy evictions
    assert ctl.usage["a"].evictions == 2
    ctl.check_invariants()


def test_disk_admission_evicts_first_and_refuses_what_cannot_fit() -> None:
    clock = Clock()
    ctl = controller(clock, disk_bytes=50)
    assert ctl.admit_disk(info("a", 30), hold=False) == []
    clock.now += 1
    assert ctl.admit_disk(info("b", 30), hold=False) == ["a"]
    with pytest.raises(NoRoomError, match="larger than the tier"):
        ctl.admit_disk(info("c", 60))
    assert ctl.hold_disk_copy("b") and not ctl.hold_disk_copy("a")
    c = ctl.tier_counters()["disk"]
    assert (c.hits, c.misses, c.evictions) == (1, 1, 1)


def test_patience_waits_for_a_busy_cold_slot_instead_of_evicting_a_hot_one() -> None:
    clock = Clock()
    ctl = controller(clock, slots=2, policy=make_policy("hybrid"), patience_s=1.0)
    hot = info("hot")
    for _ in range(50):
        clock.now += 0.01
        ctl.access(hot)
    ctl.admit_host(hot, counted=0)
    for k in ("cold", "new"):
        ctl.admit_host(info(k))
    ctl.release_slot(ctl.reserve_slot(ctl.host_info("hot"))[0])  # type: ignore[index]  # idle
    ctl.reserve_slot(ctl.host_info("cold"))  # busy, requested once
    since = clock.now
    assert ctl.reserve_slot(ctl.host_info("new"), waiting_since=since) is None  # holds out
    assert ctl.slot_of.keys() == {"hot", "cold"} and ctl.stats.slot_waits == 1
    clock.now = since + 1.0  # patience spent: the plan evicts the idle hot adapter
    slot = ctl.slot_of["hot"]
    assert ctl.reserve_slot(ctl.host_info("new"), waiting_since=since) == (slot, True)
    assert ctl.slot_of.keys() == {"new", "cold"}
    ctl.check_invariants()


def test_minimum_residency_is_measured_on_the_injected_clock() -> None:
    clock = Clock()
    ctl = controller(clock, slots=1, host_bytes=10, min_residency_s=5.0)
    load(ctl, clock, "a")
    ctl.release_request("a")
    with pytest.raises(NoRoomError, match="too new"):
        load(ctl, clock, "b")
    clock.now += 5.0
    assert load(ctl, clock, "b") == ["a"]


def test_the_controller_needs_no_torch() -> None:
    code = (
        "import sys\nimport loraplex.cache.controller, loraplex.tools.sim.simulate\n"
        "assert 'torch' not in sys.modules, 'the tier controller imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
