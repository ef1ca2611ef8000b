"""Qwen3: Llama's layers plus a per-head RMSNorm on q and k before RoPE.

``head_dim`` is explicit in its config and may differ from ``hidden_size / heads`` (the common
parse reads it); the small sizes tie the LM head to the embedding; no q/k/v bias unless
``attention_bias`` (which then biases o_proj too, as for Llama).
"""

from __future__ import annotations

from collections.abc import Mapping

from loraplex.model.decoder import LLAMA_LAYER_WEIGHTS, DecoderForCausalLM

QWEN3_LAYER_WEIGHTS: Mapping[str, tuple[str, int]] = {
    **LLAMA_LAYER_WEIGHTS,
    "self_attn.q_norm": ("q_norm", 0),  # [head_dim]
    "self_attn.k_norm": ("k_norm", 0),  # [head_dim]
}


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 dense models."""

    model_type = "qwen3"
    qk_norm = True
    layer_weights = QWEN3_LAYER_WEIGHTS
