"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k norms) with a sparse block
in every ``decoder_sparse_step``-th layer outside ``mlp_only_layers`` (the others keep a dense
MLP of ``intermediate_size``).

Routing as transformers: softmax over the ``num_experts`` router logits in float32, top
``num_experts_per_tok``, renormalised when ``norm_topk_prob``, then cast back to the model dtype.
Experts of ``moe_intermediate_size``; no shared expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.checkpoint.modules import MoESpec
from loraplex.model.moe import MoEDecoderForCausalLM, moe_config_fields
from loraplex.model.qwen3 import QWEN3_LAYER_WEIGHTS


class Qwen3MoeForCausalLM(MoEDecoderForCausalLM):
    """Qwen3-30B-A3B, Qwen3-235B-A22B and their fine-tunes."""

    model_type = "qwen3_moe"
    qk_norm = True
    layer_weights = QWEN3_LAYER_WEIGHTS

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        spec = MoESpec.from_hf_config({**c, "model_type": "qwen3_moe"})
        assert spec is not None
        return moe_config_fields(
            c, source, num_experts=spec.num_experts, inter=spec.intermediate,
            sparse=spec.layers, norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            block="mlp", in_model_dtype=True,
        )  # fmt: skip
