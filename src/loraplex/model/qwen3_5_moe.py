"""Qwen3.5-MoE: Qwen3.5's hybrid layers (``model/qwen3_5.py``: Gated DeltaNet linear attention
and gated full attention) with a sparse block in every layer (``model/moe.py``).

What differs from Qwen3.5: no dense MLP. Each layer routes as Qwen3-MoE does (softmax over the
``num_experts`` router logits in float32, top ``num_experts_per_tok``, always renormalised, cast
back to the model dtype) over experts of ``moe_intermediate_size`` (packed ``experts.gate_up_proj``
``[E, 2 I, D]`` / ``experts.down_proj [E, D, I]``), and adds a shared expert of
``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``. Adapters may
target the linear-attention and attention projections, the router, the experts (PEFT's
``target_parameters``), the shared expert's projections and its gate (PEFT's ``all-linear``
takes all of them but the router, a parameter).

Tensor parallelism: Qwen3.5's cut (``qwen3_5.py``) and the sparse block's (``moe.py``: each
expert's and the shared expert's columns, its gate and the router whole).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraplex.checkpoint.modules import MoESpec
from loraplex.model.moe import MoEConfig, MoEDecoderForCausalLM, moe_config_fields
from loraplex.model.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM, text_checkpoint_name
from loraplex.types import ModelLoadError


@dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3_5Config, MoEConfig):
    """Qwen3.5's hybrid fields and the sparse blocks' (the shared expert's gate is one of its
    layer's modules: ``MoESpec.shapes``)."""


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM, MoEDecoderForCausalLM):
    """Qwen3.5-MoE text models (``Qwen3_5MoeForCausalLM``)."""

    model_type = "qwen3_5_moe_text"
    config_class = Qwen3_5MoeConfig

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        spec = MoESpec.from_hf_config({**c, "model_type": "qwen3_5_moe_text"})
        if spec is None or not spec.layers:
            raise ModelLoadError(f"{source}: num_experts must be >= 1")
        moe = moe_config_fields(
            c, source, num_experts=spec.num_experts, inter=spec.intermediate, sparse=spec.layers,
            norm_topk_prob=True, block="mlp", in_model_dtype=True,
            shared=spec.shared_intermediate, shared_gate=spec.shared_intermediate > 0,
        )  # fmt: skip
        return {**super().config_fields(c, source), **moe, "packed_only": True}


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The language model of a Qwen3.5-MoE vision-language checkpoint (text prompts only)."""

    model_type = "qwen3_5_moe"

    def checkpoint_name(self, name: str) -> str | None:
        return text_checkpoint_name(name, super().checkpoint_name)
