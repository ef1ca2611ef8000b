"""A background thread started on demand that exits when idle (no internal imports, no torch).

Used where a job must run beside the caller without paying a thread start per job (slot writes
beside the engine step, the second half of a verified disk read) and where an idle process must
hold no threads (tests build many engines and tiers).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

IDLE_EXIT_S = 2.0
"""How long a worker waits for another job before its thread exits."""


class IdleWorker:
    """Runs submitted callables one at a time, in submission order, on one thread: started by
    the first job, kept while jobs keep coming, gone after ``idle_exit_s`` without one.

    A job reports its own errors; one that escapes is logged and the thread goes on to the
    next job."""

    def __init__(self, name: str, *, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self.name = name
        self.idle_exit_s = idle_exit_s
        self._cond = threading.Condition()
        self._queue: deque[Callable[[], None]] = deque()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; returns at once (a waiting thread takes it, else one is started)."""
        with self._cond:
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            else:
                self._cond.notify_all()

    @property
    def alive(self) -> bool:
        """A thread is running or waiting for the next job."""
        with self._cond:
            return self._thread is not None

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._cond.wait_for(lambda: bool(self._queue), self.idle_exit_s)
                if not self._queue:  # decided under the lock submit() takes: no job is lost
                    self._thread = None
                    return
                job = self._queue.popleft()
            try:
                job()
            except Exception:  # a job's bug must not strand the jobs queued behind it
                log.exception("%s: a job raised", self.name)
            del job  # what it holds (a load's buffer) is not kept alive while the thread waits
