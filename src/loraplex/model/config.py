"""Parse an HF ``config.json`` for the Llama family (Llama, Mistral, Qwen2) into a typed config."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loraplex.lora.adapter import projection_shapes
from loraplex.types import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a Llama-family decoder."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str | None
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    generation_defaults: dict[str, Any] = field(default_factory=dict, compare=False)
    """Default sampling parameters from generation_config.json (SamplingParams field names:
    temperature, top_p, top_k, min_p, repetition_penalty, max_tokens), for the fields a request
    leaves out; empty with ``--generation-config vllm``."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """proj name -> (d_in, d_out) of the seven adaptable projections."""
        return projection_shapes(
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
        )

    def num_parameters(self) -> int:
        per_layer = sum(a * b for a, b in self.module_shapes.values()) + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        return (
            self.num_layers * per_layer
            + embed * (1 if self.tie_word_embeddings else 2)
            + self.hidden_size
        )


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
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
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
    model_type = SUPPORTED_ARCHITECTURES[arch]
    eos_ids = _eos_ids(c.get("eos_token_id", raw.get("eos_token_id")))
    sliding = c.get("sliding_window")
    if model_type == "qwen2" and not c.get("use_sliding_window", False):
        sliding = None
    attention_bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        model_type=model_type,
        vocab_size=int(req("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(req("intermediate_size")),
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
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(c.get("mlp_bias", False)),
        torch_dtype=c.get("torch_dtype") or c.get("dtype") or raw.get("torch_dtype"),
        rope_scaling=rope_scaling,
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=eos_ids,
        bos_token_id=c.get("bos_token_id"),
        raw=raw,
    )
