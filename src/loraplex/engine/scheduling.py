"""Scheduling policies: the order waiting sequences are admitted in, whom a waiting sequence
may preempt, which running one goes first when KV blocks run out, and (fair) the seats and
prompt tokens a class may take. ``loraplex.engine.scheduler.Scheduler`` runs the step and asks
its policy; it is chosen once at start-up, by name from ``POLICIES`` (``--scheduling-policy``)
or passed as an object.

- ``fcfs``: arrival order; the newest running sequence is preempted (vLLM's default).
- ``priority``: vLLM's: lowest ``Sequence.priority`` first, then arrival; a waiting sequence
  may preempt a running one of a strictly larger priority value, and under KV pressure the
  largest value (then the newest) goes first.
- ``fair``: SLO classes with weighted shares, and tenants balanced within a class by a virtual
  token counter (VTC, Sheng et al., "Fairness in Serving Large Language Models", OSDI '24)::

      class(seq)     = clamp(default_class + seq.priority, 0, len(class_weights) - 1)
      served tokens  = PROMPT_TOKEN_COST * prompt tokens + OUTPUT_TOKEN_COST * output tokens
      C[class]      += served / class_weights[class]       # per scheduled chunk
      V[class, ten] += served
      admit next: the class with the least C (ties: the more important), within it the tenant
                  with the least V (ties: the oldest head), within the tenant arrival order
      a key that becomes active starts at max(its own, min over active keys)  # no banked credit

  so a class with weight w gets about w / sum(w) of the tokens while all are backlogged and a
  lower class never starves. Production rules that keep a more important class's latency
  without thrashing the lower ones:

  - *headroom*: a lower class may not take the last K seats, K = sum over the more important
    classes of (their peak concurrency, running + waiting, over the last ``headroom_window``
    steps) minus (their running now); K leaves the lower class one seat at least. So a gold
    arrival usually finds a free seat instead of preempting.
  - *preempt only when needed*: a waiting sequence may preempt a running one of a less
    important class (whose C is at least its own) only when no seat or block is free; the
    victim is the least important class, within it the one with the least computed work
    (fewest computed tokens: the cheapest recompute), then the tenant most over its share,
    then the newest; and never one preempted within the last ``preempt_cooldown`` steps
    (hysteresis; under KV pressure such ones go last but still go, so memory always frees).
  - *seat shares*: a step's time grows with its rows, so every row of a lower class slows the
    steps of a more important one. While a more important class is active (it had a sequence
    within the last ``headroom_window`` steps), class ``c`` may run at most
    ``max(1, floor(max_num_seqs * w_c / (w_c + sum of the active more important classes' w)))``
    sequences (gold=8, batch=1: one batch seat in 8); new ones wait (nothing is preempted for
    it), and once the more important classes have been idle for a window the whole engine is
    the lower class's again. The weights say how much latency the lower class's throughput may
    cost: closer weights, more seats.
  - *prefill caps*: while a more important class has prompt work this step (a waiting
    sequence, or a running one mid-prompt), a lower class's prompt chunks in the step are
    capped at its weighted share of ``max_num_batched_tokens`` (decodes never are); when the
    more important classes only decode or are idle, the lower class gets the whole budget.

The scheduler keeps the accounting every policy may read (``SchedulerState``: the queues, each
sequence's class, the class and tenant service counters, the preemption cooldown); a policy
only decides. A new policy is a ``SchedulingPolicy`` subclass (``admission_order`` and
``victim``, plus whichever other hook differs from the defaults) and one entry in
``POLICIES``; for ``--scheduling-policy`` to offer it, also its name in
``loraplex.config.SCHEDULING_POLICIES`` (config imports nothing of the engine; a test checks
that both list the same names).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from loraplex.engine.sequence import Sequence

K = TypeVar("K", bound=Hashable)


class VirtualTokenCounter(Generic[K]):
    """Weighted service received per key, VTC-style: a key that becomes active (its first
    member joins) is lifted to the least counter of the keys active then, so an idle key cannot
    bank credit and a newcomer cannot take the engine over for long."""

    def __init__(self) -> None:
        self.served: dict[K, float] = {}
        self.members: Counter[K] = Counter()

    def __getitem__(self, key: K) -> float:
        return self.served.get(key, 0.0)

    def active(self) -> list[K]:
        return [k for k, n in self.members.items() if n > 0]

    def join(self, key: K) -> None:
        if self.members[key] == 0:
            others = [self.served.get(k, 0.0) for k in self.active()]
            if others:
                self.served[key] = max(self.served.get(key, 0.0), min(others))
        self.members[key] += 1

    def leave(self, key: K) -> None:
        self.members[key] -= 1
        if self.members[key] <= 0:
            del self.members[key]

    def charge(self, key: K, amount: float) -> None:
        self.served[key] = self.served.get(key, 0.0) + amount


class SchedulerState(Protocol):
    """What a policy reads of the scheduler (``Scheduler`` is one); policies change none of it."""

    running: list[Sequence]  # in ``running_key`` order, ties in admission order
    waiting: deque[Sequence]
    loading: deque[Sequence]  # waiting for a device slot (or a rank budget)
    max_num_seqs: int
    max_num_batched_tokens: int
    class_weights: tuple[float, ...]
    class_service: VirtualTokenCounter[int]  # C: weighted served tokens per class
    tenant_service: VirtualTokenCounter[tuple[int, str | None]]  # V per (class, tenant)
    headroom_window: int
    seat_shares: bool
    step_index: int  # schedule() calls so far
    num_preemptions: int
    generation: int
    """Bumped by every add(), finish() and schedule(): what a policy derives from this state
    and caches stays valid until it changes, but for what admissions and preemptions within
    the step change (``running``, ``num_preemptions``, the service counters)."""

    def class_of(self, seq: Sequence) -> int: ...

    def cooling(self, seq: Sequence) -> bool:
        """Whether ``seq`` was preempted within the last ``preempt_cooldown`` steps."""
        ...


class SchedulingPolicy(ABC):
    """The decisions the scheduler leaves to its policy. Each hook gets the scheduler's state;
    the defaults are those of a policy without classes: it outranks none (no preemption to
    admit), keeps no seats back and caps nothing."""

    name: ClassVar[str] = "custom"
    preempts_for_admission: ClassVar[bool] = True
    """False where ``outranks`` is always False: then a step with no free seat or token left
    admits nothing, and the scheduler skips admission (and the loading queue's retry)."""
    request_priorities: ClassVar[bool] = True
    """Whether a request's own ``priority`` field means anything (False: it is refused, as
    vLLM refuses it under fcfs)."""

    def running_key(self, state: SchedulerState, seq: Sequence) -> int:
        """What the running list is kept sorted by (stable: ties stay in admission order)."""
        return 0

    @abstractmethod
    def admission_order(self, state: SchedulerState, waiting: list[Sequence]) -> Iterator[Sequence]:
        """``waiting`` in the order it is admitted; lazily, the generator may read the service
        counters as admissions charge them."""

    @abstractmethod
    def victim(self, state: SchedulerState, candidates: list[Sequence]) -> Sequence:
        """Which of ``candidates`` (running, in running order) to preempt first."""

    def outranks(self, state: SchedulerState, seq: Sequence, other: Sequence) -> bool:
        """Whether waiting ``seq`` may preempt running ``other`` to get in (the scheduler never
        asks about one still cooling down from a preemption)."""
        return False

    def begin_step(self, state: SchedulerState) -> None:
        """Called at the start of each schedule(), before anything is scheduled."""
        return None

    def prefill_caps(self, state: SchedulerState) -> dict[int, int] | None:
        """This step's prompt-chunk token cap per class (decodes are never capped); None: none."""
        return None

    def headroom(self, state: SchedulerState, c: int) -> int:
        """Free seats a class-``c`` sequence may not take (kept for more important classes);
        it may still get in by preempting one it outranks when every seat is taken."""
        return 0

    def seat_share(self, state: SchedulerState, c: int) -> int | None:
        """The most sequences class ``c`` may run now; None: no cap."""
        return None

    def recent_peak(self, state: SchedulerState, c: int) -> int:
        """Class ``c``'s largest number of sequences in the last ``headroom_window`` steps, where
        the policy tracks it (0 otherwise)."""
        return 0


class FCFSPolicy(SchedulingPolicy):
    """Arrival order; the newest running sequence is preempted (vLLM's default)."""

    name = "fcfs"
    preempts_for_admission = False
    request_priorities = False

    def admission_order(self, state: SchedulerState, waiting: list[Sequence]) -> Iterator[Sequence]:
        return iter(waiting)

    def victim(self, state: SchedulerState, candidates: list[Sequence]) -> Sequence:
        return candidates[-1]


class PriorityPolicy(SchedulingPolicy):
    """vLLM's priority scheduling: lowest ``priority`` first, then arrival; a waiting sequence
    preempts a running one of a strictly larger value; the victim: not cooling down first, then
    the largest value, then the newest."""

    name = "priority"

    def running_key(self, state: SchedulerState, seq: Sequence) -> int:
        return seq.priority

    def admission_order(self, state: SchedulerState, waiting: list[Sequence]) -> Iterator[Sequence]:
        return iter(sorted(waiting, key=lambda s: (s.priority, s.arrival)))

    def victim(self, state: SchedulerState, candidates: list[Sequence]) -> Sequence:
        i = max(
            range(len(candidates)),
            key=lambda j: (not state.cooling(candidates[j]), candidates[j].priority, j),
        )
        return candidates[i]

    def outranks(self, state: SchedulerState, seq: Sequence, other: Sequence) -> bool:
        return seq.priority < other.priority


class FairPolicy(SchedulingPolicy):
    """SLO classes with weighted shares, VTC within a class, headroom, seat shares and prefill
    caps (the module docstring). Holds the per-class demand it observed (one scheduler's)."""

    name = "fair"

    def __init__(self) -> None:
        # class -> k -> the last step at which the class had at least k sequences
        self._seen_at: dict[int, dict[int, int]] = {}
        # headroom per (class, len(running), num_preemptions), and seat share per class, for
        # one ``generation`` of the state: in between, what they depend on changes only with
        # admissions and preemptions
        self._generation = -1
        self._headroom_memo: dict[tuple[int, int, int], int] = {}
        self._share_memo: dict[int, int | None] = {}

    def _memos(self, state: SchedulerState) -> None:
        if state.generation != self._generation:
            self._generation = state.generation
            self._headroom_memo, self._share_memo = {}, {}

    def running_key(self, state: SchedulerState, seq: Sequence) -> int:
        return state.class_of(seq)

    def admission_order(self, state: SchedulerState, waiting: list[Sequence]) -> Iterator[Sequence]:
        groups: dict[int, dict[str | None, deque[Sequence]]] = {}
        for s in waiting:
            groups.setdefault(state.class_of(s), {}).setdefault(s.tenant, deque()).append(s)
        while groups:
            c = min(groups, key=lambda k: (state.class_service[k], k))
            tenants = groups[c]
            t = min(tenants, key=lambda k: (state.tenant_service[(c, k)], tenants[k][0].arrival))
            queue = tenants[t]
            seq = queue.popleft()
            if not queue:
                del tenants[t]
                if not tenants:
                    del groups[c]
            yield seq

    def victim(self, state: SchedulerState, candidates: list[Sequence]) -> Sequence:
        def key(j: int) -> tuple[bool, int, int, float, int]:
            s = candidates[j]
            c = state.class_of(s)
            v = state.tenant_service[(c, s.tenant)]
            return not state.cooling(s), c, -s.num_computed_tokens, v, j

        return candidates[max(range(len(candidates)), key=key)]

    def outranks(self, state: SchedulerState, seq: Sequence, other: Sequence) -> bool:
        c, o = state.class_of(seq), state.class_of(other)
        return c < o and state.class_service[c] <= state.class_service[o]

    def begin_step(self, state: SchedulerState) -> None:
        """Record this step's sequences per class (running + waiting + loading)."""
        counts = Counter(state.class_of(s) for s in state.running)
        counts.update(state.class_of(s) for s in state.waiting)
        counts.update(state.class_of(s) for s in state.loading)
        for c, n in counts.items():
            seen = self._seen_at.setdefault(c, {})
            for k in range(1, min(n, state.max_num_seqs) + 1):
                seen[k] = state.step_index

    def prefill_caps(self, state: SchedulerState) -> dict[int, int] | None:
        """The prompt-chunk cap of each class that has a more important class with prompt work
        this step (a waiting sequence, or a running one mid-prompt): its weighted share, among
        the active classes, of the step's token budget. A class whose more important classes
        only decode (or are idle) is not capped, so the cap never starves it."""
        active = state.class_service.active()
        if len(active) < 2:
            return None
        pending = {state.class_of(s) for s in state.waiting}
        pending |= {
            state.class_of(s) for s in state.running if s.num_tokens - s.num_computed_tokens > 1
        }
        if not pending:
            return None
        top = min(pending)
        total = sum(state.class_weights[c] for c in active)
        budget = state.max_num_batched_tokens
        caps = {c: max(1, int(budget * state.class_weights[c] / total)) for c in active if c > top}
        return caps or None

    def recent_peak(self, state: SchedulerState, c: int) -> int:
        seen = self._seen_at.get(c, {})
        since = state.step_index - state.headroom_window
        return max((k for k, at in seen.items() if at > since), default=0)

    def headroom(self, state: SchedulerState, c: int) -> int:
        """What the more important classes had recently beyond what they run now, counting
        those idle now or within their share (C at most ``c``'s: a backlogged class over its
        share holds no seats back, so a class owed service by the weights is never starved by
        headroom); at most ``max_num_seqs - 1``."""
        if c == 0:
            return 0
        self._memos(state)
        memo = (c, len(state.running), state.num_preemptions)
        if memo in self._headroom_memo:
            return self._headroom_memo[memo]
        running = Counter(state.class_of(s) for s in state.running)
        service = state.class_service
        keep = sum(
            max(0, self.recent_peak(state, h) - running[h])
            for h in range(c)
            if h in self._seen_at and (not service.members[h] or service[h] <= service[c])
        )
        self._headroom_memo[memo] = min(keep, state.max_num_seqs - 1)
        return self._headroom_memo[memo]

    def seat_share(self, state: SchedulerState, c: int) -> int | None:
        """See *seat shares* in the module docstring; None when no more important class was
        active within the window (no cap), or ``seat_shares`` is off."""
        if c == 0 or not state.seat_shares:
            return None
        self._memos(state)
        if c not in self._share_memo:  # what it reads changes once per step
            above = [state.class_weights[h] for h in range(c) if self.recent_peak(state, h) > 0]
            w = state.class_weights[c]
            share = max(1, int(state.max_num_seqs * w / (w + sum(above)))) if above else None
            self._share_memo[c] = share
        return self._share_memo[c]


POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
    "fair": FairPolicy,
}
"""Scheduling policy names -> a fresh policy (one per scheduler: a policy may keep state)."""


def make_policy(name: str) -> SchedulingPolicy:
    """A fresh policy by its ``POLICIES`` name; ValueError naming the choices otherwise."""
    try:
        factory = POLICIES[name]
    except KeyError:
        choices = ", ".join(POLICIES)
        raise ValueError(f"unknown scheduling policy {name!r} (choose from {choices})") from None
    return factory()
