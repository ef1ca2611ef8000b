"""Per-adapter demand by hour of day and hour of week: what the ``hybrid-forecast`` policy adds.

:class:`DemandForecast` keeps, per adapter, exponentially decayed request counts in 24
hour-of-day and 168 hour-of-week buckets (UTC; half-lives 3 and 14 days), normalised by the
decayed number of times each bucket has elapsed since the adapter was first seen, so a bucket
predicts "requests in this hour on a typical day". The week bucket speaks once that hour of the
week has passed at least once (weekends differ from weekdays), the day bucket before that.
Memory is bounded: 192 floats per adapter, at most ``max_keys`` adapters. The owner feeds the
queue with ``HybridPolicy.set_waiting``, and may ask ``HybridPolicy.forecast_demand`` which
adapters to load ahead of demand (``TierController.prefetch_slot``).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

_HOUR = 3600.0
_DAY_H, _WEEK_H = 24, 168
_MONDAY_OFFSET_H = 72  # 1970-01-01 00:00 UTC was a Thursday: hour 0 is hour 72 of its week


@dataclass
class _History:
    """One adapter's decayed counts by hour of day and hour of week, scaled to ``ref``."""

    day: array  # [24]  sum of 2 ** ((t - ref) / day_half_life) per request in that hour
    week: array  # [168] same with the week half-life
    ref: float  # the time the scale is relative to (renormalised when it drifts far)
    first: float  # when the adapter was first seen (buckets count from its hour)


class DemandForecast:
    """Per-adapter time-of-day / day-of-week request history with decay; bounded memory.

    ``epoch_s`` turns the owner's clock into Unix time (``wall = now + epoch_s``): buckets are
    UTC hours. ``rate(key, start, end)`` is the expected request rate over ``[start, end)``::

        for each hour H overlapping [start, end):
            c(H) = week estimate of H's hour-of-week bucket if that bucket has elapsed since
                   the adapter was first seen, else its hour-of-day estimate
            estimate of bucket b = (decayed sum of requests in b) / (decayed number of b's
                                   elapsed occurrences since first seen)
        rate = sum over H of c(H) * overlap(H) / 3600 / (end - start)
    """

    def __init__(
        self,
        *,
        epoch_s: float = 0.0,
        day_half_life_s: float = 3 * 86400.0,
        week_half_life_s: float = 14 * 86400.0,
        max_keys: int = 10_000,
    ) -> None:
        if day_half_life_s <= 0 or week_half_life_s <= 0:
            raise ValueError("forecast half-lives must be > 0")
        if max_keys < 1:
            raise ValueError(f"forecast max_keys must be >= 1, got {max_keys}")
        if not math.isfinite(epoch_s):
            raise ValueError(f"forecast epoch_s must be finite, got {epoch_s}")
        self.epoch_s = float(epoch_s)
        self.day_half_life_s = float(day_half_life_s)
        self.week_half_life_s = float(week_half_life_s)
        self.max_keys = max_keys
        self._hist: dict[str, _History] = {}

    def __len__(self) -> int:
        return len(self._hist)

    def __contains__(self, key: object) -> bool:
        return key in self._hist

    def keys(self) -> list[str]:
        return list(self._hist)

    def observe(self, key: str, now: float) -> None:
        """One request for ``key`` at ``now``."""
        h = self._hist.get(key)
        if h is None:
            if len(self._hist) >= self.max_keys:
                self._prune(now)
            h = _History(array("d", bytes(8 * _DAY_H)), array("d", bytes(8 * _WEEK_H)), now, now)
            self._hist[key] = h
        if now - h.ref > 32 * self.day_half_life_s:  # keep the scale factors in range
            self._rescale(h, now)
        hour = math.floor((now + self.epoch_s) / _HOUR)
        h.day[hour % _DAY_H] += 2.0 ** ((now - h.ref) / self.day_half_life_s)
        h.week[(hour + _MONDAY_OFFSET_H) % _WEEK_H] += 2.0 ** (
            (now - h.ref) / self.week_half_life_s
        )

    def forget(self, key: str) -> None:
        self._hist.pop(key, None)

    def hourly(self, key: str, hour: int, now: float) -> float:
        """Expected requests of ``key`` in the absolute UTC hour ``hour`` (0 if unknown)."""
        h = self._hist.get(key)
        if h is None:
            return 0.0
        first_hour = math.floor((h.first + self.epoch_s) / _HOUR)
        now_hour = math.floor((now + self.epoch_s) / _HOUR)
        wb = (hour + _MONDAY_OFFSET_H) % _WEEK_H
        w = self._estimate(
            h.week, wb, hour, _WEEK_H, first_hour, now_hour, now, h.ref, self.week_half_life_s
        )
        if w is not None:
            return w
        d = self._estimate(
            h.day,
            hour % _DAY_H,
            hour,
            _DAY_H,
            first_hour,
            now_hour,
            now,
            h.ref,
            self.day_half_life_s,
        )
        return d if d is not None else 0.0

    def rate(self, key: str, start: float, end: float) -> float:
        """Expected requests per second of ``key`` over ``[start, end)`` (``start`` is now)."""
        if key not in self._hist or end <= start:
            return 0.0
        total = 0.0
        t = start
        while t < end:
            hour = math.floor((t + self.epoch_s) / _HOUR)
            nxt = min(end, (hour + 1) * _HOUR - self.epoch_s)
            total += self.hourly(key, hour, start) * (nxt - t) / _HOUR
            t = nxt
        return total / (end - start)

    # internals -------------------------------------------------------------------------------
    def _estimate(
        self,
        buckets: array,
        b: int,
        hour: int,
        period: int,
        first_hour: int,
        now_hour: int,
        now: float,
        ref: float,
        half_life: float,
    ) -> float | None:
        """Bucket ``b``'s requests per occurrence, or None if no occurrence has elapsed."""
        # the latest completed occurrence of this bucket: the last hour congruent to ``hour``
        # before the current one (the current hour is still running)
        last = now_hour - 1 - ((now_hour - 1 - hour) % period)
        if last < first_hour:
            return None
        n = (last - first_hour) // period + 1
        r = 2.0 ** (-period * _HOUR / half_life)
        age = now + self.epoch_s - (last + 0.5) * _HOUR  # seconds since its middle
        occurrences = 2.0 ** (-age / half_life) * (1.0 - r**n) / (1.0 - r)
        if occurrences < 0.5:
            return None
        return buckets[b] * 2.0 ** (-(now - ref) / half_life) / occurrences

    def _rescale(self, h: _History, now: float) -> None:
        fd = 2.0 ** (-(now - h.ref) / self.day_half_life_s)
        fw = 2.0 ** (-(now - h.ref) / self.week_half_life_s)
        for i in range(_DAY_H):
            h.day[i] *= fd
        for i in range(_WEEK_H):
            h.week[i] *= fw
        h.ref = now

    def _prune(self, now: float) -> None:
        """Drop the tenth of the adapters with the least decayed history."""

        def weight(k: str) -> float:
            h = self._hist[k]
            return sum(h.week) * 2.0 ** (-(now - h.ref) / self.week_half_life_s)

        for k in sorted(self._hist, key=weight)[: max(1, len(self._hist) // 10)]:
            del self._hist[k]
