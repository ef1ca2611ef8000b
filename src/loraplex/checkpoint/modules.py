"""What a base model's adaptable modules are called and their shapes, by architecture family.

- the seven projections of a Llama-family decoder layer (:data:`PROJ_NAMES`: attention, then
  MLP) under ``model.layers.N.{self_attn,mlp}`` and their ``(d_in, d_out)``
  (:func:`projection_shapes`); the fused modules of checkpoints that concatenate some of them
  (Phi-3's ``qkv_proj`` / ``gate_up_proj``: :data:`FUSED_PROJ_NAMES`, by ``model_type``);
- the two modules outside the layers, the token embedding and the LM head, keyed
  ``(VOCAB_LAYER, name)`` (:data:`EMBED_KEY`, :data:`LM_HEAD_KEY`) wherever modules are keyed
  ``(layer, name)`` (adapters, slot tables, merging);
- a mixture-of-experts block: its router (:data:`ROUTER`), its experts as loraplex keys them
  (:data:`EXPERT_PROJ_NAMES`) and as checkpoints name them (:data:`EXPERT_CHECKPOINT_NAMES`,
  transformers 5's packed parameters :data:`PACKED_EXPERT_PARAMS`);
- :class:`BaseModelSpec` / :class:`MoESpec`: all of it for one base, from its ``config.json``.

The model (building and loading a decoder) and the adapter side (checking an adapter against
the base it is served on) both read these facts here. No torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from loraplex.checkpoint import gemma4_layers

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
LINEAR_ATTN_PROJ_NAMES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
"""The projections of a Gated DeltaNet linear-attention layer (``linear_attn``: Qwen3.5,
Qwen3-Next): q/k/v before the convolution, the output gate z, the write strength b, the decay
input a, and the output; they stand where a full layer's attention projections do."""
GATED_Q_MODEL_TYPES = frozenset(
    ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
)
"""Model types whose ``q_proj`` also yields a per-head output gate (``[2 q, hidden]``: each
head's query, then its gate)."""


PER_LAYER_INPUT_PROJ_NAMES = ("per_layer_input_gate", "per_layer_projection")
"""Gemma 4's per-layer input modules, directly under ``model.layers.N`` (no block): the gate
``[P, hidden]`` into the per-layer stream and the projection ``[hidden, P]`` back out."""
PER_LAYER_MODEL_PROJECTION = "per_layer_model_projection"
"""Gemma 4's projection of the scaled embeddings into every layer's per-layer input
(``model.per_layer_model_projection`` ``[layers * P, hidden]``), outside the layers: keyed
``(VOCAB_LAYER, name)`` like the embedding and the head."""


def block_of(proj: str) -> str:
    """The submodule of a decoder layer that holds ``proj``: ``self_attn``, ``linear_attn``,
    ``mlp``, or "" for a module directly under the layer (:data:`PER_LAYER_INPUT_PROJ_NAMES`)."""
    if proj in PER_LAYER_INPUT_PROJ_NAMES:
        return ""
    if proj in ATTN_PROJ_NAMES:
        return "self_attn"
    return "linear_attn" if proj in LINEAR_ATTN_PROJ_NAMES else "mlp"


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


def module_key(layer: int, proj: str, prefix: str = "model.", mlp: str = "mlp") -> str:
    """The module name PEFT matches its patterns against: ``model.layers.3.mlp.up_proj``
    (``mlp``: the MLP block's name, Llama 4's ``feed_forward``; Gemma 4's per-layer input
    modules sit directly under the layer)."""
    block = block_of(proj)
    if not block:
        return f"{prefix}layers.{layer}.{proj}"
    return f"{prefix}layers.{layer}.{mlp if block == 'mlp' else block}.{proj}"


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
OUTER_MODULES = (*VOCAB_MODULES, PER_LAYER_MODEL_PROJECTION)
"""Every adaptable module outside the decoder layers (a base has those its
``BaseModelSpec.vocab_shapes`` names)."""
VOCAB_LAYER = -1
"""The layer index of :data:`OUTER_MODULES` in ``(layer, name)`` module keys."""
EMBED_KEY = (VOCAB_LAYER, EMBED_TOKENS)
LM_HEAD_KEY = (VOCAB_LAYER, LM_HEAD)


def vocab_module_shapes(vocab_size: int, hidden: int) -> dict[str, tuple[int, int]]:
    """name -> (d_in, d_out) of the two vocabulary-wide modules: the embedding maps a token
    (one of ``vocab_size``) to ``hidden`` features, the head the other way round."""
    return {EMBED_TOKENS: (vocab_size, hidden), LM_HEAD: (hidden, vocab_size)}


def vocab_module_key(name: str, prefix: str = "model.") -> str:
    """The module name PEFT matches its patterns against: ``model.embed_tokens``, ``lm_head``
    (the head sits beside the decoder, outside ``prefix``)."""
    return name if name == LM_HEAD else f"{prefix}{name}"


def per_layer_input_shapes(
    raw: Mapping[str, Any], shapes: Mapping[str, tuple[int, int]]
) -> tuple[tuple[dict[str, tuple[int, int]], ...], dict[str, tuple[int, int]]]:
    """Where a text config makes layers differ (Gemma 4): each layer's adaptable modules, and
    the modules outside the layers beyond the vocabulary's, from ``shapes`` (a layer's seven
    projections) and each layer's head size, KV heads and MLP width
    (``checkpoint.gemma4_layers.layer_geometry``). With per-layer inputs
    (``hidden_size_per_layer_input`` P > 0) each layer has :data:`PER_LAYER_INPUT_PROJ_NAMES`
    and the model :data:`PER_LAYER_MODEL_PROJECTION`; the last ``num_kv_shared_layers`` layers
    have no ``k_proj`` / ``v_proj``, and with ``attention_k_eq_v`` the full layers no
    ``v_proj``. ``((), {})`` where every layer has ``shapes``."""

    if raw.get("model_type") != gemma4_layers.MODEL_TYPE:
        return (), {}
    ple = int(raw.get("hidden_size_per_layer_input") or 0)
    shared = int(raw.get("num_kv_shared_layers") or 0)
    n, d, heads = (
        int(raw["num_hidden_layers"]),
        int(raw["hidden_size"]),
        int(raw["num_attention_heads"]),
    )
    extra = {"per_layer_input_gate": (d, ple), "per_layer_projection": (ple, d)} if ple else {}
    layers = []
    tied = gemma4_layers.values_from_keys(raw)
    for i, (hd, kvh, inter) in enumerate(gemma4_layers.layer_geometry(raw)):
        own = {**projection_shapes(d, heads, kvh, hd, inter), **extra}
        drop = ("k_proj", "v_proj") if i >= n - shared else ("v_proj",) if tied[i] else ()
        layers.append({p: dims for p, dims in own.items() if p not in drop})
    if all(layer == dict(shapes) for layer in layers):
        return (), {}
    outer = {PER_LAYER_MODEL_PROJECTION: (d, n * ple)} if ple else {}
    return tuple(layers), outer


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
    "feed_forward": {"gate_proj": "experts.gate_proj", "up_proj": "experts.up_proj",
                     "down_proj": "experts.down_proj"},
    "": {"gate_proj": "experts.gate_proj", "up_proj": "experts.up_proj",
         "down_proj": "experts.down_proj"},
}  # fmt: skip
"""The sparse block's name in checkpoints and adapters -> its per-expert module names ->
loraplex's (Qwen-MoE's ``mlp.experts.{e}.gate_proj``; Mixtral's ``block_sparse_moe.experts.{e}.w1``
with ``w1`` gate, ``w3`` up, ``w2`` down; Llama 4 names its MLP blocks ``feed_forward``; "": the
experts directly under the layer, Gemma 4's, packed only)."""
PACKED_EXPERT_PARAMS: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("experts.gate_proj", "experts.up_proj"),
    "down_proj": ("experts.down_proj",),
}
"""transformers 5's packed 3-D expert parameters (``mlp.experts.gate_up_proj [E, 2 I, hidden]``,
gate rows then up rows; ``mlp.experts.down_proj [E, hidden, I]``), PEFT's ``target_parameters``
-> the expert projections they hold."""
SHARED_EXPERT_PROJ_NAMES = (
    "shared_expert.gate_proj",
    "shared_expert.up_proj",
    "shared_expert.down_proj",
)
"""A sparse block's shared expert (a gated MLP every token runs, added to the routed output:
Llama 4, Qwen2/3.5-MoE), adaptable as ordinary linears under ``mlp.shared_expert``."""
SHARED_EXPERT_GATE = "shared_expert_gate"
"""The shared expert's gate ``[1, hidden]`` (Qwen-MoE's), under the sparse block; PEFT's
``all-linear`` adapts it."""


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
    shared_intermediate: int = 0
    """The shared expert's width (0: none)."""
    packed_in_out: bool = False
    """The packed expert parameters are stored ``[E, d_in, d_out]`` (Llama 4's
    ``gate_up_proj [E, hidden, 2 I]``, ``down_proj [E, I, hidden]``), not ``[E, d_out, d_in]``;
    PEFT's ``target_parameters`` factors then swap roles (``A`` expands, ``B`` shrinks)."""
    router_name: str = ROUTER
    """The router's module name under the block (Llama 4: ``router``; loraplex keys it
    :data:`ROUTER` whatever it is called)."""
    shared_gate: bool = False
    """Whether a one-output linear gates the shared expert (:data:`SHARED_EXPERT_GATE`,
    Qwen-MoE's ``sigmoid(shared_expert_gate(x))``), adaptable as any linear."""
    gate_up_interleaved: bool = False
    """The packed ``gate_up_proj`` interleaves gate and up (GPT-OSS: ``[E, hidden, 2 I]``, gate
    the even columns, up the odd ones), and so does its LoRA's ``B``: gate's rows are ``B[0::2]``,
    up's ``B[1::2]``."""
    dense_mlp: bool = False
    """The sparse layers keep their dense MLP beside the sparse block (Gemma 4's: both run on
    the same residual), so an adapter names both its projections and the block's."""
    packed_only: bool = False
    """No transformers version has per-expert modules for this family (Qwen3.5-MoE and GPT-OSS
    came with transformers 5's packed experts; Llama 4's and Gemma 4's are packed too): a
    saved ``target_modules`` naming ``gate_proj`` (the shared expert's) never meant experts."""

    @property
    def per_expert_modules(self) -> bool:
        """Whether an adapter may name each expert's projections (older transformers' layout)."""
        return not (self.packed_only or self.packed_in_out or not self.block)

    def under(self, name: str, block: str | None = None) -> str:
        """``name`` as a layer's submodule: under ``block`` (default: :attr:`block`), or
        directly under the layer where the block is "" (Gemma 4's ``router.proj``,
        ``experts``)."""
        block = self.block if block is None else block
        return f"{block}.{name}" if block else name

    @property
    def mlp_block(self) -> str:
        """The MLP block's name in transformers 5 (a dense layer's, and the sparse block's
        over its packed parameters, what ``target_parameters`` name): ``mlp`` for every MoE
        (Mixtral's ``block_sparse_moe`` too) but Llama 4 (``feed_forward``)."""
        return "mlp" if self.block in ("block_sparse_moe", "") else self.block

    @property
    def v5_block(self) -> str:
        """Where transformers 5 puts the sparse block's packed experts and router:
        :attr:`mlp_block`, or "" (directly under the layer) for Gemma 4's."""
        return self.block and self.mlp_block

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """The router's and each expert projection's ``(d_in, d_out)`` (per expert), and the
        shared expert's projections when there is one."""
        h, i, s = self.hidden, self.intermediate, self.shared_intermediate
        shared = dict(zip(SHARED_EXPERT_PROJ_NAMES, ((h, s), (h, s), (s, h)), strict=True))
        return {
            ROUTER: (h, self.num_experts),
            "experts.gate_proj": (h, i),
            "experts.up_proj": (h, i),
            "experts.down_proj": (i, h),
            **(shared if s else {}),
            **({SHARED_EXPERT_GATE: (h, 1)} if self.shared_gate else {}),
        }

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any]) -> MoESpec | None:
        """The sparse blocks of a Qwen2/3-MoE, Qwen3.5-MoE, Mixtral, GPT-OSS, Llama 4 or
        Gemma 4 text ``config.json`` (None for a dense one): ``num_experts`` / ``num_local_experts``, ``moe_intermediate_size``,
        ``decoder_sparse_step`` and ``mlp_only_layers`` (Llama 4: ``moe_layers`` or
        ``interleave_moe_layer_step``, a shared expert as wide as an expert, experts packed
        ``[E, in, out]``) as transformers reads them."""
        mtype = str(raw.get("model_type", ""))
        if mtype in ("llama4_text", "llama4"):
            n, num_layers = int(raw.get("num_local_experts") or 16), int(raw["num_hidden_layers"])
            step = int(raw.get("interleave_moe_layer_step") or 1)
            moe = raw.get("moe_layers")
            layers = tuple(moe) if moe is not None else tuple(range(step - 1, num_layers, step))
            inter = int(raw["intermediate_size"])
            hidden = int(raw["hidden_size"])
            return cls(n, layers, hidden, inter, "feed_forward", inter, True, "router")
        if mtype == "gpt_oss":  # every layer sparse, experts of intermediate_size, interleaved
            n = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
            layers = tuple(range(int(raw["num_hidden_layers"])))
            return cls(n, layers, int(raw["hidden_size"]), int(raw["intermediate_size"]),
                       gate_up_interleaved=True, packed_only=True)  # fmt: skip
        if mtype == gemma4_layers.MODEL_TYPE:  # enable_moe_block: every layer, beside the MLP
            if not raw.get("enable_moe_block"):
                return None
            n, layers = int(raw.get("num_experts") or 0), range(int(raw["num_hidden_layers"]))
            return cls(n, tuple(layers), int(raw["hidden_size"]),
                       int(raw.get("moe_intermediate_size") or 0), "", router_name="router.proj",
                       dense_mlp=True)  # fmt: skip
        if mtype == "mixtral":
            n = int(raw.get("num_local_experts") or 8)
            layers = tuple(range(int(raw["num_hidden_layers"])))
            inter = int(raw["intermediate_size"])
            return cls(n, layers, int(raw["hidden_size"]), inter, "block_sparse_moe")
        if mtype in ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next"):  # every layer sparse
            n = int(raw.get("num_experts") or 0)
            shared = int(raw.get("shared_expert_intermediate_size") or 0)
            layers = tuple(range(int(raw["num_hidden_layers"]))) if n > 0 else ()
            inter = int(raw["moe_intermediate_size"])
            return cls(
                n, layers, int(raw["hidden_size"]), inter, shared_intermediate=shared,
                shared_gate=shared > 0, packed_only=True,
            )  # fmt: skip
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


LAYER_MODULE_ORDER = (
    *PROJ_NAMES[:4],
    *LINEAR_ATTN_PROJ_NAMES,
    *PROJ_NAMES[4:],
    *PER_LAYER_INPUT_PROJ_NAMES,
    ROUTER,
    *EXPERT_PROJ_NAMES,
    *SHARED_EXPERT_PROJ_NAMES,
    SHARED_EXPERT_GATE,
)
"""Every module a layer may adapt, in table order (a layer's token mixer, then its MLP or
sparse block)."""


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The Gated DeltaNet layers of a hybrid base (``layer_types: linear_attention``)."""

    layers: tuple[int, ...]
    hidden: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    kernel: int

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """Each linear-attention projection's ``(d_in, d_out)``."""
        h, k, v, hv = self.hidden, self.key_heads * self.key_dim, self.value_heads * self.value_dim, self.value_heads  # fmt: skip
        return {
            "in_proj_qkv": (h, 2 * k + v),
            "in_proj_z": (h, v),
            "in_proj_b": (h, hv),
            "in_proj_a": (h, hv),
            "out_proj": (v, h),
        }

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any]) -> LinearAttentionSpec | None:
        """The linear-attention layers of a text ``config.json`` (None: no such layers)."""
        types = raw.get("layer_types") or []
        layers = tuple(i for i, t in enumerate(types) if t == "linear_attention")
        if not layers:
            return None
        return cls(
            layers, int(raw["hidden_size"]), int(raw["linear_num_key_heads"]),
            int(raw["linear_num_value_heads"]), int(raw["linear_key_head_dim"]),
            int(raw["linear_value_head_dim"]), int(raw.get("linear_conv_kernel_dim") or 4),
        )  # fmt: skip


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
    adapter's tensors on the other towers (``lora.peft.tensors.OTHER_TOWER_RE``) are skipped,
    as vLLM does; they never touch a text-only forward."""
    moe: MoESpec | None = None
    """The sparse blocks of a mixture-of-experts base (None: dense): in its ``moe.layers`` an
    adapter names the router and the experts instead of the dense MLP's projections."""
    linear: LinearAttentionSpec | None = None
    """The linear-attention layers of a hybrid base (None: attention only): in its
    ``linear.layers`` an adapter names the linear-attention projections instead of q/k/v/o."""
    layer_modules: tuple[dict[str, tuple[int, int]], ...] = ()
    """Each layer's modules where layers differ (:func:`per_layer_input_shapes`); empty: every
    layer has :attr:`adapter_shapes` (or a MoE or linear-attention layer's)."""

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
        # the dense MLP's width (Llama 4's intermediate_size is an expert's)
        # Llama 4's dense layers: intermediate_size_mlp; a MoE without dense layers (Qwen3.5-MoE)
        # has no intermediate_size: its experts' width stands in
        inter = int(
            raw.get("intermediate_size_mlp")
            or raw.get("intermediate_size")
            or raw["moe_intermediate_size"]
        )
        shapes = projection_shapes(hidden, heads, kv_heads, head_dim, inter)
        if str(raw.get("model_type", model_type)) in GATED_Q_MODEL_TYPES:
            shapes["q_proj"] = (hidden, 2 * heads * head_dim)  # each head's query and gate
        vocab = raw.get("vocab_size")
        vocab_shapes = vocab_module_shapes(int(vocab), hidden) if vocab else {}
        moe = MoESpec.from_hf_config(raw)
        linear = LinearAttentionSpec.from_hf_config(raw)
        layers, outer = per_layer_input_shapes(raw, shapes)
        if vocab_shapes:
            vocab_shapes.update(outer)
        n = int(raw["num_hidden_layers"])
        return cls(n, shapes, model_type, vocab_shapes, text_only, moe, linear, layers)

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        """The modules an adapter may name in ``layer`` -> (d_in, d_out) (an expert
        projection's are one expert's): attention, then the dense MLP or the sparse block (or
        both: ``MoESpec.dense_mlp``)."""
        sparse = self.moe is not None and layer in self.moe.layers
        shapes = self.layer_modules[layer] if self.layer_modules else self.adapter_shapes
        if self.moe is not None and sparse and self.moe.dense_mlp:  # the block beside the MLP
            return {**shapes, **self.moe.shapes}
        if self.layer_modules:
            return shapes
        linear = self.linear is not None and layer in self.linear.layers
        if not linear and not sparse:
            return shapes
        attn = {p: d for p, d in shapes.items() if p in ATTN_PROJ_NAMES}
        mlp = {p: d for p, d in shapes.items() if p not in ATTN_PROJ_NAMES}
        if linear:
            assert self.linear is not None
            attn = self.linear.shapes
        if sparse:
            assert self.moe is not None
            mlp = self.moe.shapes
        return {**attn, **mlp}
