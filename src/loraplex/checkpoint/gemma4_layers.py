"""How a Gemma 4 text config makes its layers differ, as transformers derives it (no torch):
each layer's attention type, the layer whose KV it reads, and its head size, KV heads and MLP
width. The model (``model/gemma4.py``) and the adapter checks (``BaseModelSpec``) both read
these facts here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"
MODEL_TYPE = "gemma4_text"


def layer_types(raw: Mapping[str, Any]) -> list[str]:
    """``layer_types``, or five sliding layers per full one; the last layer always full."""
    n = int(raw["num_hidden_layers"])
    types = [str(t) for t in raw.get("layer_types") or []]
    if not types:
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    if types:
        types[-1] = FULL
    return types


def kv_sources(types: list[str], shared: int) -> list[int]:
    """transformers' ``kv_sharing_modes``: the last ``shared`` layers read the KV of the last
    earlier layer of their type (itself for every other layer). ValueError naming a sharing
    layer whose type no earlier layer has."""
    first = len(types) - shared
    out = list(range(len(types)))
    for i in range(first, len(types)):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise ValueError(
                f"num_kv_shared_layers {shared}: layer {i} ({types[i]}) has no earlier layer "
                "of its type to share KV with"
            )
        out[i] = earlier[-1]
    return out


def layer_geometry(raw: Mapping[str, Any]) -> list[tuple[int, int, int]]:
    """Each layer's ``(head_dim, kv_heads, intermediate)``: ``per_layer_config`` overrides by
    layer index where the config has one (what transformers 5 saves), else the full layers
    take ``global_head_dim`` (transformers' default 512) and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads``; with ``use_double_wide_mlp`` the KV-sharing layers' MLP
    is twice as wide."""
    types = layer_types(raw)
    hd = int(raw.get("head_dim") or 256)
    kvh = int(raw.get("num_key_value_heads") or raw["num_attention_heads"])
    inter = int(raw["intermediate_size"])
    shared = int(raw.get("num_kv_shared_layers") or 0)
    per_layer = raw.get("per_layer_config")
    out = []
    for i, t in enumerate(types):
        if isinstance(per_layer, Mapping):
            over = per_layer.get(str(i)) or per_layer.get(i) or {}  # type: ignore[call-overload]
            geo = (int(over.get("head_dim", hd)), int(over.get("num_key_value_heads", kvh)))
        elif t == FULL:
            glob_kvh = (
                raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v") else None
            )
            geo = (int(raw.get("global_head_dim") or 512), int(glob_kvh or kvh))
        else:
            geo = (hd, kvh)
        wide = raw.get("use_double_wide_mlp") and i >= len(types) - shared
        out.append((*geo, inter * (2 if wide else 1)))
    return out


def values_from_keys(raw: Mapping[str, Any]) -> list[bool]:
    """Per layer: whether its values are its keys' projection (``attention_k_eq_v``: the full
    layers have no ``v_proj``; v is k's projection before the k norm)."""
    tied = bool(raw.get("attention_k_eq_v"))
    return [tied and t == FULL for t in layer_types(raw)]
