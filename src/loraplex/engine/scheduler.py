"""Continuous batching: which sequences run this step, with how many new tokens each.

Per step: running sequences first (decode, or the next chunk of a long prompt), preempting
running ones (free + recompute) when KV blocks run out; then waiting sequences while the token
budget, ``max_num_seqs`` and free blocks allow. A waiting sequence whose adapter cannot get a
device slot (or whose rank bucket is at its slot budget) moves to the *loading queue*: it never
blocks the requests behind it, and it is retried (once per adapter per step) before admission.

The policy (``loraplex.engine.scheduling``: ``fcfs``, ``priority``, ``fair``, or an object)
orders the waiting sequences, says whom a waiting sequence may preempt and which running one
goes first under KV pressure, and, for fair, which seats and prompt tokens a class may take.
The scheduler does the accounting every policy reads: the SLO class of each sequence, the
served tokens per class and tenant (virtual token counters, charged per scheduled chunk), and
the preemption cooldown.

Slots are only *reserved* here ("slot k now belongs to digest d", bookkeeping in the adapter
cache); the engine copies the weights of newly reserved adapters before the step runs.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from loraplex.engine.kv_keys import GroupKeys
from loraplex.engine.scheduling import (
    POLICIES,
    SchedulingPolicy,
    VirtualTokenCounter,
    make_policy,
)
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.kv.block_pool import BlockPool, hash_prefix_blocks
from loraplex.kv.groups import KVCacheGroup
from loraplex.kv.manager import KVCacheManager
from loraplex.kv.stats import SharingStats

if TYPE_CHECKING:
    from loraplex.lora.adapter import LoRAAdapter

SCHEDULING_POLICIES = tuple(POLICIES)
"""The registry's names; ``--scheduling-policy`` offers ``loraplex.config.SCHEDULING_POLICIES``
(config imports nothing of the engine; a test checks they agree)."""
PROMPT_TOKEN_COST = 1.0  # VTC's weights (the paper's w_p = 1, w_q = 2)
OUTPUT_TOKEN_COST = 2.0


class SlotReservations(Protocol):
    """Slot bookkeeping the scheduler needs (the tiered adapter cache provides it)."""

    def reserve_slot(self, adapter: LoRAAdapter) -> int | None:
        """The slot ``adapter`` runs in for one more request; None: none may be freed now."""
        ...

    def release_slot(self, slot: int) -> None: ...


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
        """slot -> the adapter reserved in it, for every slot this batch uses (a composed
        request's every component included)."""
        got: dict[int, LoRAAdapter] = {}
        for s, _ in self.items:
            if s.slot is not None and s.adapter is not None:
                got[s.slot] = s.adapter
                got.update(zip(s.composed_slots, s.composed, strict=False))
        return got


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
        policy: str | SchedulingPolicy = "fcfs",
        class_weights: tuple[float, ...] = (1.0,),
        default_class: int = 0,
        rank_slot_budgets: Mapping[int, int] | None = None,
        headroom_window: int = 256,
        preempt_cooldown: int = 64,
        seat_shares: bool = True,
        kv_groups: list[KVCacheGroup] | None = None,
        state_pool: BlockPool | None = None,
    ) -> None:
        """``policy``: a ``POLICIES`` name or a policy object (used by this scheduler only);
        ``class_weights[i]``: the share weight of SLO class ``i`` (0 the most important);
        ``rank_slot_budgets``: bucket's largest rank -> device slots its adapters may hold in
        running requests at once (e.g. ``{8: 12, 64: 4}``); ``headroom_window``: steps over
        which a class's peak concurrency sizes the seats kept for it (fair);
        ``preempt_cooldown``: steps after a preemption in which that sequence is not chosen
        again (fair and priority); ``seat_shares``: cap a lower class's running sequences
        while a more important one is active (fair; see ``loraplex.engine.scheduling``);
        ``kv_groups``: the KV cache's groups of layers (None: one group); ``state_pool``: the
        pages of its state groups (recurrent layers), if it has any."""
        if isinstance(policy, str):
            policy = make_policy(policy)
        elif not isinstance(policy, SchedulingPolicy):
            raise TypeError(
                f"policy must be a scheduling policy name or a SchedulingPolicy, got {policy!r}"
            )
        if not class_weights or any(w <= 0 for w in class_weights):
            raise ValueError(f"class weights must be > 0, got {class_weights!r}")
        if not 0 <= default_class < len(class_weights):
            raise ValueError(f"default class {default_class} is not one of {len(class_weights)}")
        self.pool = pool
        self.kv = KVCacheManager(pool, kv_groups, state_pool)
        self.keys = GroupKeys(self.kv.groups)  # which chain keys each group's blocks
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy: SchedulingPolicy = policy
        self.class_weights = tuple(float(w) for w in class_weights)
        self.default_class = default_class
        self.rank_slot_budgets = dict(rank_slot_budgets or {})
        self.waiting: deque[Sequence] = deque()
        self.loading: deque[Sequence] = deque()  # waiting for a device slot (or a rank budget)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.sharing = SharingStats()
        self.class_service: VirtualTokenCounter[int] = VirtualTokenCounter()
        self.tenant_service: VirtualTokenCounter[tuple[int, str | None]] = VirtualTokenCounter()
        self._caps: dict[int, int] | None = None  # this step's prefill caps per class
        self._cap_used: Counter[int] = Counter()
        self.headroom_window = headroom_window
        self.preempt_cooldown = preempt_cooldown
        self.seat_shares = seat_shares
        self.step_index = 0  # schedule() calls so far
        self.generation = 0  # bumped by add(), finish() and schedule(): policies' caches

    # -- classes ---------------------------------------------------------------------------------
    def class_of(self, seq: Sequence) -> int:
        """The SLO class index of ``seq`` (0 the most important)."""
        return min(max(self.default_class + seq.priority, 0), len(self.class_weights) - 1)

    def _running_key(self, seq: Sequence) -> int:
        return self.policy.running_key(self, seq)

    # -- queue -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.generation += 1
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
        self.generation += 1
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
        self.kv.free(seq.block_tables)
        seq.block_tables = []
        self._release_slots(seq)

    def _release_slots(self, seq: Sequence) -> None:
        """Give back every device slot ``seq`` holds (a composition's components' too)."""
        if self.adapters is not None:
            for slot in seq.slots:
                self.adapters.release_slot(slot)
        seq.slot = None
        seq.composed_slots = []

    @staticmethod
    def drop_drafts(seq: Sequence, keep: int = 0) -> None:
        """Keep only the first ``keep`` of ``seq``'s draft tokens (and their distributions)."""
        del seq.spec_tokens[keep:]
        if seq.spec_probs is not None:
            seq.spec_probs = seq.spec_probs[:keep] if keep else None

    def _preempt(self, seq: Sequence) -> None:
        """Free everything and requeue at the front; its tokens are recomputed later."""
        self.running.remove(seq)
        self.drop_drafts(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0
        seq.block_hashes, seq.base_block_hashes, seq.kv_shared = [], [], []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.preempted_at_step = self.step_index
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def cooling(self, seq: Sequence) -> bool:
        """Whether ``seq`` was preempted within the last ``preempt_cooldown`` steps."""
        at = seq.preempted_at_step
        return at is not None and self.step_index - at < self.preempt_cooldown

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        """Which of ``candidates`` (running, in running order) to preempt first."""
        return self.policy.victim(self, candidates)

    def _outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Whether waiting ``seq`` may preempt running ``other`` to get in (never one that
        was preempted within the cooldown: no thrash)."""
        at = other.preempted_at_step  # cooling(other), inline: asked per waiting x running
        if at is not None and self.step_index - at < self.preempt_cooldown:
            return False
        return self.policy.outranks(self, seq, other)

    def _charge(self, seq: Sequence, n: int, sign: float = 1.0) -> None:
        """Count ``n`` tokens scheduled for ``seq`` as served (``sign=-1`` takes them back)."""
        prompt = max(0, min(n, len(seq.prompt_token_ids) - seq.num_computed_tokens))
        cost = sign * (PROMPT_TOKEN_COST * prompt + OUTPUT_TOKEN_COST * (n - prompt))
        c = self.class_of(seq)
        self.class_service.charge(c, cost / self.class_weights[c])
        self.tenant_service.charge((c, seq.tenant), cost)

    def _state_reserve(self) -> int:
        """State pages a chunk's optional snapshots leave free: one per state group for every
        running sequence and one more (each may reach a new block next step)."""
        return (len(self.running) + 1) * len(self.kv.state_groups)

    def _blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Additional blocks ``seq`` needs to hold ``num_tokens`` tokens in total."""
        return self.kv.blocks_needed(seq.block_tables, num_tokens)

    # -- seats (the policy's) --------------------------------------------------------------------
    def recent_peak(self, c: int) -> int:
        """Class ``c``'s largest number of sequences in the last ``headroom_window`` steps (as
        the policy tracks it: fair; 0 otherwise)."""
        return self.policy.recent_peak(self, c)

    def headroom(self, c: int) -> int:
        """Free seats a class-``c`` sequence may not take (fair: kept for more important
        classes that were busy recently; at most ``max_num_seqs - 1``)."""
        return self.policy.headroom(self, c)

    def seat_share(self, c: int) -> int | None:
        """The most sequences class ``c`` may run now (fair: see *seat shares* in
        ``loraplex.engine.scheduling``); None: no cap."""
        return self.policy.seat_share(self, c)

    def _over_seat_share(self, seq: Sequence) -> bool:
        """Whether admitting ``seq`` would take its class past its seat share."""
        c = self.class_of(seq)
        share = self.seat_share(c)
        return share is not None and sum(self.class_of(s) == c for s in self.running) >= share

    # -- one step --------------------------------------------------------------------------------
    def _capped(self, seq: Sequence, n: int) -> int:
        """``n`` tokens for ``seq`` this step within its class's prefill cap (the policy's)."""
        if self._caps is None or seq.num_tokens - seq.num_computed_tokens <= 1:
            return n
        c = self.class_of(seq)
        return max(0, min(n, self._caps.get(c, n) - self._cap_used[c]))

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self.step_index += 1
        self.generation += 1
        self.policy.begin_step(self)
        self._caps, self._cap_used = self.policy.prefill_caps(self), Counter()
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            left = seq.num_tokens - seq.num_computed_tokens
            if seq.spec_tokens and left != 1:  # drafts only ride on a decode row
                self.drop_drafts(seq)
            n = self._capped(seq, min(left + len(seq.spec_tokens), budget))
            if n == 0:  # its class used its prefill share of this step
                i += 1
                continue
            if seq.spec_tokens and (
                n < 1 + len(seq.spec_tokens)
                or not self.kv.fits(seq.block_tables, seq.num_computed_tokens + n)
            ):  # what the budget or the free blocks do not hold is not drafted (no preemption)
                keep = n - 1 if self.kv.fits(seq.block_tables, seq.num_computed_tokens + n) else 0
                self.drop_drafts(seq, keep)
                n = 1 + len(seq.spec_tokens)
            need = self._blocks_for(seq, seq.num_computed_tokens + n)
            while need and not self.kv.fits(seq.block_tables, seq.num_computed_tokens + n):
                victim = self._victim(self.running[i:])  # never already batched
                self._preempt(victim)
                preempted = True
                batch.num_preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # seq itself was preempted; running[i] is now the next one
            if need:
                seq.block_tables = self.kv.allocate(
                    seq.block_tables, seq.num_computed_tokens + n, self._state_reserve()
                )
            batch.items.append((seq, n))
            self._charge(seq, n)
            budget -= n
            i += 1
            if n > 1 and not seq.spec_tokens:  # a prompt chunk (a drafted row is a decode)
                self._cap_used[self.class_of(seq)] += n
        if not preempted:
            self._admit(batch, budget)
        return batch

    def _slot_budget_full(self, seq: Sequence, in_use: dict[int, set[int]]) -> bool:
        """Whether ``seq``'s adapters (a composition's every component) would need more slots
        of a rank bucket than its budget leaves."""
        if not self.rank_slot_budgets or seq.adapter is None:
            return False
        running = {a.ref.sha256 for s in self.running for a in s.adapters}
        need: dict[int, int] = {}
        for a in seq.adapters:
            bucket = rank_bucket(a.rank, self.rank_slot_budgets)
            if bucket is not None and a.ref.sha256 not in running:  # else: its slot is in use
                need[bucket] = need.get(bucket, 0) + 1
        return any(len(in_use.get(b, ())) + n > self.rank_slot_budgets[b] for b, n in need.items())

    def _slots_in_use(self) -> dict[int, set[int]]:
        """Rank bucket -> slots that running sequences hold."""
        used: dict[int, set[int]] = {}
        for s in self.running:
            for a, slot in zip(s.adapters, s.slots, strict=False):
                b = rank_bucket(a.rank, self.rank_slot_budgets)
                if b is not None:
                    used.setdefault(b, set()).add(slot)
        return used

    def _reserve(self, seq: Sequence, in_use: dict[int, set[int]]) -> bool:
        """Give ``seq`` its adapters' slots (all of a composition's, or none); False (nothing
        held) when it must wait for one."""
        if seq.adapter is None or self.adapters is None or seq.slot is not None:
            return True
        if self._slot_budget_full(seq, in_use):
            return False
        got: list[int] = []
        for a in seq.adapters:
            slot = self.adapters.reserve_slot(a)
            if slot is None:
                for s in got:
                    self.adapters.release_slot(s)
                return False
            got.append(slot)
        seq.slot, seq.composed_slots = got[0], got[1:]
        for a, slot in zip(seq.adapters, got, strict=True):
            b = rank_bucket(a.rank, self.rank_slot_budgets)
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
            d = seq.adapter_key or ""
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
        users = Counter(s for r in self.running for s in r.slots)  # compositions' too
        victims = [
            r
            for r in self.running
            if any(users[s] == 1 for s in r.slots) and self._outranks(seq, r)
        ]
        return self._make_room(seq, batch, victims) if victims else None

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        full = budget <= 0 or len(self.running) >= self.max_num_seqs
        if full and not self.policy.preempts_for_admission:
            return  # nothing can get in (no preemption for admission)
        in_use = self._slots_in_use()
        self._retry_loading(in_use)
        to_loading: set[int] = set()  # ids of sequences moved to the loading queue
        for seq in self.policy.admission_order(self, list(self.waiting)):
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
            k, hits = 0, []  # hit blocks, and each KV-cache group's cached blocks
            # prompt logprobs need every prompt position computed: no prefix-cache hits
            if (
                seq.num_computed_tokens == 0
                and self.pool.enable_prefix_caching
                and not seq.needs_prompt_logits
            ):
                tokens = seq.all_token_ids
                bs = self.pool.block_size
                seq.block_hashes = hash_prefix_blocks(seq.namespaces(bs), tokens, bs)
                self.keys.extend_base(seq, len(tokens) // bs, bs)
                m = (len(tokens) - 1) // bs  # at least one token must be computed for logits
                k, hits = self.kv.lookup([c[:m] for c in self.keys.chains(seq)])
            computed = k * self.pool.block_size
            n = min(seq.num_tokens - computed, budget)
            if self._caps is not None and n > 1:
                c = self.class_of(seq)
                n = max(1, min(n, self._caps.get(c, n) - self._cap_used[c]))
            while not self.kv.fits(hits, computed + n, hits):
                freed = self._make_room(seq, batch)
                if freed is None:
                    break
                budget += freed
            if not self.kv.fits(hits, computed + n, hits):
                self._release_slots(seq)
                break  # memory is FCFS: stop admitting
            self.kv.touch(hits)
            seq.kv_shared = [len(t) for t in hits]
            seq.block_tables = self.kv.allocate(hits, computed + n, self._state_reserve())
            seq.num_computed_tokens = computed
            seq.num_published_blocks = computed // self.pool.block_size
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = computed
                self.pool.record_query(len(seq.prompt_token_ids), computed)
                self._record_sharing(seq, k)
            seq.status = SequenceStatus.RUNNING
            if n > 1:
                self._cap_used[self.class_of(seq)] += n
            self._insert_running(seq)
            batch.items.append((seq, n))
            self._charge(seq, n)
            budget -= n
        self._rebuild_waiting(to_loading)  # admitted ones are RUNNING now
        for seq in self.waiting:  # reserved by the loading retry but not admitted: give back
            if seq.slot is not None:
                self._release_slots(seq)

    def _record_sharing(self, seq: Sequence, hit_blocks: int) -> None:
        """Count ``seq``'s prefix lookup by adapter, and its hits on base-keyed blocks."""
        bs = self.pool.block_size
        aligned = 0
        if seq.adapter is not None:
            start = seq.lora_start
            base_blocks = hit_blocks if start is None else min(hit_blocks, start // bs)
            aligned = base_blocks * bs
        digest = seq.adapter.ref.sha256 if seq.adapter is not None else None
        self.sharing.record_lookup(digest, len(seq.prompt_token_ids), hit_blocks * bs, aligned)

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
        bisect.insort_right(self.running, seq, key=self._running_key)

    def after_step(
        self, batch: ScheduledBatch, rejected: Mapping[Sequence, int] | None = None
    ) -> None:
        """Advance computed counts, publish newly full blocks to the prefix cache and release
        the blocks windowed layers no longer see. ``rejected[seq]``: draft tokens of ``seq``
        the step ran but verification rejected: their KV is not counted as computed (later
        steps overwrite those positions before any block holding them is published)."""
        for seq, n in batch.items:
            if rejected:
                n -= rejected.get(seq, 0)
            seq.num_computed_tokens += n
            if self.pool.enable_prefix_caching:
                self._publish(seq)
            if self.kv.windowed:
                self.kv.drop_out_of_window(
                    seq.block_tables, seq.num_computed_tokens, seq.num_computed_tokens - n
                )

    def _publish(self, seq: Sequence) -> None:
        """Hash and register every block of ``seq`` whose KV is now fully computed."""
        bs = self.pool.block_size
        full = seq.num_computed_tokens // bs
        if full <= seq.num_published_blocks:
            return
        if len(seq.block_hashes) < full:
            tokens = seq.all_token_ids[: full * bs]
            seq.block_hashes = hash_prefix_blocks(seq.namespaces(bs), tokens, bs, seq.block_hashes)
        self.keys.extend_base(seq, full, bs)
        chains = self.keys.chains(seq)
        for b in range(seq.num_published_blocks, full):
            self.kv.register(seq.block_tables, b, chains)
        seq.num_published_blocks = full
