"""Turn a scheduled batch into tensors and run the model once.

Adapter slots come with the batch: ``batch.slot_rows[slot]`` is the ``(row_start, row_end)``
range the slot's adapter occupies in the slot bank's tables (recorded when the engine activated
the batch's adapters); the runner never asks the adapter cache.
"""

from __future__ import annotations

import torch

from loraplex.engine.scheduler import ScheduledBatch
from loraplex.engine.sequence import Sequence
from loraplex.kv.cache import PagedKVCache
from loraplex.lora.plan import LoRAPlanCosts, plan_lora_batch
from loraplex.model.attention import AttentionMetadata, PrefillSpan
from loraplex.model.llama import ForwardBatch, LlamaForCausalLM


class ModelRunner:
    """Owns the model and its KV cache; one ``run`` per engine step."""

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.block_size = cache.block_size
        dims = model.cfg.module_shapes.values()
        self.lora_costs = LoRAPlanCosts(feature_dim=sum(i + o for i, o in dims) // len(dims))

    @staticmethod
    def order(batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
        """Base-model sequences first, then grouped by adapter slot in row order (LoRA runs)."""
        rows = batch.slot_rows

        def key(item: tuple[Sequence, int]) -> tuple[int, int]:
            slot = item[0].slot
            return (-1, -1) if slot is None else (rows[slot][0], slot)

        return sorted(batch.items, key=key)

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Cache slot of each position in [start, end) of ``seq``."""
        bs = self.block_size
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_ids, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def prepare(
        self, items: list[tuple[Sequence, int]], slot_rows: dict[int, tuple[int, int]]
    ) -> tuple[ForwardBatch, list[Sequence]]:
        """Flatten the step into a ForwardBatch; returns it and the sequences that sample.

        ``slot_rows``: slot -> (row_start, row_end) of the adapters in ``items``."""
        ids: list[int] = []
        positions: list[int] = []
        slot_chunks: list[torch.Tensor] = []
        dec_tokens: list[int] = []
        dec_seqs: list[Sequence] = []
        prefills: list[PrefillSpan] = []
        logits_idx: list[int] = []
        samplers: list[Sequence] = []
        segments: list[tuple[int, int, int, int]] = []
        t = 0
        for seq, n in items:
            start = seq.num_computed_tokens
            ids += seq.all_token_ids[start : start + n]
            positions += range(start, start + n)
            slot_chunks.append(self._slots(seq, start, start + n))
            if n == 1 and start > 0:
                dec_tokens.append(t)
                dec_seqs.append(seq)
            elif start == 0:
                prefills.append(PrefillSpan(t, t + n))
            else:
                ctx = start + n
                mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]  # [n, ctx]
                prefills.append(
                    PrefillSpan(
                        t, t + n, self._slots(seq, 0, ctx).to(self.device), mask.to(self.device)
                    )
                )
            if start + n == seq.num_tokens:
                logits_idx.append(t + n - 1)
                samplers.append(seq)
            if seq.slot is not None:
                rs, re = slot_rows[seq.slot]
                if segments and segments[-1][2] == rs and segments[-1][1] == t:
                    segments[-1] = (segments[-1][0], t + n, rs, re)
                else:
                    segments.append((t, t + n, rs, re))
            t += n
        dev = self.device
        attn = AttentionMetadata(slot_mapping=torch.cat(slot_chunks).to(dev), prefills=prefills)
        if dec_seqs:
            lens = [s.num_computed_tokens + 1 for s in dec_seqs]
            lmax = max(lens)
            nblk = -(-lmax // self.block_size)
            table = torch.zeros(len(dec_seqs), nblk, dtype=torch.long)
            for r, s in enumerate(dec_seqs):
                table[r, : len(s.block_ids[:nblk])] = torch.tensor(s.block_ids[:nblk])
            pos = torch.arange(lmax)
            ctx_slots = (
                table[:, pos // self.block_size] * self.block_size + pos % self.block_size
            )  # [Bd, L]
            mask = pos[None, :] < torch.tensor(lens)[:, None]  # [Bd, L]
            attn.decode_ctx_slots = ctx_slots.to(dev)
            attn.decode_mask = mask[:, None, None, :].to(dev)
            attn.decode_all = len(dec_tokens) == t
            attn.decode_tokens = torch.tensor(dec_tokens, dtype=torch.long, device=dev)
        plan = None
        if segments:
            plan = plan_lora_batch(t, segments, self.model.dtype, dev, self.lora_costs)
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            attn=attn,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=dev),
            lora_plan=plan,
        )
        return fb, samplers

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Forward the step; returns logits [S, vocab] (float32) and the sampling sequences."""
        fb, samplers = self.prepare(self.order(batch), batch.slot_rows)
        logits = self.model.forward(fb, self.cache)  # [0, vocab] for partial prefill chunks only
        return logits, samplers
