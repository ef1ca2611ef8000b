"""``loraplex plan``: capacity planning for LoRA serving, from shapes alone (no torch, no weights).

    loraplex plan --model llama-3-8b --rank 16 --targets q_proj,v_proj --device-budget 2GiB \\
        --num-adapters 1000 --host-budget 64GiB
    loraplex plan --model /models/llama3/config.json --adapter /adapters/sql --adapter /adapters/fr

For a Llama-family base (a model directory, its ``config.json``, or a preset) and adapters
(PEFT directories / ``adapter_config.json`` files / JSON manifests with ``r`` or ``rank`` and
``target_modules``, or ``--rank``/``--targets``), it computes:

- bytes per adapter: for every adapted projection of every adapted layer, r x (d_in + d_out)
  parameters (A is [r, d_in], B is [d_out, r]) times the dtype's bytes; ``embed_tokens`` and
  ``lm_head`` once each, r x (vocab + hidden);
- device slots: a slot holds any adapter up to ``max_lora_rank`` for the union of targets, so a
  slot is ``max_lora_rank`` x (d_in + d_out) per module; how many slots a device budget buys
  and how many KV-cache tokens that memory would have held instead
  (KV bytes/token = 2 x layers x kv_heads x head_dim x dtype bytes); beside it what
  ``loraplex serve`` allocates per slot (every projection, and ``embed_tokens`` and ``lm_head``
  whatever the adapters target: ``max_lora_rank`` x 2 x (vocab + hidden) of it);
- host and disk: bytes for N adapters, or how many fit a budget;
- the decode byte model: a decode step reads the base weights once (every linear layer and the
  LM head; the embedding is a gather) plus the A and B of each distinct adapter in the batch
  (of an embedding LoRA only B: its A is gathered by token id like the embedding), so k distinct
  adapters add k x an adapter's decode bytes, shown as a share of the base weight traffic.

A mixture-of-experts base (``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``: its sparse layers
hold a router ``gate [E, hidden]`` and E experts of ``gate_proj``/``up_proj``/``down_proj``):

- weights count every expert; a token reads ``num_experts_per_tok`` (top-k) of them per sparse
  layer, a step of T tokens at most ``min(E, T x top_k)`` (an upper bound: every token is taken
  to choose experts no other token chose, as far as there are any). The decode model reports
  both ends: *one token per adapter* (k adapters, k tokens: the base reads
  ``min(E, k x top_k)`` experts per sparse layer, each adapter the LoRA of its token's top-k)
  and *a full batch* of ``--decode-batch`` tokens spread evenly over the k adapters;
- an adapter on the experts, per-expert keys (``mlp.experts.{e}.gate_proj``, Mixtral's
  ``block_sparse_moe.experts.{e}.w1``) or PEFT's ``target_parameters`` on the packed experts
  (``mlp.experts.gate_up_proj``: one A ``[E r, hidden]`` and B ``[2 I, E r]``), costs
  r x (d_in + d_out) per adapted expert, E times what the same rank costs on one dense
  projection: each adapter's bytes are reported by part (attention, dense MLP, router, experts,
  embed_tokens/lm_head), so an expert adapter's size is plain. A config alone that names the
  experts' projections (``gate_proj``..., ``w1``..., ``all-linear``) is priced per expert, the
  layout PEFT saved while experts were linears (a note says that PEFT on transformers 5 trains
  them packed, ``gate_up_proj`` at rank 2r); an adapter directory is priced as saved (an
  ``all-linear`` one by the experts and router its weights hold);
- a slot (and the engine's bank) holds every expert's rows of every expert projection:
  ``max_lora_rank x E x (d_in + d_out)`` per expert projection per sparse layer, as the slot
  bank allocates them (``E x capacity`` rows), plus the router's
  ``max_lora_rank x (hidden + E)``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loraplex.checkpoint.modules import (
    ATTN_PROJ_NAMES,
    EMBED_TOKENS,
    EXPERT_CHECKPOINT_NAMES,
    EXPERT_PROJ_NAMES,
    FUSED_BY_MODEL_TYPE,
    FUSED_PROJ_NAMES,
    PACKED_EXPERT_PARAMS,
    PROJ_NAMES,
    ROUTER,
    VOCAB_LAYER,
    VOCAB_MODULES,
    MoESpec,
    module_key,
    projection_shapes,
    vocab_module_key,
    vocab_module_shapes,
)
from loraplex.checkpoint.safetensors import SafetensorsError, TensorInfo, safetensors_header
from loraplex.cliargs import byte_size, positive_int, positive_ints
from loraplex.lora.peft.config import parse_lora_config
from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.files import CONFIG_NAME, SAFETENSORS_NAME
from loraplex.lora.peft.targets import LoraSettings
from loraplex.lora.peft.tensors import EXPERT_KEY_RE, OTHER_TOWER_RE, ROUTER_KEY_RE

__all__ = [
    "MOE_ARCHITECTURES",
    "PRESETS",
    "AdapterShape",
    "ModelShape",
    "PlanError",
    "adapter_from_path",
    "build_plan",
    "main",
    "render_plan",
]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}
QUANT_BITS = {"int8": 8, "int4": 4, "fp8": 8}
"""``--quantization``: bits per projection weight (GPTQ / AWQ / compressed-tensors W4A16
checkpoints are ``int4`` here, W8A8 and W8A16 ``int8``)."""


def projection_bytes_per_param(quantization: str | None, group_size: int | None, dtype_bytes: int) -> float:  # fmt: skip
    """Resident bytes per projection weight: the dtype's, or a quantized base's as loraplex
    stores it (model/quant/weights.py): the values' bits, a float32 scale per group (int4:
    ``group_size``, default 128) and an int8 zero point per int4 group; int8 and float8 have one
    scale per output row (per channel), under a byte per million weights here."""
    if quantization is None:
        return float(dtype_bytes)
    bits = QUANT_BITS[quantization]
    if bits == 8:
        return 1.0
    gs = group_size or 128
    return bits / 8 + (4 + 1) / gs


PACKED_GATE_UP = "experts.gate_up_proj"
"""PEFT's ``target_parameters`` LoRA on the packed ``mlp.experts.gate_up_proj`` as the planner
names it: one A ``[E r, hidden]`` for gate and up and one B over both (the engine splits it into
``experts.gate_proj`` and ``experts.up_proj``, A copied to each)."""
ALL_FUSED: dict[str, tuple[str, ...]] = {
    **FUSED_PROJ_NAMES,
    PACKED_GATE_UP: PACKED_EXPERT_PARAMS["gate_up_proj"],
}
MOE_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
"""``model_type`` -> the mixture-of-experts architecture served for it."""
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
PARTS = ("attention", "mlp", "router", "experts", "vocab")
"""An adapter's parts, as reported: attention projections, a dense MLP's, the router of a sparse
layer, its experts, and ``embed_tokens`` / ``lm_head``."""
PART_NAMES = {"attention": "attention", "mlp": "dense MLP", "router": "router",
              "experts": "experts", "vocab": "embed_tokens/lm_head"}  # fmt: skip
DEFAULT_DECODE_BATCH = 64  # the engine's default --max-num-seqs


class PlanError(ValueError):
    """Bad planner input; the message names the problem."""


def part_of(proj: str) -> str:
    """The part (:data:`PARTS`) a module of an adapter belongs to."""
    if proj in VOCAB_MODULES:
        return "vocab"
    if proj == ROUTER:
        return "router"
    if proj.startswith("experts."):
        return "experts"
    return "attention" if proj in ATTN_PROJ_NAMES else "mlp"


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a Llama-family config (or a mixture-of-experts one)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int  # the dense MLP's (a MoE base's dense layers, if any)
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    layer_norm_params: int = 0  # 0: Llama's two norms of hidden_size per layer
    layer_bias_params: int = 0
    text_only: bool = False  # a multimodal checkpoint's language model (other towers unserved)
    fused: tuple[str, ...] = ()  # the checkpoint's fused modules (Phi-3's qkv_proj, gate_up_proj)
    num_experts: int = 0  # experts per sparse layer (0: a dense model)
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's
    sparse_layers: tuple[int, ...] | None = None  # the sparse layers (None: all, when MoE)
    moe_block: str = "mlp"  # the sparse block's checkpoint name (Mixtral's block_sparse_moe)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def sparse(self) -> tuple[int, ...]:
        """The layers whose MLP is a sparse block (none for a dense model)."""
        if not self.is_moe:
            return ()
        return tuple(range(self.num_layers)) if self.sparse_layers is None else self.sparse_layers

    @property
    def moe(self) -> MoESpec | None:
        """The sparse blocks (None: dense)."""
        if not self.is_moe:
            return None
        return MoESpec(
            self.num_experts, self.sparse, self.hidden_size, self.moe_intermediate_size,
            self.moe_block,
        )  # fmt: skip

    @property
    def adapter_projs(self) -> tuple[str, ...]:
        """The modules of a layer an adapter for this base names: the seven projections, with
        each fused module in place of its parts."""
        out: list[str] = []
        for p in PROJ_NAMES:
            f = next((f for f in self.fused if p in FUSED_PROJ_NAMES[f]), p)
            if f not in out:
                out.append(f)
        return tuple(out)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """What ``target_modules`` may name on this base (for messages): the layers' modules
        (a MoE's router and per-expert projections too) and the vocabulary modules."""
        names = list(self.adapter_projs)
        if self.is_moe:
            names += [ROUTER, *EXPERT_CHECKPOINT_NAMES[self.moe_block]]
        return tuple(dict.fromkeys([*names, *VOCAB_MODULES]))

    def layer_projs(self, layer: int) -> tuple[str, ...]:
        """The modules of ``layer`` as the engine holds them (fused ones split): the seven
        projections, or a sparse layer's attention, router and three expert projections."""
        if layer in self.sparse:
            return (*PROJ_NAMES[:4], ROUTER, *EXPERT_PROJ_NAMES)
        return PROJ_NAMES

    def experts_of(self, proj: str) -> int:
        """How many times a module's ``(d_in, d_out)`` is held: E for an expert projection (the
        slot bank's ``E x capacity`` rows), else 1."""
        return self.num_experts if proj.startswith("experts.") else 1

    def dims(self, proj: str) -> tuple[int, int]:
        """(d_in, d_out) of a projection, of a fused module (its parts' rows), of
        ``embed_tokens`` / ``lm_head``, or of a sparse layer's router and expert projections
        (one expert's)."""
        if proj in VOCAB_MODULES:
            return vocab_module_shapes(self.vocab_size, self.hidden_size)[proj]
        if proj in ALL_FUSED:
            parts = [self.dims(q) for q in ALL_FUSED[proj]]
            return parts[0][0], sum(d_out for _, d_out in parts)
        if proj == ROUTER or proj in EXPERT_PROJ_NAMES:
            moe = self.moe
            if moe is None:
                raise PlanError(f"{self.name} is not a mixture-of-experts model: it has no {proj}")
            return moe.shapes[proj]
        shapes = projection_shapes(
            self.hidden_size, self.num_heads, self.num_kv_heads, self.hd, self.intermediate_size
        )
        return shapes[proj]

    def expert_params(self) -> int:
        """Parameters of one expert of a sparse layer (its three projections; 0: dense)."""
        return sum(math.prod(self.dims(p)) for p in EXPERT_PROJ_NAMES) if self.is_moe else 0

    def linear_params(self) -> int:
        """Parameters of every projection of every layer, a sparse layer's router and all its
        experts (no norms, embeddings or head)."""
        n_sparse = len(self.sparse)
        out = (self.num_layers - n_sparse) * sum(math.prod(self.dims(p)) for p in PROJ_NAMES)
        if n_sparse:
            attn = sum(math.prod(self.dims(p)) for p in PROJ_NAMES[:4])
            router = math.prod(self.dims(ROUTER))
            out += n_sparse * (attn + router + self.num_experts * self.expert_params())
        return out

    def _layer_extras(self) -> int:
        """A layer's norm and bias parameters, and the final norm."""
        norms = self.layer_norm_params or 2 * self.hidden_size
        return self.num_layers * (norms + self.layer_bias_params) + self.hidden_size

    def params(self) -> int:
        """All parameters: projections (every expert), biases, norms, embedding, LM head
        (unless tied)."""
        emb = self.vocab_size * self.hidden_size
        return (
            self.linear_params()
            + self._layer_extras()
            + emb * (1 if self.tie_word_embeddings else 2)
        )

    def experts_read(self, tokens: int) -> int:
        """Experts a step of ``tokens`` tokens reads per sparse layer, at most (every token
        choosing experts no other token chose while there are any): min(E, tokens x top-k)."""
        return min(self.num_experts, tokens * self.num_experts_per_tok)

    def _idle_expert_params(self, tokens: int) -> int:
        idle = self.num_experts - self.experts_read(tokens)
        return len(self.sparse) * idle * self.expert_params()

    def active_params(self) -> int:
        """Parameters one token reads: all but the experts it does not choose (top-k of E per
        sparse layer: the "A3B" of Qwen3-30B-A3B; every parameter of a dense model)."""
        return self.params() - self._idle_expert_params(1)

    def decode_read_params(self, tokens: int = 1) -> int:
        """Parameters a decode step of ``tokens`` tokens reads in full: projections (of a
        sparse layer at most :meth:`experts_read` experts), biases, norms and the LM head (the
        embedding is a gather of a few rows; a tied head reads the embedding matrix)."""
        return (
            self.linear_params()
            - self._idle_expert_params(tokens)
            + self._layer_extras()
            + self.vocab_size * self.hidden_size
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.hd * dtype_bytes


# every layer sparse: 128 experts of 768, top-8; Qwen3's q/k norms of head_dim
_QWEN3_30B_A3B = ModelShape("qwen3-30b-a3b", 2048, 48, 32, 4, 6144, 151936, 128,
                            layer_norm_params=2 * 2048 + 2 * 128, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768)  # fmt: skip
_MIXTRAL_8X7B = ModelShape("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=14336,
                           moe_block="block_sparse_moe")  # fmt: skip
PRESETS: dict[str, ModelShape] = {
    p.name: p
    for p in (
        ModelShape("llama-3-8b", 4096, 32, 32, 8, 14336, 128256),
        ModelShape("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256),
        ModelShape("llama-3-70b", 8192, 80, 64, 8, 28672, 128256),
        ModelShape("llama-2-7b", 4096, 32, 32, 32, 11008, 32000),
        ModelShape("llama-2-13b", 5120, 40, 40, 40, 13824, 32000),
        ModelShape("mistral-7b", 4096, 32, 32, 8, 14336, 32000),
        ModelShape("qwen2-7b", 3584, 28, 28, 4, 18944, 152064),
        ModelShape("smollm2-135m", 576, 30, 9, 3, 1536, 49152, 64, True),
        _QWEN3_30B_A3B,
        _MIXTRAL_8X7B,
    )
}


def _positive(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def model_from_config(cfg: dict[str, Any], name: str) -> ModelShape:
    """The shape of a ``config.json``: through the architecture's own parse where it names one
    we serve (its norms, biases, a multimodal checkpoint's ``text_config``, a MoE's sparse
    blocks; a MoE ``model_type`` we serve without ``architectures`` counts as naming it), else
    read as a Llama-family config. A mixture-of-experts config of another architecture is
    refused: its experts would be left out of every count."""
    from loraplex.model.config import parse_model_config
    from loraplex.model.registry import ARCHITECTURES

    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") in MOE_ARCHITECTURES:
        cfg = {**cfg, "architectures": [MOE_ARCHITECTURES[str(cfg["model_type"])]]}
        archs = cfg["architectures"]
    if any(a in ARCHITECTURES for a in archs):
        from loraplex.types import ModelLoadError

        try:
            mc = parse_model_config(cfg, source=name)
        except ModelLoadError as e:
            raise PlanError(str(e)) from None
        moe = mc.moe_spec()
        return ModelShape(
            name=name,
            hidden_size=mc.hidden_size,
            num_layers=mc.num_layers,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            intermediate_size=mc.intermediate_size,
            vocab_size=mc.vocab_size,
            head_dim=mc.head_dim,
            tie_word_embeddings=mc.tie_word_embeddings,
            dtype=str(mc.torch_dtype or "bfloat16"),
            layer_norm_params=sum(mc.layer_norm_widths),
            layer_bias_params=mc.layer_bias_params(),
            text_only=isinstance(cfg.get("text_config"), dict),
            fused=FUSED_BY_MODEL_TYPE.get(mc.model_type, ()),
            num_experts=moe.num_experts if moe else 0,
            num_experts_per_tok=int(getattr(mc, "num_experts_per_tok", 0)) if moe else 0,
            moe_intermediate_size=moe.intermediate if moe else 0,
            sparse_layers=tuple(moe.layers) if moe else None,
            moe_block=moe.block if moe else "mlp",
        )
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    if any(_positive(text.get(k)) for k in _MOE_KEYS):
        what = ", ".join(map(str, archs)) or f"model_type {cfg.get('model_type')!r}"
        raise PlanError(
            f"{name}: a mixture-of-experts config ({what}) of an architecture loraplex does not "
            f"serve (MoE bases served: {', '.join(MOE_ARCHITECTURES.values())})"
        )
    try:
        heads = int(cfg["num_attention_heads"])
        shape = ModelShape(
            name=name,
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            head_dim=int(cfg.get("head_dim") or 0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )
    except KeyError as e:
        raise PlanError(
            f"{name}: config has no {e.args[0]!r} (is it a Llama-family config?)"
        ) from None
    except (TypeError, ValueError) as e:
        raise PlanError(f"{name}: bad value in config ({e})") from None
    if min(shape.hidden_size, shape.num_layers, heads, shape.num_kv_heads,
           shape.intermediate_size, shape.vocab_size) < 1:  # fmt: skip
        raise PlanError(f"{name}: config sizes must be >= 1")
    return shape


def load_model(spec: str) -> ModelShape:
    """A preset name, a model directory, or a ``config.json`` path."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    p = Path(spec)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        raise PlanError(
            f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory "
            "or config.json"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{cfg_path} is not a JSON object")
    return model_from_config(cfg, p.name if p.is_dir() else p.parent.name or str(p))


# -- adapters --------------------------------------------------------------------------------------
@dataclass
class AdapterShape:
    """An adapter's rank per (layer, module) it adapts; ``file_*`` from its safetensors.

    An expert module (``experts.gate_proj`` / ``experts.up_proj`` / ``experts.down_proj`` of
    per-expert keys, or PEFT's packed ``experts.gate_up_proj`` / ``experts.down_proj``) holds
    every expert's factors: ``modules`` has its largest expert's rank (the rows it takes in a
    slot), ``expert_ranks`` each expert's (0: an expert it leaves alone)."""

    name: str
    modules: dict[tuple[int, str], int]  # (layer, proj) -> rank
    file_params: int | None = None
    file_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    expert_ranks: dict[tuple[int, str], tuple[int, ...]] = field(default_factory=dict)
    packed: set[tuple[int, str]] = field(default_factory=set)
    """The expert modules of PEFT's ``target_parameters`` (the others: per-expert keys)."""

    @property
    def expert_layout(self) -> str | None:
        """``per_expert``, ``packed`` (``target_parameters``), ``mixed``, or None (no experts)."""
        per = any(key not in self.packed for key in self.expert_ranks)
        if self.packed:
            return "mixed" if per else "packed"
        return "per_expert" if per else None

    @property
    def max_rank(self) -> int:
        return max(self.modules.values(), default=0)

    @property
    def targets(self) -> list[str]:
        names = (*VOCAB_MODULES, *PROJ_NAMES, *FUSED_PROJ_NAMES, ROUTER, *EXPERT_PROJ_NAMES,
                 PACKED_GATE_UP)  # fmt: skip
        return [p for p in names if any(q == p for _, q in self.modules)]

    @property
    def layers(self) -> int:
        return len({layer for layer, _ in self.modules if layer != VOCAB_LAYER})

    @property
    def adapted_experts(self) -> int:
        """The most experts any one expert module adapts (0: no expert modules)."""
        return max((sum(r > 0 for r in rs) for rs in self.expert_ranks.values()), default=0)

    def module_params(self, m: ModelShape, key: tuple[int, str]) -> int:
        """One module's parameters: r x (d_in + d_out), an expert module's summed over its
        experts."""
        ranks = self.expert_ranks.get(key)
        return sum(m.dims(key[1])) * (sum(ranks) if ranks is not None else self.modules[key])

    def params(self, m: ModelShape) -> int:
        return sum(self.module_params(m, key) for key in self.modules)

    def part_params(self, m: ModelShape) -> dict[str, int]:
        """Parameters by part (:data:`PARTS`; the parts it has)."""
        out = dict.fromkeys(PARTS, 0)
        for key in self.modules:
            out[part_of(key[1])] += self.module_params(m, key)
        return {p: n for p, n in out.items() if n}

    def decode_params(self, m: ModelShape, tokens: int = 1) -> int:
        """Parameters a decode step with ``tokens`` tokens of this adapter reads in full: all
        but an embedding LoRA's A, which is gathered by token id (a few rows); a fused module's
        LoRA as the engine holds it, split into its parts (A once per part, B by rows); of an
        expert module only the experts the tokens route to, at most
        ``min(adapted experts, tokens x top-k)`` (its largest ranks)."""
        r_embed = self.modules.get((VOCAB_LAYER, EMBED_TOKENS), 0)
        read = m.experts_read(tokens)
        total = 0
        for key, r in self.modules.items():
            split = sum(sum(m.dims(q)) for q in ALL_FUSED.get(key[1], (key[1],)))
            ranks = self.expert_ranks.get(key)
            total += split * (r if ranks is None else sum(sorted(ranks, reverse=True)[:read]))
        return total - r_embed * m.vocab_size


PER_EXPERT_NOTE = (
    "experts counted per expert (the layout PEFT saves where experts are linears, "
    "transformers 4); PEFT on transformers 5 trains these targets on the packed experts "
    "instead (target_parameters, gate_up_proj at rank 2r: slots of 2r rows)"
)
"""The note on a per-expert adapter priced from its config alone (no weights file)."""


def _is_all_linear(targets: Any) -> bool:
    return isinstance(targets, str) and targets.lower() == "all-linear"


def _sparse_layer_modules(
    settings: LoraSettings, m: ModelShape, layer: int, a: AdapterShape
) -> None:
    """Add the router and expert modules of sparse ``layer`` the config targets, as the loader
    reads the config: the router by ``target_modules`` (``gate``) or ``target_parameters``
    (``mlp.gate.weight``), the packed experts by ``target_parameters``, the per-expert modules
    by ``target_modules`` expert by expert (``all-linear`` as it was while experts and router
    were linears: all of them); packed wins where both name a projection."""
    pre, block, n = f"model.layers.{layer}", m.moe_block, m.num_experts
    router = f"{pre}.{block}.{ROUTER}"
    if settings.is_targeted(router):
        a.modules[(layer, ROUTER)] = int(settings.rank_of(router))
    elif settings.is_param_targeted(f"{pre}.mlp.{ROUTER}.weight"):
        a.modules[(layer, ROUTER)] = int(settings.rank_of(f"{pre}.mlp.{ROUTER}"))
    packed: set[str] = set()
    for param, parts in PACKED_EXPERT_PARAMS.items():
        full = f"{pre}.mlp.experts.{param}"
        if settings.is_param_targeted(full):
            name = PACKED_GATE_UP if len(parts) > 1 else parts[0]
            r = int(settings.rank_of(full))
            a.modules[(layer, name)], a.expert_ranks[(layer, name)] = r, (r,) * n
            a.packed.add((layer, name))
            packed.update(parts)
    for ckpt, proj in EXPERT_CHECKPOINT_NAMES[block].items():
        if proj in packed:
            continue
        keys = [f"{pre}.{block}.experts.{e}.{ckpt}" for e in range(n)]
        ranks = tuple(int(settings.rank_of(k)) if settings.is_targeted(k) else 0 for k in keys)
        if any(ranks):
            a.modules[(layer, proj)], a.expert_ranks[(layer, proj)] = max(ranks), ranks


def adapter_from_config(cfg: dict[str, Any], m: ModelShape, name: str) -> AdapterShape:
    """(layer, module) -> rank for a PEFT LoraConfig (``r``/``rank``, ``target_modules``,
    ``exclude_modules``, ``layers_to_transform``/``layers_pattern``, ``rank_pattern``; on a MoE
    base also ``target_parameters`` on the packed experts and the router) applied to the
    model's layers with the loader's own module selection (``LoraSettings``)."""
    r = cfg.get("r", cfg.get("rank"))
    targets = cfg.get("target_modules")
    params = cfg.get("target_parameters")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise PlanError(f"adapter {name}: rank (r) must be an integer >= 1, got {r!r}")
    if params:
        try:  # the loader's rules for target_parameters
            parse_lora_config({"peft_type": "LORA", "r": r, "target_modules": targets,
                               "target_parameters": params})  # fmt: skip
        except FormatError as e:
            raise PlanError(f"adapter {name}: {e}") from None
        if not m.is_moe:
            raise PlanError(
                f"adapter {name}: target_parameters {params!r} name a mixture-of-experts base's "
                f"experts or router; {m.name} is a dense model"
            )
    elif not (isinstance(targets, str) or (isinstance(targets, list) and targets)):
        raise PlanError(f"adapter {name}: target_modules must be a string or a non-empty list")
    layers = cfg.get("layers_to_transform")
    wanted = [layers] if isinstance(layers, int) else (layers or [])
    if not set(wanted) <= set(range(m.num_layers)):
        raise PlanError(
            f"adapter {name}: layers_to_transform {sorted(wanted)} beyond the model's "
            f"{m.num_layers} layers"
        )
    settings = LoraSettings.of({**cfg, "r": r, "target_modules": targets or []})
    a = AdapterShape(name, {})
    sparse = set(m.sparse)
    try:
        for v in VOCAB_MODULES:
            full = vocab_module_key(v)
            if settings.is_targeted(full):
                a.modules[(VOCAB_LAYER, v)] = int(settings.rank_of(full))
        for layer in range(m.num_layers):
            for p in m.adapter_projs:
                if layer in sparse and p not in ATTN_PROJ_NAMES:
                    continue  # a sparse layer has a router and experts in place of the MLP
                full = module_key(layer, p)
                if settings.is_targeted(full):
                    a.modules[(layer, p)] = int(settings.rank_of(full))
            if layer in sparse:
                _sparse_layer_modules(settings, m, layer, a)
    except (re.error, TypeError, ValueError) as e:
        raise PlanError(
            f"adapter {name}: bad target_modules / exclude_modules / rank_pattern ({e})"
        ) from None
    if not a.modules:
        what = f"target_modules {targets!r}"
        what += f" / target_parameters {params!r}" if params else ""
        raise PlanError(
            f"adapter {name}: {what} match none of the model's modules "
            f"({', '.join(m.adapter_names)}): this adapter would change nothing"
        )
    if a.expert_layout in ("per_expert", "mixed"):
        a.notes.append(PER_EXPERT_NOTE)
    return a


def _header_experts(header: dict[str, TensorInfo], m: ModelShape, a: AdapterShape) -> None:
    """Replace the router and per-expert modules of an ``all-linear`` adapter on a MoE base
    (which the loader serves if present and does not require) by those its weights hold, ranks
    from the A shapes."""
    moe_layers = set(m.sparse)
    for key in [k for k in a.expert_ranks if k not in a.packed]:
        del a.modules[key], a.expert_ranks[key]
    for key in [k for k in a.modules if k[1] == ROUTER]:
        del a.modules[key]
    ranks: dict[tuple[int, str], list[int]] = {}
    for key, t in header.items():
        if (hit := EXPERT_KEY_RE.match(key)) is not None and hit["ab"] == "A":
            layer, e = int(hit["layer"]), int(hit["expert"])
            proj = EXPERT_CHECKPOINT_NAMES[hit["block"]].get(hit["proj"])
            if proj is not None and layer in moe_layers and e < m.num_experts:
                ranks.setdefault((layer, proj), [0] * m.num_experts)[e] = int(t.shape[0])
        elif (hit := ROUTER_KEY_RE.match(key)) is not None and hit["ab"] == "A":
            if int(hit["layer"]) in moe_layers:
                a.modules[(int(hit["layer"]), ROUTER)] = int(t.shape[0])
    for key, rs in ranks.items():
        if key not in a.expert_ranks:  # packed wins, as in the config
            a.modules[key], a.expert_ranks[key] = max(rs), tuple(rs)


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        return safetensors_header(path)
    except (OSError, SafetensorsError) as e:
        raise PlanError(f"cannot read the safetensors header of {path}: {e}") from None


def _safetensors_stats(
    path: Path | dict[str, TensorInfo], text_only: bool = False
) -> tuple[int, int]:
    """(LoRA parameters, their bytes) from a safetensors header (no tensor data read); on a
    multimodal base's language model, of the text backbone only (what is served)."""
    header = _read_header(path) if isinstance(path, Path) else path
    lora = [
        t
        for key, t in header.items()
        if "lora_" in key and not (text_only and OTHER_TOWER_RE.match(key))
    ]
    return sum(math.prod(t.shape) for t in lora), sum(t.nbytes for t in lora)


def adapter_from_path(spec: str, m: ModelShape) -> AdapterShape:
    """A PEFT directory, its adapter_config.json, or a JSON manifest (``r``/``rank`` and
    ``target_modules``, or an ``adapter_config`` / ``config`` object holding them)."""
    p = Path(spec)
    cfg_path = p / CONFIG_NAME if p.is_dir() else p
    if not cfg_path.is_file():
        raise PlanError(f"--adapter {spec!r}: no such PEFT directory or JSON file")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{cfg_path} is not a JSON object")
    for key in ("adapter_config", "config"):
        if "r" not in cfg and "rank" not in cfg and isinstance(cfg.get(key), dict):
            cfg = cfg[key]
    name = p.name if p.is_dir() else cfg_path.stem
    a = adapter_from_config(cfg, m, name)
    weights = cfg_path.parent / SAFETENSORS_NAME
    if weights.is_file():
        header = _read_header(weights)
        a.notes = [n for n in a.notes if n != PER_EXPERT_NOTE]  # the weights say what is there
        if m.is_moe and _is_all_linear(cfg.get("target_modules")):
            _header_experts(header, m, a)
        a.file_params, a.file_bytes = _safetensors_stats(header, m.text_only)
        if a.file_params != a.params(m):
            a.notes.append(
                f"its weights hold {a.file_params:,} LoRA parameters but its config on this "
                f"model gives {a.params(m):,}: made for another base model?"
            )
    return a


# -- the plan --------------------------------------------------------------------------------------
def _slot_params(m: ModelShape, modules: Sequence[str], rank: int) -> int:
    """Parameters of a slot of ``rank`` rows for ``modules`` (engine names) in every layer
    that has them (an expert module's ``E x rank`` rows) and ``embed_tokens`` / ``lm_head``."""
    wanted = set(modules)
    out = sum(rank * sum(m.dims(p)) for p in VOCAB_MODULES if p in wanted)
    for layer in range(m.num_layers):
        out += sum(
            rank * sum(m.dims(p)) * m.experts_of(p) for p in m.layer_projs(layer) if p in wanted
        )
    return out


def build_plan(
    m: ModelShape,
    adapters: Sequence[AdapterShape],
    *,
    dtype: str | None = None,
    max_lora_rank: int | None = None,
    device_budget: int | None = None,
    slots: int | None = None,
    num_adapters: int | None = None,
    host_budget: int | None = None,
    disk_budget: int | None = None,
    decode_k: Sequence[int] = (1, 2, 4, 8, 16, 32),
    decode_batch: int = DEFAULT_DECODE_BATCH,
    quantization: str | None = None,
    quantization_group_size: int | None = None,
) -> dict[str, Any]:
    """Every number of the report as a JSON-able dict (bytes as integers). ``quantization``:
    the base's projections quantized (``QUANT_BITS``); embedding, norms and LM head stay in
    ``dtype``, adapters and KV too."""
    if quantization is not None and quantization not in QUANT_BITS:
        raise PlanError(f"unknown quantization {quantization!r}; valid: {', '.join(QUANT_BITS)}")
    if not adapters:
        raise PlanError("no adapters: give --adapter or --rank/--targets")
    dt = dtype or (m.dtype if m.dtype in DTYPE_BYTES else "bfloat16")
    if dt not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {dt!r}; valid: {', '.join(DTYPE_BYTES)}")
    if decode_batch < 1:
        raise PlanError(f"--decode-batch must be >= 1, got {decode_batch}")
    b = DTYPE_BYTES[dt]
    qb = projection_bytes_per_param(quantization, quantization_group_size, b)

    def base_bytes(params: int, linear: int) -> int:
        """Bytes of ``params`` base weights of which ``linear`` are projections."""
        return int((params - linear) * b + linear * qb)

    def read_bytes(tokens: int) -> int:
        linear = m.linear_params() - m._idle_expert_params(tokens)
        return base_bytes(m.decode_read_params(tokens), linear)

    rows = []
    for a in adapters:
        params = a.params(m)
        parts = {p: n * b for p, n in a.part_params(m).items()}
        rows.append({
            "name": a.name, "rank": a.max_rank, "targets": a.targets, "layers": a.layers,
            "params": params, "bytes": params * b, "decode_bytes": a.decode_params(m) * b,
            "parts": parts, "experts_share": parts.get("experts", 0) / (params * b),
            "expert_layout": a.expert_layout, "adapted_experts": a.adapted_experts,
            "file_params": a.file_params, "file_bytes": a.file_bytes, "notes": a.notes,
        })  # fmt: skip
    max_rank = max_lora_rank or max(a.max_rank for a in adapters)
    if max_rank < max(a.max_rank for a in adapters):
        raise PlanError(f"--max-lora-rank {max_rank} is below an adapter's rank")
    # a slot holds the parts of a fused module (the engine splits its LoRA), every expert of an
    # expert module
    held = {q for a in adapters for p in a.targets for q in ALL_FUSED.get(p, (p,))}
    order = (*VOCAB_MODULES, *PROJ_NAMES, ROUTER, *EXPERT_PROJ_NAMES)
    union = [p for p in order if p in held]
    slot_params = _slot_params(m, union, max_rank)
    slot_bytes = slot_params * b
    # loraplex serve's bank: rows for every module, whatever the adapters target
    vocab_slot_bytes = _slot_params(m, VOCAB_MODULES, max_rank) * b
    engine_slot_bytes = _slot_params(m, order, max_rank) * b
    engine_expert_slot_bytes = _slot_params(m, EXPERT_PROJ_NAMES, max_rank) * b
    kv_tok = m.kv_bytes_per_token(b)
    mean_bytes = sum(r["bytes"] for r in rows) / len(rows)
    device: dict[str, Any] = {
        "max_lora_rank": max_rank,
        "slot_targets": union,
        "slot_params": slot_params,
        "slot_bytes": slot_bytes,
        "engine_slot_bytes": engine_slot_bytes,
        "engine_vocab_slot_bytes": vocab_slot_bytes,
        "engine_expert_slot_bytes": engine_expert_slot_bytes,
        "engine_router_slot_bytes": _slot_params(m, (ROUTER,), max_rank) * b,
        "kv_bytes_per_token": kv_tok,
        "kv_tokens_per_slot": slot_bytes / kv_tok,
    }
    if device_budget is not None:
        n = device_budget // slot_bytes
        device.update(budget=device_budget, slots_in_budget=n,
                      kv_tokens_forgone=n * slot_bytes / kv_tok)  # fmt: skip
    if slots is not None:
        device.update(slots=slots, slots_bytes=slots * slot_bytes,
                      slots_kv_tokens_forgone=slots * slot_bytes / kv_tok)  # fmt: skip
    storage: dict[str, Any] = {"mean_adapter_bytes": mean_bytes}
    if num_adapters is not None:
        storage.update(num_adapters=num_adapters, host_bytes_needed=num_adapters * mean_bytes)
        files = [r["file_bytes"] or r["bytes"] for r in rows]
        storage["disk_bytes_needed"] = num_adapters * sum(files) / len(files)
    if host_budget is not None:
        storage.update(host_budget=host_budget, adapters_in_host=int(host_budget // mean_bytes))
    if disk_budget is not None:
        storage.update(disk_budget=disk_budget, adapters_on_disk=int(disk_budget // mean_bytes))

    def mean_decode(tokens: int) -> float:
        return sum(a.decode_params(m, tokens) for a in adapters) * b / len(adapters)

    drows = []
    for k in decode_k:
        # one token per adapter: k tokens; a full batch: decode_batch tokens (at least k) shared
        # evenly by the k adapters
        base_k, extra_k = read_bytes(k), k * mean_decode(1)
        full = max(decode_batch, k)
        base_full = read_bytes(full)
        extra_full = k * mean_decode(-(-full // k))
        drows.append({
            "k": k, "base_bytes": base_k, "extra_bytes": extra_k, "share_of_base": extra_k / base_k,
            "base_bytes_full_batch": base_full, "extra_bytes_full_batch": extra_full,
            "share_of_base_full_batch": extra_full / base_full,
        })  # fmt: skip
    decode: dict[str, Any] = {
        "base_bytes_per_step": read_bytes(1),
        "decode_batch": decode_batch,
        "base_bytes_full_batch": read_bytes(decode_batch),
        "rows": drows,
    }
    model: dict[str, Any] = {
        **asdict(m),
        "head_dim": m.hd,
        "params": m.params(),
        "weight_bytes": base_bytes(m.params(), m.linear_params()),
        "dtype": dt,
        "quantization": quantization,
        "projection_bytes_per_param": qb,
    }
    if m.is_moe:
        model.update(
            sparse_layers=list(m.sparse),
            active_params=m.active_params(),
            active_weight_bytes=base_bytes(
                m.active_params(), m.linear_params() - m._idle_expert_params(1)
            ),
            expert_weight_bytes=int(len(m.sparse) * m.num_experts * m.expert_params() * qb),
        )
        decode["experts_read_per_layer"] = {
            "one_token": m.experts_read(1), "full_batch": m.experts_read(decode_batch),
        }  # fmt: skip
    return {"model": model, "adapters": rows, "device": device, "storage": storage,
            "decode": decode}  # fmt: skip


def _h(n: float) -> str:
    """Bytes for people: 13.0 MiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _parts_line(r: dict[str, Any]) -> str:
    """An adapter's bytes by part, the experts' share of them said plainly."""
    parts = ", ".join(f"{PART_NAMES[p]} {_h(n)}" for p, n in r["parts"].items())
    line = f"{'':<24}  parts: {parts}"
    if "experts" in r["parts"]:
        layout = {"packed": "packed target_parameters", "mixed": "packed and per-expert"}.get(
            r["expert_layout"], "per-expert keys"
        )
        line += (
            f" ({r['adapted_experts']} experts per expert module, {layout}); "
            f"experts: {100 * r['experts_share']:.0f}% of this adapter's bytes"
        )
    return line


def render_plan(plan: dict[str, Any]) -> str:
    m, d, s, dec = plan["model"], plan["device"], plan["storage"], plan["decode"]
    moe = m["num_experts"] > 0
    inter = f"intermediate {m['intermediate_size']}"
    if moe:
        n_sparse = len(m["sparse_layers"])
        dense = m["num_layers"] - n_sparse
        inter = (
            f"{n_sparse} sparse layer{'s' * (n_sparse != 1)} of {m['num_experts']} experts "
            f"(top-{m['num_experts_per_tok']}, intermediate {m['moe_intermediate_size']})"
            + (f" and {dense} dense (intermediate {m['intermediate_size']})" if dense else "")
        )
    out = [
        f"model {m['name']}: {m['num_layers']} layers, hidden {m['hidden_size']}, heads "
        f"{m['num_heads']}/{m['num_kv_heads']} kv x {m['head_dim']}, {inter}, vocab "
        f"{m['vocab_size']}; {m['params']:,} parameters = {_h(m['weight_bytes'])} in {m['dtype']}"
        + (
            f" with {m['quantization']} projections ({m['projection_bytes_per_param']:.3f} "
            "bytes a weight; embedding, norms and head in the dtype)"
            if m.get("quantization")
            else ""
        ),
    ]
    if moe:
        out.append(
            f"  experts: {_h(m['expert_weight_bytes'])} of the weights; a token reads "
            f"{m['active_params']:,} parameters ({_h(m['active_weight_bytes'])}: "
            f"{m['num_experts_per_tok']} of {m['num_experts']} experts per sparse layer)"
        )
    out += ["", f"{'adapter':<24}{'rank':>5}{'layers':>7}{'parameters':>14}{'bytes':>12}  targets"]
    for r in plan["adapters"]:
        out.append(
            f"{r['name'][:24]:<24}{r['rank']:>5}{r['layers']:>7}{r['params']:>14,}"
            f"{_h(r['bytes']):>12}  {','.join(r['targets'])}"
        )
        if moe and set(r["parts"]) & {"router", "experts"}:
            out.append(_parts_line(r))
        if r["file_bytes"] is not None:
            out.append(f"{'':<24}  file: {r['file_params']:,} parameters, {_h(r['file_bytes'])}")
        out += [f"{'':<24}  note: {n}" for n in r["notes"]]
    serve = f"loraplex serve allocates {_h(d['engine_slot_bytes'])} per slot (every projection"
    if moe:
        serve += (
            f", the router ({_h(d['engine_router_slot_bytes'])}) and all {m['num_experts']} "
            f"experts of each expert projection ({_h(d['engine_expert_slot_bytes'])})"
        )
    out += [
        "",
        f"device slot (rank {d['max_lora_rank']}, {','.join(d['slot_targets'])}): "
        f"{_h(d['slot_bytes'])} = {d['kv_tokens_per_slot']:.1f} KV-cache tokens "
        f"({_h(d['kv_bytes_per_token'])}/token)",
        f"{serve}, and {_h(d['engine_vocab_slot_bytes'])} for embed_tokens + lm_head)",
    ]
    if "budget" in d:
        out.append(
            f"device budget {_h(d['budget'])}: {d['slots_in_budget']} slots, forgoing "
            f"{d['kv_tokens_forgone']:,.0f} KV tokens"
        )
    if "slots" in d:
        out.append(
            f"{d['slots']} slots: {_h(d['slots_bytes'])}, forgoing "
            f"{d['slots_kv_tokens_forgone']:,.0f} KV tokens"
        )
    if "num_adapters" in s:
        out.append(
            f"{s['num_adapters']:,} adapters: host {_h(s['host_bytes_needed'])}, disk "
            f"{_h(s['disk_bytes_needed'])}"
        )
    if "host_budget" in s:
        out.append(f"host budget {_h(s['host_budget'])}: {s['adapters_in_host']:,} adapters")
    if "disk_budget" in s:
        out.append(f"disk budget {_h(s['disk_budget'])}: {s['adapters_on_disk']:,} adapters")
    out.append("")
    if not moe:
        out += [
            f"decode step: base weights read {_h(dec['base_bytes_per_step'])}; k distinct "
            "adapters in the batch add:",
            f"{'k':>6}{'extra bytes':>14}{'of base':>10}",
        ]
        for r in dec["rows"]:
            out.append(f"{r['k']:>6}{_h(r['extra_bytes']):>14}{100 * r['share_of_base']:>9.2f}%")
        return "\n".join(out)
    e, topk, batch = m["num_experts"], m["num_experts_per_tok"], dec["decode_batch"]
    out += [
        f"decode step: a token reads {topk} of {e} experts per sparse layer, a step of T tokens "
        f"at most min({e}, T x {topk}) (an upper bound: each token taken to choose experts no "
        "other token chose)",
        f"base weights read: one token {_h(dec['base_bytes_per_step'])}; a full batch of {batch} "
        f"tokens ({dec['experts_read_per_layer']['full_batch']} experts per sparse layer) "
        f"{_h(dec['base_bytes_full_batch'])}",
        "k distinct adapters in the batch add (one token each: a batch of k tokens; full batch: "
        f"its {batch} tokens shared evenly by the k adapters, each reading the LoRA of the "
        "experts its tokens choose):",
        f"{'k':>6}{'base read':>12}{'extra bytes':>14}{'of base':>10}"
        f"{'batch base':>13}{'batch extra':>13}{'of base':>10}",
    ]
    for r in dec["rows"]:
        out.append(
            f"{r['k']:>6}{_h(r['base_bytes']):>12}{_h(r['extra_bytes']):>14}"
            f"{100 * r['share_of_base']:>9.2f}%{_h(r['base_bytes_full_batch']):>13}"
            f"{_h(r['extra_bytes_full_batch']):>13}{100 * r['share_of_base_full_batch']:>9.2f}%"
        )
    return "\n".join(out)


# -- CLI -------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loraplex plan",
        description="Capacity planner: adapter bytes, device slots vs KV-cache tokens, host/disk "
        "budgets, decode byte model.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--model", required=True, help=f"model dir, config.json, or {', '.join(PRESETS)}"
    )
    p.add_argument("--adapter", action="append", default=[], metavar="PATH",
                   help="PEFT dir / adapter_config.json / JSON manifest (repeatable)")  # fmt: skip
    p.add_argument(
        "--rank", type=positive_int, help="a synthetic adapter of this rank (with --targets)"
    )
    p.add_argument("--targets", default="q_proj,v_proj",
                   help="with --rank: modules, comma-separated, or all-linear (on a MoE base "
                   "gate_proj,up_proj,down_proj / w1,w3,w2 adapt every expert, gate the "
                   "router)")  # fmt: skip
    p.add_argument("--target-parameters", default="", metavar="P,P,...",
                   help="with --rank on a MoE base: PEFT target_parameters, e.g. "
                   "mlp.experts.gate_up_proj,mlp.experts.down_proj,mlp.gate.weight")  # fmt: skip
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), help="default: the model's")
    p.add_argument(
        "--quantization",
        choices=list(QUANT_BITS),
        help="the base's projections quantized (GPTQ/AWQ/W4A16: int4; W8A8: int8)",
    )
    p.add_argument(
        "--quantization-group-size",
        type=positive_int,
        metavar="N",
        help="int4 columns per scale (default 128)",
    )
    p.add_argument("--max-lora-rank", type=positive_int, help="slot rank (default: the largest)")
    p.add_argument(
        "--device-budget", type=byte_size, metavar="BYTES", help="e.g. 2GiB for adapters"
    )
    p.add_argument(
        "--slots", type=positive_int, help="device slots (max_loras) to price in KV tokens"
    )
    p.add_argument("--num-adapters", type=positive_int, help="adapters to keep on host and disk")
    p.add_argument("--host-budget", type=byte_size, metavar="BYTES")
    p.add_argument("--disk-budget", type=byte_size, metavar="BYTES")
    p.add_argument(
        "--decode-k", type=positive_ints, default=[1, 2, 4, 8, 16, 32], metavar="K,K,..."
    )
    p.add_argument("--decode-batch", type=positive_int, default=DEFAULT_DECODE_BATCH,
                   metavar="T", help="tokens of a full decode batch, for a MoE base's experts "
                   "read (default: %(default)s, the engine's --max-num-seqs)")  # fmt: skip
    p.add_argument("--json", action="store_true")
    return p


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    """``loraplex plan``: 0 on success, 2 on bad input."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else 2
    try:
        m = load_model(args.model)
        adapters = [adapter_from_path(a, m) for a in args.adapter]
        if args.rank is not None:
            t = args.targets.strip()
            targets: str | list[str] = t if t == "all-linear" else _csv(t)
            cfg: dict[str, Any] = {"r": args.rank, "target_modules": targets}
            if _csv(args.target_parameters):
                cfg["target_parameters"] = _csv(args.target_parameters)
            adapters.append(adapter_from_config(cfg, m, f"r{args.rank}"))
        plan = build_plan(
            m,
            adapters,
            dtype=args.dtype,
            max_lora_rank=args.max_lora_rank,
            device_budget=args.device_budget,
            slots=args.slots,
            num_adapters=args.num_adapters,
            host_budget=args.host_budget,
            disk_budget=args.disk_budget,
            decode_k=args.decode_k,
            decode_batch=args.decode_batch,
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
        )
    except PlanError as e:
        print(f"loraplex plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=1) if args.json else render_plan(plan))
    return 0
