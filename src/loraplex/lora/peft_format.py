"""The PEFT LoRA adapter format as loraplex serves it, written once and without torch.

Everything the loader (:mod:`loraplex.lora.adapter`), the registry
(:mod:`loraplex.registry.inspect`) and the planning tools (:mod:`loraplex.tools.plan`,
:mod:`loraplex.tools.verify`) know about an adapter directory lives here:

- the file names (``adapter_config.json`` + ``adapter_model.safetensors``, or the older
  ``adapter_model.bin``) and which weights file a directory is read from;
- the seven projections of a Llama-family decoder layer and their ``(d_in, d_out)`` (a base
  whose checkpoints fuse some, Phi-3's ``qkv_proj`` / ``gate_up_proj``, has adapters on the
  fused modules: :data:`FUSED_PROJ_NAMES`, split into the seven by :func:`check_layout`), and the
  two modules outside the layers (``embed_tokens``, PEFT's ``lora_embedding_A/B``, and
  ``lm_head``), keyed ``(VOCAB_LAYER, name)``;
- the config features we refuse (DoRA, biases, modules_to_save, base-modifying inits, ...),
  checked by :func:`parse_lora_config`;
- PEFT's module selection and per-module rank/scale (:class:`LoraSettings`: ``target_modules``
  as a list, a regex or ``all-linear``, ``exclude_modules``, ``layers_to_transform`` with
  ``layers_pattern``, ``rank_pattern`` / ``alpha_pattern``);
- the tensor names PEFT saves and what a set of tensors must look like for a base model
  (:func:`check_layout`: every tensor a LoRA A/B of a targeted module, ``A: [r, d_in]``,
  ``B: [d_out, r]``, the configured rank, every targeted module present; the copies of the
  base's own embedding matrices PEFT saves beside an embedding / lm_head LoRA are checked
  against the base's shape and not served).

Each refusal is a :class:`FormatError` with a registry ``reason`` code and a message; the
loader wraps it into an ``AdapterError`` naming the path, the registry into a
``ValidationError`` carrying the reason.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
ADAPTER_FILES = (CONFIG_NAME, SAFETENSORS_NAME, BIN_NAME)
"""Every file that can make up an adapter directory (the config, then weights by preference)."""


def choose_adapter_files(names: Iterable[str]) -> tuple[str, ...]:
    """The files an adapter is read from, given the names present in its directory: the config
    plus safetensors if present, else the .bin. ``()`` without a config, ``(CONFIG_NAME,)``
    without weights."""
    present = set(names)
    if CONFIG_NAME not in present:
        return ()
    for weights in (SAFETENSORS_NAME, BIN_NAME):
        if weights in present:
            return (CONFIG_NAME, weights)
    return (CONFIG_NAME,)


# -- the base model ------------------------------------------------------------------------------

PROJ_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Llama-family projections an adapter may target (attention first, then MLP)."""
FUSED_PROJ_NAMES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""A checkpoint module that is several projections in one (Phi-3's ``qkv_proj`` ``[q + 2 kv,
D]``, ``gate_up_proj`` ``[2 I, D]``) -> its parts in row order. An adapter on it has one
``A [r, d_in]`` and one ``B`` over the fused rows; the layout check splits it into its parts
(``A`` shared, ``B`` by rows), so slots, kernels and the merger see the seven projections."""
FUSED_BY_MODEL_TYPE: dict[str, tuple[str, ...]] = {"phi3": ("qkv_proj", "gate_up_proj")}
"""``model_type`` -> the fused modules its checkpoints (and so its adapters) have."""
ATTN_PROJ_NAMES = frozenset((*PROJ_NAMES[:4], "qkv_proj"))
MLP_PROJ_NAMES = frozenset((*PROJ_NAMES[4:], "gate_up_proj"))


def block_of(proj: str) -> str:
    """The submodule of a decoder layer that holds ``proj``: ``self_attn`` or ``mlp``."""
    return "self_attn" if proj in ATTN_PROJ_NAMES else "mlp"


def adapter_module_shapes(
    module_shapes: Mapping[str, tuple[int, int]], fused: Iterable[str] = ()
) -> dict[str, tuple[int, int]]:
    """The modules an adapter names on a base -> (d_in, d_out): ``module_shapes`` (the seven
    projections) with each ``fused`` module in place of its parts (d_out: the parts' sum)."""
    fused = tuple(fused)
    part_of = {part: f for f in fused for part in FUSED_PROJ_NAMES[f]}
    out: dict[str, tuple[int, int]] = {}
    for proj, (d_in, d_out) in module_shapes.items():
        f = part_of.get(proj)
        if f is None:
            out[proj] = (d_in, d_out)
        else:
            out[f] = (d_in, out.get(f, (d_in, 0))[1] + d_out)
    return out


def module_key(layer: int, proj: str, prefix: str = "model.") -> str:
    """The module name PEFT matches its patterns against: ``model.layers.3.mlp.up_proj``."""
    return f"{prefix}layers.{layer}.{block_of(proj)}.{proj}"


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


EMBED_TOKENS = "embed_tokens"
LM_HEAD = "lm_head"
VOCAB_MODULES = (EMBED_TOKENS, LM_HEAD)
"""The adaptable modules outside the decoder layers: the token embedding (PEFT's
``lora_embedding_A [r, vocab]`` / ``lora_embedding_B [hidden, r]``) and the LM head (an ordinary
``lora_A [r, hidden]`` / ``lora_B [vocab, r]``)."""
VOCAB_LAYER = -1
"""The layer index of :data:`VOCAB_MODULES` in ``(layer, name)`` module keys."""
EMBED_KEY = (VOCAB_LAYER, EMBED_TOKENS)
LM_HEAD_KEY = (VOCAB_LAYER, LM_HEAD)


def vocab_module_shapes(vocab_size: int, hidden: int) -> dict[str, tuple[int, int]]:
    """name -> (d_in, d_out) of the two vocabulary-wide modules: the embedding maps a token
    (one of ``vocab_size``) to ``hidden`` features, the head the other way round."""
    return {EMBED_TOKENS: (vocab_size, hidden), LM_HEAD: (hidden, vocab_size)}


def vocab_module_key(name: str, prefix: str = "model.") -> str:
    """The module name PEFT matches its patterns against: ``model.embed_tokens``, ``lm_head``
    (the head sits beside the decoder, outside ``prefix``)."""
    return f"{prefix}{name}" if name == EMBED_TOKENS else name


# -- mixture-of-experts layers -------------------------------------------------------------------

ROUTER = "gate"
"""The router linear of a sparse MoE block (``mlp.gate``: ``[num_experts, hidden]``), adaptable as
any linear (PEFT's ``target_modules=["gate"]`` on older transformers, ``target_parameters=
["mlp.gate.weight"]`` on transformers 5: both save ``...mlp.gate.lora_A/B.weight``)."""
EXPERT_PROJ_NAMES = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
"""The experts' projections as loraplex keys them (one module per layer, all experts in it):
``gate`` / ``up`` ``[I, hidden]`` and ``down`` ``[hidden, I]`` of each expert."""
EXPERT_CHECKPOINT_NAMES: dict[str, dict[str, str]] = {
    "mlp": {"gate_proj": "experts.gate_proj", "up_proj": "experts.up_proj",
            "down_proj": "experts.down_proj"},
    "block_sparse_moe": {"w1": "experts.gate_proj", "w3": "experts.up_proj",
                         "w2": "experts.down_proj"},
}  # fmt: skip
"""The sparse block's name in checkpoints and adapters -> its per-expert module names ->
loraplex's (Qwen-MoE's ``mlp.experts.{e}.gate_proj``; Mixtral's ``block_sparse_moe.experts.{e}.w1``
with ``w1`` gate, ``w3`` up, ``w2`` down)."""
TARGET_PARAMETER_SUFFIXES = ("experts.gate_up_proj", "experts.down_proj", "gate.weight")
"""What a ``target_parameters`` entry may name (or a dotted suffix of it: PEFT's conversion of
an older adapter config writes bare ``gate_up_proj`` / ``down_proj``): the packed experts, or
the router's weight."""
PACKED_EXPERT_PARAMS: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("experts.gate_proj", "experts.up_proj"),
    "down_proj": ("experts.down_proj",),
}
"""transformers 5's packed 3-D expert parameters (``mlp.experts.gate_up_proj [E, 2 I, hidden]``,
gate rows then up rows; ``mlp.experts.down_proj [E, hidden, I]``), PEFT's ``target_parameters``
-> the expert projections they hold."""


@dataclass(frozen=True)
class MoESpec:
    """The sparse blocks of a mixture-of-experts base, as adapters are checked against them."""

    num_experts: int
    layers: tuple[int, ...]
    """The layers whose MLP is a sparse block (the others are dense: ``mlp_only_layers``,
    ``decoder_sparse_step``)."""
    hidden: int
    intermediate: int  # of one expert (``moe_intermediate_size``; Mixtral's ``intermediate_size``)
    block: str = "mlp"
    """The sparse block's module name in checkpoints and older adapters (``block_sparse_moe``
    for Mixtral); transformers 5 names it ``mlp`` for every MoE model."""

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """The router's and each expert projection's ``(d_in, d_out)`` (per expert)."""
        h, i = self.hidden, self.intermediate
        return {
            ROUTER: (h, self.num_experts),
            "experts.gate_proj": (h, i),
            "experts.up_proj": (h, i),
            "experts.down_proj": (i, h),
        }

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any]) -> MoESpec | None:
        """The sparse blocks of a Qwen2/3-MoE or Mixtral ``config.json`` (None for a dense one):
        ``num_experts`` / ``num_local_experts``, ``moe_intermediate_size``, ``decoder_sparse_step``
        and ``mlp_only_layers`` as transformers reads them."""
        mtype = str(raw.get("model_type", ""))
        if mtype == "mixtral":
            n = int(raw.get("num_local_experts") or 8)
            layers = tuple(range(int(raw["num_hidden_layers"])))
            inter = int(raw["intermediate_size"])
            return cls(n, layers, int(raw["hidden_size"]), inter, "block_sparse_moe")
        if mtype not in ("qwen3_moe", "qwen2_moe"):
            return None
        n = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step") or 1)
        dense = set(raw.get("mlp_only_layers") or [])
        layers = tuple(
            i
            for i in range(int(raw["num_hidden_layers"]))
            if n > 0 and i not in dense and (i + 1) % step == 0
        )
        inter = int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
        return cls(n, layers, int(raw["hidden_size"]), inter)


@dataclass(frozen=True)
class BaseModelSpec:
    """What an adapter is validated against, built from the base model's config."""

    num_layers: int
    module_shapes: dict[str, tuple[int, int]]  # proj name -> (d_in, d_out)
    model_type: str = "llama"
    vocab_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    """``embed_tokens`` / ``lm_head`` -> (d_in, d_out) (:func:`vocab_module_shapes`); empty
    when the base does not serve LoRA on them (such adapters are then refused)."""
    text_only: bool = False
    """The base is the language model of a multimodal checkpoint (Gemma 3's
    ``Gemma3ForConditionalGeneration``): LoRA applies to the text backbone only, and an
    adapter's tensors on the other towers (:data:`OTHER_TOWER_RE`) are skipped, as vLLM does;
    they never touch a text-only forward."""
    moe: MoESpec | None = None
    """The sparse blocks of a mixture-of-experts base (None: dense): in its ``moe.layers`` an
    adapter names the router and the experts instead of the dense MLP's projections."""

    @property
    def fused(self) -> tuple[str, ...]:
        """The fused modules of this base's checkpoints (``FUSED_BY_MODEL_TYPE``; Phi-3's
        ``qkv_proj``, ``gate_up_proj``): its adapters name these, never their parts."""
        return FUSED_BY_MODEL_TYPE.get(self.model_type, ())

    @property
    def adapter_shapes(self) -> dict[str, tuple[int, int]]:
        """The modules an adapter for this base names in a layer -> (d_in, d_out)."""
        return adapter_module_shapes(self.module_shapes, self.fused)

    def fused_rows(self, proj: str) -> tuple[tuple[str, int, int], ...]:
        """``(part, first row, end row)`` of fused module ``proj``'s output (q, then k, then v
        under GQA; gate, then up)."""
        rows, lo = [], 0
        for part in FUSED_PROJ_NAMES[proj]:
            hi = lo + self.module_shapes[part][1]
            rows.append((part, lo, hi))
            lo = hi
        return tuple(rows)

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any]) -> BaseModelSpec:
        """Spec from a Llama-family HF ``config.json`` dict (a multimodal one's ``text_config``
        for the language model); ``KeyError`` / ``TypeError`` / ``ValueError`` /
        ``ZeroDivisionError`` when it is not one."""
        model_type = str(raw.get("model_type", "llama"))
        text_only = isinstance(raw.get("text_config"), Mapping)
        if text_only:
            raw = raw["text_config"]
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        inter = int(raw["intermediate_size"])
        shapes = projection_shapes(hidden, heads, kv_heads, head_dim, inter)
        vocab = raw.get("vocab_size")
        vocab_shapes = vocab_module_shapes(int(vocab), hidden) if vocab else {}
        moe = MoESpec.from_hf_config(raw)
        return cls(int(raw["num_hidden_layers"]), shapes, model_type, vocab_shapes, text_only, moe)

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        """The modules an adapter may name in ``layer`` -> (d_in, d_out) (an expert
        projection's are one expert's): attention, then the dense MLP or the sparse block."""
        shapes = self.adapter_shapes
        if self.moe is None or layer not in self.moe.layers:
            return shapes
        attn = {p: d for p, d in shapes.items() if p in ATTN_PROJ_NAMES}
        return {**attn, **self.moe.shapes}


# -- errors --------------------------------------------------------------------------------------


class FormatError(ValueError):
    """An adapter breaks a format rule. ``reason`` is the registry's code (``unsupported_config``,
    ``unsupported_target``, ``unsupported_tensor``, ``unsupported_dtype``, ``incomplete_adapter``,
    ``shape_mismatch``, ``rank_too_large``, ``unsupported_base``); the message names the field
    or tensor."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# -- the config ----------------------------------------------------------------------------------

UNSUPPORTED_FIELDS: dict[str, str] = {
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "full replacement weights (modules_to_save) are not served, only LoRA A/B",
    "lora_bias": "LoRA bias terms are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QA-LoRA adapters are not supported",
    "trainable_token_indices": "trainable tokens (trainable_token_indices) are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "KaSA adapters (kasa_config) are not supported",
    "monteclora_config": "MonteCLoRA adapters (monteclora_config) are not supported",
}
"""Fields whose presence (truthy value) means a variant we cannot serve as W + scale * B @ A."""

BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
"""``init_lora_weights`` values that rewrite the base weights at init: such an adapter only fits
the modified base unless PEFT converted it on save (which resets init_lora_weights to True)."""


def pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first pattern (in file order) matching a suffix of
    ``module``."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


@dataclass(frozen=True)
class LoraSettings:
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
    target_parameters: tuple[str, ...] = ()
    """PEFT's ``target_parameters``: parameters adapted directly (a MoE's packed experts,
    ``mlp.experts.gate_up_proj``; its router, ``mlp.gate.weight``), matched as name suffixes."""

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> LoraSettings:
        """The settings as ``config`` spells them, PEFT's defaults for missing fields; no checks
        (:func:`parse_lora_config` checks first)."""
        pattern = config.get("layers_pattern")
        alpha = config.get("lora_alpha", 8)
        return cls(
            r=config.get("r", 8),
            lora_alpha=float(alpha) if _is_number(alpha) else alpha,
            use_rslora=config.get("use_rslora", False),
            target_modules=config.get("target_modules"),  # type: ignore[arg-type]
            exclude_modules=config.get("exclude_modules"),
            layers_to_transform=config.get("layers_to_transform"),
            layers_pattern=[pattern] if isinstance(pattern, str) else (pattern or None),
            rank_pattern=config.get("rank_pattern") or {},
            alpha_pattern=config.get("alpha_pattern") or {},
            target_parameters=tuple(config.get("target_parameters") or ()),
        )

    def is_param_targeted(self, param: str) -> bool:
        """Whether ``target_parameters`` names parameter ``param`` (e.g.
        ``model.layers.3.mlp.experts.down_proj``): the whole name or a suffix of it after a dot,
        within ``layers_to_transform`` as for modules."""
        if not any(param == t or param.endswith(f".{t}") for t in self.target_parameters):
            return False
        return self._in_layers(param)

    def is_targeted(self, module: str) -> bool:
        """PEFT's ``check_target_module_exists`` for a key like ``model.layers.3.mlp.up_proj``
        (or ``model.embed_tokens`` / ``lm_head``: with no layer index, ``layers_to_transform``
        leaves them out unless ``target_modules`` lists the whole name, as PEFT does)."""
        ex = self.exclude_modules
        if ex:
            if isinstance(ex, str):
                if re.fullmatch(ex, module):
                    return False
            elif module in ex or any(module.endswith(f".{e}") for e in ex):
                return False
        tm = self.target_modules
        if not tm:
            return False
        if isinstance(tm, str):
            if tm.lower() == "all-linear":  # every linear but the LM head (an embedding is none)
                found = module.rsplit(".", 1)[-1] not in VOCAB_MODULES
            else:
                return re.fullmatch(tm, module) is not None
        elif module in tm:
            return True
        else:
            found = any(module.endswith(f".{t}") for t in tm)
        return found and self._in_layers(module)

    def _in_layers(self, module: str) -> bool:
        """Whether ``layers_to_transform`` (with ``layers_pattern``) keeps ``module``."""
        lt = self.layers_to_transform
        if lt is None or (isinstance(lt, list) and not lt):
            return True
        match = None
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        else:
            for pattern in self.layers_pattern:
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
                if match is not None:
                    break
        if match is None:
            return False
        idx = int(match.group("idx"))
        return idx == lt if isinstance(lt, int) else idx in lt

    def rank_and_scale(self, module: str) -> tuple[int, float]:
        """Configured (rank, scale) of one module: ``scale = alpha / r`` (``alpha / sqrt(r)``
        with rsLoRA); rank and alpha from the first matching pattern, else ``r`` /
        ``lora_alpha``."""
        r = self.rank_of(module)
        a_key = pattern_key(self.alpha_pattern, module)
        alpha = self.alpha_pattern[a_key] if a_key is not None else self.lora_alpha
        scale = alpha / math.sqrt(r) if self.use_rslora else alpha / r
        return r, float(scale)

    def rank_of(self, module: str) -> int:
        """Configured rank of one module: the first matching ``rank_pattern`` entry, else ``r``."""
        key = pattern_key(self.rank_pattern, module)
        return self.rank_pattern[key] if key is not None else self.r

    def rank_field(self, module: str) -> str:
        """The config field the module's rank comes from: ``rank_pattern`` or ``r``."""
        return "rank_pattern" if pattern_key(self.rank_pattern, module) else "r"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _str_or_str_list(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def _config_error(message: str) -> FormatError:
    return FormatError("unsupported_config", message)


def parse_lora_config(config: Mapping[str, Any]) -> LoraSettings:
    """Refuse every config feature we cannot serve exactly (``FormatError``, reason
    ``unsupported_config``); return the targeting settings."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise _config_error(f"peft_type must be 'LORA', got {peft_type!r}")
    for name, why in UNSUPPORTED_FIELDS.items():
        value = config.get(name)
        if value and name == "modules_to_save":
            modules = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
            raise _config_error(
                f"modules_to_save={value!r}: full replacement weights for {modules} are not "
                "served, only LoRA A/B"
            )
        if value:
            raise _config_error(f"{name}={value!r}: {why}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise _config_error(f"bias={bias!r}: only bias='none' is supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_MODIFYING_INITS):
        raise _config_error(
            f"init_lora_weights={init!r}: this adapter expects a modified base model; convert it "
            "with save_pretrained(path_initial_model_for_weight_conversion=...) first",
        )

    r = config.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise _config_error(f"r must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise _config_error(f"lora_alpha must be a number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _config_error(f"use_rslora must be a boolean, got {use_rslora!r}")
    rank_pattern = config.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in rank_pattern.values()
    ):
        raise _config_error(
            f"rank_pattern must map patterns to positive ints, got {rank_pattern!r}"
        )
    alpha_pattern = config.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict) or not all(
        _is_number(v) for v in alpha_pattern.values()
    ):
        raise _config_error(f"alpha_pattern must map patterns to numbers, got {alpha_pattern!r}")
    target = config.get("target_modules")
    params = config.get("target_parameters")
    if params is not None and not (
        isinstance(params, list) and all(isinstance(p, str) and p for p in params)
    ):
        raise _config_error(f"target_parameters must be a list of strings, got {params!r}")
    for param in params or ():
        if param.rsplit(".", 1)[-1] not in PACKED_EXPERT_PARAMS and not (
            param == "gate.weight" or param.endswith(".gate.weight")
        ):
            raise _config_error(
                f"target_parameters entry {param!r} is not supported (supported: the packed "
                f"experts and the router of a MoE base: {', '.join(TARGET_PARAMETER_SUFFIXES)})"
            )
    if not (target or params) or (target and not _str_or_str_list(target)):
        raise _config_error(f"target_modules must be a string or list of strings, got {target!r}")
    exclude = config.get("exclude_modules")
    if exclude is not None and not _str_or_str_list(exclude):
        raise _config_error(f"exclude_modules must be a string or list of strings, got {exclude!r}")
    layers = config.get("layers_to_transform")
    if layers is not None and not (
        (isinstance(layers, int) and not isinstance(layers, bool))
        or (isinstance(layers, list) and all(isinstance(i, int) for i in layers))
    ):
        raise _config_error(f"layers_to_transform must be an int or list of ints, got {layers!r}")
    pattern = config.get("layers_pattern")
    if pattern is not None and not _str_or_str_list(pattern):
        raise _config_error(f"layers_pattern must be a string or list of strings, got {pattern!r}")
    for name, value in (("target_modules", target), ("exclude_modules", exclude)):
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                raise _config_error(f"{name} is not a valid regex {value!r}: {e}") from e
    settings = LoraSettings.of(config)
    tied = [m for m in VOCAB_MODULES if settings.is_targeted(vocab_module_key(m))]
    if config.get("ensure_weight_tying") and tied:
        raise _config_error(
            f"ensure_weight_tying=True with {' and '.join(tied)} targeted: one LoRA shared "
            "by a tied embedding and LM head is not supported"
        )
    return settings


def merge_writes_tied_matrix(config: Mapping[str, Any], base_config: Mapping[str, Any]) -> bool:
    """Whether PEFT's ``merge_and_unload`` of this adapter (its ``adapter_config.json``) would
    write the one matrix a tied base (``tie_word_embeddings``) shares between its embedding and
    LM head: a LoRA on either would then reach the other too. The adapter means what it did in
    training, the unmerged PEFT model: LoRA on the tied head on the logits only, on the
    embedding in the lookup only (what loraplex serves)."""
    text = base_config.get("text_config")
    tied = base_config.get("tie_word_embeddings")
    if tied is None and isinstance(text, Mapping):
        tied = text.get("tie_word_embeddings")
    if not tied:
        return False
    try:
        settings = parse_lora_config(config)
    except FormatError:
        return False
    return any(settings.is_targeted(vocab_module_key(m)) for m in VOCAB_MODULES)


def unservable_targets(target_modules: Any) -> list[Any]:
    """Entries of a ``target_modules`` list that name no module we serve (GPT-2's ``c_attn``,
    non-strings; not the seven projections, ``embed_tokens``, ``lm_head``, a MoE's router
    ``gate`` or its experts' ``gate_proj`` / ``w1`` ...). The registry
    refuses adapters whose config names such modules; the loader only refuses their tensors."""
    if not isinstance(target_modules, list):
        return []
    experts = {name for names in EXPERT_CHECKPOINT_NAMES.values() for name in names}
    servable = (*PROJ_NAMES, *FUSED_PROJ_NAMES, *VOCAB_MODULES, ROUTER, *experts)
    return [t for t in target_modules if not isinstance(t, str) or t.split(".")[-1] not in servable]


# -- the tensors ---------------------------------------------------------------------------------

_DECODER = r"(?:model\.)?(?:language_model\.)?(?:model\.)?"
"""What precedes ``layers.N`` / ``embed_tokens``: ``model.`` for a causal LM, and
``model.language_model.`` (transformers 5) or ``language_model.model.`` (older) for the
language model of a multimodal checkpoint."""
# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight
TENSOR_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?"
    rf"(?P<module>{_DECODER}layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<proj>[^.]+))"
    r"\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.lora_A...
OTHER_TOWER_RE = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:vision_tower|multi_modal_projector|audio_tower)\."
)
"""Tensors of a multimodal checkpoint's non-text towers (skipped on a text-only base)."""
_EMBED_MODULE = rf"{_DECODER}embed_tokens"
_HEAD_MODULE = r"(?:language_model\.)?lm_head"
# base_model.model.model.embed_tokens.lora_embedding_A[.default]  (PEFT's nn.Parameter names)
EMBED_KEY_RE = re.compile(
    rf"^(?:base_model\.model\.)?(?P<module>{_EMBED_MODULE})\.lora_embedding_(?P<ab>[AB])"
    r"(?:\.[^.]+)?$"
)
# base_model.model.lm_head.lora_A[.default].weight
HEAD_KEY_RE = re.compile(
    rf"^(?:base_model\.model\.)?(?P<module>{_HEAD_MODULE})\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# base_model.model.model.embed_tokens.base_layer.weight: PEFT's save_embedding_layers="auto"
# saves the base's own (frozen) matrix beside an embedding / lm_head LoRA
BASE_COPY_RE = re.compile(
    rf"^(?:base_model\.model\.)?(?P<module>{_EMBED_MODULE}|{_HEAD_MODULE})\.base_layer\.weight$"
)
_VOCAB_WEIGHT_RE = re.compile(
    rf"^(?:base_model\.model\.)?(?:{_EMBED_MODULE}|{_HEAD_MODULE})(?:\.[^.]+)?\.weight$"
)


_MOE_BLOCK = r"(?P<block>mlp|block_sparse_moe)"
# base_model.model.model.layers.3.mlp.experts.5.gate_proj.lora_A[.default].weight (per expert)
EXPERT_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?"
    rf"(?P<module>{_DECODER}layers\.(?P<layer>\d+)\.{_MOE_BLOCK}\.experts\.(?P<expert>\d+)"
    r"\.(?P<proj>[^.]+))\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# base_model.model.model.layers.3.mlp.experts[.base_layer].lora_A[.default].weight: PEFT's
# target_parameters on the packed parameters, one ParamWrapper around the other (which is
# inner depends on PEFT's order; the shapes say which parameter each pair adapts)
PACKED_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?"
    rf"(?P<module>{_DECODER}layers\.(?P<layer>\d+)\.{_MOE_BLOCK}\.experts)"
    r"(?P<inner>(?:\.base_layer)*)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# base_model.model.model.layers.3.mlp.gate.lora_A[.default].weight (the router)
ROUTER_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?"
    rf"(?P<module>{_DECODER}layers\.(?P<layer>\d+)\.{_MOE_BLOCK}\.gate)"
    r"\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


@dataclass(frozen=True)
class TensorKey:
    """A tensor name PEFT saves for one LoRA factor of an adaptable module."""

    module: str  # e.g. "model.layers.3.self_attn.q_proj" (what patterns are matched against)
    layer: int  # VOCAB_LAYER for embed_tokens / lm_head
    block: str  # self_attn | mlp; "" for embed_tokens / lm_head
    proj: str
    ab: str  # "A" | "B"


def parse_tensor_key(name: str) -> TensorKey | None:
    """The parts of ``...layers.N.{self_attn,mlp}.<proj>.lora_{A,B}[.<adapter>].weight``,
    ``...embed_tokens.lora_embedding_{A,B}[.<adapter>]`` or
    ``...lm_head.lora_{A,B}[.<adapter>].weight``."""
    m = TENSOR_KEY_RE.match(name)
    if m is not None:
        return TensorKey(m["module"], int(m["layer"]), m["block"], m["proj"], m["ab"])
    for proj, pattern in ((EMBED_TOKENS, EMBED_KEY_RE), (LM_HEAD, HEAD_KEY_RE)):
        m = pattern.match(name)
        if m is not None:
            return TensorKey(m["module"], VOCAB_LAYER, "", proj, m["ab"])
    return None


def parse_base_copy(name: str) -> str | None:
    """``embed_tokens`` / ``lm_head`` when ``name`` is PEFT's copy of that base matrix
    (``...embed_tokens.base_layer.weight``), else None."""
    m = BASE_COPY_RE.match(name)
    if m is None:
        return None
    return LM_HEAD if m["module"].endswith(LM_HEAD) else EMBED_TOKENS


def unknown_tensor_error(name: str) -> FormatError:
    """Why a tensor whose name :func:`parse_tensor_key` does not parse is refused."""
    if "lora_magnitude_vector" in name:
        why = "DoRA magnitude vectors are not supported"
    elif "modules_to_save" in name:
        why = "modules_to_save weights are not supported"
    elif "trainable_tokens" in name:
        why = "trainable tokens are not supported"
    elif ".lora_" in name and name.endswith(".bias"):
        why = "LoRA bias (lora_bias) is not supported"
    elif ".embed_tokens.lora_" in name:
        why = "an embed_tokens LoRA is PEFT's lora_embedding_A / lora_embedding_B"
    elif _VOCAB_WEIGHT_RE.match(name):
        module = LM_HEAD if LM_HEAD in name else EMBED_TOKENS
        why = (
            f"full replacement weights for {module} (modules_to_save, or a resized "
            "vocabulary) are not served, only LoRA A/B"
        )
    else:
        return FormatError(
            "unsupported_tensor",
            f"tensor {name!r} is not a LoRA A/B weight of a module we understand",
        )
    return FormatError("unsupported_tensor", f"tensor {name!r}: {why}")


@dataclass(frozen=True)
class TensorMeta:
    """What the layout check needs of one tensor (no data)."""

    shape: tuple[int, ...]
    dtype: str  # str(torch dtype), e.g. "torch.float32"
    floating: bool


@dataclass(frozen=True)
class ModuleLayout:
    """One adapted projection as the tensors and the config describe it."""

    module: str  # the module key PEFT saw
    a_name: str
    b_name: str
    rank: int
    scale: float
    b_rows: tuple[int, int] | None = None
    """The rows of ``B`` this projection takes when the tensors are a fused module's (Phi-3's
    ``qkv_proj``: q's rows, k's, v's; ``A`` is then shared by the parts); None: all of them."""

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The tensors this module is served from."""
        return (self.a_name, self.b_name)


@dataclass(frozen=True)
class ExpertFactors:
    """The LoRA factors of one expert (per-expert keys: ``A [r, d_in]``, ``B [d_out, r]``), or of
    every expert at once (PEFT's ``target_parameters``: ``A [E r, d_in]`` expert-major,
    ``B [d_out, r E]`` rank-major: expert ``e``'s columns are ``e, E + e, 2 E + e, ...``)."""

    a_name: str
    b_name: str
    rank: int  # of one expert
    scale: float


@dataclass(frozen=True)
class ExpertModuleLayout:
    """One expert projection of one layer (every expert of it) as the tensors describe it:
    ``per_expert`` (keys per expert; None for an expert the config leaves alone, whose delta
    is zero) or ``packed`` (``target_parameters``), never both."""

    module: str  # the module key PEFT saw (per expert: the first expert's)
    num_experts: int
    rank: int  # rows per expert: the largest expert's rank
    per_expert: tuple[ExpertFactors | None, ...] | None = None
    packed: ExpertFactors | None = None
    b_rows: tuple[int, int] | None = None
    """The rows of the packed ``B`` this projection takes (``gate_up_proj``: gate's, up's)."""

    @property
    def tensor_names(self) -> tuple[str, ...]:
        factors = [self.packed] if self.packed is not None else list(self.per_expert or ())
        return tuple(n for f in factors if f is not None for n in (f.a_name, f.b_name))


Layout = ModuleLayout | ExpertModuleLayout


def _module_order(key: tuple[int, str]) -> tuple[int, int]:
    """Modules in table order: embed_tokens and lm_head first, then layer by layer (a fused
    module where its first part is)."""
    layer, proj = key
    if layer == VOCAB_LAYER:
        return (layer, VOCAB_MODULES.index(proj))
    if proj == ROUTER or proj in EXPERT_PROJ_NAMES:  # the sparse block, after attention
        return (
            layer,
            len(PROJ_NAMES) + (0 if proj == ROUTER else 1 + EXPERT_PROJ_NAMES.index(proj)),
        )
    return (layer, PROJ_NAMES.index(FUSED_PROJ_NAMES.get(proj, (proj,))[0]))


def _decoder_prefix(module_keys: Iterable[str]) -> str:
    """What precedes ``layers.N`` / ``embed_tokens`` in the module names PEFT saw
    (``model.``, ``model.language_model.``), for naming the modules it must have seen."""
    for mkey in module_keys:
        for anchor in ("layers.", EMBED_TOKENS):
            if anchor in mkey:
                return mkey.split(anchor)[0]
    return "model."


def check_layout(
    settings: LoraSettings,
    tensors: Mapping[str, TensorMeta],
    spec: BaseModelSpec,
    *,
    max_rank: int,
) -> dict[tuple[int, str], Layout]:
    """Check a set of tensors (name -> shape and kind, no data) against the config and the base.

    Every tensor must be ``lora_A``/``lora_B`` of a projection of a decoder layer or of the LM
    head, or ``lora_embedding_A``/``lora_embedding_B`` of the token embedding; each module has
    both, ``A: [r, d_in]`` and ``B: [d_out, r]`` of the base's shapes (the embedding's ``d_in``
    is the vocabulary) with the configured rank ``r <= max_rank``, the config targets it, and
    every module the config targets has tensors (a half-present adapter, e.g. made for a model
    with fewer layers, is a mismatch). PEFT's copies of the base's embedding / LM head matrix
    (``...base_layer.weight``, saved beside a LoRA on them) must have the base's shape (else the
    vocabulary was resized) and are not served: LoRA training freezes them. Returns
    ``(layer, proj) -> ModuleLayout`` in table order (``(VOCAB_LAYER, name)`` first); a fused
    module of the base (``spec.fused``: Phi-3's ``qkv_proj``) is checked as one module and
    returned as its parts, each with its rows of ``B`` (``b_rows``). On a MoE base
    (``spec.moe``) the sparse layers' router is an ordinary module and their experts come back
    as :class:`ExpertModuleLayout` (:class:`_ExpertTensors` checks them).
    """
    pairs: dict[tuple[int, str], dict[str, str]] = {}  # (layer, proj) -> {"A": name, "B": name}
    module_keys: dict[tuple[int, str], str] = {}
    copies: dict[str, str] = {}  # base copy tensor name -> embed_tokens | lm_head
    if settings.target_parameters and spec.moe is None:
        raise FormatError(
            "unsupported_target",
            f"target_parameters {list(settings.target_parameters)} name a MoE's experts or "
            "router, and this base model has none (adapter made for another model?)",
        )
    experts = _ExpertTensors(spec, settings, tensors, max_rank) if spec.moe else None
    for name in sorted(tensors):
        if spec.text_only and OTHER_TOWER_RE.match(name):
            continue  # LoRA on the text backbone only (the other towers never run)
        if experts is not None and experts.collect(name):
            continue
        if experts is not None and (m := ROUTER_KEY_RE.match(name)) is not None:
            k = TensorKey(m["module"], int(m["layer"]), m["block"], ROUTER, m["ab"])
            slot = pairs.setdefault((k.layer, ROUTER), {})
            if k.ab in slot:
                raise FormatError(
                    "unsupported_tensor", f"tensor {name!r} duplicates {slot[k.ab]!r}"
                )
            slot[k.ab] = name
            module_keys[(k.layer, ROUTER)] = k.module
            continue
        copied = parse_base_copy(name)
        if copied is not None:
            copies[name] = copied
            continue
        k = parse_tensor_key(name)
        if k is None:
            raise unknown_tensor_error(name)
        if k.layer == VOCAB_LAYER:
            if k.proj not in spec.vocab_shapes:
                raise FormatError(
                    "unsupported_target",
                    f"tensor {name!r}: this base model serves no LoRA on {k.proj}",
                )
        elif k.proj not in spec.layer_shapes(k.layer):
            supported = (*spec.layer_shapes(k.layer), *VOCAB_MODULES)
            where = f" in layer {k.layer}" if spec.moe is not None else ""  # differs by layer
            raise FormatError(
                "unsupported_target",
                f"tensor {name!r}: target module {k.proj!r} is not supported{where} "
                f"(supported: {', '.join(supported)})",
            )
        elif k.block != block_of(k.proj):
            raise FormatError(
                "unsupported_tensor", f"tensor {name!r}: {k.proj} does not belong under {k.block}"
            )
        slot = pairs.setdefault((k.layer, k.proj), {})
        if k.ab in slot:
            raise FormatError("unsupported_tensor", f"tensor {name!r} duplicates {slot[k.ab]!r}")
        slot[k.ab] = name
        module_keys[(k.layer, k.proj)] = k.module
    if not pairs and (experts is None or not experts.any):
        raise FormatError("incomplete_adapter", "no LoRA tensors (lora_A/lora_B weights) found")
    for name, copied in copies.items():
        if (VOCAB_LAYER, copied) not in pairs:
            raise FormatError(
                "unsupported_tensor",
                f"tensor {name!r}: a copy of the base's {copied} matrix without a LoRA on "
                f"{copied} (full replacement weights are not served, only LoRA A/B)",
            )
        vocab = spec.vocab_shapes[copied][0 if copied == EMBED_TOKENS else 1]
        want = [vocab, spec.vocab_shapes[EMBED_TOKENS][1]]
        if list(tensors[name].shape) != want:
            raise FormatError(
                "shape_mismatch",
                f"tensor {name!r}: shape {list(tensors[name].shape)}, the base's {copied} is "
                f"{want} (a resized vocabulary is not served)",
            )

    out: dict[tuple[int, str], ModuleLayout] = {}
    for key in sorted(pairs, key=_module_order):
        layer, proj = key
        mkey, slot = module_keys[key], pairs[key]
        for ab in "AB":
            if ab not in slot:
                what = f"lora_embedding_{ab}" if proj == EMBED_TOKENS else f"lora_{ab} weight"
                raise FormatError("incomplete_adapter", f"module {mkey}: {what} missing")
        a_name, b_name = slot["A"], slot["B"]
        a, b = tensors[a_name], tensors[b_name]
        if layer >= spec.num_layers:
            raise FormatError(
                "shape_mismatch",
                f"tensor {a_name!r}: layer {layer} >= base model num_layers {spec.num_layers}",
            )
        shapes = spec.vocab_shapes if layer == VOCAB_LAYER else spec.layer_shapes(layer)
        if proj not in shapes:
            raise FormatError("shape_mismatch", f"tensor {a_name!r}: base model has no {proj}")
        targeted = settings.is_targeted(mkey)
        if proj == ROUTER:  # target_modules=["gate"], or target_parameters=["mlp.gate.weight"]
            targeted = targeted or settings.is_param_targeted(f"{mkey}.weight")
        if not targeted:
            raise FormatError(
                "unsupported_tensor",
                f"tensor {a_name!r}: module {mkey} is not targeted by the config "
                "(target_modules / layers_to_transform / exclude_modules)",
            )
        _check_factor_meta(a_name, a, b_name, b)
        d_in, d_out = shapes[proj]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise FormatError(
                "shape_mismatch",
                f"rank mismatch in {mkey}: {a_name!r} has rank {rank}, {b_name!r} has {b.shape[1]}",
            )
        if a.shape[1] != d_in:
            raise FormatError(
                "shape_mismatch",
                f"tensor {a_name!r}: shape {list(a.shape)}, expected [r, d_in={d_in}] "
                "(adapter made for a different base model?)",
            )
        if b.shape[0] != d_out:
            raise FormatError(
                "shape_mismatch",
                f"tensor {b_name!r}: shape {list(b.shape)}, expected [d_out={d_out}, r] "
                "(adapter made for a different base model?)",
            )
        cfg_rank, scale = settings.rank_and_scale(mkey)
        if rank != cfg_rank:
            raise FormatError(
                "shape_mismatch",
                f"tensor {a_name!r}: rank {rank} != configured rank {cfg_rank} "
                f"({settings.rank_field(mkey)})",
            )
        if rank > max_rank:
            raise FormatError(
                "rank_too_large", f"tensor {a_name!r}: rank {rank} > max_lora_rank {max_rank}"
            )
        if proj in FUSED_PROJ_NAMES:  # one A/B pair over the parts' rows: A shared, B split
            for part, lo, hi in spec.fused_rows(proj):
                out[(layer, part)] = ModuleLayout(mkey, a_name, b_name, rank, scale, (lo, hi))
        else:
            out[key] = ModuleLayout(mkey, a_name, b_name, rank, scale)

    prefix = _decoder_prefix([*module_keys.values(), *(experts.modules if experts else ())])
    expected = [
        ((layer, proj), module_key(layer, proj, prefix))
        for layer in range(spec.num_layers)
        for proj in spec.layer_shapes(layer)
        if proj not in EXPERT_PROJ_NAMES and proj != ROUTER  # the sparse block's: below
    ]
    expected += [((VOCAB_LAYER, m), vocab_module_key(m, prefix)) for m in VOCAB_MODULES]
    for key, mkey in expected:
        if key not in pairs and settings.is_targeted(mkey):
            if key[0] == VOCAB_LAYER and key[1] not in spec.vocab_shapes:
                raise FormatError(
                    "unsupported_target",
                    f"module {mkey} is targeted by the config, and this base model serves no "
                    f"LoRA on {key[1]}",
                )
            raise FormatError(
                "incomplete_adapter",
                f"module {mkey} is targeted by the config (target_modules / "
                "layers_to_transform) but has no LoRA tensors "
                "(adapter made for another model?)",
            )
    if experts is not None:
        out.update(experts.layouts(prefix, router_seen={k for k in pairs if k[1] == ROUTER}))
        out = dict(sorted(out.items(), key=lambda kv: _module_order(kv[0])))
    return out


def _check_factor_meta(a_name: str, a: TensorMeta, b_name: str, b: TensorMeta) -> None:
    """Both factors of a LoRA pair are 2-D floating-point tensors."""
    for tname, t in ((a_name, a), (b_name, b)):
        if not t.floating:
            raise FormatError(
                "unsupported_dtype", f"tensor {tname!r}: dtype {t.dtype} is not floating point"
            )
        if len(t.shape) != 2:
            raise FormatError(
                "shape_mismatch", f"tensor {tname!r}: expected 2-D, got shape {list(t.shape)}"
            )


class _ExpertTensors:
    """The expert LoRA tensors of an adapter for a MoE base, collected by name and then checked
    as :func:`check_layout` checks modules: per-expert keys (``experts.{e}.gate_proj``, Mixtral's
    ``experts.{e}.w1``) or PEFT's ``target_parameters`` on the packed parameters, each targeted
    by the config, of the base's shapes and expert count, of the configured rank; and every
    expert module the config targets present (not for ``all-linear``: on transformers 5 the
    experts are no linears, and PEFT's ``all-linear`` leaves them out)."""

    def __init__(
        self,
        spec: BaseModelSpec,
        settings: LoraSettings,
        tensors: Mapping[str, TensorMeta],
        max_rank: int,
    ) -> None:
        assert spec.moe is not None
        self.moe, self.settings, self.tensors, self.max_rank = spec.moe, settings, tensors, max_rank
        # (layer, proj) -> expert -> {"A": name, "B": name}; module key of each
        self.per_expert: dict[tuple[int, str], dict[int, dict[str, str]]] = {}
        self.expert_modules: dict[tuple[int, str, int], str] = {}
        # layer -> wrapper depth -> {"A": name, "B": name}; the module key of each layer
        self.packed: dict[int, dict[int, dict[str, str]]] = {}
        self.packed_modules: dict[int, str] = {}

    @property
    def any(self) -> bool:
        return bool(self.per_expert or self.packed)

    @property
    def modules(self) -> list[str]:
        return [*self.expert_modules.values(), *self.packed_modules.values()]

    def _add(self, slot: dict[str, str], ab: str, name: str) -> None:
        if ab in slot:
            raise FormatError("unsupported_tensor", f"tensor {name!r} duplicates {slot[ab]!r}")
        slot[ab] = name

    def collect(self, name: str) -> bool:
        """Take ``name`` if it is an expert LoRA tensor (False: not one)."""
        m = EXPERT_KEY_RE.match(name)
        if m is not None:
            layer, expert = int(m["layer"]), int(m["expert"])
            proj = EXPERT_CHECKPOINT_NAMES[m["block"]].get(m["proj"])
            if proj is None:
                names = ", ".join(EXPERT_CHECKPOINT_NAMES[m["block"]])
                raise FormatError(
                    "unsupported_target",
                    f"tensor {name!r}: expert module {m['proj']!r} is not supported (supported "
                    f"under {m['block']}: {names})",
                )
            self._check_where(name, layer, expert)
            self._add(self.per_expert.setdefault((layer, proj), {}).setdefault(expert, {}),
                      m["ab"], name)  # fmt: skip
            self.expert_modules[(layer, proj, expert)] = m["module"]
            return True
        m = PACKED_KEY_RE.match(name)
        if m is not None:
            layer = int(m["layer"])
            self._check_where(name, layer, 0)
            depth = m["inner"].count(".base_layer")
            self._add(self.packed.setdefault(layer, {}).setdefault(depth, {}), m["ab"], name)
            self.packed_modules[layer] = m["module"]
            return True
        return False

    def _check_where(self, name: str, layer: int, expert: int) -> None:
        moe = self.moe
        if layer not in moe.layers:
            raise FormatError(
                "shape_mismatch",
                f"tensor {name!r}: layer {layer} of the base model has no experts "
                f"(its sparse layers: {list(moe.layers)})",
            )
        if expert >= moe.num_experts:
            raise FormatError(
                "shape_mismatch",
                f"tensor {name!r}: expert {expert} >= the base model's num_experts "
                f"{moe.num_experts} (adapter made for a model with more experts?)",
            )

    def _factors(self, mkey: str, a_name: str, b_name: str, experts: int) -> ExpertFactors:
        """Check one A/B pair of ``experts`` experts' rows (1: a per-expert pair)."""
        a, b = self.tensors[a_name], self.tensors[b_name]
        _check_factor_meta(a_name, a, b_name, b)
        rows = a.shape[0]
        if b.shape[1] != rows:
            raise FormatError(
                "shape_mismatch",
                f"rank mismatch in {mkey}: {a_name!r} has {rows} rows, {b_name!r} {b.shape[1]}",
            )
        if rows % experts:
            raise FormatError(
                "shape_mismatch",
                f"tensor {a_name!r}: {rows} rows are not a rank for each of the base model's "
                f"{experts} experts (adapter made for a different expert count?)",
            )
        rank = rows // experts
        cfg_rank, scale = self.settings.rank_and_scale(mkey)
        if rank != cfg_rank:
            raise FormatError(
                "shape_mismatch",
                f"tensor {a_name!r}: rank {rank} != configured rank {cfg_rank} "
                f"({self.settings.rank_field(mkey)})",
            )
        if rank > self.max_rank:
            raise FormatError(
                "rank_too_large", f"tensor {a_name!r}: rank {rank} > max_lora_rank {self.max_rank}"
            )
        return ExpertFactors(a_name, b_name, rank, scale)

    def _check_dims(self, mkey: str, f: ExpertFactors, d_in: int, d_out: int) -> None:
        a, b = self.tensors[f.a_name].shape, self.tensors[f.b_name].shape
        if a[1] != d_in or b[0] != d_out:
            raise FormatError(
                "shape_mismatch",
                f"module {mkey}: A {list(a)} and B {list(b)}, expected A [r, d_in={d_in}] and "
                f"B [d_out={d_out}, r] (adapter made for a different base model?)",
            )

    def _complete(self, pair: dict[str, str], mkey: str) -> tuple[str, str]:
        for ab in "AB":
            if ab not in pair:
                raise FormatError("incomplete_adapter", f"module {mkey}: lora_{ab} weight missing")
        return pair["A"], pair["B"]

    def _strict(self) -> bool:
        tm = self.settings.target_modules
        return not (isinstance(tm, str) and tm.lower() == "all-linear")

    def layouts(
        self, prefix: str, router_seen: set[tuple[int, str]]
    ) -> dict[tuple[int, str], ExpertModuleLayout]:
        """The expert modules, each checked; a targeted one without tensors is refused."""
        moe, settings, shapes = self.moe, self.settings, self.moe.shapes
        n = moe.num_experts
        out: dict[tuple[int, str], ExpertModuleLayout] = {}
        block = moe.block
        for layer, depths in sorted(self.packed.items()):
            base = self.packed_modules[layer]
            for pair in depths.values():
                a_name, b_name = self._complete(pair, base)
                d_in, d_out = self.tensors[a_name].shape[1], self.tensors[b_name].shape[0]
                param = next(
                    (p for p, parts in PACKED_EXPERT_PARAMS.items()
                     if (d_in, d_out) == (shapes[parts[0]][0],
                                          sum(shapes[q][1] for q in parts))),
                    None,
                )  # fmt: skip
                if param is None:
                    raise FormatError(
                        "shape_mismatch",
                        f"tensor {a_name!r}: A {list(self.tensors[a_name].shape)} and B "
                        f"{list(self.tensors[b_name].shape)} fit neither of the base model's "
                        "packed experts (gate_up_proj, down_proj)",
                    )
                mkey = f"{base}.{param}"
                if not settings.is_param_targeted(mkey):
                    raise FormatError(
                        "unsupported_tensor",
                        f"tensor {a_name!r}: parameter {mkey} is not targeted by the config "
                        "(target_parameters / layers_to_transform)",
                    )
                f = self._factors(mkey, a_name, b_name, n)
                lo = 0
                for part in PACKED_EXPERT_PARAMS[param]:
                    hi = lo + shapes[part][1]
                    if (layer, part) in out or (layer, part) in self.per_expert:
                        raise FormatError(
                            "unsupported_tensor",
                            f"module {mkey}: adapted twice (packed and per expert?)",
                        )
                    out[(layer, part)] = ExpertModuleLayout(
                        mkey, n, f.rank, packed=f, b_rows=(lo, hi)
                    )
                    lo = hi
        for (layer, proj), by_expert in sorted(self.per_expert.items()):
            if (layer, proj) in out:
                raise FormatError(
                    "unsupported_tensor",
                    f"layer {layer} {proj}: adapted twice (packed and per expert?)",
                )
            d_in, d_out = shapes[proj]
            factors: list[ExpertFactors | None] = [None] * n
            for e, pair in by_expert.items():
                mkey = self.expert_modules[(layer, proj, e)]
                if not settings.is_targeted(mkey):
                    raise FormatError(
                        "unsupported_tensor",
                        f"tensor {pair.get('A', pair.get('B'))!r}: module {mkey} is not targeted "
                        "by the config (target_modules / layers_to_transform / exclude_modules)",
                    )
                f = self._factors(mkey, *self._complete(pair, mkey), 1)
                self._check_dims(mkey, f, d_in, d_out)
                factors[e] = f
            first = self.expert_modules[(layer, proj, min(by_expert))]
            rank = max(f.rank for f in factors if f is not None)
            out[(layer, proj)] = ExpertModuleLayout(first, n, rank, per_expert=tuple(factors))
        # what the config targets must be there
        names = {v: k for k, v in EXPERT_CHECKPOINT_NAMES[block].items()}
        for layer in moe.layers:
            for param, parts in PACKED_EXPERT_PARAMS.items():
                mkey = f"{prefix}layers.{layer}.mlp.experts.{param}"
                if settings.is_param_targeted(mkey) and any((layer, q) not in out for q in parts):
                    raise FormatError(
                        "incomplete_adapter",
                        f"parameter {mkey} is targeted by the config (target_parameters) but "
                        "has no LoRA tensors (adapter made for another model?)",
                    )
            router = f"{prefix}layers.{layer}.{block}.{ROUTER}"
            router_v5 = f"{prefix}layers.{layer}.mlp.{ROUTER}"
            wants_router = settings.is_param_targeted(f"{router_v5}.weight") or (
                self._strict() and settings.is_targeted(router)
            )
            if wants_router and (layer, ROUTER) not in router_seen:
                raise FormatError(
                    "incomplete_adapter",
                    f"module {router} is targeted by the config but has no LoRA tensors",
                )
            if not self._strict():
                continue
            for proj in EXPERT_PROJ_NAMES:
                if (layer, proj) in out and out[(layer, proj)].packed is not None:
                    continue
                have = self.per_expert.get((layer, proj), {})
                for e in range(moe.num_experts):
                    mkey = f"{prefix}layers.{layer}.{block}.experts.{e}.{names[proj]}"
                    if e not in have and settings.is_targeted(mkey):
                        raise FormatError(
                            "incomplete_adapter",
                            f"module {mkey} is targeted by the config (target_modules / "
                            "layers_to_transform) but has no LoRA tensors (adapter made for a "
                            "model with fewer experts?)",
                        )
        return out
