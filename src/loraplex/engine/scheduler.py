"""Continuous batching: which sequences run this step, with how many new tokens each.

Per step: running sequences first (decode, or the next chunk of a long prompt), preempting
running ones (free + recompute) when KV blocks run out; then waiting sequences while the token
budget, ``max_num_seqs`` and free blocks allow. A waiting sequence whose adapter cannot get a
device slot (or whose rank bucket is at its slot budget) moves to the *loading queue*: it never
blocks the requests behind it, and it is retried (once per adapter per step) before admission.

Three policies order the waiting sequences and pick preemption victims (``policy``):

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

Slots are only *reserved* here ("slot k now belongs to digest d", bookkeeping in the adapter
cache); the engine copies the weights of newly reserved adapters before the step runs.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.kv.block_pool import BlockPool, hash_block, hash_prefix_blocks

if TYPE_CHECKING:
    from loraplex.lora.adapter import LoRAAdapter

SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
PROMPT_TOKEN_COST = 1.0  # VTC's weights (the paper's w_p = 1, w_q = 2)
OUTPUT_TOKEN_COST = 2.0

K = TypeVar("K", bound=Hashable)


class SlotReservations(Protocol):
    """Slot bookkeeping the scheduler needs (the tiered adapter cache provides it)."""

    def reserve_slot(self, adapter: LoRAAdapter) -> int | None:
        """The slot ``adapter`` runs in for one more request; None: none may be freed now."""
        ...

    def release_slot(self, slot: int) -> None: ...


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


@dataclass
class ScheduledBatch:
    """The step's work: (sequence, number of new tokens) pairs, and once the adapters are
    activated, the rank rows ``(row_start, row_end)`` each slot of the batch occupies."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    num_preempted: int = 0
    slot_rows: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.items

    def slot_adapters(self) -> dict[int, LoRAAdapter]:
        """slot -> the adapter reserved in it, for every slot this batch uses."""
        return {
            s.slot: s.adapter for s, _ in self.items if s.slot is not None and s.adapter is not None
        }


def rank_bucket(rank: int, budgets: Mapping[int, int]) -> int | None:
    """The bucket (its largest rank) a rank falls in: the smallest bucket >= rank; None above
    every bucket (no budget applies)."""
    return min((b for b in budgets if b >= rank), default=None)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        adapters: SlotReservations | None,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        class_weights: tuple[float, ...] = (1.0,),
        default_class: int = 0,
        rank_slot_budgets: Mapping[int, int] | None = None,
        headroom_window: int = 256,
        preempt_cooldown: int = 64,
        seat_shares: bool = True,
    ) -> None:
        """``class_weights[i]``: the share weight of SLO class ``i`` (0 the most important);
        ``rank_slot_budgets``: bucket's largest rank -> device slots its adapters may hold in
        running requests at once (e.g. ``{8: 12, 64: 4}``); ``headroom_window``: steps over
        which a class's peak concurrency sizes the seats kept for it (fair);
        ``preempt_cooldown``: steps after a preemption in which that sequence is not chosen
        again (fair and priority); ``seat_shares``: cap a lower class's running sequences
        while a more important one is active (fair; see the module docstring)."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"unknown scheduling policy {policy!r} ({', '.join(SCHEDULING_POLICIES)})"
            )
        if not class_weights or any(w <= 0 for w in class_weights):
            raise ValueError(f"class weights must be > 0, got {class_weights!r}")
        if not 0 <= default_class < len(class_weights):
            raise ValueError(f"default class {default_class} is not one of {len(class_weights)}")
        self.pool = pool
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.class_weights = tuple(float(w) for w in class_weights)
        self.default_class = default_class
        self.rank_slot_budgets = dict(rank_slot_budgets or {})
        self.waiting: deque[Sequence] = deque()
        self.loading: deque[Sequence] = deque()  # waiting for a device slot (or a rank budget)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.class_service: VirtualTokenCounter[int] = VirtualTokenCounter()
        self.tenant_service: VirtualTokenCounter[tuple[int, str | None]] = VirtualTokenCounter()
        self._caps: dict[int, int] | None = None  # this step's prefill caps per class
        self._cap_used: Counter[int] = Counter()
        self.headroom_window = headroom_window
        self.preempt_cooldown = preempt_cooldown
        self.seat_shares = seat_shares
        self.step_index = 0  # schedule() calls so far
        # class -> k -> the last step at which the class had at least k sequences
        self._seen_at: dict[int, dict[int, int]] = {}
        # headroom per (class, len(running), num_preemptions), cleared by schedule(), add()
        # and finish(): in between, what it depends on changes only with admissions and
        # preemptions
        self._headroom_memo: dict[tuple[int, int, int], int] = {}
        self._share_memo: dict[int, int | None] = {}  # class -> seat share, cleared per step

    # -- classes ---------------------------------------------------------------------------------
    def class_of(self, seq: Sequence) -> int:
        """The SLO class index of ``seq`` (0 the most important)."""
        return min(max(self.default_class + seq.priority, 0), len(self.class_weights) - 1)

    def _order_key(self, seq: Sequence) -> int:
        """What the running list is kept sorted by (stable: ties stay in admission order)."""
        if self.policy == "priority":
            return seq.priority
        return self.class_of(seq) if self.policy == "fair" else 0

    # -- queue -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._headroom_memo = {}
        self.waiting.append(seq)
        c = self.class_of(seq)
        self.class_service.join(c)
        self.tenant_service.join((c, seq.tenant))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences not running: waiting to be admitted or for their adapter's slot."""
        return len(self.waiting) + len(self.loading)

    def waiting_sequences(self) -> list[Sequence]:
        return [*self.waiting, *self.loading]

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free its blocks and slot (from any queue)."""
        self._headroom_memo = {}
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            if seq in self.loading:
                self.loading.remove(seq)
            else:
                self.waiting.remove(seq)
        if seq.status is not SequenceStatus.FINISHED:
            c = self.class_of(seq)
            self.class_service.leave(c)
            self.tenant_service.leave((c, seq.tenant))
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        if seq.slot is not None and self.adapters is not None:
            self.adapters.release_slot(seq.slot)
        seq.slot = None

    def _preempt(self, seq: Sequence) -> None:
        """Free everything and requeue at the front; its tokens are recomputed later."""
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0
        seq.block_hashes = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.preempted_at_step = self.step_index
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _cooling(self, seq: Sequence) -> bool:
        """Whether ``seq`` was preempted within the last ``preempt_cooldown`` steps."""
        at = seq.preempted_at_step
        return at is not None and self.step_index - at < self.preempt_cooldown

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        """Which of ``candidates`` (running, in running order) to preempt first."""
        if self.policy == "priority":
            i = max(
                range(len(candidates)),
                key=lambda j: (not self._cooling(candidates[j]), candidates[j].priority, j),
            )
        elif self.policy == "fair":

            def key(j: int) -> tuple[bool, int, int, float, int]:
                s = candidates[j]
                c = self.class_of(s)
                v = self.tenant_service[(c, s.tenant)]
                return not self._cooling(s), c, -s.num_computed_tokens, v, j

            i = max(range(len(candidates)), key=key)
        else:
            i = len(candidates) - 1
        return candidates[i]

    def _outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Whether waiting ``seq`` may preempt running ``other`` to get in (never one that
        was preempted within the cooldown: no thrash)."""
        if self._cooling(other):
            return False
        if self.policy == "priority":
            return seq.priority < other.priority
        if self.policy == "fair":
            c, o = self.class_of(seq), self.class_of(other)
            return c < o and self.class_service[c] <= self.class_service[o]
        return False

    def _charge(self, seq: Sequence, n: int, sign: float = 1.0) -> None:
        """Count ``n`` tokens scheduled for ``seq`` as served (``sign=-1`` takes them back)."""
        prompt = max(0, min(n, len(seq.prompt_token_ids) - seq.num_computed_tokens))
        cost = sign * (PROMPT_TOKEN_COST * prompt + OUTPUT_TOKEN_COST * (n - prompt))
        c = self.class_of(seq)
        self.class_service.charge(c, cost / self.class_weights[c])
        self.tenant_service.charge((c, seq.tenant), cost)

    def _blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Additional blocks ``seq`` needs to hold ``num_tokens`` tokens in total."""
        bs = self.pool.block_size
        return max(0, -(-num_tokens // bs) - len(seq.block_ids))

    # -- one step --------------------------------------------------------------------------------
    def _prefill_caps(self) -> dict[int, int] | None:
        """fair: the prompt-chunk cap of each class that has a more important class with
        prompt work this step (a waiting sequence, or a running one mid-prompt): its weighted
        share, among the active classes, of the step's token budget. A class whose more
        important classes only decode (or are idle) is not capped, so the cap never starves
        it. None: no caps (other policies, or nothing to cap)."""
        if self.policy != "fair":
            return None
        active = self.class_service.active()
        if len(active) < 2:
            return None
        pending = {self.class_of(s) for s in self.waiting}
        pending |= {
            self.class_of(s) for s in self.running if s.num_tokens - s.num_computed_tokens > 1
        }
        if not pending:
            return None
        top = min(pending)
        total = sum(self.class_weights[c] for c in active)
        budget = self.max_num_batched_tokens
        caps = {c: max(1, int(budget * self.class_weights[c] / total)) for c in active if c > top}
        return caps or None

    # -- headroom --------------------------------------------------------------------------------
    def _observe_demand(self) -> None:
        """Record this step's sequences per class (running + waiting + loading)."""
        counts = Counter(self.class_of(s) for s in self.running)
        counts.update(self.class_of(s) for s in self.waiting)
        counts.update(self.class_of(s) for s in self.loading)
        for c, n in counts.items():
            seen = self._seen_at.setdefault(c, {})
            for k in range(1, min(n, self.max_num_seqs) + 1):
                seen[k] = self.step_index

    def recent_peak(self, c: int) -> int:
        """Class ``c``'s largest number of sequences in the last ``headroom_window`` steps."""
        seen = self._seen_at.get(c, {})
        since = self.step_index - self.headroom_window
        return max((k for k, at in seen.items() if at > since), default=0)

    def headroom(self, c: int) -> int:
        """Seats a class-``c`` sequence may not take: what the more important classes had
        recently beyond what they run now, counting those idle now or within their share (C at
        most ``c``'s: a backlogged class over its share holds no seats back, so a class owed
        service by the weights is never starved by headroom); fair only, at most
        ``max_num_seqs - 1``."""
        if self.policy != "fair" or c == 0:
            return 0
        memo = (c, len(self.running), self.num_preemptions)
        if memo in self._headroom_memo:
            return self._headroom_memo[memo]
        running = Counter(self.class_of(s) for s in self.running)
        keep = sum(
            max(0, self.recent_peak(h) - running[h])
            for h in range(c)
            if h in self._seen_at
            and (
                not self.class_service.members[h] or self.class_service[h] <= self.class_service[c]
            )
        )
        self._headroom_memo[memo] = min(keep, self.max_num_seqs - 1)
        return self._headroom_memo[memo]

    def seat_share(self, c: int) -> int | None:
        """fair: the most sequences class ``c`` may run now (see *seat shares* above); None when
        no more important class was active within the window (no cap)."""
        if self.policy != "fair" or c == 0 or not self.seat_shares:
            return None
        if c not in self._share_memo:  # what it reads changes once per step
            above = [self.class_weights[h] for h in range(c) if self.recent_peak(h) > 0]
            w = self.class_weights[c]
            share = max(1, int(self.max_num_seqs * w / (w + sum(above)))) if above else None
            self._share_memo[c] = share
        return self._share_memo[c]

    def _over_seat_share(self, seq: Sequence) -> bool:
        """Whether admitting ``seq`` would take its class past its seat share."""
        c = self.class_of(seq)
        share = self.seat_share(c)
        return share is not None and sum(self.class_of(s) == c for s in self.running) >= share

    def _capped(self, seq: Sequence, n: int) -> int:
        """``n`` tokens for ``seq`` this step within its class's prefill cap (see above)."""
        if self._caps is None or seq.num_tokens - seq.num_computed_tokens <= 1:
            return n
        c = self.class_of(seq)
        return max(0, min(n, self._caps.get(c, n) - self._cap_used[c]))

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self.step_index += 1
        self._headroom_memo, self._share_memo = {}, {}
        if self.policy == "fair":
            self._observe_demand()
        self._caps, self._cap_used = self._prefill_caps(), Counter()
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._capped(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if n == 0:  # its class used its prefill share of this step
                i += 1
                continue
            need = self._blocks_for(seq, seq.num_computed_tokens + n)
            while need > self.pool.num_free:
                victim = self._victim(self.running[i:])  # never already batched
                self._preempt(victim)
                preempted = True
                batch.num_preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # seq itself was preempted; running[i] is now the next one
            seq.block_ids += self.pool.allocate(need)
            batch.items.append((seq, n))
            self._charge(seq, n)
            budget -= n
            i += 1
            if n > 1:
                self._cap_used[self.class_of(seq)] += n
        if not preempted:
            self._admit(batch, budget)
        return batch

    def _candidates(self, waiting: list[Sequence]) -> Iterator[Sequence]:
        """Waiting sequences in the order the policy admits them (lazily: the fair order reads
        the counters as admissions charge them)."""
        if self.policy == "fcfs":
            yield from waiting
            return
        if self.policy == "priority":
            yield from sorted(waiting, key=lambda s: (s.priority, s.arrival))
            return
        groups: dict[int, dict[str | None, deque[Sequence]]] = {}
        for s in waiting:
            groups.setdefault(self.class_of(s), {}).setdefault(s.tenant, deque()).append(s)
        while groups:
            c = min(groups, key=lambda k: (self.class_service[k], k))
            tenants = groups[c]
            t = min(tenants, key=lambda k: (self.tenant_service[(c, k)], tenants[k][0].arrival))
            queue = tenants[t]
            seq = queue.popleft()
            if not queue:
                del tenants[t]
                if not tenants:
                    del groups[c]
            yield seq

    def _slot_budget_full(self, seq: Sequence, in_use: dict[int, set[int]]) -> bool:
        """Whether ``seq``'s adapter would need one more slot of a rank bucket at its budget."""
        if not self.rank_slot_budgets or seq.adapter is None:
            return False
        bucket = rank_bucket(seq.adapter.rank, self.rank_slot_budgets)
        if bucket is None:
            return False
        d = seq.adapter.ref.sha256
        if any(s.adapter is not None and s.adapter.ref.sha256 == d for s in self.running):
            return False  # its slot is in use already
        return len(in_use.get(bucket, ())) >= self.rank_slot_budgets[bucket]

    def _slots_in_use(self) -> dict[int, set[int]]:
        """Rank bucket -> slots that running sequences hold."""
        used: dict[int, set[int]] = {}
        for s in self.running:
            if s.adapter is not None and s.slot is not None:
                b = rank_bucket(s.adapter.rank, self.rank_slot_budgets)
                if b is not None:
                    used.setdefault(b, set()).add(s.slot)
        return used

    def _reserve(self, seq: Sequence, in_use: dict[int, set[int]]) -> bool:
        """Give ``seq`` its adapter's slot; False (nothing held) when it must wait for one."""
        if seq.adapter is None or self.adapters is None or seq.slot is not None:
            return True
        if self._slot_budget_full(seq, in_use):
            return False
        slot = self.adapters.reserve_slot(seq.adapter)
        if slot is None:
            return False
        seq.slot = slot
        b = rank_bucket(seq.adapter.rank, self.rank_slot_budgets)
        if b is not None:
            in_use.setdefault(b, set()).add(slot)
        return True

    def _retry_loading(self, in_use: dict[int, set[int]]) -> None:
        """Loading sequences whose adapter now gets a slot go back to the waiting queue's front
        (they are older than what came since); each adapter is tried once per step."""
        if not self.loading:
            return
        failed: set[str] = set()
        ready: list[Sequence] = []
        still: deque[Sequence] = deque()
        for seq in self.loading:
            d = seq.adapter.ref.sha256 if seq.adapter is not None else ""
            if d not in failed and self._reserve(seq, in_use):
                ready.append(seq)
            else:
                failed.add(d)
                still.append(seq)
        self.loading = still
        self.waiting.extendleft(reversed(ready))

    def _make_room(
        self, seq: Sequence, batch: ScheduledBatch, among: list[Sequence] | None = None
    ) -> int | None:
        """Preempt one running sequence that ``seq`` outranks (of ``among`` if given), taking
        its chunk out of ``batch``; the token budget it gave back, or None when there is none."""
        pool = self.running if among is None else among
        victims = [r for r in pool if self._outranks(seq, r)]
        if not victims:
            return None
        victim = self._victim(victims)
        freed = 0
        for j, (s, n) in enumerate(batch.items):
            if s is victim:
                del batch.items[j]
                self._charge(s, n, -1.0)
                freed = n
                break
        self._preempt(victim)
        batch.num_preempted += 1
        return freed

    def _free_a_slot(self, seq: Sequence, batch: ScheduledBatch) -> int | None:
        """Preempt the running sequence ``seq`` outranks that alone holds a device slot (so
        preempting it frees the slot); the budget given back, or None when there is none."""
        users = Counter(r.slot for r in self.running if r.slot is not None)
        victims = [
            r
            for r in self.running
            if r.slot is not None and users[r.slot] == 1 and self._outranks(seq, r)
        ]
        return self._make_room(seq, batch, victims) if victims else None

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        full = budget <= 0 or len(self.running) >= self.max_num_seqs
        if full and self.policy == "fcfs":
            return  # nothing can get in (no preemption for admission under fcfs)
        in_use = self._slots_in_use()
        self._retry_loading(in_use)
        to_loading: set[int] = set()  # ids of sequences moved to the loading queue
        for seq in self._candidates(list(self.waiting)):
            if budget > 0 and self._capped(seq, budget) == 0:
                continue  # its class used its prefill share of this step: others may go
            if self._over_seat_share(seq):
                continue  # its class runs its share of seats while a more important one is on
            if len(self.running) + self.headroom(self.class_of(seq)) >= self.max_num_seqs:
                # the free seats are kept for a more important class; it may still get in by
                # preempting a less important one when every seat is taken
                full = len(self.running) >= self.max_num_seqs
                if not full or not any(self._outranks(seq, r) for r in self.running):
                    continue
            while budget <= 0 or len(self.running) >= self.max_num_seqs:
                freed = self._make_room(seq, batch)
                if freed is None:
                    break
                budget += freed
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            got = self._reserve(seq, in_use)
            while not got and (freed := self._free_a_slot(seq, batch)) is not None:
                budget += freed
                in_use = self._slots_in_use()
                got = self._reserve(seq, in_use)
            if not got:  # no slot for its adapter now: let others pass
                to_loading.add(id(seq))
                self.loading.append(seq)
                continue
            hits: list[int] = []
            # prompt logprobs need every prompt position computed: no prefix-cache hits
            if (
                seq.num_computed_tokens == 0
                and self.pool.enable_prefix_caching
                and not seq.needs_prompt_logits
            ):
                tokens = seq.all_token_ids
                bs = self.pool.block_size
                seq.block_hashes = hash_prefix_blocks(seq.namespace, tokens, bs)
                # at least one token must be computed to produce logits
                hits = self.pool.lookup(seq.block_hashes[: (len(tokens) - 1) // bs])
            computed = len(hits) * self.pool.block_size
            n = min(seq.num_tokens - computed, budget)
            if self._caps is not None and n > 1:
                c = self.class_of(seq)
                n = max(1, min(n, self._caps.get(c, n) - self._cap_used[c]))
            need = -(-(computed + n) // self.pool.block_size) - len(hits)
            while need > self.pool.num_free_after_touch(hits):
                freed = self._make_room(seq, batch)
                if freed is None:
                    break
                budget += freed
            if need > self.pool.num_free_after_touch(hits):
                if seq.slot is not None and self.adapters is not None:
                    self.adapters.release_slot(seq.slot)
                    seq.slot = None
                break  # memory is FCFS: stop admitting
            self.pool.touch(hits)
            seq.block_ids = hits + self.pool.allocate(need)
            seq.num_computed_tokens = computed
            seq.num_published_blocks = len(hits)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = computed
                self.pool.record_query(len(seq.prompt_token_ids), computed)
            seq.status = SequenceStatus.RUNNING
            if n > 1:
                self._cap_used[self.class_of(seq)] += n
            self._insert_running(seq)
            batch.items.append((seq, n))
            self._charge(seq, n)
            budget -= n
        self._rebuild_waiting(to_loading)  # admitted ones are RUNNING now
        for seq in self.waiting:  # reserved by the loading retry but not admitted: give back
            if seq.slot is not None and self.adapters is not None:
                self.adapters.release_slot(seq.slot)
                seq.slot = None

    def _rebuild_waiting(self, to_loading: set[int]) -> None:
        """The waiting queue without what left it this step (admitted, or moved to the loading
        queue), keeping each sequence once: one admitted and then preempted again in the same
        step (by a more important one) is waiting again, at the front where preemption put it."""
        seen: set[int] = set()
        kept: deque[Sequence] = deque()
        for s in self.waiting:
            if s.status is not SequenceStatus.WAITING or id(s) in seen:
                continue
            if id(s) in to_loading:
                continue
            seen.add(id(s))
            kept.append(s)
        self.waiting = kept

    def _insert_running(self, seq: Sequence) -> None:
        if self.policy == "fcfs":
            self.running.append(seq)
        else:
            bisect.insort_right(self.running, seq, key=self._order_key)

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance computed counts and publish newly full blocks to the prefix cache."""
        for seq, n in batch.items:
            seq.num_computed_tokens += n
            if self.pool.enable_prefix_caching:
                self._publish(seq)

    def _publish(self, seq: Sequence) -> None:
        """Hash and register every block of ``seq`` whose KV is now fully computed."""
        bs = self.pool.block_size
        full = seq.num_computed_tokens // bs
        if full <= seq.num_published_blocks:
            return
        if len(seq.block_hashes) < full:
            tokens = seq.all_token_ids
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            for b in range(len(seq.block_hashes), full):
                parent = hash_block(parent, seq.namespace, tokens[b * bs : (b + 1) * bs])
                seq.block_hashes.append(parent)
        for b in range(seq.num_published_blocks, full):
            self.pool.register(seq.block_ids[b], seq.block_hashes[b])
        seq.num_published_blocks = full
