"""Continuous batching: which sequences run this step, with how many new tokens each.

Per step: running sequences first (decode, or the next chunk of a long prompt), preempting the
newest running ones (free + recompute) when KV blocks run out; then waiting sequences in arrival
order while the token budget, ``max_num_seqs`` and free blocks allow. A waiting sequence whose
adapter cannot get a device slot is skipped, not waited on: it never blocks requests behind it.

Slots are only *reserved* here ("slot k now belongs to digest d", bookkeeping in the adapter
cache); the engine copies the weights of newly reserved adapters before the step runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.kv.block_pool import BlockPool, hash_block, hash_prefix_blocks

if TYPE_CHECKING:
    from loraplex.lora.adapter import LoRAAdapter


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
        """slot -> the adapter reserved in it, for every slot this batch uses."""
        return {
            s.slot: s.adapter for s, _ in self.items if s.slot is not None and s.adapter is not None
        }


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        adapters: SlotReservations | None,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.pool = pool
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free its blocks and slot (from either queue)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
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
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Additional blocks ``seq`` needs to hold ``num_tokens`` tokens in total."""
        bs = self.pool.block_size
        return max(0, -(-num_tokens // bs) - len(seq.block_ids))

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self._blocks_for(seq, seq.num_computed_tokens + n)
            while need > self.pool.num_free:
                victim = self.running[-1]  # newest; at index >= i, so never already batched
                self._preempt(victim)
                preempted = True
                batch.num_preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # seq itself was preempted; running[i] is now the next one
            seq.block_ids += self.pool.allocate(need)
            batch.items.append((seq, n))
            budget -= n
            i += 1
        if not preempted:
            self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            if seq.adapter is not None and self.adapters is not None:
                slot = self.adapters.reserve_slot(seq.adapter)
                if slot is None:  # every slot busy with other adapters: let others pass
                    skipped.append(seq)
                    continue
                seq.slot = slot
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
            need = -(-(computed + n) // self.pool.block_size) - len(hits)
            if need > self.pool.num_free_after_touch(hits):
                if seq.slot is not None and self.adapters is not None:
                    self.adapters.release_slot(seq.slot)
                    seq.slot = None
                self.waiting.appendleft(seq)  # memory is FCFS: stop admitting
                break
            self.pool.touch(hits)
            seq.block_ids = hits + self.pool.allocate(need)
            seq.num_computed_tokens = computed
            seq.num_published_blocks = len(hits)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = computed
                self.pool.record_query(len(seq.prompt_token_ids), computed)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n
        for seq in reversed(skipped):
            self.waiting.appendleft(seq)

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
