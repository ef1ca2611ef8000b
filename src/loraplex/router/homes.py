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
    mass(a)   = count(a) / total, the evidence missing below window / 4 requests spread evenly
                over the tracked adapters (a few requests' noise does not tell equally popular
                adapters apart)
    order     = by k desc, then first seen (newcomers never displace others; which adapters a
                replica keeps in memory is its own cache's choice, the order only balances)
    keep:  for a in order: each current home of a, while it has a free memory slot and room
           for a under the mass bound x 1.1, or x 1.6 (2x the fair share) while the total count
           is still below window / 4 (geometric in between): a move costs a cold start, so only
           a clear imbalance, or a replica gone, moves an adapter
    place: for a in order, its remaining k(a) - kept homes: walk its current homes, then the
           live replicas by rendezvous h(a, r) desc, and take
        1. each with a free memory slot (adapters assigned < its memory) and room under the
           mass bound (assigned mass + mass(a) / k(a) <= (1 + balance) * total mass / live),
        2. then those with a free memory slot, 3. then any (the working set exceeds the fleet's
           memory: the overflow goes by rendezvous alone)

The assignment is recomputed every ``rebalance_every`` requests (at least a quarter of the
tracked adapters' count apart, so the cost per request stays bounded) and whenever the live fleet
(URLs, memory sizes) changes. An adapter is placed when a replica first answers for it, on that
replica if it has a free memory slot (its copy is warm there; until then its requests go where
it would be placed, holding one memory slot there until the answer or the next rebalance, so
concurrent newcomers fill the fleet instead of one replica), so from empty caches the homes
fill the fleet's memory in the order adapters arrive and the rebalances that follow keep them:
a partition, with only the compulsory misses. Everything is a deterministic function of the answers seen and the replica
views; removing one of N replicas moves only the adapters it was home to, and a replica that
joins (or comes back) takes the adapters whose rendezvous order ranks it above their current
homes, about 1/N of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from loraplex.config.fields import check_fields, setting
from loraplex.router.scoring import (
    Decision,
    ReplicaView,
    Thresholds,
    Weights,
    choose,
    rendezvous,
)

_SHRINK = 0.75  # k shrinks once the raw size is below _SHRINK * (k - 1)
_KEEP_SLACK = 2.0  # with little evidence a warm home stays up to 2x its replica's fair share
_KEEP_OVER = 1.1  # with enough, up to 1.1x the mass bound (share noise near it moves nobody)
_PRUNE_BELOW = 0.05  # decayed counts below this are forgotten (about 3 windows unseen)
_TENTATIVE_MAX = 64  # newcomers' held slots (first request sent, not answered yet)


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
        """Fraction of the requests counted now, the evidence missing below ``window / 4``
        requests spread evenly over the tracked adapters (a few requests' noise does not make
        equally popular adapters look 3x apart)."""
        missing = max(0.0, self.window / 4 - self.total)
        if not self.counts:
            return 0.0
        prior = missing / len(self.counts)
        return (self.counts.get(adapter, 0.0) + prior) / (self.total + missing)


@dataclass(frozen=True)
class Member:
    """A live replica as home placement sees it."""

    url: str
    memory: int | None  # adapters it can hold in memory (device + host); None: unknown


class Placer:
    """Places adapters one after another: k homes each, by rendezvous order, under the
    memory-slot and traffic-mass bounds (the three passes of the module docstring)."""

    def __init__(
        self, members: Sequence[Member], total_mass: float, balance: float, keep: float = 1.0
    ) -> None:
        self.members = list(members)
        self.count = {m.url: 0 for m in members}
        self.mass = {m.url: 0.0 for m in members}
        self.balance = balance
        self.keep_over = keep  # kept homes may carry this x the mass bound
        self.total = 0.0
        self.fair = self.bound = 0.0
        self.grow(total_mass)
        self._memory = {m.url: m.memory for m in members}
        self._with_room = {m.url for m in members if m.memory is None or m.memory > 0}

    def rank(self, adapter: str) -> list[str]:
        """The live replicas in the adapter's rendezvous order, best first."""
        urls = [m.url for m in self.members]
        return sorted(urls, key=lambda u: rendezvous(adapter, u), reverse=True)

    def grow(self, mass: float) -> None:
        """Count ``mass`` more traffic in the fair share (an adapter placed between
        rebalances)."""
        self.total += mass
        self.fair = self.total / max(len(self.members), 1)
        self.bound = (1.0 + self.balance) * self.fair

    def keep(self, k: int, mass: float, homes: Sequence[str], *, bounded: bool = True) -> list[str]:
        """Of an adapter's current ``homes`` (best first), keep up to ``k`` that still have a
        free memory slot and, if ``bounded``, room for it under ``keep_over`` x the mass bound
        (or no mass yet); commits the kept ones. A move costs a cold start, so while the
        masses rest on little evidence only a clear imbalance is worth one."""
        share = mass / max(k, 1)
        limit = self.keep_over * self.bound + 1e-12
        kept = []
        for u in homes:
            if len(kept) == k:
                break
            if u not in self.count:
                continue
            cap = self._memory[u]
            if cap is not None and self.count[u] >= cap:
                continue
            if not bounded or self.mass[u] <= 0 or self.mass[u] + share <= limit:
                kept.append(u)
        self._commit(kept, share)
        return kept

    def place(
        self,
        adapter: str,
        k: int,
        mass: float,
        order: Sequence[str],
        *,
        commit: bool = True,
        have: Sequence[str] = (),
        prefer: Sequence[str] = (),
    ) -> tuple[str, ...]:
        """Take ``k`` replicas for ``adapter`` (``have`` of them already kept) from ``order``
        (its rendezvous ranking), trying ``prefer`` first (where it already lives);
        ``commit=False``: only say where, taking no room."""
        k = max(1, min(k, len(order)))
        share = mass / k
        chosen = list(have[:k])
        cands = [u for u in dict.fromkeys([*prefer, *order]) if u in self.count]
        if not self._with_room:  # every replica's memory is taken: where it is, or rendezvous
            for u in cands:
                if len(chosen) == k:
                    break
                if u not in chosen:
                    chosen.append(u)
        else:
            count, memory, load = self.count, self._memory, self.mass
            free = [u for u in cands if (m := memory[u]) is None or count[u] < m]
            for u in free:  # 1. a free memory slot and room under the mass bound
                if len(chosen) == k:
                    break
                if u not in chosen and load[u] + share <= self.bound + 1e-12:
                    chosen.append(u)
            for group in (free, cands):  # 2. a free memory slot, 3. any
                for u in group:
                    if len(chosen) == k:
                        break
                    if u not in chosen:
                        chosen.append(u)
        if commit:
            self._commit(chosen[len(have) :], share)
        # preference order within the set: the adapter's rendezvous order
        return tuple(u for u in order if u in chosen)

    def _commit(self, urls: Iterable[str], share: float) -> None:
        for u in urls:
            self.count[u] += 1
            self.mass[u] += share
            cap = self._memory[u]
            if cap is not None and self.count[u] >= cap:
                self._with_room.discard(u)

    def reserve(self, url: str) -> bool:
        """Hold one free memory slot of ``url`` for an adapter whose first request is on its
        way there (no traffic mass yet); False when it has none free."""
        if url not in self._with_room:
            return False
        self._commit([url], 0.0)
        return True

    def release(self, url: str) -> None:
        """Give back a slot :meth:`reserve` held."""
        if url in self.count and self.count[url] > 0:
            self.count[url] -= 1
            cap = self._memory[url]
            if cap is None or self.count[url] < cap:
                self._with_room.add(url)


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
        self.homes: dict[str, tuple[str, ...]] = {}
        self.rebalances = 0
        self._fleet: tuple[Member, ...] | None = None
        self._placer: Placer | None = None
        self._ranks: dict[str, list[str]] = {}  # adapter -> rendezvous order over the fleet
        self._since = 0  # requests observed since the last rebalance
        # adapter -> the replica its first request went to, a memory slot held there until it
        # is answered (so concurrent newcomers fill the fleet instead of one replica); oldest
        # first, at most _TENTATIVE_MAX, all dropped at a rebalance (names never answered
        # hold nothing for long)
        self._tentative: dict[str, str] = {}

    def observe(self, adapter: str, replica: str | None = None) -> None:
        """One answered request for ``adapter`` (by ``replica``, its URL, if known). An adapter
        answered for the first time is placed now, on the replica that answered if it has
        room: its copy is warm there, and a placement made later, against a fill that other
        newcomers have changed meanwhile, would move it."""
        self.shares.observe(adapter)
        self._since += 1
        self.unanswered(adapter)  # its held slot, if any: placed for real below
        if adapter not in self.homes and self._placer is not None:
            self._place_new(adapter, commit=True, served=replica)

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
            held = self._tentative.get(adapter)
            if held is not None:  # its placer's, on a live replica (a rebalance drops holds)
                homes = (held,)
            else:
                homes = self._place_new(adapter, commit=adapter in self.shares.counts)
                if adapter not in self.homes and homes:  # never answered: hold its slot
                    self._hold(adapter, homes[0])
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
        """The adapter's traffic share, for the mass bound (``TrafficShares.fraction``)."""
        return self.shares.fraction(adapter)

    def _rank(self, adapter: str, placer: Placer) -> list[str]:
        r = self._ranks.get(adapter)
        if r is None:
            r = self._ranks[adapter] = placer.rank(adapter)
        return r

    def _hold(self, adapter: str, url: str) -> None:
        placer = self._placer
        assert placer is not None
        if len(self._tentative) >= _TENTATIVE_MAX:
            self.unanswered(next(iter(self._tentative)))
        if placer.reserve(url):
            self._tentative[adapter] = url

    def unanswered(self, adapter: str) -> None:
        """A request for ``adapter`` ended without a success (a bogus name, a refusal): a slot
        held for its first answer is given back."""
        held = self._tentative.pop(adapter, None)
        if held is not None and self._placer is not None:
            self._placer.release(held)

    def rebalance(self, fleet: tuple[Member, ...]) -> None:
        """Recompute every tracked adapter's size, mass and home set over ``fleet``, keeping
        the homes it has where they still fit (module docstring)."""
        self._tentative = {}  # a fresh placer: the held slots go with the old one
        joined = {m.url for m in fleet} - {m.url for m in self._fleet or ()}
        if fleet != self._fleet:
            self._ranks = {}
        self._fleet = fleet
        self._since = 0
        self.rebalances += 1
        self.shares.decay()
        names = list(self.shares.counts)
        for gone in set(self.k) - set(names):
            self.k.pop(gone, None)
            self._ranks.pop(gone, None)
        n = len(fleet)
        info = {a: (self._size(a, n), self._mass(a)) for a in names}
        seniority = {a: i for i, a in enumerate(names)}
        order = sorted(names, key=lambda a: (-info[a][0], seniority[a]))
        # kept homes: up to 2x the fair share while the shares rest on few requests, 1.1x the
        # mass bound from window / 4 requests on
        balance = self.settings.balance
        evidence = min(1.0, self.shares.total / max(self.settings.window / 4, 1.0))
        loose = max(_KEEP_OVER, _KEEP_SLACK / (1.0 + balance))
        keep = max(_KEEP_OVER, loose ** (1.0 - evidence) * _KEEP_OVER**evidence)
        placer = Placer(fleet, sum(m for _, m in info.values()), balance, keep)
        old: dict[str, list[str]] = {}
        for a in order:  # the current homes still live, less those a newcomer outranks
            rank = self._rank(a, placer)
            homes = [u for u in self.homes.get(a, ()) if u in placer.count]
            if homes and joined:
                pos = {u: i for i, u in enumerate(rank)}
                top = min(pos[u] for u in joined)
                homes = [u for u in homes if pos[u] < top]
            old[a] = homes
        kept = {a: placer.keep(info[a][0], info[a][1], old[a]) for a in order}
        self.homes = {
            a: placer.place(a, *info[a], self._rank(a, placer), have=kept[a], prefer=old[a])
            for a in order
        }
        self._placer = placer

    def _place_new(
        self, adapter: str, *, commit: bool, served: str | None = None
    ) -> tuple[str, ...]:
        """Place an adapter first answered since the last rebalance against the current fill,
        ``served`` (the replica that answered it) first (``commit=False``: one never answered;
        nothing about it is kept)."""
        placer = self._placer
        assert placer is not None
        if not commit:
            return placer.place(adapter, 1, 0.0, placer.rank(adapter), commit=False)
        assert self._fleet is not None
        k, mass = self._size(adapter, len(self._fleet)), self._mass(adapter)
        placer.grow(mass)
        kept = placer.keep(k, mass, [served] if served is not None else [], bounded=False)
        homes = placer.place(adapter, k, mass, self._rank(adapter, placer), have=kept)
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

    def note_answered(self, adapter: str, replica: str | None = None) -> None:
        """``replica`` (its URL) answered a request for ``adapter`` (2xx with its adapter
        state): one request of traffic for the home sets."""
        if self.policy == "home":
            self.homes.observe(adapter, replica)

    def note_unanswered(self, adapter: str) -> None:
        """A request for ``adapter`` got an answer that was not a success: it counts for
        nothing, and a memory slot held for its first answer is free again."""
        if self.policy == "home":
            self.homes.unanswered(adapter)

    def pick(
        self,
        views: Sequence[ReplicaView],
        adapter: str | None,
        *,
        exclude: frozenset[int] = frozenset(),
        components: Sequence[str] = (),
    ) -> Decision | None:
        """Choose a replica for one attempt of a request (``components``: a composition's
        adapters, ``adapter`` its first; see :func:`~loraplex.router.scoring.choose`)."""
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
            components=components,
        )
        self.turn += 1
        return d
