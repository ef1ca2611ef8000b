"""Parse an HF ``config.json`` into a typed ``ModelConfig`` for one of the supported architectures.

The fields every decoder shares are read here; the architecture's class (looked up in
``model/registry.py``) reads what it does its own way (``config_fields``). An unknown
architecture, rope type or activation is refused with one line naming it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from loraplex.model.layers import ACTIVATIONS, ROPE_TYPES
from loraplex.model.registry import ARCHITECTURES, SUPPORTED_ARCHITECTURES, model_class
from loraplex.model.spec import ModelConfig
from loraplex.types import ModelLoadError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "ModelConfig",
    "generation_defaults_of",
    "load_model_config",
    "parse_model_config",
    "read_generation_config",
]

SUPPORTED_ROPE_TYPES = tuple(ROPE_TYPES)


GENERATION_CONFIG = "generation_config.json"
_GENERATION_KEYS = {  # generation_config.json key -> SamplingParams field (vLLM's set)
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _eos_ids(value: Any) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value] if value is not None else []
    return tuple(int(e) for e in values if isinstance(e, int) and not isinstance(e, bool))


def read_generation_config(directory: str | Path) -> tuple[dict[str, Any], tuple[int, ...]]:
    """``directory/generation_config.json`` as (sampling defaults by SamplingParams field name,
    its EOS ids); ({}, ()) when the file is absent. Values of the wrong type raise
    ModelLoadError, so a bad file is found at start-up rather than by a request."""
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        return {}, ()
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return generation_defaults_of(raw, source=str(path)), _eos_ids(raw.get("eos_token_id"))


def generation_defaults_of(
    raw: dict[str, Any], source: str = "generation config"
) -> dict[str, Any]:
    """The sampling defaults of a generation config mapping (vLLM's keys; others ignored)."""
    out: dict[str, Any] = {}
    for key, name in _GENERATION_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        integral = name in ("top_k", "max_tokens")
        ok = isinstance(value, int) if integral else isinstance(value, int | float)
        if isinstance(value, bool) or not ok:
            kind = "an integer" if integral else "a number"
            raise ModelLoadError(f"{source}: {key} must be {kind}, got {value!r}")
        out[name] = int(value) if integral else float(value)
    return out


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    return raw.get("text_config", raw) if "text_config" in raw and "hidden_size" not in raw else raw


def load_model_config(
    model_dir: str | Path,
    generation_config: str = "auto",
    override_generation_config: dict[str, Any] | None = None,
) -> ModelConfig:
    """Read ``model_dir/config.json``; unsupported architectures or fields raise ModelLoadError.

    ``generation_config`` as vLLM's flag: ``auto`` reads ``model_dir/generation_config.json``
    (its sampling defaults, and its EOS ids join the model's), ``vllm`` reads none, anything
    else is a directory holding one. ``override_generation_config`` (SamplingParams field
    names, or generation_config.json keys) goes over the defaults."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelLoadError(f"model directory not found: {model_dir}")
    if not path.is_file():
        raise ModelLoadError(f"model directory {model_dir} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
    config = parse_model_config(raw, source=str(path))
    defaults: dict[str, Any] = {}
    eos: tuple[int, ...] = ()
    if generation_config != "vllm":
        where = model_dir if generation_config == "auto" else generation_config
        defaults, eos = read_generation_config(where)
    if override_generation_config:
        from dataclasses import fields as dc_fields

        from loraplex.requests import SamplingParams

        known = {f.name for f in dc_fields(SamplingParams)}
        named = {_GENERATION_KEYS.get(k, k): v for k, v in override_generation_config.items()}
        unknown = sorted(set(named) - known)
        if unknown:
            raise ModelLoadError(
                f"override_generation_config: unknown sampling parameter(s) {unknown}"
            )
        defaults = {**defaults, **named}
    extra = tuple(e for e in eos if e not in config.eos_token_ids)
    return replace(config, generation_defaults=defaults, eos_token_ids=config.eos_token_ids + extra)


def parse_model_config(raw: dict[str, Any], source: str = "config") -> ModelConfig:
    """``raw`` (a parsed config.json) as the ``ModelConfig`` of its architecture's class."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        named = (
            ", ".join(repr(a) for a in archs)
            or f"(none named; model_type {raw.get('model_type')!r})"
        )
        raise ModelLoadError(
            f"{source}: unsupported architecture {named}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    cls = model_class(arch, raw)
    c = _text_config(raw)

    def req(key: str) -> Any:
        if key not in c or c[key] is None:
            raise ModelLoadError(f"{source}: missing field {key!r}")
        return c[key]

    hidden = int(req("hidden_size"))
    heads = int(req("num_attention_heads"))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads {heads} not divisible by num_key_value_heads {kv_heads}"
        )
    rope_scaling = c.get("rope_scaling") or None
    rope_theta = c.get("rope_theta")
    rope_params = c.get("rope_parameters")  # transformers >= 5 layout
    if isinstance(rope_params, dict):
        rope_theta = rope_params.get("rope_theta", rope_theta)
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
    if rope_scaling is not None:
        rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rtype not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"{source}: unsupported rope_scaling type {rtype!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        rope_scaling = {**rope_scaling, "rope_type": rtype}
        if rtype == "default":
            rope_scaling = None
    eos_ids = _eos_ids(c.get("eos_token_id", raw.get("eos_token_id")))
    # Qwen2/3 configs carry a sliding_window they only use with use_sliding_window
    sliding = c.get("sliding_window") if c.get("use_sliding_window", True) else None
    attention_bias = bool(c.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        vocab_size=int(req("vocab_size")),
        hidden_size=hidden,
        # a MoE without dense layers (Qwen3.5-MoE) has no intermediate_size: its experts' width
        intermediate_size=int(c.get("intermediate_size") or req("moe_intermediate_size")),
        num_layers=int(req("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(
            c.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        ),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(c.get("mlp_bias", False)),
        torch_dtype=c.get("torch_dtype") or c.get("dtype") or raw.get("torch_dtype"),
        rope_scaling=rope_scaling,
        sliding_window=int(sliding) if sliding else None,
        hidden_act=str(c.get("hidden_act") or "silu"),
        eos_token_ids=eos_ids,
        bos_token_id=c.get("bos_token_id"),
    )
    fields.update(cls.config_fields(c, source))
    if fields["hidden_act"] not in ACTIVATIONS:
        raise ModelLoadError(
            f"{source}: unsupported hidden_act {fields['hidden_act']!r}; "
            f"supported: {', '.join(ACTIVATIONS)}"
        )
    config = cls.config_class(architecture=arch, model_type=cls.model_type, raw=raw, **fields)
    return replace(config, layer_norm_widths=cls.layer_norm_widths(config))
