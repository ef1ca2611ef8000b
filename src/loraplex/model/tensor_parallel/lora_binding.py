"""LoRA on a tensor-parallel rank in ``--fully-sharded-loras`` mode: the model-side binding
(``model/lora_binding.py``) for A and B both cut over the ranks (``sharding`` says the cut).

It lives here, not beside :class:`~loraplex.model.lora_binding.LoRABinding`, because it exists
only under tensor parallelism and reads the rank's cut and its all-reduce: the one-device
binding knows nothing of ranks. The default split needs no binding of its own (its shrink's
all-reduce rides on the layer's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from loraplex.lora.ops import LoRAOps
from loraplex.lora.plan import LoRABatchPlan
from loraplex.lora.slots import LoRASlotBank
from loraplex.model.lora_binding import LoRABinding
from loraplex.model.tensor_parallel.sharding import HIDDEN_IN, HIDDEN_OUT, TensorParallel

if TYPE_CHECKING:
    from loraplex.model.spec import ModelConfig


class FullyShardedLoRABinding(LoRABinding):
    """LoRA in ``--fully-sharded-loras`` mode (``sharding``'s docstring)::

    y_r = shrink(x_r, A_r)            # x_r: the rank's input columns of x
    y = all_reduce(y_r)               # [T, rank rows] per module, one collective a group
    out[:, cols_r] += expand(y, B_r)  # cols_r: the rank's output columns
    """

    def __init__(
        self, bank: LoRASlotBank, ops: LoRAOps, tp: TensorParallel, cfg: ModelConfig
    ) -> None:
        super().__init__(bank, ops)
        self.tp = tp
        self.hidden = tp.hidden_cols(cfg)

    def add(
        self,
        layer: int,
        parts: Any,
        x: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
        rows_plan: LoRABatchPlan | None = None,
    ) -> None:
        if rows_plan is not None or parts[0][0] not in HIDDEN_IN | HIDDEN_OUT:
            # a MoE's experts and router, a shared expert's gate: the default split
            super().add(layer, parts, x, out, plan, rows_plan)
            return
        modules = self.modules_of(layer, parts, plan)
        if not modules:
            return
        lo, hi = self.hidden
        column = parts[0][0] in HIDDEN_IN
        x_in = x[:, lo:hi].contiguous() if column else x  # [T, D / size] or the rank's own
        ys = [self.ops.shrink(x_in, a, plan) for a, _, _, _ in modules]  # [T, rows] each
        y = torch.cat(ys, dim=1) if len(ys) > 1 else ys[0]
        self.tp.all_reduce(y)
        rows = ys[0].shape[1]
        for i, (_, bt, c0, c1) in enumerate(modules):
            dest = out[:, c0:c1] if column else out[:, lo:hi]  # row-parallel: its D columns
            self.ops.expand(y[:, i * rows : (i + 1) * rows].contiguous(), bt, dest, plan)
