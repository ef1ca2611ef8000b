"""The decoder skeleton every architecture shares: embedding, layers, final norm, LM head,
over a flattened token batch with paged KV (loading its weights from a checkpoint:
``model/loading.py``).

Base GEMMs run once per step for all tokens (q/k/v and gate/up fused); each adapted projection
then adds its gathered LoRA delta for the tokens of every adapter in the batch.

An architecture is a subclass (one short file) that says only how it differs: its checkpoint
names (``layer_weights``, ``checkpoint_name``), its ``config.json`` extras (``config_fields``,
``config_class``), its norm (``norm_class``), q/k norm (``qk_norm``), attention scale, rotary
per layer (``layer_rotaries``) and, where the residual wiring differs, ``run_layers``; tensors
the common loader does not know (a MoE's experts) it takes itself (``take_tensor``,
``check_own_tensors``, ``build_own``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from loraplex.kv.cache import PagedKVCache, StateShape
from loraplex.kv.groups import Window, kind_order
from loraplex.lora.plan import LoRABatchPlan
from loraplex.model.attention import AttentionMetadata
from loraplex.model.layer_ops import LayerOps, select_layer_ops
from loraplex.model.layers import (
    Attention,
    DecoderLayer,
    FeedForward,
    GatedMLP,
    LayerStep,
    ProjectionGroup,
    RMSNorm,
    RotaryEmbedding,
    attention_groups,
    make_rotary,
    mlp_groups,
)
from loraplex.model.linear import Linear, LinearFactory
from loraplex.model.lora_binding import LoRABinding
from loraplex.model.quant.formats import QuantSpec
from loraplex.model.quant.kernels import QuantKernels
from loraplex.model.quant.weights import QuantizedEmbedding, QuantWeight
from loraplex.model.spec import ModelConfig
from loraplex.model.tensor_parallel.sharding import ShardLayout, TensorParallel
from loraplex.types import ModelLoadError


@dataclass
class ForwardBatch:
    """Tensors for one engine step; tokens of one adapter are contiguous (see the runner)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows whose next-token logits are needed
    lora_plan: LoRABatchPlan | None = None
    logits_lora_plan: LoRABatchPlan | None = None  # lora_plan over the S logits rows (lm_head)


LINEAR_SLOTS = ("qkv", "o", "gate_up", "down")
"""The fused Linear slots of a layer, in forward order (the attributes ``projection_groups``
names and the merger swaps)."""

LLAMA_LAYER_WEIGHTS: Mapping[str, tuple[str, int]] = {
    "input_layernorm": ("ln1", 0),
    "post_attention_layernorm": ("ln2", 0),
    "self_attn.q_proj": ("qkv", 0),
    "self_attn.k_proj": ("qkv", 1),
    "self_attn.v_proj": ("qkv", 2),
    "self_attn.o_proj": ("o", 0),
    "mlp.gate_proj": ("gate_up", 0),
    "mlp.up_proj": ("gate_up", 1),
    "mlp.down_proj": ("down", 0),
}
"""Checkpoint module under ``model.layers.N.`` -> (``DecoderLayer`` slot, part of the slot):
parts of one slot are concatenated in part order (q, k, v -> ``qkv``); its ``.weight`` and
``.bias`` tensors load into the slot's weight and bias."""


class DecoderForCausalLM:
    """Inference-only decoder reading a paged KV cache; the Llama layout unless a subclass
    says otherwise."""

    model_type: ClassVar[str] = "llama"
    """The HF ``model_type`` adapters are checked against (``BaseModelSpec``)."""
    config_class: ClassVar[type[ModelConfig]] = ModelConfig
    layer_weights: ClassVar[Mapping[str, tuple[str, int]]] = LLAMA_LAYER_WEIGHTS
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm
    """Every norm of the model (layers, q/k, final); Gemma's ``(1 + w)`` float32 norm goes here."""
    qk_norm: ClassVar[bool] = False
    """Per-head RMSNorm of q and k before RoPE (``q_norm`` and ``k_norm`` slots)."""
    attention_class: ClassVar[type[Attention]] = Attention
    """The attention block (a subclass changes how q and k are positioned: ``position_qk``)."""
    supports_quantization: ClassVar[bool] = True
    """Whether quantized projections load (a MoE's experts have no quantized path yet)."""
    supports_quantized_checkpoints: ClassVar[bool] = True
    """Whether a quantized checkpoint's format loads too, beyond ``--quantization int8/int4``
    at load (an architecture whose own projections no format reader knows: Qwen3.5's)."""
    supports_tensor_parallel: ClassVar[bool] = True
    """Whether the weights shard over tensor-parallel ranks."""
    own_quant_methods: ClassVar[frozenset[str]] = frozenset()
    """``quantization_config.quant_method`` values whose tensors the architecture reads itself
    (``take_tensor``, dequantizing at load: GPT-OSS's MXFP4 experts); the base then loads as a
    float one."""

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        """``ModelConfig`` fields this architecture reads its own way from its text config
        ``c`` (they replace the common parse's values; new fields need a ``config_class``).
        Raise ModelLoadError naming the field for a value it cannot serve."""
        return {}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        per_layer = self.layer_rotaries()
        assert len(per_layer) == cfg.num_layers, "layer_rotaries: one rotary per layer"
        # cos/sin once per step for each distinct rotary; a layer without one (NoPE) reads none
        self.rotaries = list({id(r): r for r in per_layer if r is not None}.values())
        index = {id(r): j for j, r in enumerate(self.rotaries)}
        windows = self.layer_windows()
        assert len(windows) == cfg.num_layers, "layer_windows: one window per layer"
        self.windows: tuple[Window, ...] = tuple(
            sorted({w for w in windows if w is not None}, key=kind_order)
        )
        """The distinct sliding windows (and attention chunks) of the layers (the runner builds
        each one's masks once per step; a layer's ``window`` indexes them)."""
        self.layers = [
            DecoderLayer(
                None if r is None else index[id(r)], None if w is None else self.windows.index(w)
            )
            for r, w in zip(per_layer, windows, strict=True)
        ]
        self.ops: LayerOps = select_layer_ops(dtype, device)
        """Norms with the residual, rotary, activation and decode attention (C on CPU)."""
        self.attn = self.attention_class(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.attention_scale(),
            self.qk_norm,
            self.ops,
            self.attention_softcap(),
        )
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, self.ops)
        self.projection_groups: tuple[ProjectionGroup, ...] = (*self.attn.groups, *self.mlp.groups)
        """Each fused Linear (in forward order), its input width and its projections' output
        columns ``(proj, lo, hi)``: the one map of projections to fused weights (LoRA groups,
        merging)."""
        self._group_parts = tuple(parts for _, _, parts in self.projection_groups)
        self.embed_tokens: torch.Tensor  # [V, D]
        self.norm: RMSNorm
        self.head: Linear
        self.linear_impl = "unset"
        self.make_linear: LinearFactory | None = None
        """The float projections' Linear factory chosen at load (the merger builds with it)."""
        self.make_projection: Callable[[Any, torch.Tensor | None], Linear] | None = None
        """The projections' factory: ``make_linear``, or on a quantized base the quantized
        kernels' for a quantized weight (:meth:`own_projection` builds with it)."""
        self.lora: LoRABinding | None = None
        self.quant: QuantSpec | None = None
        """The base's quantization (a checkpoint format, or int8/int4 at load); None: float."""
        self.quant_kernels: QuantKernels | None = None
        self.tp: TensorParallel | None = None
        """This rank's shard plan and process group (None: the whole model on one device);
        ``cfg`` then holds the rank's heads and MLP width, ``full_cfg`` the checkpoint's."""
        self.full_cfg = cfg
        self._gather_logits: Callable[[torch.Tensor], torch.Tensor] = _same

    # -- what an architecture may change -----------------------------------------------------
    def layer_rotaries(self) -> list[RotaryEmbedding | None]:
        """The rotary embedding of each layer: one shared instance per distinct rope (an
        architecture with local and global bases returns two instances, each layer its own);
        None for a layer without positional rotation (NoPE: its q and k attend as projected)."""
        c = self.cfg
        rot = make_rotary(c.head_dim, c.rope_theta, c.rope_scaling, self.dtype, self.device)
        return [rot] * c.num_layers

    def attention_scale(self) -> float:
        """The softmax scale of attention scores."""
        return self.cfg.head_dim**-0.5

    def attention_softcap(self) -> float | None:
        """The soft cap of attention scores (``tanh(s / cap) * cap`` before the mask; None:
        uncapped, the SDPA path)."""
        return None

    def layer_windows(self) -> list[Window]:
        """Each layer's sliding window or attention chunk (``loraplex.kv.groups.Chunked``;
        None: global attention): :meth:`windows_of` its config."""
        return self.windows_of(self.cfg)

    @classmethod
    def windows_of(cls, c: ModelConfig) -> list[Window]:
        """Each layer's sliding window under config ``c`` (None: global attention), by
        transformers' rule: with a ``sliding_window``, the ``sliding_attention`` layers of
        ``layer_types`` where config.json lists them, else the layers from
        ``max_window_layers`` on (Qwen2/3), else every layer (Mistral)."""
        if c.sliding_window is None:
            return [None] * c.num_layers
        raw = c.raw.get("text_config", c.raw) if "hidden_size" not in c.raw else c.raw
        types = raw.get("layer_types")
        if types:
            return [c.sliding_window if t == "sliding_attention" else None for t in types]
        first = int(raw.get("max_window_layers") or 0)
        return [c.sliding_window if i >= first else None for i in range(c.num_layers)]

    def state_layers(self) -> tuple[int, ...]:
        """The layers that keep a recurrent state per sequence instead of KV (linear
        attention; they form the KV cache's state groups); none for an attention model."""
        return ()

    def state_shape(self) -> StateShape | None:
        """The per-sequence state of one of ``state_layers`` (None: no such layers)."""
        return None

    @classmethod
    def serves(cls, text: Mapping[str, Any]) -> bool:
        """Whether this class serves text config ``text`` of its architecture (a variant
        under another class's name, ``registry.VARIANTS``, says when it does)."""
        return True

    def layer_weights_of(self, layer: int) -> Mapping[str, tuple[str, int]]:
        """``layer_weights`` of one layer (a MoE layer has no dense MLP: its sparse block's
        tensors are the architecture's own, see ``take_tensor``)."""
        return self.layer_weights

    def take_tensor(
        self, key: str, read: Callable[[], torch.Tensor], shape: tuple[int, ...]
    ) -> bool:
        """Load checkpoint tensor ``key`` (canonical name, ``shape``) the architecture's own way
        and return True, or False to leave it to the common loader. ``read()`` reads it in the
        model's dtype (``read(dtype=None)``: as stored, e.g. packed uint8 codes). Every tensor comes
        here first (a MoE's experts and router)."""
        return False

    def check_own_tensors(self, src: object) -> None:
        """Raise ModelLoadError naming what ``take_tensor`` still misses (after the last
        tensor); nothing to check for a dense architecture."""

    def build_own(self) -> None:
        """Build the modules of the tensors ``take_tensor`` kept, once the common ones are
        built (``make_linear`` is set); nothing for a dense architecture."""

    def own_projection(self, weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> Linear:
        """A projection of the architecture's own tensors (``build_own``; ``name`` names it in
        an error), quantized under ``--quantization int8/int4`` as the common ones are."""
        make, spec = self.make_projection, self.quant
        assert make is not None
        if spec is None or not spec.on_the_fly:
            return make(weight, bias)
        try:
            return make(QuantWeight.quantize(weight, spec.bits or 8, spec.group_size), bias)
        except ValueError as e:
            raise ModelLoadError(f"--quantization {spec.label}: {name}: {e}") from e

    def row_parallel_blocks(self) -> tuple[Any, ...]:
        """The blocks whose outputs are summed over tensor-parallel ranks (their ``reduce``)."""
        return (self.attn, self.mlp)

    # -- tensor parallelism: how this architecture's tensors cut over the ranks. Each default
    #    is the Llama-shaped cut of ``model/tensor_parallel/sharding.py``; an architecture with
    #    tensors of its own overrides them for those and defers to these for the rest.
    @classmethod
    def shard_config(cls, cfg: ModelConfig, layout: ShardLayout) -> ModelConfig:
        """The config of rank ``layout.rank``'s shard (its blocks, KV cache and slot tables
        are built from it); ModelLoadError naming a field that does not split."""
        return layout.local_config(cfg)

    def whole_projection_groups(self, layer: int) -> tuple[ProjectionGroup, ...]:
        """``layer_projection_groups`` as the whole checkpoint has them (a rank's ``cfg`` has
        only its cut): the shapes its tensors are checked against and where each part of a
        fused slot starts."""
        c = self.full_cfg
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return (
            *attention_groups(c.hidden_size, q, kv),
            *mlp_groups(c.hidden_size, c.intermediate_size),
        )

    def shard_slot(
        self, layer: int, slot: str, kind: str, t: torch.Tensor, offsets: dict[str, int]
    ) -> torch.Tensor | None:
        """This rank's part of fused slot ``slot``'s whole ``kind`` tensor in ``layer`` (None:
        a row-parallel bias on a rank other than 0); ``offsets``: each part's first column."""
        assert self.tp is not None
        return self.tp.shard_slot(slot, kind, t, self.full_cfg, offsets)

    def lora_shard_shape(self, key: tuple[int, str], dims: tuple[int, int]) -> tuple[int, int]:
        """The rank's ``(d_in, d_out)`` of LoRA module ``key`` (layer, module) whose cut by
        ``cfg`` is ``dims``."""
        assert self.tp is not None
        return self.tp.lora_shape(key[1], dims, self.full_cfg)

    def shard_lora(
        self, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of LoRA module ``key`` from the adapter's whole A and B."""
        assert self.tp is not None
        return self.tp.shard_lora(key[1], a, b, self.full_cfg)

    def checkpoint_name(self, name: str) -> str | None:
        """The canonical name (``model/loading.py``'s ``TOP_WEIGHTS`` or
        ``model.layers.N.<module>.<weight|bias>``) of checkpoint tensor ``name``, or None to
        skip it (rotary buffers; a multimodal checkpoint's other towers)."""
        return None if name.endswith("rotary_emb.inv_freq") else name

    def layer_projection_groups(self, layer: int) -> tuple[ProjectionGroup, ...]:
        """``projection_groups`` of ``layer`` (Gemma 4's full-attention layers have wider
        heads than its sliding ones): what its checkpoint tensors and merges are shaped by."""
        return self.projection_groups

    def layer_norm_dims(self, layer: int) -> dict[str, int]:
        """``norm_dims`` of ``layer`` (its q/k norms are its own head size)."""
        return self.norm_dims(self.cfg)

    @classmethod
    def norm_dims(cls, c: ModelConfig) -> dict[str, int]:
        """Width of each norm slot of ``layer_weights`` (the shape check of its weight)."""
        return {
            "ln1": c.hidden_size,
            "ln2": c.hidden_size,
            "q_norm": c.head_dim,
            "k_norm": c.head_dim,
        }

    @classmethod
    def layer_norm_widths(cls, c: ModelConfig) -> tuple[int, ...]:
        """The width of every norm weight of a layer, in ``layer_weights`` order (the byte
        model's count: ``ModelConfig.layer_norm_widths``)."""
        slots = dict.fromkeys(s for s, _ in cls.layer_weights.values() if s not in LINEAR_SLOTS)
        dims = cls.norm_dims(c)
        return tuple(dims[s] for s in slots)

    # -- forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Run all layers for the batch; returns float32 logits [S, vocab] at logits_indices."""
        h = self.hidden_states(batch, cache)  # [T, D]
        return self.compute_logits(h[batch.logits_indices], batch.logits_lora_plan)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding lookup: input_ids [T] -> [T, D]."""
        return self.embed_tokens[input_ids]

    @torch.inference_mode()
    def compute_logits(
        self, h: torch.Tensor, lora_plan: LoRABatchPlan | None = None
    ) -> torch.Tensor:
        """Final norm and LM head over last-layer hidden states.  h: [N, D] -> float32 [N, V].
        ``lora_plan`` (over the N rows, ``plan_rows`` of the step's): the head's LoRA, added to
        the float32 logits before anything else is done to them."""
        x = self.norm(h)  # [N, D]
        logits = self.head(x).float()  # [N, V] (this rank's vocabulary rows under TP)
        if lora_plan is not None and self.lora is not None:
            self.lora.add_logits(x, logits, lora_plan)
        return self._gather_logits(logits)

    def logits_at(
        self, h: torch.Tensor, rows: torch.Tensor, lora_plan: LoRABatchPlan | None = None
    ) -> torch.Tensor:
        """``compute_logits(h[rows], lora_plan)``: the step's logits of hidden-state ``rows``
        (one call for every rank of a tensor-parallel model, which all index alike)."""
        return self.compute_logits(h[rows], lora_plan)

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Run all layers for the batch (writing its KV); returns the last layer's hidden
        states [T, D] before the final norm, for every token (prompt logprobs need them all)."""
        for r in self.rotaries:  # LongRoPE picks its factor set per sequence; others ignore it
            r.begin_step(batch.positions, batch.attn)
        rope = [r.cos_sin(batch.positions) for r in self.rotaries]
        step = LayerStep(cache, batch.attn, rope, batch.input_ids, batch.positions)
        h = self.embed(batch.input_ids)  # [T, D]
        lora, plan = self.lora, batch.lora_plan
        if lora is not None and plan is not None:
            step.lora, step.plan = lora, plan
            step.lora_qkv, step.lora_o, step.lora_gate_up, step.lora_down = lora.active(
                plan, self._group_parts
            )
            lora.add_embedding(batch.input_ids, h, plan)  # the lookup's own (never a tied head's)
        return self.run_layers(h, step)  # [T, D]

    def run_layers(self, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """The layer stack's residual wiring (pre-norm): h: [T, D] -> [T, D]."""
        return pre_norm_stack(self, h, step, [self.mlp] * len(self.layers))

    def use_layer_ops(self, ops: LayerOps) -> None:
        """Run the layers on ``ops`` from now on (benchmarks and tests compare them)."""
        self.ops = self.attn.ops = self.mlp.ops = ops

    @property
    def nbytes(self) -> int:
        """Bytes of the weights as loaded (embedding, norms, projections, head)."""
        table = getattr(self.embed_tokens, "table", self.embed_tokens)  # a rank's VocabShard
        shared = getattr(self.head, "weight", None) is table  # tied and unpacked
        if isinstance(self.embed_tokens, QuantizedEmbedding):  # tied: one int8 matrix
            source, head_q = self.embed_tokens.source, getattr(self.head, "quant", None)
            shared = source is self.head or (
                isinstance(source, QuantWeight)
                and isinstance(head_q, QuantWeight)
                and head_q.q.data_ptr() == source.q.data_ptr()
            )
        total = self.embed_tokens.nbytes + self.norm.nbytes + (0 if shared else self.head.nbytes)
        return total + sum(L.nbytes for L in self.layers)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def pre_norm_stack(
    model: DecoderForCausalLM,
    h: torch.Tensor,
    step: LayerStep,
    ffns: list[FeedForward],
    post: tuple[str, str] | None = None,
    mixers: list[FeedForward] | None = None,
) -> torch.Tensor:
    """Pre-norm wiring: ``h += attn(ln1(h)); h += ffn_i(ln2(h))`` per layer ``i``, each residual
    add fused with the norm after it (``LayerOps.add_norm``; the last add has none); ``post``:
    the layer's norms of the attention and feed-forward outputs by attribute (Gemma's
    ``post_attn``, ``post_mlp``) applied before each add. h: [T, D] -> [T, D] (the embedding
    output, updated in place). ``mixers``: each layer's token mixer where they differ (a
    hybrid's linear-attention layers; default: ``model.attn`` for every layer)."""
    ops, layers = model.ops, model.layers
    mix = mixers or [model.attn] * len(layers)
    h, x = ops.add_norm(h, None, layers[0].ln1)
    for i, (L, ffn) in enumerate(zip(layers, ffns, strict=True)):
        a = mix[i](L, i, x, step)
        h, x = ops.add_norm(h, a if post is None else getattr(L, post[0])(a), L.ln2)
        m = ffn(L, i, x, step)
        if post is not None:
            m = getattr(L, post[1])(m)
        if i + 1 == len(layers):
            return h + m
        h, x = ops.add_norm(h, m, layers[i + 1].ln1)
    return h
