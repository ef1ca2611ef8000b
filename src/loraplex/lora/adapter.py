"""Read and validate PEFT LoRA adapter directories as they are on disk.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or the
older ``adapter_model.bin``). :func:`load_peft_adapter` turns it into a :class:`LoRAAdapter`:
per ``(layer, proj)`` the factors ``A: [r, d_in]``, ``B: [d_out, r]`` and the scale, so that

    W_eff = W + scale * B @ A        # what PEFT's merge_and_unload computes

Everything we cannot serve exactly (DoRA, biases, embedding LoRA, modules_to_save, ...) is
refused with an :class:`AdapterError` that names the adapter path and the offending field or
tensor, never silently ignored. The identity of an adapter is :func:`compute_adapter_digest`:
a sha256 over the config fields that change the math and the raw tensor bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.lora.digest import (
    ATTN_PROJ_NAMES,
    DIGEST_VERSION,
    PROJ_NAMES,
    _math_config,
)
from loraplex.types import AdapterError, AdapterRef

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"

# Fields whose presence (truthy value) means a variant we cannot serve as W + scale * B @ A.
_UNSUPPORTED_FIELDS: dict[str, str] = {
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "lora_bias": "LoRA bias terms are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QA-LoRA adapters are not supported",
    "target_parameters": "LoRA on nn.Parameter targets (target_parameters) is not supported",
    "trainable_token_indices": "trainable tokens (trainable_token_indices) are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "KaSA adapters (kasa_config) are not supported",
    "monteclora_config": "MonteCLoRA adapters (monteclora_config) are not supported",
}

# init_lora_weights values that rewrite the base weights at init: such an adapter only fits the
# modified base unless PEFT converted it on save (which resets init_lora_weights to True).
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?"
    r"(?P<module>(?:model\.)?layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<proj>[^.]+))"
    r"\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


def projection_shapes(
    hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int
) -> dict[str, tuple[int, int]]:
    """proj name -> (d_in, d_out) of the seven adaptable projections of a Llama-family layer."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


@dataclass(frozen=True)
class BaseModelSpec:
    """What an adapter is validated against, built from the base model's config."""

    num_layers: int
    module_shapes: dict[str, tuple[int, int]]  # proj name -> (d_in, d_out)
    model_type: str = "llama"

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any]) -> BaseModelSpec:
        """Spec from a Llama-family HF ``config.json`` dict (used by tests and tools)."""
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        inter = int(raw["intermediate_size"])
        shapes = projection_shapes(hidden, heads, kv_heads, head_dim, inter)
        return cls(int(raw["num_hidden_layers"]), shapes, str(raw.get("model_type", "llama")))


@dataclass
class LoRAModuleWeights:
    """One adapted projection: ``y += scale * (x @ a.T) @ b.T``."""

    a: torch.Tensor  # [r, d_in]
    b: torch.Tensor  # [d_out, r]
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoRAAdapter:
    """A validated adapter: identity, source path, per-module factors and the raw config."""

    ref: AdapterRef
    path: str
    weights: dict[tuple[int, str], LoRAModuleWeights]  # (layer index, proj name) -> weights
    config: dict

    @property
    def rank(self) -> int:
        """Max rank over modules (what a device slot must hold)."""
        return max(w.rank for w in self.weights.values())

    @property
    def target_modules(self) -> tuple[str, ...]:
        """Sorted proj names this adapter adapts in at least one layer."""
        return tuple(sorted({proj for _, proj in self.weights}))

    @property
    def nbytes(self) -> int:
        """Bytes of all A and B tensors (host memory the adapter occupies)."""
        return sum(
            w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
            for w in self.weights.values()
        )


def _fail(path: str | Path, what: str) -> AdapterError:
    return AdapterError(f"adapter {path}: {what}")


def read_adapter_files(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read ``adapter_config.json`` and the weights (safetensors preferred, else .bin) of ``path``.

    Only checks that the files exist and parse; :func:`load_peft_adapter` validates content.
    """
    root = Path(path)
    if not root.is_dir():
        raise _fail(path, "directory not found")
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        raise _fail(path, f"missing {CONFIG_NAME}")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"{CONFIG_NAME} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise _fail(path, f"{CONFIG_NAME} must hold a JSON object, got {type(config).__name__}")

    st_path, bin_path = root / SAFETENSORS_NAME, root / BIN_NAME
    if st_path.is_file():
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(st_path), device="cpu")
        except Exception as e:  # SafetensorError, OSError, ...: all mean "unusable file"
            raise _fail(path, f"cannot read {SAFETENSORS_NAME} (corrupt or truncated?): {e}") from e
    elif bin_path.is_file():
        try:
            tensors = torch.load(str(bin_path), map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError, RuntimeError, EOFError, ...
            raise _fail(path, f"cannot read {BIN_NAME} (corrupt or not a state dict?): {e}") from e
        if not isinstance(tensors, dict):
            raise _fail(path, f"{BIN_NAME} must hold a dict of tensors")
    else:
        raise _fail(path, f"missing weights file ({SAFETENSORS_NAME} or {BIN_NAME})")
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise _fail(path, f"weights entry {name!r} is not a named tensor")
    return config, dict(tensors)


def compute_adapter_digest(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex of an adapter's identity: math config + every tensor's name/dtype/shape/bytes.

    Canonical form: ``DIGEST_VERSION``, canonical JSON of the math config fields (sorted keys),
    then per tensor name in sorted order a JSON header line ``{name, dtype, shape, nbytes}`` and
    the raw little-endian bytes. Independent of file format (.bin/.safetensors) and key order.
    """
    h = hashlib.sha256(DIGEST_VERSION)
    cfg_json = json.dumps(_math_config(config), sort_keys=True, separators=(",", ":"))
    h.update(cfg_json.encode() + b"\n")
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # zero-copy byte view
        header = {"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "nbytes": raw.size}
        h.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\n")
        h.update(raw)
    return h.hexdigest()


@dataclass(frozen=True)
class _LoraSettings:
    """The parts of adapter_config.json that decide which modules are adapted and how."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: str | list[str]
    exclude_modules: str | list[str] | None
    layers_to_transform: int | list[int] | None
    layers_pattern: list[str] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def is_targeted(self, module_key: str) -> bool:
        """PEFT's ``check_target_module_exists`` for a key like ``model.layers.3.mlp.up_proj``."""
        ex = self.exclude_modules
        if ex:
            if isinstance(ex, str):
                if re.fullmatch(ex, module_key):
                    return False
            elif module_key in ex or any(module_key.endswith(f".{e}") for e in ex):
                return False
        tm = self.target_modules
        if isinstance(tm, str):
            if tm.lower() == "all-linear":  # every linear except the LM head: all 7 projections
                found = True
            else:
                return re.fullmatch(tm, module_key) is not None
        elif module_key in tm:
            return True
        else:
            found = any(module_key.endswith(f".{t}") for t in tm)
        lt = self.layers_to_transform
        if not found or lt is None or (isinstance(lt, list) and not lt):
            return found
        match = None
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_key)
        else:
            for pattern in self.layers_pattern:
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module_key)
                if match is not None:
                    break
        if match is None:
            return False
        idx = int(match.group("idx"))
        return idx == lt if isinstance(lt, int) else idx in lt

    def rank_and_scale(self, module_key: str) -> tuple[int, float]:
        """Configured (rank, scale) of one module; patterns are matched as PEFT matches them."""
        r_key = _pattern_key(self.rank_pattern, module_key)
        a_key = _pattern_key(self.alpha_pattern, module_key)
        r = self.rank_pattern[r_key] if r_key is not None else self.r
        alpha = self.alpha_pattern[a_key] if a_key is not None else self.lora_alpha
        scale = alpha / math.sqrt(r) if self.use_rslora else alpha / r
        return r, float(scale)


def _pattern_key(patterns: Mapping[str, Any], module_key: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first pattern matching a suffix of ``module_key``."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_key):
            return key
    return None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _str_or_str_list(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def _parse_config(config: Mapping[str, Any], path: str | Path) -> _LoraSettings:
    """Refuse every config feature we cannot serve exactly; return the targeting settings."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise _fail(path, f"peft_type must be 'LORA', got {peft_type!r}")
    for field, why in _UNSUPPORTED_FIELDS.items():
        if config.get(field):
            raise _fail(path, f"{field}={config[field]!r}: {why}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise _fail(path, f"bias={bias!r}: only bias='none' is supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise _fail(
            path,
            f"init_lora_weights={init!r}: this adapter expects a modified base model; convert it "
            "with save_pretrained(path_initial_model_for_weight_conversion=...) first",
        )

    r = config.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise _fail(path, f"r must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise _fail(path, f"lora_alpha must be a number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _fail(path, f"use_rslora must be a boolean, got {use_rslora!r}")
    rank_pattern = config.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in rank_pattern.values()
    ):
        raise _fail(path, f"rank_pattern must map patterns to positive ints, got {rank_pattern!r}")
    alpha_pattern = config.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict) or not all(
        _is_number(v) for v in alpha_pattern.values()
    ):
        raise _fail(path, f"alpha_pattern must map patterns to numbers, got {alpha_pattern!r}")
    target = config.get("target_modules")
    if not target or not _str_or_str_list(target):
        raise _fail(path, f"target_modules must be a string or list of strings, got {target!r}")
    exclude = config.get("exclude_modules")
    if exclude is not None and not _str_or_str_list(exclude):
        raise _fail(path, f"exclude_modules must be a string or list of strings, got {exclude!r}")
    layers = config.get("layers_to_transform")
    if layers is not None and not (
        (isinstance(layers, int) and not isinstance(layers, bool))
        or (isinstance(layers, list) and all(isinstance(i, int) for i in layers))
    ):
        raise _fail(path, f"layers_to_transform must be an int or list of ints, got {layers!r}")
    pattern = config.get("layers_pattern")
    if pattern is not None and not _str_or_str_list(pattern):
        raise _fail(path, f"layers_pattern must be a string or list of strings, got {pattern!r}")
    for field, value in (("target_modules", target), ("exclude_modules", exclude)):
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                raise _fail(path, f"{field} is not a valid regex {value!r}: {e}") from e
    return _LoraSettings(
        r=r,
        lora_alpha=float(alpha),
        use_rslora=use_rslora,
        target_modules=target,
        exclude_modules=exclude,
        layers_to_transform=layers,
        layers_pattern=[pattern] if isinstance(pattern, str) else (pattern or None),
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
    )


def _explain_unknown(name: str) -> str:
    """Why a tensor not named ``...layers.N.{self_attn,mlp}.<proj>.lora_{A,B}.weight`` is bad."""
    if "lora_embedding_" in name or ".embed_tokens." in name or "lm_head" in name:
        return f"tensor {name!r}: embedding / lm_head LoRA is not supported"
    if "lora_magnitude_vector" in name:
        return f"tensor {name!r}: DoRA magnitude vectors are not supported"
    if "modules_to_save" in name:
        return f"tensor {name!r}: modules_to_save weights are not supported"
    if "trainable_tokens" in name:
        return f"tensor {name!r}: trainable tokens are not supported"
    if ".lora_" in name and name.endswith(".bias"):
        return f"tensor {name!r}: LoRA bias (lora_bias) is not supported"
    return f"tensor {name!r} is not a LoRA A/B weight of a decoder-layer projection we understand"


def load_peft_adapter(
    path: str | Path,
    spec: BaseModelSpec,
    *,
    name: str | None = None,
    revision: str | None = None,
    max_lora_rank: int = 64,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Read, validate and convert a PEFT LoRA adapter directory for the base model ``spec``.

    ``name`` defaults to the directory name, ``revision`` to the first 12 hex digits of the
    digest. Every problem raises :class:`AdapterError` naming ``path`` and the field/tensor.
    """
    config, tensors = read_adapter_files(path)
    return build_adapter(
        config,
        tensors,
        spec,
        path=path,
        name=name,
        revision=revision,
        max_lora_rank=max_lora_rank,
        dtype=dtype,
    )


def build_adapter(
    config: dict,
    tensors: dict[str, torch.Tensor],
    spec: BaseModelSpec,
    *,
    path: str | Path,
    name: str | None = None,
    revision: str | None = None,
    max_lora_rank: int = 64,
    dtype: torch.dtype = torch.float32,
    digest: str | None = None,
) -> LoRAAdapter:
    """Validate and convert an adapter already read as ``(config, tensors)`` (e.g. a verified
    copy from the disk tier or an object store); :func:`load_peft_adapter` is read + this.

    ``path`` names the source in errors; ``digest`` skips re-hashing when the caller has just
    computed it from the same ``(config, tensors)``.
    """
    if digest is None:
        digest = compute_adapter_digest(config, tensors)
    settings = _parse_config(config, path)

    # Group tensors by module: (layer, proj) -> {"A": t, "B": t}; module_key keeps the key PEFT saw.
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    module_keys: dict[tuple[int, str], str] = {}
    for tname in sorted(tensors):
        m = _KEY_RE.match(tname)
        if m is None:
            raise _fail(path, _explain_unknown(tname))
        proj, block, layer = m["proj"], m["block"], int(m["layer"])
        if proj not in PROJ_NAMES:
            raise _fail(
                path,
                f"tensor {tname!r}: target module {proj!r} is not supported "
                f"(supported: {', '.join(PROJ_NAMES)})",
            )
        if (block == "self_attn") != (proj in ATTN_PROJ_NAMES):
            raise _fail(path, f"tensor {tname!r}: {proj} does not belong under {block}")
        key = (layer, proj)
        slot = pairs.setdefault(key, {})
        if m["ab"] in slot:
            raise _fail(path, f"tensor {tname!r} duplicates {slot[m['ab']][0]!r}")
        slot[m["ab"]] = (tname, tensors[tname])
        module_keys[key] = m["module"]
    if not pairs:
        raise _fail(path, "no LoRA tensors (lora_A/lora_B weights) found")

    weights: dict[tuple[int, str], LoRAModuleWeights] = {}
    for key in sorted(pairs, key=lambda k: (k[0], PROJ_NAMES.index(k[1]))):
        layer, proj = key
        mkey = module_keys[key]
        slot = pairs[key]
        for ab in "AB":
            if ab not in slot:
                raise _fail(path, f"module {mkey}: lora_{ab} weight missing")
        (a_name, a), (b_name, b) = slot["A"], slot["B"]
        if layer >= spec.num_layers:
            raise _fail(
                path, f"tensor {a_name!r}: layer {layer} >= base model num_layers {spec.num_layers}"
            )
        if proj not in spec.module_shapes:
            raise _fail(path, f"tensor {a_name!r}: base model has no {proj}")
        if not settings.is_targeted(mkey):
            raise _fail(
                path,
                f"tensor {a_name!r}: module {mkey} is not targeted by the config "
                "(target_modules / layers_to_transform / exclude_modules)",
            )
        for tname, t in ((a_name, a), (b_name, b)):
            if not t.is_floating_point():
                raise _fail(path, f"tensor {tname!r}: dtype {t.dtype} is not floating point")
            if t.dim() != 2:
                raise _fail(path, f"tensor {tname!r}: expected 2-D, got shape {list(t.shape)}")
        d_in, d_out = spec.module_shapes[proj]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise _fail(
                path,
                f"rank mismatch in {mkey}: {a_name!r} has rank {rank}, {b_name!r} has {b.shape[1]}",
            )
        if a.shape[1] != d_in:
            raise _fail(
                path,
                f"tensor {a_name!r}: shape {list(a.shape)}, expected [r, d_in={d_in}] "
                "(adapter made for a different base model?)",
            )
        if b.shape[0] != d_out:
            raise _fail(
                path,
                f"tensor {b_name!r}: shape {list(b.shape)}, expected [d_out={d_out}, r] "
                "(adapter made for a different base model?)",
            )
        cfg_rank, scale = settings.rank_and_scale(mkey)
        if rank != cfg_rank:
            field = "rank_pattern" if _pattern_key(settings.rank_pattern, mkey) else "r"
            raise _fail(
                path, f"tensor {a_name!r}: rank {rank} != configured rank {cfg_rank} ({field})"
            )
        if rank > max_lora_rank:
            raise _fail(path, f"tensor {a_name!r}: rank {rank} > max_lora_rank {max_lora_rank}")
        for tname, t in ((a_name, a), (b_name, b)):
            if not bool(torch.isfinite(t).all()):
                raise _fail(path, f"tensor {tname!r}: contains non-finite values (NaN/inf)")
        weights[key] = LoRAModuleWeights(a=a, b=b, scale=scale)

    # Every module the config targets must be present: a half-present adapter (e.g. made for a
    # model with fewer layers) is a mismatch, not something to serve partially.
    prefix = next(iter(module_keys.values())).split("layers.")[0]
    for layer in range(spec.num_layers):
        for proj in spec.module_shapes:
            block = "self_attn" if proj in ATTN_PROJ_NAMES else "mlp"
            mkey = f"{prefix}layers.{layer}.{block}.{proj}"
            if (layer, proj) not in weights and settings.is_targeted(mkey):
                raise _fail(
                    path,
                    f"module {mkey} is targeted by the config (target_modules / "
                    "layers_to_transform) but has no LoRA tensors "
                    "(adapter made for another model?)",
                )

    for w in weights.values():  # convert last: all checks ran on the stored values
        w.a = w.a.to(dtype).contiguous()
        w.b = w.b.to(dtype).contiguous()
    adapter_name = name if name is not None else Path(os.path.abspath(path)).name
    ref = AdapterRef(adapter_name, revision if revision is not None else digest[:12], digest)
    return LoRAAdapter(ref=ref, path=str(path), weights=weights, config=dict(config))
