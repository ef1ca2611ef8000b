"""``--speculative-config``: vLLM's JSON object, parsed once into :class:`SpeculativeConfig`.

The keys are vLLM's (``method``, ``num_speculative_tokens``, ``prompt_lookup_min`` /
``prompt_lookup_max``, the ``suffix_decoding_*`` keys, ``model``, ``disable_by_batch_size``), with
vLLM's defaults; loraplex adds a few, each documented below. A method loraplex does not build
(EAGLE, Medusa, MTP, ...) is refused by name; an unknown key is refused, as vLLM's config class
refuses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "suffix", "draft_model")
"""The methods loraplex builds."""
REFUSED_SPEC_METHODS = (
    "eagle",
    "eagle3",
    "medusa",
    "mlp_speculator",
    "mtp",
    "ngram_gpu",
    "deepseek_mtp",
    "mimo_mtp",
    "glm4_moe_mtp",
    "ernie_mtp",
    "qwen3_next_mtp",
    "longcat_flash_mtp",
    "pangu_ultra_moe_mtp",
)
"""vLLM's other methods: refused by name (they need draft heads trained for the base)."""
MAX_SPECULATIVE_TOKENS = 16
"""The most draft tokens one sequence may carry into a step (bounds the step's rows)."""
MAX_SUFFIX_TREE_DEPTH = 256
DEFAULT_SUFFIX_CACHE_BYTES = 64 << 20


@dataclass(frozen=True)
class SpeculativeConfig:
    """One engine's speculative decoding (see ``docs/speculative.md``).

    ``num_speculative_tokens`` is the most tokens drafted per sequence and step; with
    ``adaptive`` (loraplex, default on) the engine drafts fewer, down to none, when the measured
    step cost and the adapter's running acceptance say more would not pay."""

    method: str
    num_speculative_tokens: int
    # ngram (prompt lookup): the longest / shortest n-gram matched against the context
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # suffix decoding (vLLM's keys and defaults)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cache_bytes: int = DEFAULT_SUFFIX_CACHE_BYTES
    """loraplex: the byte bound of all past-output trees together (per tenant and adapter)."""
    # draft model
    model: str | None = None
    draft_lora_modules: tuple[tuple[str, str], ...] = ()
    """loraplex: request adapter name -> a LoRA of the draft model that drafts for it."""
    # when to speculate
    disable_by_batch_size: int | None = None
    """vLLM's: no drafts while this many requests or more run."""
    adaptive: bool = True
    """loraplex: pick each step's k per sequence (0 included) from the measured step cost and
    each adapter's acceptance; False: always ``num_speculative_tokens`` (vLLM's behaviour)."""

    def to_json(self) -> str:
        """The canonical JSON text of this config (the flag's value)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = dict(value) if f.name == "draft_lora_modules" else value
        return json.dumps(out, sort_keys=True)


_INT_KEYS = {
    "num_speculative_tokens": (1, MAX_SPECULATIVE_TOKENS),
    "prompt_lookup_min": (1, 1024),
    "prompt_lookup_max": (1, 1024),
    "suffix_decoding_max_tree_depth": (1, MAX_SUFFIX_TREE_DEPTH),
    "suffix_decoding_max_cached_requests": (0, 10_000_000),
    "suffix_decoding_max_cache_bytes": (1 << 16, 1 << 40),
    "disable_by_batch_size": (1, 1 << 20),
}
_FLOAT_KEYS = {
    "suffix_decoding_max_spec_factor": (0.0, 1e6),
    "suffix_decoding_min_token_prob": (0.0, 1.0),
}
_IGNORED_KEYS = {"disable_log_stats", "disable_padded_drafter_batch", "disable_logprobs"}
"""vLLM keys that change nothing here (logging; a CUDA padding option; logprobs are kept)."""
_ONE_KEYS = {"draft_tensor_parallel_size": 1, "tensor_parallel_size": 1}


def parse_speculative_config(text: str | dict[str, Any]) -> SpeculativeConfig:
    """The config from its JSON text (or an already parsed dict). Raises ValueError naming the
    key and the problem."""
    if isinstance(text, str):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON {text!r}: {e.msg}") from None
    else:
        obj = dict(text)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    obj = dict(obj)
    method = obj.pop("method", None)
    model = obj.pop("model", None)
    if model is not None and not (isinstance(model, str) and model.strip()):
        raise ValueError(f"model must be a path or hub id, got {model!r}")
    if method is None and model in ("ngram", "[ngram]"):  # vLLM's older spelling
        method, model = "ngram", None
    if method is None:
        if model is None:
            raise ValueError("method is required (one of " + ", ".join(SPEC_METHODS) + ")")
        method = "draft_model"  # vLLM infers a draft model from a model alone
    if not isinstance(method, str):
        raise ValueError(f"method must be a string, got {method!r}")
    if method in REFUSED_SPEC_METHODS:
        raise ValueError(
            f"method {method!r} is not supported by loraplex (it builds "
            + ", ".join(SPEC_METHODS)
            + ")"
        )
    if method not in SPEC_METHODS:
        raise ValueError(f"unknown method {method!r}: expected one of " + ", ".join(SPEC_METHODS))
    if method == "draft_model" and model is None:
        raise ValueError("method 'draft_model' needs model (the draft model's directory)")
    if method != "draft_model" and model is not None:
        raise ValueError(f"model is for method 'draft_model', not {method!r}")
    values: dict[str, Any] = {"method": method, "model": model}
    for key, (lo, hi) in _INT_KEYS.items():
        if key not in obj:
            continue
        v = obj.pop(key)
        if v is None and key == "disable_by_batch_size":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{key} must be an integer in [{lo}, {hi}], got {v!r}")
        values[key] = v
    for key, (flo, fhi) in _FLOAT_KEYS.items():
        if key not in obj:
            continue
        v = obj.pop(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not flo <= v <= fhi:
            raise ValueError(f"{key} must be a number in [{flo:g}, {fhi:g}], got {v!r}")
        values[key] = float(v)
    if "adaptive" in obj:
        v = obj.pop("adaptive")
        if not isinstance(v, bool):
            raise ValueError(f"adaptive must be true or false, got {v!r}")
        values["adaptive"] = v
    if "draft_lora_modules" in obj:
        v = obj.pop("draft_lora_modules")
        if method != "draft_model":
            raise ValueError("draft_lora_modules is for method 'draft_model'")
        if not isinstance(v, dict) or not all(
            isinstance(k, str) and k and isinstance(p, str) and p for k, p in v.items()
        ):
            raise ValueError(
                "draft_lora_modules must map adapter names to draft-model LoRA directories, "
                f"got {v!r}"
            )
        values["draft_lora_modules"] = tuple(sorted(v.items()))
    for key, only in _ONE_KEYS.items():
        if key in obj and obj.pop(key) not in (None, only):
            raise ValueError(f"{key} must be {only}: the draft runs beside the target")
    for key in _IGNORED_KEYS:
        obj.pop(key, None)
    if obj:
        raise ValueError(f"unknown key {sorted(obj)[0]!r} in the speculative config")
    _defaults(values)
    return SpeculativeConfig(**values)


def _defaults(values: dict[str, Any]) -> None:
    """vLLM's rules between keys: ngram's window bounds, suffix's k, a required k."""
    method = values["method"]
    if method == "ngram":
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        values["prompt_lookup_min"], values["prompt_lookup_max"] = lo, hi
    if "num_speculative_tokens" not in values:
        if method != "suffix":
            raise ValueError(f"method {method!r} needs num_speculative_tokens")
        depth = values.get("suffix_decoding_max_tree_depth", 24)
        values["num_speculative_tokens"] = min(depth, MAX_SPECULATIVE_TOKENS)


def speculative_config_text(text: str) -> str:
    """The flag's parser: the text, once it parses (config objects hold plain values)."""
    parse_speculative_config(text)
    return text
