"""The LoRA state a decoder reads each step: the slot bank's tables and the op backend.

A model calls ``add`` once per fused projection group and layer; modules no adapter of the step
targets are skipped without a call. Outside the layers it calls ``add_embedding`` after the token
lookup and ``add_logits`` after the LM head, once per step each (both return at once when no
adapter of the step targets ``embed_tokens`` / ``lm_head``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from loraplex.checkpoint.modules import EMBED_KEY, LM_HEAD_KEY
from loraplex.lora.ops import LoRAOps
from loraplex.lora.plan import LoRABatchPlan, token_segments
from loraplex.lora.slots import LoRASlotBank, ModuleKey


class LoRABinding:
    """The LoRA state a model reads: slot tables plus the op backend chosen at start-up."""

    def __init__(self, bank: LoRASlotBank, ops: LoRAOps) -> None:
        self.bank = bank
        self.ops = ops
        # plan.modules -> (layer, first proj) -> the modules' (a, bt, lo, hi); bank tables are
        # fixed for the bank's life, so an entry stays valid however slots change
        self._by_modules: dict[frozenset[ModuleKey] | None, dict[tuple[int, str], tuple]] = {}
        self._lists: dict[tuple[int, str], tuple] = {}
        self._plan: LoRABatchPlan | None = None
        self._expert_layers: dict[frozenset[ModuleKey] | None, frozenset[int]] = {}
        self._segments: tuple[LoRABatchPlan, tuple[np.ndarray, np.ndarray]] | None = None
        self._embed: tuple[torch.Tensor, torch.Tensor] | None = None  # (at, bt), if adaptable
        self._head: tuple[tuple[torch.Tensor, torch.Tensor, int, int], ...] | None = None
        if EMBED_KEY in bank.module_shapes:
            a, bt = bank.tables(*EMBED_KEY)
            self._embed = (a.t(), bt)  # at: [vocab, capacity] (stored so), bt: [capacity, D]
        if LM_HEAD_KEY in bank.module_shapes:
            a, bt = bank.tables(*LM_HEAD_KEY)
            self._head = ((a, bt, 0, bt.shape[1]),)  # a: [capacity, D], bt: [capacity, vocab]

    def modules_for(self, slots: Iterable[int]) -> frozenset[ModuleKey]:
        """Modules any of ``slots``' adapters targets (recorded by the bank when it filled each
        slot), so a step's plan can skip every other module."""
        found: set[ModuleKey] = set()
        for slot in slots:
            found |= self.bank.slot_modules(slot)
        return frozenset(found)

    def add(
        self,
        layer: int,
        parts: Sequence[tuple[str, int, int]],
        x: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
        rows_plan: LoRABatchPlan | None = None,
    ) -> None:
        """``out[:, lo:hi] += `` LoRA delta of each ``(proj, lo, hi)`` of ``parts`` in ``layer``
        for every adapted token, the projections sharing input ``x: [T, d_in]`` in one
        ``apply_many``. Modules outside ``plan.modules`` (no adapter of the step targets them)
        are skipped. ``parts``: the same groups every step (the first name keys the cache).
        ``rows_plan``: the rows of ``x`` are not the step's tokens but a MoE layer's (token,
        expert) pairs, planned by ``plan_expert_rows`` (``plan`` still says which modules)."""
        modules = self.modules_of(layer, parts, plan)
        if modules:
            self.ops.apply_many(x, out, modules, plan if rows_plan is None else rows_plan)

    def modules_of(
        self, layer: int, parts: Sequence[tuple[str, int, int]], plan: LoRABatchPlan
    ) -> tuple:
        """``(a, bt, lo, hi)`` of each projection of ``parts`` in ``layer`` that an adapter of
        the step targets (the same tuple object while the step's modules stay the same)."""
        if plan is not self._plan:
            self._switch(plan)
        key = (layer, parts[0][0])
        modules = self._lists.get(key)
        if modules is None:
            wanted = plan.modules
            modules = self._lists[key] = tuple(
                (*self.bank.tables(layer, proj), lo, hi)
                for proj, lo, hi in parts
                if wanted is None or (layer, proj) in wanted
            )
        return modules

    def experts_used(self, layer: int, plan: LoRABatchPlan) -> bool:
        """Whether an adapter of the step targets one of ``layer``'s expert projections."""
        got = self._expert_layers.get(plan.modules)
        if got is None:
            if len(self._expert_layers) >= 64:
                self._expert_layers.clear()
            experts = [
                k for k in self.bank.module_experts if plan.modules is None or k in plan.modules
            ]
            got = self._expert_layers[plan.modules] = frozenset(k[0] for k in experts)
        return layer in got

    def token_segments(self, plan: LoRABatchPlan) -> tuple[np.ndarray, np.ndarray]:
        """``token_segments(plan)``, once per step (every MoE layer reads it)."""
        got = self._segments
        if got is None or got[0] is not plan:
            got = self._segments = (plan, token_segments(plan))
        return got[1]

    def add_embedding(self, input_ids: torch.Tensor, h: torch.Tensor, plan: LoRABatchPlan) -> None:
        """``h[t] += `` the embedding LoRA delta of token ``input_ids[t]`` for every adapted
        token (``h: [T, D]``, the looked-up embeddings; ``plan`` the step's)."""
        if self._embed is not None and plan.uses(EMBED_KEY):
            self.ops.embed(input_ids, *self._embed, h, plan)

    def add_logits(self, x: torch.Tensor, logits: torch.Tensor, plan: LoRABatchPlan) -> None:
        """``logits[i] += `` the LM head's LoRA delta of row ``x[i]`` (``x: [N, D]``, the head's
        input; ``logits: [N, vocab]``; ``plan`` over those N rows, ``plan_rows`` of the step's).
        A tied head gets it here and never in the embedding lookup."""
        if self._head is not None and plan.uses(LM_HEAD_KEY):
            self.ops.apply_many(x, logits, self._head, plan)

    def active(
        self, plan: LoRABatchPlan, groups: Sequence[Sequence[tuple[str, int, int]]]
    ) -> list[bool]:
        """Per group of ``groups``: whether any adapter of the step targets one of its
        projections in some layer (the model skips the others' ``add`` calls altogether)."""
        if plan.modules is None:
            return [True] * len(groups)
        projs = {proj for _, proj in plan.modules}
        return [any(proj in projs for proj, _, _ in parts) for parts in groups]

    def _switch(self, plan: LoRABatchPlan) -> None:
        """The module lists for ``plan.modules``: the same tuple objects while the step's set of
        targeted modules stays the same (so backends may key what they derive on identity)."""
        if len(self._by_modules) >= 64 and plan.modules not in self._by_modules:
            self._by_modules.clear()
        self._lists = self._by_modules.setdefault(plan.modules, {})
        self._plan = plan
