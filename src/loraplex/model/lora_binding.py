"""The LoRA state a decoder reads each step: the slot bank's tables and the op backend.

A model calls ``add`` once per fused projection group and layer; modules no adapter of the step
targets are skipped without a call."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from loraplex.lora.ops import LoRAOps
from loraplex.lora.plan import LoRABatchPlan
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
    ) -> None:
        """``out[:, lo:hi] += `` LoRA delta of each ``(proj, lo, hi)`` of ``parts`` in ``layer``
        for every adapted token, the projections sharing input ``x: [T, d_in]`` in one
        ``apply_many``. Modules outside ``plan.modules`` (no adapter of the step targets them)
        are skipped. ``parts``: the same groups every step (the first name keys the cache)."""
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
        if modules:
            self.ops.apply_many(x, out, modules, plan)

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
