"""Home sets: every adapter's stable set of replicas, sized by its share of recent traffic.

Following "wherever the adapter is warm right now" chases residency that the router's own
spreading keeps changing; a static partition of the adapters over the replicas' memory makes
only compulsory misses. The ``home`` policy gives every adapter such a partition-like home set,
which residency and saturation adjust (``scoring.choose``: the best-scoring open member of the
home set, a warm one first; outside it only when every member is saturated or down)::

    count(a)  = requests for a, decayed by (1 - 1/window) per request (no clocks)
    share(a)  = count(a) / max(total count, window / 4)      (little evidence: small shares)
    k(a)      = clamp(ceil(share(a) * live replicas * spread), 1, live)
                (grows at once, shrinks only below 0.75 * (k - 1): hysteresis)
    bucket(a) = round(log2(count(a) / total)), moved only once 2x away from it (hysteresis);
                mass(a) = 2 ** bucket(a), the quantised traffic share
    order     = by k desc, then first seen (newcomers never displace others; which adapters a
                replica keeps in memory is its own cache's choice, the order only balances)
    for a in order: walk the live replicas by rendezvous h(a, r) desc and take k(a) of them,
        1. each with a free memory slot (adapters assigned < its memory) and room under the
           mass bound (assigned mass + mass(a) / k(a) <= (1 + balance) * total mass / live),
        2. then those with a free memory slot, 3. then any (the working set exceeds the fleet's
           memory: the overflow goes by rendezvous alone)

The assignment is recomputed every ``rebalance_every`` requests (at least a quarter of the
tracked adapters' count apart, so the cost per request stays bounded) and whenever the live fleet
(URLs, memory sizes) changes; a new adapter in between is placed at once against the current
fill. Everything is a deterministic function of the requests seen and the replica views, so
removing one of N replicas moves only the adapters it was home to (and those the capacity bounds
pushed off their first choice), and adding one moves about 1/N of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from loraplex.router.scoring import (
    Decision,
    ReplicaView,
    Thresholds,
    Weights,
    choose,
    rendezvous,
)
from loraplex.settings import check_fields, setting

_SHRINK = 0.75  # k shrinks once the raw size is below _SHRINK * (k - 1)
_BUCKET_HYSTERESIS = 1.0  # a bucket moves once log2(share) is this far from it (2x)
_PRUNE_BELOW = 0.05  # decayed counts below this are forgotten (about 3 windows unseen)


@dataclass(frozen=True)
class HomeSettings:
    """How the ``home`` policy sizes and places home sets."""

    spread: float = field(
        default=1.0,
        metadata=setting(
            "--home-spread",
            gt=0,
            metavar="FACTOR",
            group="routing",
            help="home-set size = ceil(traffic share x live replicas x FACTOR): an adapter "
            "with more than its replica's fair share of traffic gets more homes "
            "(default: {default})",
        ),
    )
    window: int = field(
        default=1000,
        metadata=setting(
            "--home-window",
            ge=1,
            metavar="REQUESTS",
            group="routing",
            help="traffic shares are measured over about this many recent requests "
            "(exponential decay) (default: {default})",
        ),
    )
    balance: float = field(
        default=0.25,
        metadata=setting(
            "--home-balance",
            ge=0,
            metavar="FRACTION",
            group="routing",
            help="a replica is home to at most (1 + FRACTION) x its fair share of traffic "
            "while others have room (default: {default})",
        ),
    )
    rebalance_every: int = field(
        default=64,
        metadata=setting(
            "--home-rebalance",
            ge=1,
            metavar="REQUESTS",
            group="routing",
            help="requests between recomputations of the home sets, at least; with many "
            "adapters tracked, a quarter of their number (default: {default})",
        ),
    )

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting (the declared bounds)."""
        check_fields(self)


class TrafficShares:
    """Decayed request counts per adapter, in first-seen order (the dict's order)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.counts: dict[str, float] = {}
        self.total = 0.0
        self._undecayed = 0  # requests since the last decay

    def observe(self, adapter: str) -> None:
        self.counts[adapter] = self.counts.get(adapter, 0.0) + 1.0
        self.total += 1.0
        self._undecayed += 1

    def decay(self) -> None:
        """Apply the decay owed for the requests since the last call; forget tiny counts."""
        f = (1.0 - 1.0 / self.window) ** self._undecayed if self.window > 1 else 0.0
        self._undecayed = 0
        kept: dict[str, float] = {}
        for a, c in self.counts.items():
            if c * f >= _PRUNE_BELOW:
                kept[a] = c * f
        self.counts = kept
        self.total = sum(kept.values())

    def share(self, adapter: str) -> float:
        """Fraction of recent requests, small while there is little evidence."""
        return self.counts.get(adapter, 0.0) / max(self.total, self.window / 4, 1.0)

    def fraction(self, adapter: str) -> float:
        """Fraction of the requests counted now (no evidence floor)."""
        return self.counts.get(adapter, 0.0) / self.total if self.total > 0 else 0.0


@dataclass(frozen=True)
class Member:
    """A live replica as home placement sees it."""

    url: str
    memory: int | None  # adapters it can hold in memory (device + host); None: unknown


class Placer:
    """Places adapters one after another: k homes each, by rendezvous order, under the
    memory-slot and traffic-mass bounds (the three passes of the module docstring)."""

    def __init__(self, members: Sequence[Member], total_mass: float, balance: float) -> None:
        self.members = list(members)
        self.count = {m.url: 0 for m in members}
        self.mass = {m.url: 0.0 for m in members}
        self.bound = (1.0 + balance) * total_mass / max(len(members), 1)
        self._memory = {m.url: m.memory for m in members}
        self._with_room = {m.url for m in members if m.memory is None or m.memory > 0}

    def rank(self, adapter: str) -> list[str]:
        """The live replicas in the adapter's rendezvous order, best first."""
        urls = [m.url for m in self.members]
        return sorted(urls, key=lambda u: rendezvous(adapter, u), reverse=True)

    def place(
        self, adapter: str, k: int, mass: float, order: Sequence[str], *, commit: bool = True
    ) -> tuple[str, ...]:
        """Take ``k`` replicas for ``adapter`` from ``order`` (its rendezvous ranking);
        ``commit=False``: only say where, taking no room."""
        k = max(1, min(k, len(order)))
        share = mass / k
        if not self._with_room:  # every replica's memory is taken: rendezvous alone
            chosen = list(order[:k])
        else:
            chosen = []
            count, memory, load = self.count, self._memory, self.mass
            free = [u for u in order if (m := memory[u]) is None or count[u] < m]
            for u in free:  # 1. a free memory slot and room under the mass bound
                if load[u] + share <= self.bound + 1e-12:
                    chosen.append(u)
                    if len(chosen) == k:
                        break
            for group in (free, order):  # 2. a free memory slot, 3. any
                for u in group:
                    if len(chosen) == k:
                        break
                    if u not in chosen:
                        chosen.append(u)
        if commit:
            for u in chosen:
                self.count[u] += 1
                self.mass[u] += share
                cap = self._memory[u]
                if cap is not None and self.count[u] == cap:
                    self._with_room.discard(u)
        # preference order within the set: the adapter's rendezvous order
        return tuple(u for u in order if u in chosen)


def assign_homes(
    adapters: Iterable[tuple[str, int, float]], members: Sequence[Member], balance: float
) -> dict[str, tuple[str, ...]]:
    """``(name, k, mass)`` in placement order -> each adapter's home URLs, best first (a pure
    function: the same inputs give the same homes)."""
    items = list(adapters)
    placer = Placer(members, sum(m for _, _, m in items), balance)
    return {a: placer.place(a, k, m, placer.rank(a)) for a, k, m in items}


class HomeMap:
    """The router's home sets: traffic shares, sizes and placement, kept between requests.

    ``observe(adapter)`` once per answered request (a replica's 2xx with its adapter state:
    what clients merely ask for never counts, so a flood of bogus names cannot move anyone's
    home); ``home(adapter, views)`` -> indices into ``views`` of the adapter's home set, best
    first (the live ones only). A name never answered gets where it would be placed, taking no
    room."""

    def __init__(self, settings: HomeSettings | None = None) -> None:
        self.settings = settings or HomeSettings()
        self.shares = TrafficShares(self.settings.window)
        self.k: dict[str, int] = {}
        self.bucket: dict[str, int] = {}
        self.homes: dict[str, tuple[str, ...]] = {}
        self.rebalances = 0
        self._fleet: tuple[Member, ...] | None = None
        self._placer: Placer | None = None
        self._ranks: dict[str, list[str]] = {}  # adapter -> rendezvous order over the fleet
        self._since = 0  # requests observed since the last rebalance

    def observe(self, adapter: str) -> None:
        self.shares.observe(adapter)
        self._since += 1

    def home(self, adapter: str, views: Sequence[ReplicaView]) -> list[int]:
        fleet = tuple(
            sorted((Member(v.url, v.memory) for v in views if v.healthy), key=lambda m: m.url)
        )
        if not fleet:
            return []
        # at least rebalance_every requests apart, and one per len(tracked) / 4 requests, so
        # the cost per request stays bounded however many adapters are tracked
        every = max(self.settings.rebalance_every, len(self.shares.counts) // 4)
        if fleet != self._fleet or self._since >= every:
            self.rebalance(fleet)
        homes = self.homes.get(adapter)
        if homes is None:
            homes = self._place_new(adapter, commit=adapter in self.shares.counts)
        where = {v.url: i for i, v in enumerate(views)}
        return [where[u] for u in homes if u in where]

    # -- internals -------------------------------------------------------------------------------
    def _size(self, adapter: str, n: int) -> int:
        raw = self.shares.share(adapter) * n * self.settings.spread
        new = max(1, min(n, math.ceil(raw - 1e-9)))
        old = self.k.get(adapter)
        if old is not None:
            old = min(old, n)
            if new < old and raw > _SHRINK * (old - 1):
                new = old  # not clearly smaller yet: keep the set
        self.k[adapter] = new
        return new

    def _mass(self, adapter: str) -> float:
        f = self.shares.fraction(adapter)
        x = math.log2(f) if f > 0 else -64.0
        old = self.bucket.get(adapter)
        if old is None or abs(x - old) > _BUCKET_HYSTERESIS:
            old = round(x)
            self.bucket[adapter] = old
        return 2.0**old

    def _rank(self, adapter: str, placer: Placer) -> list[str]:
        r = self._ranks.get(adapter)
        if r is None:
            r = self._ranks[adapter] = placer.rank(adapter)
        return r

    def rebalance(self, fleet: tuple[Member, ...]) -> None:
        """Recompute every tracked adapter's size, bucket and home set over ``fleet``."""
        if fleet != self._fleet:
            self._ranks = {}
        self._fleet = fleet
        self._since = 0
        self.rebalances += 1
        self.shares.decay()
        names = list(self.shares.counts)
        for gone in set(self.k) - set(names):
            self.k.pop(gone, None)
            self.bucket.pop(gone, None)
            self._ranks.pop(gone, None)
        n = len(fleet)
        info = {a: (self._size(a, n), self._mass(a)) for a in names}
        seniority = {a: i for i, a in enumerate(names)}
        order = sorted(names, key=lambda a: (-info[a][0], seniority[a]))
        placer = Placer(fleet, sum(m for _, m in info.values()), self.settings.balance)
        self.homes = {a: placer.place(a, *info[a], self._rank(a, placer)) for a in order}
        self._placer = placer

    def _place_new(self, adapter: str, *, commit: bool) -> tuple[str, ...]:
        """Place an adapter first answered since the last rebalance against the current fill
        (``commit=False``: one never answered; nothing about it is kept)."""
        placer = self._placer
        assert placer is not None
        if not commit:
            return placer.place(adapter, 1, 0.0, placer.rank(adapter), commit=False)
        assert self._fleet is not None
        k, mass = self._size(adapter, len(self._fleet)), self._mass(adapter)
        homes = placer.place(adapter, k, mass, self._rank(adapter, placer))
        self.homes[adapter] = homes
        return homes


class Picker:
    """One router's decision state: the round-robin turn and the home map. The router and the
    routing simulation (``scripts/bench_router.py``) both decide through this object."""

    def __init__(
        self,
        policy: str = "home",
        weights: Weights | None = None,
        thresholds: Thresholds | None = None,
        homes: HomeSettings | None = None,
    ) -> None:
        self.policy = policy
        self.weights = weights or Weights()
        self.thresholds = thresholds or Thresholds()
        self.homes = HomeMap(homes)
        self.turn = 0

    def home_sets(self) -> dict[str, list[str]]:
        """Every tracked adapter's home URLs, best first (``GET /v1/replicas``)."""
        return {a: list(h) for a, h in sorted(self.homes.homes.items())}

    def note_answered(self, adapter: str) -> None:
        """A replica answered a request for ``adapter`` (2xx with its adapter state): one
        request of traffic for the home sets."""
        if self.policy == "home":
            self.homes.observe(adapter)

    def pick(
        self,
        views: Sequence[ReplicaView],
        adapter: str | None,
        *,
        exclude: frozenset[int] = frozenset(),
    ) -> Decision | None:
        """Choose a replica for one attempt of a request."""
        home: list[int] | None = None
        if self.policy == "home" and adapter is not None:
            home = self.homes.home(adapter, views)
        d = choose(
            views,
            adapter,
            policy=self.policy,
            weights=self.weights,
            thresholds=self.thresholds,
            turn=self.turn,
            exclude=exclude,
            home=home,
        )
        self.turn += 1
        return d
