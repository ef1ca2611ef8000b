"""Per-tenant admission limits: a request rate (token bucket) and a cap on sequences in flight.

A tenant over either limit gets 429 with ``Retry-After``, before anything is queued or loaded, so
one bursting tenant cannot fill the shared queue that ``--max-waiting`` protects.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class TenantLimitExceeded(Exception):
    """A tenant is over its rate or in-flight limit; ``retry_after`` in whole seconds."""

    def __init__(self, message: str, *, code: str, retry_after: int) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


class TenantLimits:
    """Token buckets (burst = max(1, rate) requests) and in-flight sequence counts per tenant."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}
        self._in_flight: dict[str, int] = {}

    def acquire(
        self,
        tenant: str,
        n: int,
        *,
        rate_rps: float | None,
        max_in_flight: int | None,
        requests: int | None = None,
    ) -> None:
        """Admit ``n`` sequences of ``tenant`` in flight, made of ``requests`` requests (default
        ``n``) for the rate, or raise :class:`TenantLimitExceeded`; on success the caller must
        :meth:`release` the same ``n`` when they are done."""
        cost = n if requests is None else requests
        with self._lock:
            now = self._clock()
            held = self._in_flight.get(tenant, 0)
            if max_in_flight is not None and held + n > max_in_flight:
                raise TenantLimitExceeded(
                    f"tenant {tenant!r} has {held} sequences in flight, this call needs {n} "
                    f"(limit {max_in_flight}); "
                    "retry later",
                    code="tenant_queue_full",
                    retry_after=1,
                )
            if rate_rps is not None:
                burst = max(1.0, rate_rps)
                b = self._buckets.get(tenant)
                if b is None:
                    b = self._buckets[tenant] = _Bucket(burst, now)
                b.tokens = min(burst, b.tokens + (now - b.stamp) * rate_rps)
                b.stamp = now
                if b.tokens < cost:
                    wait = (cost - b.tokens) / rate_rps if rate_rps > 0 else 3600.0
                    raise TenantLimitExceeded(
                        f"tenant {tenant!r} is over its rate limit ({rate_rps:g} requests/s); "
                        f"retry in {wait:.1f}s",
                        code="rate_limit_exceeded",
                        retry_after=max(1, math.ceil(wait)),
                    )
                b.tokens -= cost
            self._in_flight[tenant] = held + n

    def release(self, tenant: str, n: int) -> None:
        with self._lock:
            left = self._in_flight.get(tenant, 0) - n
            if left > 0:
                self._in_flight[tenant] = left
            else:
                self._in_flight.pop(tenant, None)

    def in_flight(self, tenant: str) -> int:
        with self._lock:
            return self._in_flight.get(tenant, 0)
