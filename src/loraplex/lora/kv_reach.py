"""Which layers' KV an adapter can change: the first layer whose K/V may differ from the base.

A layer's K and V are ``k_proj(x)`` and ``v_proj(x)`` (then rotary, or a per-head norm: fixed
functions of position and value) of the layer's normed input ``x``, which the residual stream
of the layers before it computes. So layer ``l``'s KV equals the base model's when no adapted
module acts before layer ``l`` and layer ``l``'s k and v projections are not adapted:

- ``embed_tokens`` acts before layer 0 (it changes the residual stream everyone reads);
- ``k_proj``, ``v_proj`` (or a fused ``qkv_proj``) at layer ``l`` change ``l``'s own KV;
- ``q_proj`` at layer ``l`` changes only ``l``'s attention output: layers after ``l``;
- ``o_proj``, the MLP, a MoE's router and experts at layer ``l``: layers after ``l``;
- ``lm_head`` acts after every layer: no KV.

(``tests/lora/test_kv_reach.py`` checks the rule against transformers + PEFT.) Torch-free: it
reads the adapter's ``(layer, module)`` keys (``LoRAAdapter.weights``' keys).
"""

from __future__ import annotations

from collections.abc import Iterable

from loraplex.checkpoint.modules import (
    EMBED_TOKENS,
    LM_HEAD,
    PER_LAYER_MODEL_PROJECTION,
    VOCAB_LAYER,
)

OWN_KV = frozenset(("k_proj", "v_proj", "qkv_proj"))
"""Modules whose adapter changes their own layer's K/V (a fused qkv_proj counts as k and v)."""


def first_kv_layer(modules: Iterable[tuple[int, str]], num_layers: int) -> int:
    """The first layer whose KV may differ from the base model's under an adapter of
    ``modules`` (``(layer, module)`` keys, ``VOCAB_LAYER`` for embed_tokens / lm_head);
    ``num_layers`` when none does (every layer's KV is the base's)::

        first = min(l if m in OWN_KV else l + 1 for (l, m) in modules, l >= 0)
        first = min(first, 1) if per_layer_model_projection is adapted (layer 0's per-layer
                                                                          input follows its attention)
        first = 0 if embed_tokens is adapted
    """
    first = num_layers
    for layer, module in modules:
        if layer == VOCAB_LAYER:
            if module == EMBED_TOKENS:
                return 0
            if module == PER_LAYER_MODEL_PROJECTION:
                first = min(first, 1)
                continue
            if module != LM_HEAD:
                raise ValueError(f"unknown vocabulary module {module!r}")
            continue
        first = min(first, layer if module in OWN_KV else layer + 1)
    return first
