"""Per-adapter and per-revision concurrency limits on one replica: calls in flight per adapter
name (the active revision's ``max_concurrent_requests``, counting every revision of the name)
and per canary revision (its cap: the canary policy's ``max_concurrent_requests``, else its
traffic share of the name's limit, and never more than its own manifest's limit).

A call that does not fit waits in a bounded FIFO (at most as many waiters per name as its limit)
for a bounded time, and is admitted as soon as slots free; past either bound it gets 429
(``Retry-After``) from the caller. Nothing about other callers' load is revealed: the error
names only the adapter the caller asked for and its limit.

Event-loop thread only, except :meth:`ConcurrencyLimiter.in_flight` (a plain dict read, used
by revision choice in the I/O pool to send calls past a full canary to the active revision).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

from loraplex.server.catalog import Servable

Claim = tuple[str, int]
"""A key (``name:<adapter>`` or ``rev:<adapter>@<revision>``) and its limit."""


def name_key(name: str) -> str:
    return f"name:{name}"


def revision_key(name: str, revision: str) -> str:
    return f"rev:{name}@{revision}"


def canary_cap(sv: Servable) -> int | None:
    """The most calls the canary of ``sv`` may have in flight on one replica (None: no cap):
    its policy's ``max_concurrent_requests``, else ``ceil(weight x`` the name's limit ``)``,
    and at most its own manifest's limit."""
    canary = sv.canary
    if canary is None:
        return None
    caps = []
    policy = sv.canary_policy
    name_limit = sv.active.max_concurrent_requests
    if policy is not None and policy.max_concurrent_requests is not None:
        caps.append(policy.max_concurrent_requests)
    elif name_limit is not None:
        caps.append(max(1, math.ceil(sv.canary_weight * name_limit)))
    if canary.max_concurrent_requests is not None:
        caps.append(canary.max_concurrent_requests)
    return min(caps) if caps else None


def claims_of(sv: Servable, revision: str) -> tuple[Claim, ...]:
    """What a call of ``sv`` served by ``revision`` holds while in flight (the name's limit
    first)."""
    out: list[Claim] = []
    if sv.active.max_concurrent_requests is not None:
        out.append((name_key(sv.name), sv.active.max_concurrent_requests))
    if sv.canary is not None and revision == sv.canary.revision:
        cap = canary_cap(sv)
        if cap is not None:
            out.append((revision_key(sv.name, revision), cap))
    return tuple(out)


def canary_full(limiter: ConcurrencyLimiter, sv: Servable) -> bool:
    """Whether the canary of ``sv`` is at its cap here (then a call drawn for it is served by
    the active revision instead)."""
    cap = canary_cap(sv)
    return (
        sv.canary is not None
        and cap is not None
        and limiter.in_flight(revision_key(sv.name, sv.canary.revision)) >= cap
    )


class AdapterBusy(Exception):
    """The call's adapter is at its concurrency limit and its wait queue is full or the wait
    timed out."""

    def __init__(self, name: str, limit: int) -> None:
        super().__init__(
            f"too many concurrent requests for adapter {name!r} (limit {limit}); retry later"
        )
        self.name = name
        self.limit = limit


@dataclass
class _Waiter:
    claims: tuple[Claim, ...]
    future: asyncio.Future[None] = field(repr=False)


class ConcurrencyLimiter:
    """Counts of calls in flight per key, and the FIFO of calls waiting for room."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._waiters: deque[_Waiter] = deque()
        self._queued: dict[str, int] = {}  # waiters by their first key

    def in_flight(self, key: str) -> int:
        return self._held.get(key, 0)

    def waiting(self, key: str) -> int:
        return self._queued.get(key, 0)

    def full(self, claim: Claim) -> bool:
        key, limit = claim
        return self._held.get(key, 0) >= limit

    def try_acquire(self, claims: tuple[Claim, ...]) -> bool:
        """Take a slot of every claim if all have room. (A waiter never stays queued while its
        claims have room: every release grants at once, so a newcomer overtakes nobody.)"""
        if any(self.full(c) for c in claims):
            return False
        self._take(claims)
        return True

    def enqueue(self, name: str, claims: tuple[Claim, ...]) -> asyncio.Future[None]:
        """Queue a call for ``claims``; its future resolves when it holds them. Raises
        :class:`AdapterBusy` when as many calls as the first claim's limit already wait."""
        key, limit = claims[0]
        if self._queued.get(key, 0) >= limit:
            raise AdapterBusy(name, limit)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(_Waiter(claims, fut))
        self._queued[key] = self._queued.get(key, 0) + 1
        return fut

    async def wait(
        self, name: str, claims: tuple[Claim, ...], fut: asyncio.Future[None], timeout: float
    ) -> None:
        """Wait up to ``timeout`` seconds for ``fut`` (from :meth:`enqueue`); on time-out the
        call leaves the queue and :class:`AdapterBusy` is raised (a cancel leaves it too)."""
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException as e:
            if fut.done() and not fut.cancelled():
                self.release(claims)  # granted just as the wait ended: give it back
            else:
                fut.cancel()
                self._drop(fut)
            if isinstance(e, TimeoutError):
                raise AdapterBusy(name, claims[0][1]) from None
            raise

    def release(self, claims: tuple[Claim, ...]) -> None:
        """Give back a call's slots and admit the waiters that now fit, in arrival order."""
        for key, _ in claims:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)
        self._grant()

    def forget(self, fut: asyncio.Future[None]) -> None:
        """Take a waiter out of the queue (its call went away)."""
        self._drop(fut)

    def _take(self, claims: tuple[Claim, ...]) -> None:
        for key, _ in claims:
            self._held[key] = self._held.get(key, 0) + 1

    def _grant(self) -> None:
        for w in list(self._waiters):  # in arrival order: the first that fit go first
            if any(self.full(c) for c in w.claims):
                continue
            self._drop(w.future)
            self._take(w.claims)
            w.future.set_result(None)

    def _drop(self, fut: asyncio.Future[None]) -> None:
        for w in self._waiters:
            if w.future is fut:
                self._waiters.remove(w)
                key = w.claims[0][0]
                left = self._queued.get(key, 0) - 1
                if left > 0:
                    self._queued[key] = left
                else:
                    self._queued.pop(key, None)
                return
