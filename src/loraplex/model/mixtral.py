"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a sparse block in every layer.

Routing as transformers: softmax over the ``num_local_experts`` router logits in float32, top
``num_experts_per_tok`` (2), renormalised (a softmax over the chosen logits), and the weights
kept in float32 where they scale the experts' outputs. Each expert is ``intermediate_size`` wide;
checkpoints name the block ``block_sparse_moe`` and the experts' projections ``w1`` (gate),
``w3`` (up) and ``w2`` (down), or (transformers 5) ``mlp.experts.gate_up_proj`` / ``down_proj``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.model.moe import MoEDecoderForCausalLM, moe_config_fields


class MixtralForCausalLM(MoEDecoderForCausalLM):
    """Mixtral 8x7B, 8x22B and their fine-tunes."""

    model_type = "mixtral"

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        layers = tuple(range(int(c["num_hidden_layers"])))
        return moe_config_fields(
            c, source, num_experts=int(c.get("num_local_experts") or 8),
            inter=int(c["intermediate_size"]), sparse=layers, norm_topk_prob=True,
            block="block_sparse_moe", in_model_dtype=False,
        )  # fmt: skip
