"""Issue 19 items 3-4 without a server: the concurrency limiter (slots, bounded FIFO queue,
bounded wait, release admits the next waiter), the canary cap, and the canary health windows
(breach rules, the injectable clock, rollback once per breach)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.registry import AuditEntry, CanaryPolicy, Manifest, Registry, base_model_info
from loraplex.server.adapter_limits import (
    AdapterBusy,
    ConcurrencyLimiter,
    canary_cap,
    canary_full,
    claims_of,
    revision_key,
)
from loraplex.server.canary import (
    HEALTH_ACTOR,
    CallOutcome,
    CanaryMonitor,
    HealthStats,
    breach,
    json_validity,
    p95,
)
from loraplex.server.catalog import Servable


def manifest(revision: str, limit: int | None = None) -> Manifest:
    return Manifest(
        name="x", tenant=None, revision=revision, sha256=revision * 8, weights_sha256="w",
        config_sha256="c", base_model_name="b", base_model_digest="d", rank=8, alpha=16.0,
        dtype="float32", target_modules=("q_proj",), nbytes=1, source_uri="/x",
        max_concurrent_requests=limit,
    )  # fmt: skip


def test_limiter_admits_waiters_in_order_as_slots_free_and_bounds_its_queue() -> None:
    async def run() -> None:
        lim = ConcurrencyLimiter()
        claims = (("name:x", 2),)
        assert lim.try_acquire(claims) and lim.try_acquire(claims)
        assert not lim.try_acquire(claims) and lim.in_flight("name:x") == 2
        first = lim.enqueue("x", claims)
        second = lim.enqueue("x", claims)
        with pytest.raises(AdapterBusy, match=r"adapter 'x' \(limit 2\)"):
            lim.enqueue("x", claims)  # the queue holds as many calls as the limit
        waits = [
            asyncio.ensure_future(lim.wait("x", claims, f, timeout=120)) for f in (first, second)
        ]
        lim.release(claims)  # one slot frees: the first waiter gets it, the second still waits
        await waits[0]
        assert not waits[1].done() and lim.in_flight("name:x") == 2 and lim.waiting("name:x") == 1
        lim.release(claims)
        await waits[1]
        assert lim.waiting("name:x") == 0 and lim.in_flight("name:x") == 2
        lim.release(claims)
        lim.release(claims)
        assert lim.in_flight("name:x") == 0

    asyncio.run(run())


def test_a_wait_that_times_out_or_is_cancelled_leaves_the_queue() -> None:
    async def run() -> None:
        lim = ConcurrencyLimiter()
        claims = (("name:x", 1),)
        assert lim.try_acquire(claims)
        fut = lim.enqueue("x", claims)
        with pytest.raises(AdapterBusy):  # nothing frees the slot: the bound ends the wait
            await lim.wait("x", claims, fut, timeout=0.01)
        assert lim.waiting("name:x") == 0
        fut = lim.enqueue("x", claims)
        task = asyncio.ensure_future(lim.wait("x", claims, fut, timeout=120))
        await asyncio.sleep(0)  # let the wait start
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lim.waiting("name:x") == 0
        lim.release(claims)  # nobody is granted a slot that no call holds
        assert lim.in_flight("name:x") == 0

    asyncio.run(run())


def test_a_canary_blocked_on_its_cap_does_not_hold_back_active_calls() -> None:
    async def run() -> None:
        lim = ConcurrencyLimiter()
        canary = (("name:x", 4), ("rev:x@r2", 1))
        active = (("name:x", 4),)
        assert lim.try_acquire(canary)
        waiting = lim.enqueue("x", canary)
        assert lim.try_acquire(active)  # the name has room: the canary's cap is not its limit
        lim.release(active)
        assert not waiting.done()
        lim.release(canary)
        assert waiting.done() and lim.in_flight("rev:x@r2") == 1

    asyncio.run(run())


def test_canary_cap_is_its_share_or_its_policy() -> None:
    active, canary = manifest("r1", limit=10), manifest("r2")
    sv = Servable("x", active, canary, 0.25)
    assert canary_cap(sv) == 3  # ceil(0.25 x 10)
    assert claims_of(sv, "r1") == (("name:x", 10),)
    assert claims_of(sv, "r2") == (("name:x", 10), ("rev:x@r2", 3))
    sv = dataclasses.replace(sv, canary_policy=CanaryPolicy(max_concurrent_requests=1))
    assert canary_cap(sv) == 1
    sv = dataclasses.replace(sv, canary=manifest("r2", limit=0 + 1), canary_policy=None)
    assert canary_cap(sv) == 1  # never above its own manifest's limit
    unlimited = Servable("x", manifest("r1"), manifest("r2"), 0.5)
    assert canary_cap(unlimited) is None and claims_of(unlimited, "r2") == ()
    lim = ConcurrencyLimiter()
    assert not canary_full(lim, sv)
    lim._take(((revision_key("x", "r2"), 1),))
    assert canary_full(lim, sv)


def test_breach_rules() -> None:
    policy = CanaryPolicy(min_requests=4, max_error_rate=0.25, max_ttft_p95_s=1.0, min_quality=0.5)
    healthy = HealthStats(4, 1, 0.5, 0.01, 0, None)
    assert breach(policy, healthy) is None
    assert breach(policy, HealthStats(3, 3, None, None, 0, None)) is None  # too few calls yet
    kind, reason = breach(policy, HealthStats(4, 2, 0.5, 0.01, 0, None)) or ("", "")
    assert kind == "error_rate" and "0.500 > 0.25" in reason
    assert (breach(policy, HealthStats(4, 0, 2.0, 0.01, 0, None)) or ("",))[0] == "ttft"
    assert (breach(policy, HealthStats(0, 0, None, None, 4, 0.25)) or ("",))[0] == "quality"
    assert breach(policy, HealthStats(0, 0, None, None, 3, 0.0)) is None  # too few scores
    assert breach(policy, HealthStats(0, 0, None, None, 4, 0.5)) is None  # at the bound
    assert breach(policy, HealthStats(0, 0, None, None, 40, 1.0)) is None
    assert p95([float(i) for i in range(1, 101)]) == 95.0 and p95([]) is None
    assert json_validity(' {"a": 1} ') == 1.0 and json_validity("{nope") == 0.0


class FakeClock:
    """A settable clock: windows move only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def registry(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[Registry]:
    """A real in-memory registry where ``x``, ``slow`` and ``picky`` each run r2 as a canary
    of r1."""
    reg = Registry.open("sqlite://")
    base = base_model_info(tiny_model, "tiny")
    first, second = sorted(adapters.values())[:2]
    for name in ("x", "slow", "picky"):
        for path in (first, second):
            reg.register(path, name, base=base, actor="t", allow_any_source=True)
        reg.promote(name, "r1", actor="t")
        reg.canary(name, "r2", 0.5, actor="t")
    yield reg
    reg.close()


async def _inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def monitor(clock: FakeClock, reg: Registry, seen: list[Any]) -> CanaryMonitor:
    run_io: Callable[..., Awaitable[object]] = _inline
    return CanaryMonitor(reg, run_io, on_rollback=lambda *a: seen.append(a), clock=clock)


def rollbacks(reg: Registry, name: str) -> list[AuditEntry]:
    return [e for e in reg.audit_log(target=name) if e.action == "rollback"]


def test_errors_outside_the_window_do_not_count_and_a_breach_rolls_back_once(
    registry: Registry,
) -> None:
    async def run() -> None:
        clock, reg, seen = FakeClock(), registry, []
        mon = monitor(clock, reg, seen)
        policy = CanaryPolicy(window_s=60, min_requests=4, max_error_rate=0.25)
        for _ in range(3):
            mon.observe("x", "r2", policy, CallOutcome(failed=True))
        clock.now += 61  # those three failures leave the window
        for failed in (False, False, False, True):  # 1 in 4 = 0.25: not above the bound
            mon.observe("x", "r2", policy, CallOutcome(failed=failed))
        await mon.settled()
        assert rollbacks(reg, "x") == [] and mon.stats("x", "r2", policy).requests == 4
        mon.observe("x", "r2", policy, CallOutcome(failed=True))  # 2 in 5 = 0.4
        mon.observe("x", "r2", policy, CallOutcome(failed=True))  # while rolling back: no repeat
        await mon.settled()
        (entry,) = rollbacks(reg, "x")
        assert entry.actor == HEALTH_ACTOR and entry.before["canary_revision"] == "r2"  # type: ignore[index]
        assert "error rate 0.400 > 0.25 over 5 calls in the last 60s" in entry.after["reason"]  # type: ignore[index]
        assert reg.release("x").canary_revision is None and reg.get("x", "r2").status == "disabled"
        assert [a[:3] for a in seen] == [("x", "r2", "error_rate")] and seen[0][3] is not None
        assert mon.stats("x", "r2", policy).requests == 0  # a fresh start if canaried again
        # a call that finished just after (another replica's view): stopped already, no write
        mon.observe("x", "r2", policy, CallOutcome(failed=True))
        for _ in range(4):
            mon.observe("x", "r2", policy, CallOutcome(failed=True))
        await mon.settled()
        assert len(rollbacks(reg, "x")) == 1 and seen[-1][3] is None

    asyncio.run(run())


def test_latency_and_quality_breaches(registry: Registry) -> None:
    async def run() -> None:
        clock, reg, seen = FakeClock(), registry, []
        mon = monitor(clock, reg, seen)
        slow = CanaryPolicy(min_requests=3, max_error_rate=None, max_ttft_p95_s=0.5)
        for ttft in (0.1, 0.2, 0.9):
            mon.observe("slow", "r2", slow, CallOutcome(failed=False, ttft_s=ttft))
        picky = CanaryPolicy(min_requests=2, max_error_rate=None, min_quality=0.5, scorer="json")
        assert mon.score(picky, ['{"ok": true}', "not json"]) == 0.5
        mon.feedback("picky", "r2", picky, 0.0)
        mon.feedback("picky", "r2", picky, 0.4)
        await mon.settled()
        assert sorted(a[:3] for a in seen) == [("picky", "r2", "quality"), ("slow", "r2", "ttft")]
        assert "TTFT p95 0.900s > 0.5s" in rollbacks(reg, "slow")[0].after["reason"]  # type: ignore[index]
        assert "quality 0.200 < 0.5" in rollbacks(reg, "picky")[0].after["reason"]  # type: ignore[index]

    asyncio.run(run())
