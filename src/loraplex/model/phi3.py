"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): Llama's layers with fused checkpoint projections.

- ``self_attn.qkv_proj`` (``[q + 2 kv, D]``, rows q then k then v) and ``mlp.gate_up_proj``
  (``[2 I, D]``, gate rows then up rows, HF's ``chunk(2)``) load straight into the decoder's
  fused ``qkv`` and ``gate_up`` slots;
- rotary on the first ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75), default or
  LongRoPE (the 128k variants: short and long factors, an attention factor, the long set for a
  sequence longer than ``original_max_position_embeddings``; see ``LongRoPERotaryEmbedding``);
- a ``sliding_window``, where set, masks every layer (as Mistral).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.model.decoder import DecoderForCausalLM
from loraplex.types import ModelLoadError

PHI3_LAYER_WEIGHTS: Mapping[str, tuple[str, int]] = {
    "input_layernorm": ("ln1", 0),
    "post_attention_layernorm": ("ln2", 0),
    "self_attn.qkv_proj": ("qkv", 0),  # [q + 2 kv, D]: the whole slot
    "self_attn.o_proj": ("o", 0),
    "mlp.gate_up_proj": ("gate_up", 0),  # [2 I, D]: the whole slot
    "mlp.down_proj": ("down", 0),
}

PHI3_ROPE_TYPES = ("default", "longrope")
"""The rope types transformers' ``Phi3Config.validate_rope`` accepts."""

PHI3_ORIGINAL_MAX_POSITIONS = 4096
"""``Phi3Config.original_max_position_embeddings``'s default (HF reads the top-level field, never
the one inside ``rope_parameters``)."""


def phi3_rope_scaling(c: Mapping[str, Any], head_dim: int, source: str) -> dict[str, Any] | None:
    """The rotary's ``rope_scaling`` from Phi3 config ``c`` as transformers resolves it (None:
    default RoPE over the whole head). Other types and factor lists of the wrong length are
    refused naming the field."""
    rope = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    rtype = str(rope.get("rope_type", rope.get("type", "default")))
    if rtype not in PHI3_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope_scaling type {rtype!r} for Phi3; "
            f"supported: {PHI3_ROPE_TYPES}"
        )
    partial = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    if rtype == "default":
        return (
            None if partial == 1.0 else {"rope_type": "default", "partial_rotary_factor": partial}
        )
    half = int(head_dim * partial) // 2
    for key in ("short_factor", "long_factor"):
        factors = rope.get(key)
        if not isinstance(factors, list) or len(factors) != half:
            raise ModelLoadError(f"{source}: rope_scaling.{key} must list {half} numbers")
    original = int(c.get("original_max_position_embeddings") or PHI3_ORIGINAL_MAX_POSITIONS)
    factor = rope.get("factor")
    if factor is None:  # HF: the ratio of the context lengths
        factor = int(c.get("max_position_embeddings", 4096)) / original
    return {
        "rope_type": "longrope",
        "short_factor": [float(x) for x in rope["short_factor"]],
        "long_factor": [float(x) for x in rope["long_factor"]],
        "original_max_position_embeddings": original,
        "factor": float(factor),
        "attention_factor": rope.get("attention_factor"),
        "partial_rotary_factor": partial,
    }


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 (mini, small, medium; 4k and 128k) and Phi-4 (14B, mini)."""

    model_type = "phi3"
    layer_weights = PHI3_LAYER_WEIGHTS

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        return {"rope_scaling": phi3_rope_scaling(c, head_dim, source)}
