"""Time-window prewarming: pin adapters ahead of their warm windows, release them after.

A manifest's ``warm`` may be a :class:`~loraplex.warm.WarmSchedule` (e.g. ``{"device":
"Mon-Fri 08:00-18:00", "tz": "Europe/Berlin"}``) instead of a warm policy string; :func:`windows`
turns one into Unix times (local times through ``zoneinfo``, DST included). The
:class:`PrewarmScheduler` follows those schedules on an injected clock (Unix seconds)::

    for each scheduled adapter, at every tick:
        want = tier of the window w with  w.open - lead <= now < w.close   (device wins), or None
        lead = schedule.lead_s if given, else max(lead_s, lead_factor * measured warm seconds)
        want != held  ->  release what is held (unpin), then warm for ``want`` (load + pin)

Warming is the target's ``pin_window(spec, device=...)`` (the engine client's: load into host
memory, pin there and on disk, and pin its device slot once it has one); releasing is
``unpin_window``, which lifts only the window's pin (one an operator set during the window
stays). The
seconds a warm call takes (``timer``) are the adapter's measured load cost, which sets its lead
the next time. A failed warm is logged and retried after ``retry_s``. The scheduler starts no
thread: its owner calls :meth:`PrewarmScheduler.tick` and sleeps until the time it returns.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from zoneinfo import ZoneInfo

from loraplex.types import AdapterSpec
from loraplex.warm import WarmSchedule

__all__ = ["PrewarmScheduler", "PrewarmTarget", "ScheduledAdapter", "windows"]

log = logging.getLogger("loraplex.cache.prewarm")

_HORIZON_S = 8 * 86400.0  # windows are looked up this far ahead (covers a weekly schedule)


def windows(schedule: WarmSchedule, start: float, end: float) -> list[tuple[float, float, str]]:
    """``(open, close, tier)`` in Unix seconds of every window of ``schedule`` overlapping
    ``[start, end)``, by opening time; local times through ``zoneinfo`` (DST included)."""
    zone = ZoneInfo(schedule.tz)
    first = dt.datetime.fromtimestamp(start, zone).date() - dt.timedelta(days=1)
    last = dt.datetime.fromtimestamp(end, zone).date()
    out = []
    day = first
    while day <= last:
        for tier, wins in (("device", schedule.device), ("host", schedule.host)):
            for w in wins:
                if day.weekday() not in w.days:
                    continue
                lo = _local(day, w.start_min, zone)
                hi = _local(day, w.end_min, zone)
                if hi > start and lo < end:
                    out.append((lo, hi, tier))
        day += dt.timedelta(days=1)
    out.sort()
    return out


def _local(day: dt.date, minutes: int, zone: ZoneInfo) -> float:
    """Unix time of local ``day`` + ``minutes`` (24:00 is the next midnight)."""
    if minutes >= 24 * 60:
        nxt = dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), zone)
        return nxt.timestamp()
    wall = dt.datetime.combine(day, dt.time(minutes // 60, minutes % 60), zone)
    return wall.timestamp()


class PrewarmTarget(Protocol):
    """What the scheduler warms through (the engine client has these)."""

    def pin_window(self, spec: AdapterSpec, *, device: bool = False) -> str:
        """Load ``spec`` if needed and pin it for a window (and its slot with ``device``); its
        digest."""

    def unpin_window(self, digest: str) -> str:
        """Release the window pin of ``digest`` (a pin an operator set stays)."""


@dataclass
class ScheduledAdapter:
    """One adapter under a window schedule, and what the scheduler holds for it."""

    spec: AdapterSpec
    schedule: WarmSchedule
    held: str | None = None  # "device" / "host": pinned by the scheduler
    load_s: float | None = None  # measured seconds of its last warm call
    retry_at: float = -math.inf  # after a failed warm


class PrewarmScheduler:
    """Pins adapters ahead of their warm windows and unpins them after; see the module
    docstring. Keyed by adapter name: a new revision replaces the old one's entry (whose pin is
    released). Not thread-safe: one owner calls it."""

    def __init__(
        self,
        target: PrewarmTarget,
        *,
        clock: Callable[[], float] = time.time,
        timer: Callable[[], float] = time.perf_counter,
        lead_s: float = 300.0,
        lead_factor: float = 20.0,
        retry_s: float = 60.0,
        max_sleep_s: float = 60.0,
        max_adapters: int = 10_000,
    ) -> None:
        if min(lead_s, lead_factor, retry_s) < 0 or not max_sleep_s > 0 or max_adapters < 1:
            raise ValueError(
                "prewarm: lead_s, lead_factor, retry_s must be >= 0, max_sleep_s > 0 and "
                "max_adapters >= 1"
            )
        self.target = target
        self.clock = clock
        self.timer = timer
        self.lead_s = float(lead_s)
        self.lead_factor = float(lead_factor)
        self.retry_s = float(retry_s)
        self.max_sleep_s = float(max_sleep_s)
        self.max_adapters = max_adapters
        self.adapters: dict[str, ScheduledAdapter] = {}

    # -- schedules ----------------------------------------------------------------------------
    def schedule(self, spec: AdapterSpec, schedule: WarmSchedule) -> None:
        """Follow ``schedule`` for ``spec`` (replacing the name's previous revision or
        schedule; a pin the old entry held is released at once)."""
        old = self.adapters.get(spec.name)
        if old is not None and old.spec.sha256 == spec.sha256 and old.schedule == schedule:
            return
        if old is None and len(self.adapters) >= self.max_adapters:
            raise ValueError(f"prewarm: more than {self.max_adapters} scheduled adapters")
        entry = ScheduledAdapter(spec, schedule)
        if old is not None:
            if old.spec.sha256 == spec.sha256:
                entry.load_s = old.load_s
            self._release(old)
        self.adapters[spec.name] = entry

    def unschedule(self, name: str) -> None:
        """Stop following ``name``'s schedule (its pin, if the scheduler holds one, goes)."""
        entry = self.adapters.pop(name, None)
        if entry is not None:
            self._release(entry)

    def lead_for(self, entry: ScheduledAdapter) -> float:
        """Seconds before an opening the adapter is warmed."""
        if entry.schedule.lead_s is not None:
            return entry.schedule.lead_s
        measured = self.lead_factor * entry.load_s if entry.load_s is not None else 0.0
        return max(self.lead_s, measured)

    def wanted(self, entry: ScheduledAdapter, now: float) -> tuple[str | None, float]:
        """(the tier ``entry`` should be warm in now or None, when that may change next)."""
        lead = self.lead_for(entry)
        want: str | None = None
        change = now + _HORIZON_S
        for lo, hi, tier in windows(entry.schedule, now - 1.0, now + lead + _HORIZON_S):
            start = lo - lead
            if start <= now < hi:
                if want != "device":
                    want = tier
                change = min(change, hi)
            elif start > now:
                change = min(change, start)
        return want, change

    # -- the loop body ------------------------------------------------------------------------
    def tick(self) -> float:
        """Warm and release what is due now; seconds until the next tick is due (at most
        ``max_sleep_s``, so a clock jump or a retry is noticed)."""
        now = self.clock()
        due = now + self.max_sleep_s
        for entry in list(self.adapters.values()):
            want, change = self.wanted(entry, now)
            due = min(due, change)
            if want == entry.held:
                continue
            if entry.held is not None:
                self._release(entry)
            if want is not None:
                if now < entry.retry_at:
                    due = min(due, entry.retry_at)
                    continue
                self._warm(entry, want, now)
                if entry.held is None:
                    due = min(due, entry.retry_at)
        return max(0.0, due - now)

    def held(self) -> dict[str, str]:
        """name -> the tier the scheduler holds it pinned in now."""
        return {n: e.held for n, e in self.adapters.items() if e.held is not None}

    def close(self) -> None:
        """Release every pin the scheduler holds (shut-down)."""
        for entry in self.adapters.values():
            self._release(entry)

    # -- internals ----------------------------------------------------------------------------
    def _warm(self, entry: ScheduledAdapter, tier: str, now: float) -> None:
        start = self.timer()
        try:
            self.target.pin_window(entry.spec, device=tier == "device")
        except Exception as e:  # a load failure must not stop the other schedules
            entry.retry_at = now + self.retry_s
            log.warning(
                "prewarm of adapter %r for its %s window failed (retry in %.0f s): %s",
                entry.spec.name,
                tier,
                self.retry_s,
                e,
            )
            return
        entry.load_s = max(0.0, self.timer() - start)
        entry.held = tier
        log.info("prewarmed adapter %r (%s) ahead of its window", entry.spec.name, tier)

    def _release(self, entry: ScheduledAdapter) -> None:
        if entry.held is None:
            return
        try:
            self.target.unpin_window(entry.spec.sha256)
        except Exception as e:  # an unknown digest: nothing was pinned
            log.warning("prewarm: releasing adapter %r failed: %s", entry.spec.name, e)
        entry.held = None
        log.info("released prewarmed adapter %r after its window", entry.spec.name)
