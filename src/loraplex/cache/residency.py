"""Per-tier residency index: who is resident, and which victims may go — hard constraints first.

A :class:`TierIndex` holds the accounting of one tier (device slots, host memory, disk): its
entries, used bytes and count, in-flight references, pins, per-tenant usage and counters. It owns
no memory itself; the cache that holds the real copies follows its decisions. Victims are chosen
by the (pluggable) :class:`~loraplex.cache.policy.EvictionPolicy`, but only among entries that
the hard constraints allow, whatever the policy says:

- an entry with in-flight requests (``acquire`` > ``release``) is never evicted;
- a pinned key is never evicted (a pin may be placed before the key is resident);
- an entry younger than ``min_residency_s`` is never evicted;
- a tenant's bytes in the tier never exceed its budget: to make room for a tenant over budget
  only that tenant's own entries are evicted;
- the tier's byte and count capacities are never exceeded.

Admission is planned, then carried out by the owner, which routes every eviction through one
path of its own (the tier controller, ``loraplex.cache.controller``)::

    victims = index.plan_admission(info, now)   # raises NoRoomError when impossible
                                                # (patient=True: may raise AdmissionDeferred)
    for key in victims: index.evict(key, now)   # each through the owner's eviction path
    index.insert(info, now)                     # fits now; a resident key is a hit

The owner plans and commits under its lock with the copy already loaded (loads happen before
any victim is dropped), so a plan cannot go stale between the two.

Request accounting: call ``lookup(key, now)`` once per request that reaches this tier (counts a
hit or a miss and refreshes recency); the policy's ``on_access`` is called by the owner once per
request, not by the index (one policy instance can serve every tier).

Thread safety: a TierIndex is **not** thread-safe by itself. Its owner (the tiered cache) calls
it under its own lock, which must also cover multi-tier sequences such as plan → commit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from loraplex.cache.policy import AdapterInfo, EvictionPolicy
from loraplex.cache.stats import TierCounters

__all__ = [
    "PIN_OPERATOR",
    "PIN_WINDOW",
    "AdmissionDeferred",
    "Entry",
    "NoRoomError",
    "ResidencyError",
    "TierCounters",
    "TierIndex",
]

PIN_OPERATOR = "operator"  # a pin set by hand (admin API, warm policy): only an unpin lifts it
PIN_WINDOW = "window"  # the prewarm scheduler's pin for a warm window: released after it


class ResidencyError(Exception):
    """A residency operation is not allowed (unknown key, release without acquire, ...)."""


class NoRoomError(ResidencyError):
    """Room for an adapter cannot be made without breaking a hard constraint.

    ``reason`` names why, e.g. "all 8 resident adapters are in use (6) or pinned (2)"; the caller
    waits (bounded) and retries, or answers with a clear 503.
    """

    def __init__(self, tier: str, key: str, reason: str | Callable[[], str]) -> None:
        super().__init__(tier, key)
        self.tier = tier
        self.key = key
        self._reason = reason  # a callable is formatted on first use (most refusals are retried)

    @property
    def reason(self) -> str:
        if callable(self._reason):
            self._reason = self._reason()
        return self._reason

    def __str__(self) -> str:
        return f"tier {self.tier}: no room for adapter {self.key[:16]}: {self.reason}"


class AdmissionDeferred(NoRoomError):
    """A patient plan: better to wait for a busy low-value entry than to evict valuable ones."""


@dataclass
class Entry:
    """One resident adapter in a tier. ``entries()`` hands out copies."""

    info: AdapterInfo
    inserted_at: float
    last_access: float
    pinned: bool = False
    inflight: int = 0


class TierIndex:
    """Residency accounting of one tier, with hard constraints applied around a policy.

    ``capacity_bytes`` / ``capacity_count``: limits (None = unlimited; at least one should be set
    for eviction to ever happen). ``tenant_budgets``: bytes per tenant in this tier. Evicted keys
    are remembered for ``thrash_window_s`` (at most ``ghost_capacity`` of them) to count
    reload-after-eviction.
    """

    def __init__(
        self,
        name: str,
        *,
        capacity_bytes: int | None,
        capacity_count: int | None,
        policy: EvictionPolicy,
        min_residency_s: float = 0.0,
        tenant_budgets: Mapping[str, int] | None = None,
        thrash_window_s: float = 60.0,
        ghost_capacity: int = 4096,
    ) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"tier {name}: capacity_bytes must be >= 0, got {capacity_bytes}")
        if capacity_count is not None and capacity_count < 0:
            raise ValueError(f"tier {name}: capacity_count must be >= 0, got {capacity_count}")
        if min_residency_s < 0:
            raise ValueError(f"tier {name}: min_residency_s must be >= 0, got {min_residency_s}")
        if thrash_window_s < 0 or ghost_capacity < 0:
            raise ValueError(f"tier {name}: thrash_window_s and ghost_capacity must be >= 0")
        budgets = dict(tenant_budgets or {})
        for tenant, b in budgets.items():
            if b < 0:
                raise ValueError(f"tier {name}: budget of tenant {tenant!r} must be >= 0, got {b}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.capacity_count = capacity_count
        self.policy = policy
        self.min_residency_s = float(min_residency_s)
        self.tenant_budgets = budgets
        self.thrash_window_s = float(thrash_window_s)
        self.ghost_capacity = ghost_capacity
        self.counters = TierCounters()
        self._entries: dict[str, Entry] = {}
        self._pins: dict[str, set[str]] = {}  # key -> who pinned it (see :meth:`pin`)
        self._used_bytes = 0
        self._tenant_bytes: dict[str, int] = {}
        self._ghosts: OrderedDict[str, float] = OrderedDict()  # evicted key -> eviction time

    # ----------------------------------------------------------------------------- queries
    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def count(self) -> int:
        return len(self._entries)

    @property
    def by_bytes(self) -> bool:
        """Whether the tier is byte-budgeted (size matters to the policy) or slot-counted."""
        return self.capacity_bytes is not None

    def contains(self, key: str) -> bool:
        return key in self._entries

    __contains__ = contains

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Entry | None:
        """A copy of ``key``'s entry, or None."""
        e = self._entries.get(key)
        return dataclasses.replace(e) if e is not None else None

    def peek(self, key: str) -> Entry | None:
        """``key``'s live entry, or None: read it, never change it (:meth:`get` copies)."""
        return self._entries.get(key)

    def entries(self) -> dict[str, Entry]:
        """Snapshot (copies) of every resident entry."""
        return {k: dataclasses.replace(e) for k, e in self._entries.items()}

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def is_pinned(self, key: str) -> bool:
        return key in self._pins

    def evictable(self, key: str, now: float) -> bool:
        """Whether the hard constraints allow evicting ``key`` now."""
        e = self._entries.get(key)
        return e is not None and self._why_kept(key, e, now) is None

    # ------------------------------------------------------------------------ per request
    def lookup(self, key: str, now: float) -> bool:
        """Count a hit (and refresh recency) or a miss for one request reaching this tier."""
        if key in self._entries:
            self.touch(key, now)
            return True
        self.counters.misses += 1
        return False

    def touch(self, key: str, now: float) -> None:
        """A hit on resident ``key``."""
        e = self._require(key)
        e.last_access = max(e.last_access, now)
        self.counters.hits += 1

    def acquire(self, key: str) -> None:
        """One more in-flight request uses ``key``: it cannot be evicted until released."""
        self._require(key).inflight += 1

    def release(self, key: str) -> None:
        e = self._require(key)
        if e.inflight <= 0:
            raise ResidencyError(f"tier {self.name}: release of {key[:16]} without acquire")
        e.inflight -= 1

    def pin(self, key: str, owner: str = PIN_OPERATOR) -> None:
        """Never evict ``key`` (it need not be resident yet: the pin applies once it is).
        ``owner`` names who pinned it (an operator, a warm window): each owner's pin is
        released on its own, and ``key`` stays pinned while any owner holds it."""
        self._pins.setdefault(key, set()).add(owner)
        if key in self._entries:
            self._entries[key].pinned = True

    def unpin(self, key: str, owner: str | None = None) -> None:
        """Release ``owner``'s pin of ``key`` (None: every owner's)."""
        owners = self._pins.get(key)
        if owners is not None and owner is not None:
            owners.discard(owner)
        if owners is not None and (owner is None or not owners):
            del self._pins[key]
        if key in self._entries:
            self._entries[key].pinned = key in self._pins

    def pin_owners(self, key: str) -> frozenset[str]:
        """Who holds a pin of ``key`` (empty: not pinned)."""
        return frozenset(self._pins.get(key, ()))

    def remove(self, key: str, now: float = 0.0, *, force: bool = False) -> Entry:
        """Drop ``key`` on request (admin evict, corrupt copy), not as a policy eviction.

        Refuses an entry with in-flight requests, always, and a pinned one unless ``force``.
        Not counted in ``evictions``.
        """
        e = self._require(key)
        if e.inflight > 0:
            raise ResidencyError(
                f"tier {self.name}: adapter {key[:16]} has {e.inflight} in-flight request(s)"
            )
        if e.pinned and not force:
            raise ResidencyError(f"tier {self.name}: adapter {key[:16]} is pinned")
        self._drop(key)
        self.policy.on_evict(key, self.name, now)
        return e

    def evict(self, key: str, now: float) -> Entry:
        """Evict ``key`` as a policy eviction: counted, remembered for reload-after-eviction.

        Only an entry the hard constraints allow to go (see :meth:`evictable`); anything else
        raises ResidencyError. The caller chose it (a plan's victim, or policy-ordered).
        """
        e = self._require(key)
        why = self._why_kept(key, e, now)
        if why is not None:
            raise ResidencyError(f"tier {self.name}: adapter {key[:16]} may not be evicted ({why})")
        self._evict(key, now)
        return e

    # ------------------------------------------------------------------------ admission
    def plan_admission(self, info: AdapterInfo, now: float, *, patient: bool = False) -> list[str]:
        """Victims to evict so that ``info`` fits, lowest keep-score first; [] when it already fits.

        Raises :class:`NoRoomError` when the hard constraints make it impossible. Changes nothing.
        With ``patient``, raises :class:`AdmissionDeferred` when the policy judges it better to
        wait for a busy (in-flight or too new) low-value entry than to evict the victims now; the
        caller waits for a release and retries, and plans impatiently once it has waited enough.
        """
        if info.key in self._entries:
            return []
        size = info.size_bytes
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            raise NoRoomError(
                self.name,
                info.key,
                f"{_fmt_bytes(size)} is larger than the tier ({_fmt_bytes(self.capacity_bytes)})",
            )
        if self.capacity_count == 0:
            raise NoRoomError(self.name, info.key, "the tier has no slots")
        tenant = info.tenant
        budget = self.tenant_budgets.get(tenant) if tenant is not None else None
        if budget is not None and size > budget:
            raise NoRoomError(
                self.name,
                info.key,
                f"{_fmt_bytes(size)} exceeds tenant {tenant!r}'s budget ({_fmt_bytes(budget)})",
            )

        victims: list[str] = []
        chosen: set[str] = set()
        freed = 0
        # 1. a tenant over its budget makes room among its own entries
        if budget is not None:
            need = self.tenant_bytes(tenant) + size - budget  # type: ignore[arg-type]
            if need > 0:
                own = [k for k, e in self._entries.items() if e.info.tenant == tenant]
                for k in self._ordered(own, now):
                    if freed >= need:
                        break
                    victims.append(k)
                    chosen.add(k)
                    freed += self._entries[k].info.size_bytes
                if freed < need:
                    raise NoRoomError(
                        self.name,
                        info.key,
                        f"tenant {tenant!r} is at its budget ({_fmt_bytes(budget)}) and "
                        + self._kept_reason(own, now),
                    )
        # 2. the tier's capacities
        if not self._fits(size, freed, len(victims)):
            rest = [k for k in self._entries if k not in chosen]
            for k in self._ordered(rest, now):
                victims.append(k)
                chosen.add(k)
                freed += self._entries[k].info.size_bytes
                if self._fits(size, freed, len(victims)):
                    break
            else:
                why = functools.partial(self._kept_reason, list(self._entries), now)
                raise NoRoomError(self.name, info.key, why)
        victims = self._trim(victims, info, now)
        if patient and victims:
            scope = [self._entries[v].info.tenant for v in victims]
            busy = [
                k
                for k, e in self._entries.items()
                if k not in chosen
                and not e.pinned
                and (budget is None or e.info.tenant in scope)
                and self._why_kept(k, e, now) is not None
            ]
            if busy and self.policy.worth_waiting(
                victims, busy, self.name, now, by_bytes=self.by_bytes
            ):
                raise AdmissionDeferred(
                    self.name,
                    info.key,
                    f"waiting for one of {len(busy)} busy adapter(s) is better than evicting "
                    f"{len(victims)} more valuable one(s) now",
                )
        return victims

    def insert(self, info: AdapterInfo, now: float) -> None:
        """Insert ``info`` when it fits now (its victims already evicted); ResidencyError if it
        does not, NoRoomError never: nothing is evicted here. A resident key is a hit."""
        if info.key in self._entries:
            self.touch(info.key, now)
            return
        if not self._plan_valid(info, [], now):
            raise ResidencyError(f"tier {self.name}: adapter {info.key[:16]} does not fit")
        self._insert(info, now)

    # ------------------------------------------------------------------------ internals
    def _require(self, key: str) -> Entry:
        e = self._entries.get(key)
        if e is None:
            raise ResidencyError(f"tier {self.name}: adapter {key[:16]} is not resident")
        return e

    def _why_kept(self, key: str, e: Entry, now: float) -> str | None:
        if e.inflight > 0:
            return "in use"
        if e.pinned:
            return "pinned"
        if now - e.inserted_at < self.min_residency_s:
            return "too new"
        return None

    def _ordered(self, keys: list[str], now: float) -> list[str]:
        """Evictable ``keys`` in policy order (first victim first)."""
        entries, why = self._entries, self._why_kept
        ok = [k for k in keys if why(k, entries[k], now) is None]
        if len(ok) <= 1:
            return ok
        order = self.policy.order_victims(ok, self.name, now, by_bytes=self.by_bytes)
        if len(order) != len(ok) or set(order) != set(
            ok
        ):  # a policy may only reorder, never add or drop
            raise ResidencyError(f"policy {self.policy.name!r} returned a different key set")
        return order

    def _kept_reason(self, keys: list[str], now: float) -> str:
        keys = [k for k in keys if k in self._entries]  # formatted later: some may have left
        why: dict[str, int] = {}
        for k in keys:
            r = self._why_kept(k, self._entries[k], now)
            if r is not None:
                why[r] = why.get(r, 0) + 1
        n = len(keys)
        if not why:
            return f"evicting all {n} resident adapters would not free enough room"
        parts = [f"{r} ({why[r]})" for r in ("in use", "pinned", "too new") if r in why]
        listed = ", ".join(parts[:-1]) + (" or " if len(parts) > 1 else "") + parts[-1]
        kept = sum(why.values())
        if kept == n:
            return f"all {n} resident adapters are {listed}"
        return f"{kept} of {n} resident adapters are {listed} and the rest do not free enough room"

    def _fits(self, size: int, freed: int, n_victims: int) -> bool:
        if (
            self.capacity_bytes is not None
            and self._used_bytes - freed + size > self.capacity_bytes
        ):
            return False
        if (
            self.capacity_count is not None
            and len(self._entries) - n_victims + 1 > self.capacity_count
        ):
            return False
        return True

    def _plan_valid(self, info: AdapterInfo, victims: list[str], now: float) -> bool:
        """Victims all resident and evictable, and removing them makes ``info`` fit everywhere."""
        freed = 0
        tenant_freed = 0
        for k in victims:
            e = self._entries.get(k)
            if e is None or self._why_kept(k, e, now) is not None:
                return False
            freed += e.info.size_bytes
            if info.tenant is not None and e.info.tenant == info.tenant:
                tenant_freed += e.info.size_bytes
        if not self._fits(info.size_bytes, freed, len(victims)):
            return False
        budget = self.tenant_budgets.get(info.tenant) if info.tenant is not None else None
        return budget is None or (
            self.tenant_bytes(info.tenant) - tenant_freed + info.size_bytes <= budget  # type: ignore[arg-type]
        )

    def _trim(self, victims: list[str], info: AdapterInfo, now: float) -> list[str]:
        """Spare victims that turned out unnecessary (the greedy walk may overshoot on bytes)."""
        if len(victims) <= 1:
            return victims
        kept = list(victims)
        for k in reversed(victims):  # the highest keep-score first
            trial = [v for v in kept if v != k]
            if self._plan_valid(info, trial, now):
                kept = trial
        return kept

    def _insert(self, info: AdapterInfo, now: float) -> None:
        key = info.key
        self._entries[key] = Entry(
            info=info, inserted_at=now, last_access=now, pinned=key in self._pins
        )
        self._used_bytes += info.size_bytes
        if info.tenant is not None:
            self._tenant_bytes[info.tenant] = self.tenant_bytes(info.tenant) + info.size_bytes
        self.counters.inserts += 1
        evicted_at = self._ghosts.pop(key, None)
        if evicted_at is not None and now - evicted_at <= self.thrash_window_s:
            self.counters.reload_after_eviction += 1
        self.policy.on_insert(key, info, self.name, now)
        self._check()

    def _evict(self, key: str, now: float) -> None:
        self._drop(key)
        self.counters.evictions += 1
        if self.ghost_capacity:
            self._ghosts.pop(key, None)
            self._ghosts[key] = now
            horizon = now - self.thrash_window_s
            while self._ghosts and (
                len(self._ghosts) > self.ghost_capacity
                or next(iter(self._ghosts.values())) < horizon
            ):
                self._ghosts.popitem(last=False)
        self.policy.on_evict(key, self.name, now)

    def _drop(self, key: str) -> None:
        e = self._entries.pop(key)
        self._used_bytes -= e.info.size_bytes
        t = e.info.tenant
        if t is not None:
            left = self._tenant_bytes[t] - e.info.size_bytes
            if left:
                self._tenant_bytes[t] = left
            else:
                del self._tenant_bytes[t]

    def _check(self) -> None:
        """Budgets hold after every change (cheap; a bug here must fail loudly, not leak)."""
        if self.capacity_bytes is not None and self._used_bytes > self.capacity_bytes:
            raise AssertionError(f"tier {self.name}: {self._used_bytes} bytes > capacity")
        if self.capacity_count is not None and len(self._entries) > self.capacity_count:
            raise AssertionError(f"tier {self.name}: {len(self._entries)} entries > capacity")
        for t, b in self.tenant_budgets.items():
            if self.tenant_bytes(t) > b:
                raise AssertionError(f"tier {self.name}: tenant {t!r} over budget")


def _fmt_bytes(n: float) -> str:
    """Human-readable bytes (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
