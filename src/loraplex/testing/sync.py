"""Event-driven waits for tests and benchmarks: never race the clock, wait for the event.

``wait_until`` polls a predicate with a generous bound (a bound only turns a hang into a clear
failure; it never decides a test on a loaded machine). ``StepGate`` holds an engine's scheduler,
so "request A is in the engine while B is refused" is arranged, not hoped for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

EVENT_TIMEOUT_S = 120.0
"""Default bound of an event wait: long enough for a slow, loaded 2-core machine."""


def wait_until(
    predicate: Callable[[], Any],
    *,
    timeout: float = EVENT_TIMEOUT_S,
    interval: float = 0.01,
    what: str | Callable[[], str] = "the condition",
) -> Any:
    """Poll ``predicate`` until it returns something truthy, which is returned.

    Raises ``AssertionError`` naming ``what`` (a string, or a callable giving one at failure
    time) if ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g} s waiting for {text}")
        time.sleep(interval)


def wait_idle(engine: Any, aengine: Any = None, *, timeout: float = EVENT_TIMEOUT_S) -> None:
    """Wait until ``engine`` (an LLMEngine) holds no request, KV block, slot user or adapter
    reference, and ``aengine`` (its AsyncEngine, if given) has nothing admitted or handed over."""

    def idle() -> bool:
        return (
            engine.is_idle()
            and not engine.requests
            and (aengine is None or aengine.num_waiting == 0)
        )

    def state() -> str:
        slots = engine.adapters.slot_users if engine.adapters is not None else None
        pending = aengine.num_waiting if aengine is not None else 0
        return (
            f"an idle engine (waiting={engine.num_waiting} running={engine.num_running} "
            f"free blocks={engine.num_free_blocks}/{engine.pool.num_blocks} "
            f"requests={list(engine.requests)} slot users={slots} admitted={pending})"
        )

    wait_until(idle, timeout=timeout, interval=0.02, what=state)


class StepGate:
    """Hold an engine's scheduler: while held, every step schedules nothing; let steps through
    one by one.

    Wraps ``engine.scheduler.schedule`` until the ``with`` block ends. ``hold()`` makes later
    steps empty; ``allow(n)`` lets ``n`` real steps through and holds again; ``open()`` lets
    everything through. While held, the engine loop keeps draining commands (new requests join
    the waiting queue, aborts are applied) but nothing runs: requests already in the engine stay
    there, holding their adapter references, KV blocks and slots, and cannot finish.
    ``wait_held()`` returns once the loop has met the held gate (note: the loop only steps while
    the engine has unfinished requests).
    """

    def __init__(self, engine: Any, *, poll_s: float = 0.002) -> None:
        self._scheduler = engine.scheduler
        self._real = engine.scheduler.schedule
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._permits: int | None = None  # None: open
        self._held_seen = False
        self.passed = 0

    def __enter__(self) -> StepGate:
        self._scheduler.schedule = self._schedule
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.open()
        del self._scheduler.schedule  # back to the class's method

    def _schedule(self) -> Any:
        with self._cond:
            if self._permits == 0:
                self._held_seen = True
                self._cond.notify_all()
                held = True
            else:
                held = False
                if self._permits is not None:
                    self._permits -= 1
                self.passed += 1
        if held:
            time.sleep(self._poll_s)  # the loop spins on empty steps: keep it cheap
            from loraplex.engine.scheduler import ScheduledBatch

            return ScheduledBatch()
        return self._real()

    def hold(self) -> None:
        """Later steps schedule nothing (a step already running finishes)."""
        with self._cond:
            self._permits = 0
            self._held_seen = False

    def allow(self, n: int = 1) -> None:
        """Let ``n`` more real steps through, then hold again."""
        with self._cond:
            self._permits = (self._permits or 0) + n
            self._held_seen = False

    def open(self) -> None:
        with self._cond:
            self._permits = None
            self._cond.notify_all()

    def wait_held(self, *, timeout: float = EVENT_TIMEOUT_S) -> None:
        """Wait until the loop has met the held gate (every allowed step has run)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._held_seen and self._permits == 0, timeout)
        if not ok:
            raise AssertionError(f"the engine loop did not reach the held gate in {timeout:g} s")


def wait_healthy(proc: Any, url: str, *, timeout: float = EVENT_TIMEOUT_S) -> None:
    """Wait until ``GET url/health`` answers 200; fail at once (with its output) if ``proc`` (a
    ``subprocess.Popen`` of the server, or None) exits first."""
    import httpx

    def up() -> bool:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout is not None else ""
            raise AssertionError(
                f"the server exited with {proc.returncode} before {url} was up: {out}"
            )
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=timeout, interval=0.2, what=f"{url}/health")
