"""The default eviction policy, ``hybrid``, and ``hybrid-forecast`` (hybrid plus demand forecast).

The hybrid keep-score
---------------------
For adapter ``k`` in tier ``T`` at time ``now``::

    byte-budgeted tiers (host memory, disk):   S(k, T) = F(k) * P(k) * C(k, T) / size(k)
    slot-counted tiers (device slots):         S(k, T) = F(k) * P(k)

    F(k)    = max_i  n_i(k) * ln2 / h_i          # request rate (req/s), max over rolling windows
              n_i(k) = sum over past requests at t of 2 ** (-(now - t) / h_i)
              h = (60 s, 600 s)                   # a short window reacts, a long one remembers
    P(k)    = 2 ** priority(k)                    # SLO class (priority_base = 2)
    C(k, T) = seconds to bring k back into T: the measured load time into T (per-key EWMA,
              alpha 0.3; else the tier's EWMA seconds/byte * size; else 5 ms + size / 1 GB/s),
              plus, when ``tier_order`` is given, the measured cost of each tier below T down to
              the first one still holding k (host memory backed by disk is cheap to refill)

(exponents: ``size_exponent`` = ``cost_exponent`` = 1; ``slot_cost_exponent`` = 0 — see below.)

On byte tiers it is a GreedyDual-Size-Frequency benefit density — reload seconds saved per
second per byte held — with decayed (rolling-window) counts:

- *Recency* is built into ``n_i``: every request's weight halves every ``h_i`` seconds, so of two
  adapters requested equally often the more recent one scores higher, and a formerly hot adapter
  fades instead of squatting forever (the classic LFU pollution problem).
- *Admission by frequency*: statistics outlive residency (ghost entries, bounded by
  ``max_tracked``), so a newcomer requested once scores ``~ln2/h`` and is the first victim at the
  next miss, while an adapter that comes back regains its history. A burst of one-off cold
  adapters therefore churns through one slot instead of flushing the hot set. On an independent
  (Zipf) stream this converges to the optimal demand-paging policy A0 (keep the C-1 most
  probable adapters, cycle the last slot).
- *Priority* multiplies: one SLO class up is worth twice the request rate.
- *Cost and size*: under a byte budget a large adapter must earn proportionally more, unless it
  is also proportionally more expensive to reload.
- *Slots ignore cost and size*: every slot is the same size and every slot miss costs a load on
  the request's path. Charging slots their reload cost made L0 evict exactly the adapters whose
  host copy made them cheap — the hot ones — and collapsed the simulated L0 hit ratio. The
  expensive part of a reload is the host/disk tiers' business, where cost does count.

Ties (equal scores, e.g. two never-seen keys) fall back to least-recently-used first.

*Waiting instead of evicting* (``worth_waiting``, used by patient admissions only): when a
victim that may go now is worth more than ``wait_ratio`` (4) times the cheapest entry that is
merely busy (in flight or too new), the newcomer waits for that entry rather than evicting — a
burst of concurrent one-off requests queues for the cold slots instead of pushing hot adapters
out. The owner bounds the wait (its patience) and then admits anyway.

The demand-forecast term (``hybrid-forecast``)
----------------------------------------------
``F(k)`` only knows the past minutes: an adapter idle all night scores ~0 at 07:59 although its
tenant's office opens at 08:00. ``hybrid-forecast`` replaces ``F(k)`` by ``F(k) + w * D(k)``::

    D(k)  = E[req/s of k over [now, now + horizon)]  from :class:`DemandForecast`
              (0 when that is less than ``forecast_min_requests`` = 1 request in the horizon:
              a sparse history is noise, not demand; recomputed at most every
              ``forecast_refresh_s`` = 60 s)
            + waiting(k) * ln2 / h_0                 # requests queued for k right now
            (w = ``forecast_weight`` = 1, horizon = ``forecast_horizon_s`` = 30 min)
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loraplex.cache.policy.base import TrackingPolicy
from loraplex.cache.policy.forecast import DemandForecast

_LN2 = math.log(2.0)


@dataclass
class _Decayed:
    """Exponentially decayed request counts, one per half-life, lazily decayed to ``stamp``."""

    counts: list[float]
    stamp: float


@dataclass
class _Ewma:
    value: float | None = None
    alpha: float = 0.3

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


@dataclass
class _TierCost:
    per_byte: _Ewma = field(default_factory=_Ewma)  # seconds per byte, loads into this tier
    per_key: dict[str, _Ewma] = field(default_factory=dict)


class HybridPolicy(TrackingPolicy):
    """Keep-score = rate * priority * reload cost / size; see the module docstring."""

    name = "hybrid"

    def __init__(
        self,
        *,
        half_lives_s: Sequence[float] = (60.0, 600.0),
        priority_base: float = 2.0,
        size_exponent: float = 1.0,
        cost_exponent: float = 1.0,
        slot_cost_exponent: float = 0.0,
        tier_order: Sequence[str] | None = None,
        default_bytes_per_s: float = 1e9,
        default_load_overhead_s: float = 0.005,
        cost_alpha: float = 0.3,
        wait_ratio: float = 4.0,
        max_tracked: int = 100_000,
        forecast: DemandForecast | None = None,
        forecast_horizon_s: float = 1800.0,
        forecast_weight: float = 1.0,
        forecast_refresh_s: float = 60.0,
        forecast_min_requests: float = 1.0,
    ) -> None:
        super().__init__(max_tracked=max_tracked)
        if forecast_horizon_s <= 0 or forecast_weight < 0 or forecast_refresh_s < 0:
            raise ValueError(
                "forecast_horizon_s must be > 0, forecast_weight and forecast_refresh_s >= 0"
            )
        if not half_lives_s or any(h <= 0 for h in half_lives_s):
            raise ValueError(f"half_lives_s must be positive, got {tuple(half_lives_s)}")
        if priority_base < 1:
            raise ValueError(f"priority_base must be >= 1, got {priority_base}")
        if default_bytes_per_s <= 0:
            raise ValueError(f"default_bytes_per_s must be > 0, got {default_bytes_per_s}")
        if not 0 < cost_alpha <= 1:
            raise ValueError(f"cost_alpha must be in (0, 1], got {cost_alpha}")
        self.half_lives_s = tuple(float(h) for h in half_lives_s)
        self._k = tuple(_LN2 / h for h in self.half_lives_s)  # decay constants (1/s)
        self.priority_base = float(priority_base)
        self.size_exponent = float(size_exponent)
        self.cost_exponent = float(cost_exponent)
        self.slot_cost_exponent = float(slot_cost_exponent)
        self.tier_order = tuple(tier_order) if tier_order is not None else None
        order = self.tier_order or ()
        self._below = {t: order[i + 1 :] for i, t in enumerate(order)}  # tiers below each tier
        self.default_bytes_per_s = float(default_bytes_per_s)
        self.default_load_overhead_s = float(default_load_overhead_s)
        self.cost_alpha = float(cost_alpha)
        self.wait_ratio = float(wait_ratio)
        self._freq: dict[str, _Decayed] = {}
        self._cost: dict[str, _TierCost] = {}
        self.forecast = forecast
        self.forecast_horizon_s = float(forecast_horizon_s)
        self.forecast_weight = float(forecast_weight)
        self.forecast_refresh_s = float(forecast_refresh_s)
        self.forecast_min_requests = float(forecast_min_requests)
        self._waiting: dict[str, int] = {}  # key -> requests queued for it (set_waiting)
        # key -> (when, forecast req/s over the horizon then): a forecast moves slowly, so it
        # is recomputed at most every forecast_refresh_s (evictions score many candidates)
        self._predicted: dict[str, tuple[float, float]] = {}

    # statistics ------------------------------------------------------------------------------
    def _observe(self, key: str, now: float) -> None:
        d = self._freq.get(key)
        if d is None:
            self._freq[key] = _Decayed([1.0] * len(self.half_lives_s), now)
        else:
            dt = max(0.0, now - d.stamp)
            d.counts = [c * math.exp(-dt * k) + 1.0 for c, k in zip(d.counts, self._k, strict=True)]
            d.stamp = max(d.stamp, now)
        if self.forecast is not None:
            self.forecast.observe(key, now)

    def _forget(self, key: str) -> None:
        super()._forget(key)
        self._freq.pop(key, None)
        self._waiting.pop(key, None)
        self._predicted.pop(key, None)
        if self.forecast is not None:
            self.forecast.forget(key)
        for tc in self._cost.values():
            tc.per_key.pop(key, None)

    def rate(self, key: str, now: float) -> float:
        """F(k): the request-rate estimate (req/s), max over the rolling windows."""
        d = self._freq.get(key)
        if d is None:
            return 0.0
        dt = max(0.0, now - d.stamp)
        best = 0.0
        for c, k in zip(d.counts, self._k, strict=True):
            r = c * math.exp(-dt * k) * k  # n_i * ln2 / h_i
            if r > best:
                best = r
        return best

    def set_waiting(self, counts: Mapping[str, int]) -> None:
        """The requests queued now, per key (the owner's waiting queue); replaces the last."""
        self._waiting = {k: n for k, n in counts.items() if n > 0}

    def predicted(self, key: str, now: float) -> float:
        """D(k): forecast req/s over the horizon plus the queued requests (0 without forecast)."""
        fc = self.forecast
        if fc is None:
            return 0.0
        queued = self._waiting.get(key, 0) * self._k[0]
        cached = self._predicted.get(key)
        if cached is not None and cached[0] <= now < cached[0] + self.forecast_refresh_s:
            return cached[1] + queued
        rate = fc.rate(key, now, now + self.forecast_horizon_s)
        if rate * self.forecast_horizon_s < self.forecast_min_requests:
            rate = 0.0  # less than one expected request in the horizon: noise, not demand
        self._predicted[key] = (now, rate)
        return rate + queued

    def demand(self, key: str, now: float) -> float:
        """The rate term of the keep-score: F(k), plus w * D(k) with a forecast."""
        if self.forecast is None:
            return self.rate(key, now)
        return self.rate(key, now) + self.forecast_weight * self.predicted(key, now)

    def forecast_demand(self, now: float, limit: int) -> list[tuple[str, float]]:
        """The ``limit`` adapters with the highest D(k) > 0, highest first: what to load ahead
        of demand. [] without a forecast."""
        if self.forecast is None or limit < 1:
            return []
        scored = [(self.predicted(k, now), k) for k in self.forecast.keys() if k in self._info]
        best = heapq.nlargest(limit, (x for x in scored if x[0] > 0))
        return [(k, d) for d, k in best]

    def record_load_cost(self, tier: str, key: str, seconds: float) -> None:
        if seconds < 0 or not math.isfinite(seconds):
            return
        tc = self._cost.setdefault(tier, _TierCost(per_byte=_Ewma(alpha=self.cost_alpha)))
        tc.per_key.setdefault(key, _Ewma(alpha=self.cost_alpha)).add(seconds)
        info = self._info.get(key)
        if info is not None and info.size_bytes > 0:
            tc.per_byte.add(seconds / info.size_bytes)

    def load_cost(self, key: str, tier: str) -> float:
        """Expected seconds for one load of ``key`` into ``tier`` (measured where possible)."""
        tc = self._cost.get(tier)
        if tc is not None:
            per_key = tc.per_key.get(key)
            if per_key is not None and per_key.value is not None:
                return per_key.value
        info = self._info.get(key)
        size = info.size_bytes if info is not None else 0
        if tc is not None and tc.per_byte.value is not None:
            return tc.per_byte.value * size
        return self.default_load_overhead_s + size / self.default_bytes_per_s

    def reload_cost(self, key: str, tier: str) -> float:
        """C(k, T): seconds to bring ``key`` back into ``tier`` from the nearest tier below it."""
        cost = self.load_cost(key, tier)
        below = self._below.get(tier)
        if below:
            holding = self._tiers.get(key, ())
            for lower in below:
                if lower in holding:
                    break
                cost += self.load_cost(key, lower)
        return cost

    def keep_score(self, key: str, tier: str, now: float, *, by_bytes: bool = True) -> float:
        info = self._info.get(key)
        if info is None:
            return 0.0
        score = self.demand(key, now) * self.priority_base**info.priority
        gamma = self.cost_exponent if by_bytes else self.slot_cost_exponent
        if gamma:
            score *= max(self.reload_cost(key, tier), 1e-12) ** gamma
        if by_bytes and self.size_exponent:
            score /= max(info.size_bytes, 1) ** self.size_exponent
        return score

    def worth_waiting(
        self,
        victims: Sequence[str],
        busy: Sequence[str],
        tier: str,
        now: float,
        *,
        by_bytes: bool = True,
    ) -> bool:
        """Wait when a victim is worth more than ``wait_ratio`` times the cheapest busy entry."""
        if not victims or not busy or self.wait_ratio <= 0:
            return False
        dearest_victim = max(self.keep_score(k, tier, now, by_bytes=by_bytes) for k in victims)
        cheapest_busy = min(self.keep_score(k, tier, now, by_bytes=by_bytes) for k in busy)
        return dearest_victim > self.wait_ratio * cheapest_busy

    def order_victims(
        self, candidates: Sequence[str], tier: str, now: float, *, by_bytes: bool = True
    ) -> list[str]:
        # keep_score inlined for speed (this runs under the cache lock on every eviction)
        exp, gamma = math.exp, self.cost_exponent if by_bytes else self.slot_cost_exponent
        last, freq, infos, ks = self._last, self._freq, self._info, self._k
        pb, beta = self.priority_base, self.size_exponent if by_bytes else 0.0
        tc = self._cost.get(tier)
        measured = tc.per_key if tc is not None else {}
        simple_cost = not self._below.get(tier)
        forecast = self.forecast is not None and self.forecast_weight > 0
        scored = []
        for key in candidates:
            info = infos.get(key)
            d = freq.get(key)
            score = 0.0
            if info is not None and d is not None:
                dt = now - d.stamp if now > d.stamp else 0.0
                if dt == 0.0:
                    score = max([c * k for c, k in zip(d.counts, ks, strict=True)])
                else:
                    for c, k in zip(d.counts, ks, strict=True):
                        r = c * exp(-dt * k) * k
                        if r > score:
                            score = r
                if forecast:
                    score += self.forecast_weight * self.predicted(key, now)
                if info.priority:
                    score *= pb**info.priority
                if gamma:
                    m = measured.get(key) if simple_cost else None
                    cost = m.value if m is not None and m.value is not None else None
                    if cost is None:
                        cost = self.reload_cost(key, tier)
                    score *= (cost if cost > 1e-12 else 1e-12) ** gamma
                if beta:
                    score /= (info.size_bytes if info.size_bytes > 1 else 1) ** beta
            scored.append((score, last.get(key, -math.inf), key))
        scored.sort()
        return [k for _, _, k in scored]

    def _prune(self) -> None:
        """Drop the tenth of the ghosts with the lowest long-window rate."""
        now = max((d.stamp for d in self._freq.values()), default=0.0)
        ghosts = [k for k in self._info if k not in self._tiers]
        ghosts.sort(key=lambda k: (self.rate(k, now), self._last.get(k, -math.inf)))
        for k in ghosts[: max(1, len(self._info) // 10)]:
            self._forget(k)


class ForecastHybridPolicy(HybridPolicy):
    """``hybrid`` with the demand-forecast term on (see the module docstring).

    ``epoch_s`` maps the owner's clock to Unix time for the hour buckets; None: the clock is
    ``time.monotonic`` (the server's), so ``time.time() - time.monotonic()`` now.
    """

    name = "hybrid-forecast"

    def __init__(
        self,
        *,
        epoch_s: float | None = None,
        forecast: DemandForecast | None = None,
        max_forecast_keys: int = 10_000,
        **kwargs: object,
    ) -> None:
        if forecast is None:
            epoch = time.time() - time.monotonic() if epoch_s is None else float(epoch_s)
            forecast = DemandForecast(epoch_s=epoch, max_keys=max_forecast_keys)
        super().__init__(forecast=forecast, **kwargs)  # type: ignore[arg-type]
