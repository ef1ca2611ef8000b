"""Turn a scheduled batch into tensors and run the model once.

Adapter slots come with the batch: ``batch.slot_rows[slot]`` is the ``(row_start, row_end)``
range the slot's adapter occupies in the slot bank's tables (recorded when the engine staged
the batch's adapters); the runner never asks the adapter cache.

Merging (``lora_merge_after_steps``): before each run the runner tells its
:class:`~loraplex.engine.merge.AdapterMerger` which adapter the batch uses alone (if one does)
and learns whether that adapter runs merged into the base weights; if so its tokens take the
base path this step (``merged_slot``), except on ``embed_tokens`` / ``lm_head``, which are never
merged: a merged adapter with LoRA there keeps its segments, in a plan of only those modules.
Only the runner sets that state.

KV-cache groups (``loraplex.kv.groups``): with several, the step's metadata carries one copy
per group (``attn.kv_groups``) with that group's write slots, context slots and decode block
table. A windowed group's released blocks read as block 0 (the window masks hide them); the
positions a sequence took from the prefix cache in one group but recomputes for the others
are written to the cache's trash page, never into the shared blocks.

Speculative decoding: a sequence carrying draft tokens (``seq.spec_tokens``) runs its last token
and the draft as one row of ``1 + k`` tokens with logits at every one of them. They are written to
the cache first and attended as ``1 + k`` decode queries over the sequence's block table, query
``j`` seeing positions up to its own (the paged decode kernel, as one decode row would use).

Prompt logprobs: for a sequence that asked for them, the hidden state of every prompt position
in the step's chunk is kept, and ``logprob(prompt[p + 1] | prompt[:p + 1])`` (with the top-k) is
computed from it in row chunks that bound the [rows, vocab] logits' memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from loraplex.checkpoint.modules import LM_HEAD_KEY
from loraplex.engine.merge import AdapterMerger, vocab_modules
from loraplex.engine.scheduler import ScheduledBatch
from loraplex.engine.sequence import Sequence
from loraplex.kv.cache import PagedKVCache
from loraplex.kv.groups import NULL_BLOCK, Window, window_span
from loraplex.lora.plan import LoRABatchPlan, LoRAPlanCosts, plan_lora_batch, plan_rows
from loraplex.model.attention import (
    NO_PAGE,
    AttentionMetadata,
    PrefillSpan,
    StateMetadata,
    StateSpan,
    WindowMasks,
    causal_mask,
    decode_mask,
)
from loraplex.model.decoder import DecoderForCausalLM, ForwardBatch

_PROMPT_LOGITS_ELEMS = 1 << 24  # floats of [rows, vocab] prompt logits held at once (64 MiB)


def _head_plan(plan: LoRABatchPlan | None, rows: list[int]) -> LoRABatchPlan | None:
    """The step's plan over the logits ``rows`` (ascending token indices) when an adapter of the
    step has LoRA on the LM head, else None (no head LoRA this step)."""
    if plan is None or not plan.uses(LM_HEAD_KEY):
        return None
    return plan_rows(plan, rows)


@dataclass
class PromptLogprobRows:
    """Prompt positions of one sequence computed this step: batch ``rows`` predict the prompt
    tokens from index ``first`` on (``rows[i]`` -> ``prompt_token_ids[first + i]``)."""

    seq: Sequence
    rows: list[int]
    first: int


class ModelRunner:
    """Owns the model, its KV cache and which adapter runs merged; one ``run`` per engine step."""

    def __init__(
        self, model: DecoderForCausalLM, cache: PagedKVCache, merger: AdapterMerger | None = None
    ) -> None:
        self.model = model
        self.cache = cache
        self.merger = merger
        self.device = model.device
        self.block_size = cache.block_size
        self.windows = model.windows  # the distinct sliding windows (and chunks) of its layers
        self.windowed_groups = {g for g, grp in enumerate(cache.groups) if grp.window is not None}
        self.state_groups = [g for g, grp in enumerate(cache.groups) if grp.state]
        dims = model.cfg.module_shapes.values()
        self.lora_costs = LoRAPlanCosts(feature_dim=sum(i + o for i, o in dims) // len(dims))
        self._merged_slot: int | None = None
        self._merged_vocab: frozenset[tuple[int, str]] = frozenset()  # its gathered modules
        self._plan_memo: tuple[tuple, LoRABatchPlan] | None = None  # (inputs, plan): last step's
        self._head_memo: tuple[LoRABatchPlan | None, list[int], LoRABatchPlan | None] | None = None

    @property
    def merged_slot(self) -> int | None:
        """The slot whose adapter ran merged into the base weights in the last run (its tokens
        took the base path, with LoRA only on its embed_tokens / lm_head if any), else None."""
        return self._merged_slot

    def _merge_for(self, batch: ScheduledBatch) -> int | None:
        """Tell the merger the adapter every sequence of ``batch`` uses (None: base sequences
        or several adapters, and it unmerges: a reference swap, never a wait); the slot that
        runs merged this step, else None."""
        assert self.merger is not None
        # a composition (several adapters, or one scaled) is keyed apart from its first
        # adapter: a step with one is never a lone plain adapter's, and it never merges
        digests = {s.adapter_key for s, _ in batch.items}
        seq = batch.items[0][0]
        if len(digests) > 1 or seq.adapter is None or seq.is_alora or seq.is_composed:
            self.merger.before_step(None, None)
            self._merged_vocab = frozenset()
            return None
        merged = self.merger.before_step(seq.adapter.ref.sha256, seq.adapter.weights)
        self._merged_vocab = vocab_modules(seq.adapter.weights) if merged else frozenset()
        return seq.slot if merged else None

    @staticmethod
    def order(batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
        """Base-model sequences first, then grouped by adapter slot in row order (LoRA runs)."""
        rows = batch.slot_rows

        def key(item: tuple[Sequence, int]) -> tuple[int, int, bool]:
            slot = item[0].slot  # a composition: its first adapter's (the plan's layer 0)
            return (-1, -1, False) if slot is None else (rows[slot][0], slot, item[0].is_composed)

        return sorted(batch.items, key=key)

    def _slots(self, seq: Sequence, start: int, end: int, group: int = 0) -> torch.Tensor:
        """Cache slot of each position in [start, end) of ``seq`` in KV-cache group ``group``
        (a released block's positions, which no query sees, at block 0's slots)."""
        bs = self.block_size
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_tables[group], dtype=torch.long)
        if group in self.windowed_groups:
            table.clamp_(min=0)  # NULL_BLOCK
        return table[pos // bs] * bs + pos % bs

    def _write_slots(self, seq: Sequence, start: int, end: int, group: int) -> torch.Tensor:
        """Where group ``group`` writes positions [start, end) of ``seq``: its slots, but the
        cache's trash page for positions in blocks it took from the prefix cache (it shares
        them: their KV is already there, computed by whoever published them)."""
        slots = self._slots(seq, start, end, group)
        shared = seq.kv_shared[group] * self.block_size if seq.kv_shared else 0
        if start < shared:
            trash = self.cache.trash_block * self.block_size
            pos = torch.arange(start, min(end, shared))
            slots[: len(pos)] = trash + pos % self.block_size
        return slots

    def _decode_slot(self, seq: Sequence, group: int) -> int:
        """``_write_slots(seq, p, p + 1, group)``'s one slot for a decode row at ``p =
        seq.num_computed_tokens`` (a plain int: no tensor ops per sequence and step)."""
        bs, p = self.block_size, seq.num_computed_tokens
        if seq.kv_shared and p < seq.kv_shared[group] * bs:  # a block from the prefix cache
            assert self.cache.trash_block is not None
            return self.cache.trash_block * bs + p % bs
        block = seq.block_tables[group][p // bs]
        if group in self.windowed_groups:
            block = max(block, 0)  # NULL_BLOCK
        return block * bs + p % bs

    def _decode_table(self, dec_seqs: list[Sequence], nblk: int, group: int) -> torch.Tensor:
        """[Bd, nblk] block ids of group ``group`` (padded with 0; released blocks at 0)."""
        rows = [s.block_tables[group][:nblk] for s in dec_seqs]
        table = torch.tensor([r + [0] * (nblk - len(r)) for r in rows], dtype=torch.long)
        return table.clamp_(min=0) if group in self.windowed_groups else table

    def _group_metadata(
        self,
        attn: AttentionMetadata,
        items: list[tuple[Sequence, int]],
        dec_seqs: list[Sequence],
        group: int,
    ) -> AttentionMetadata:
        """``attn`` (group 0's) for KV-cache group ``group``: its slots, context slots and
        decode block table; the same spans, masks and lengths."""
        dev = self.device
        slots: list[int] = []
        spans = []
        it = iter(attn.prefills)
        for seq, n in items:
            start = seq.num_computed_tokens
            if n == 1 and start > 0:
                slots.append(self._decode_slot(seq, group))
                continue
            slots += self._write_slots(seq, start, start + n, group).tolist()
            if seq.spec_tokens:  # a drafted row: decode queries, no span
                continue
            span = next(it)
            if span.ctx_slots is not None:
                ctx = self._slots(seq, 0, start + n, group).to(dev)
                span = replace(span, ctx_slots=ctx)
            spans.append(span)
        table = attn.decode_block_table
        if table is not None:
            table = self._decode_table(dec_seqs, table.shape[1], group).to(dev)
        return replace(
            attn,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            prefills=spans,
            decode_block_table=table,
            kv_groups=[],
        )

    def _state_metadata(self, items: list[tuple[Sequence, int]], group: int) -> StateMetadata:
        """State group ``group``'s pages for the step: each sequence reads the page of the
        block holding its last computed position and writes the page of every block its new
        tokens reach (a decode row: one; a chunk: the state at each block end, then its end)."""
        bs, dev = self.block_size, self.device
        src: list[int] = []
        dst: list[int] = []
        spans: list[StateSpan] = []
        t = 0
        for seq, n in items:
            start, table = seq.num_computed_tokens, seq.block_tables[group]
            prev = table[(start - 1) // bs] if start > 0 else NO_PAGE
            if n == 1 and start > 0:
                src.append(prev)
                dst.append(table[start // bs])
            else:
                first, last = start // bs, (start + n - 1) // bs
                took = [b for b in range(first, last + 1) if table[b] != NULL_BLOCK]  # snapshots
                ends = [min((b + 1) * bs, start + n) - start for b in took]
                spans.append(StateSpan(t, t + n, start, prev, ends, [table[b] for b in took]))
            t += n
        meta = StateMetadata(prefills=spans)
        if src:
            meta.decode_src = torch.tensor(src, dtype=torch.long, device=dev)
            meta.decode_dst = torch.tensor(dst, dtype=torch.long, device=dev)
        return meta

    def _window_masks(
        self,
        window: Window,
        attn: AttentionMetadata,
        prefill_pos: list[tuple[int, int]],
        dec_lens: list[int],
    ) -> WindowMasks:
        """``attn``'s masks under a sliding ``window`` or attention chunk (built once per step
        for all the layers with it): the global mask where every query's context fits in the
        window (or the first chunk), else the causal one that also hides what it does not see."""
        assert window is not None
        span_of = window_span(window)
        wm = WindowMasks(size=window if isinstance(window, int) else -window.size)
        for span, (start, ctx) in zip(attn.prefills, prefill_pos, strict=True):
            bites = ctx > span_of
            wm.prefill.append(
                causal_mask(start, ctx, window).to(self.device) if bites else span.mask
            )
        if attn.decode_mask is not None:
            lens = torch.tensor(dec_lens)  # [Bd]
            width = attn.decode_mask.shape[-1]
            bites = int(lens.max()) > span_of
            wm.decode = (
                decode_mask(lens, width, window).to(self.device) if bites else attn.decode_mask
            )
        return wm

    def prepare(
        self, items: list[tuple[Sequence, int]], slot_rows: dict[int, tuple[int, int]]
    ) -> tuple[ForwardBatch, list[Sequence], list[PromptLogprobRows]]:
        """Flatten the step into a ForwardBatch; returns it, the sequences that sample and the
        prompt positions whose logprobs are due.

        ``slot_rows``: slot -> (row_start, row_end) of the adapters in ``items``."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []  # group 0's write slot of each token
        dec_tokens: list[int] = []
        dec_seqs: list[Sequence] = []  # per decode query (a drafted row: 1 + k of them)
        dec_lens: list[int] = []  # per decode query: the positions it sees (itself included)
        prefills: list[PrefillSpan] = []
        prefill_pos: list[tuple[int, int]] = []  # per prefill span: (first position, context)
        logits_idx: list[int] = []
        samplers: list[Sequence] = []
        segments: list[tuple[int, int, int, int]] = []
        weights: list[float] = []  # per segment: its sequence's (first) scale
        extra: list[tuple[int, int, int, int, float]] = []  # compositions' other adapters
        prompt_rows: list[PromptLogprobRows] = []
        t = 0
        for seq, n in items:
            start = seq.num_computed_tokens
            if seq.needs_prompt_logits:
                # position p predicts prompt[p + 1]; the first len(done) targets are known
                done = len(seq.prompt_logprobs or ())
                lo, hi = max(start, done - 1), min(start + n, len(seq.prompt_token_ids) - 1)
                if lo < hi:
                    rows = list(range(t + lo - start, t + hi - start))
                    prompt_rows.append(PromptLogprobRows(seq, rows, lo + 1))
            positions += range(start, start + n)
            k = len(seq.spec_tokens)  # a draft rides on a decode row: n == 1 + k
            if n == 1 and start > 0:  # a decode row: its token is the last one
                ids.append(seq.token_at(start))
                slots.append(self._decode_slot(seq, 0))
            else:
                ids += (
                    [seq.token_at(start), *seq.spec_tokens]
                    if k
                    else (seq.all_token_ids[start : start + n])
                )
                slots += self._write_slots(seq, start, start + n, 0).tolist()
            if n == 1 and start > 0:
                dec_tokens.append(t)
                dec_seqs.append(seq)
                dec_lens.append(start + 1)
            elif k:  # a drafted row: 1 + k decode queries, each seeing the cache up to itself
                dec_tokens.extend(range(t, t + n))
                dec_seqs.extend([seq] * n)
                dec_lens.extend(range(start + 1, start + n + 1))
            elif start == 0:
                prefills.append(PrefillSpan(t, t + n))
                prefill_pos.append((0, n))
            else:
                ctx = start + n
                mask = causal_mask(start, ctx)  # [n, ctx]
                prefill_pos.append((start, ctx))
                prefills.append(
                    PrefillSpan(
                        t, t + n, self._slots(seq, 0, ctx).to(self.device), mask.to(self.device)
                    )
                )
            if start + n - k == seq.num_tokens:  # a drafted row: logits at all 1 + k tokens
                logits_idx.extend(range(t + n - 1 - k, t + n))
                samplers.append(seq)
            merged = seq.slot == self._merged_slot
            # an aLoRA's rows before its activation point are base rows (in a composition,
            # each component from its own start)
            lo = seq.component_starts[0] if seq.component_starts else seq.lora_start
            if seq.slot is not None and (not merged or self._merged_vocab):
                rs, re = slot_rows[seq.slot]
                first = t + n if lo is None else t + max(lo - start, 0)
                w = seq.scales[0] if seq.scales is not None else 1.0
                if first >= t + n:
                    pass  # the whole chunk lies before the activation point
                elif (
                    segments
                    and segments[-1][2] == rs
                    and segments[-1][1] == first
                    and weights[-1] == w
                ):
                    segments[-1] = (segments[-1][0], t + n, rs, re)
                else:
                    segments.append((first, t + n, rs, re))
                    weights.append(w)
                if seq.scales is not None:  # a composition's other adapters
                    others = zip(
                        seq.composed_slots, seq.scales[1:], seq.component_starts[1:], strict=True
                    )
                    for slot, wk, lk in others:
                        fk = t + max(lk - start, 0) if lk is not None else t + n
                        if fk < t + n:
                            extra.append((fk, t + n, *slot_rows[slot], wk))
            t += n
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        attn = AttentionMetadata(slot_mapping=slot_mapping, prefills=prefills)
        if dec_seqs:
            lens = dec_lens
            lmax = max(lens)
            nblk = -(-lmax // self.block_size)
            table = self._decode_table(dec_seqs, nblk, 0)
            # whole blocks: gathered block-wise
            attn.decode_lens = torch.tensor(lens, dtype=torch.long)
            attn.decode_mask = decode_mask(attn.decode_lens, nblk * self.block_size).to(dev)
            attn.decode_lens = attn.decode_lens.to(dev)
            attn.decode_block_table = table.to(dev)
            attn.decode_all = len(dec_tokens) == t
            attn.decode_tokens = torch.tensor(dec_tokens, dtype=torch.long, device=dev)
        attn.windowed = [self._window_masks(w, attn, prefill_pos, dec_lens) for w in self.windows]
        if len(self.cache.groups) > 1:
            rest = range(1, len(self.cache.groups))
            attn.kv_groups = [
                attn,
                *(
                    attn
                    if g in self.state_groups
                    else self._group_metadata(attn, items, dec_seqs, g)
                    for g in rest
                ),
            ]
        for g in self.state_groups:
            attn.states[g] = self._state_metadata(items, g)
        plan = None
        if segments:
            lora = self.model.lora  # the step's adapters decide which modules the plan covers
            slots = {s for seq, _ in items for s in seq.slots if s != self._merged_slot}
            modules = lora.modules_for(slots) if lora is not None else None
            if modules is not None and self._merged_slot is not None:
                modules |= self._merged_vocab  # a merged adapter's embed_tokens / lm_head
            plan = self._plan(t, segments, weights, extra, modules)
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            attn=attn,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=dev),
            lora_plan=plan,
            logits_lora_plan=self._head_plan(plan, logits_idx),
        )
        return fb, samplers, prompt_rows

    def _plan(
        self,
        num_tokens: int,
        segments: list[tuple[int, int, int, int]],
        weights: list[float],
        extra: list[tuple[int, int, int, int, float]],
        modules: frozenset[tuple[int, str]] | None,
    ) -> LoRABatchPlan:
        """The step's LoRA plan: the last step's again when its inputs are the same (a decode
        batch that has not changed: its plan work, and what the ops derive from the plan's
        identity, are done once), else a new one."""
        key = (num_tokens, segments, weights, extra, modules)
        if self._plan_memo is not None and self._plan_memo[0] == key:
            return self._plan_memo[1]
        plan = plan_lora_batch(
            num_tokens, segments, self.model.dtype, self.device, self.lora_costs, modules,
            weights=weights, extra=extra,
        )  # fmt: skip
        self._plan_memo = (key, plan)
        return plan

    def _head_plan(self, plan: LoRABatchPlan | None, rows: list[int]) -> LoRABatchPlan | None:
        """``_head_plan`` of the step, the last step's again for the same plan and rows."""
        memo = self._head_memo
        if memo is not None and memo[0] is plan and memo[1] == rows:
            return memo[2]
        head = _head_plan(plan, rows)
        self._head_memo = (plan, rows, head)
        return head

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Forward the step; returns logits [S, vocab] (float32) and the sampling sequences:
        one row per sequence, ``1 + k`` rows for one carrying a draft of ``k`` tokens (its
        ``spec_tokens``, run after its last token: row ``j`` predicts the token after the
        draft's first ``j``). Prompt logprobs due this step are appended to their sequences."""
        if self.merger is not None:
            self._merged_slot = self._merge_for(batch)
        fb, samplers, prompt_rows = self.prepare(self.order(batch), batch.slot_rows)
        if not prompt_rows:
            logits = self.model.forward(fb, self.cache)  # [0, vocab] for partial prefills only
            return logits, samplers
        h = self.model.hidden_states(fb, self.cache)  # [T, D]
        for job in prompt_rows:
            self._prompt_logprobs(h, job, fb.lora_plan)
        return self.model.logits_at(h, fb.logits_indices, fb.logits_lora_plan), samplers

    @torch.inference_mode()
    def _prompt_logprobs(
        self, h: torch.Tensor, job: PromptLogprobRows, plan: LoRABatchPlan | None
    ) -> None:
        """Append {prompt token: logprob, top-k...} for ``job``'s rows to its sequence.
        h: [T, D] last-layer hidden states of the step; ``plan`` the step's LoRA plan."""
        seq = job.seq
        assert seq.prompt_logprobs is not None
        k = seq.params.prompt_logprobs or 0
        vocab = self.model.cfg.vocab_size
        step = max(1, _PROMPT_LOGITS_ELEMS // vocab)
        prompt = seq.prompt_token_ids
        for c in range(0, len(job.rows), step):
            rows = job.rows[c : c + step]
            first = job.first + c
            targets = torch.tensor(prompt[first : first + len(rows)], device=self.device)
            idx = torch.tensor(rows, dtype=torch.long, device=self.device)
            logits = self.model.logits_at(h, idx, _head_plan(plan, rows))  # [r, V]
            lp = torch.log_softmax(logits, dim=-1)
            chosen = lp.gather(1, targets[:, None])[:, 0].cpu().tolist()  # [r]
            top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            top_v, top_i = top_v.cpu().tolist(), top_i.cpu().tolist()  # [r, k]
            for r in range(len(rows)):
                entry = {prompt[first + r]: chosen[r]}  # the prompt token first, as vLLM
                for tok, val in zip(top_i[r], top_v[r], strict=True):
                    entry.setdefault(tok, val)
                seq.prompt_logprobs.append(entry)
