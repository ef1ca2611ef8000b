"""The decoder skeleton every architecture shares: embedding, layers, final norm, LM head,
over a flattened token batch with paged KV, and loading from an HF safetensors checkpoint.

Base GEMMs run once per step for all tokens (q/k/v and gate/up fused); each adapted projection
then adds its gathered LoRA delta for the tokens of every adapter in the batch.

An architecture is a subclass (one short file) that says only how it differs: its checkpoint
names (``layer_weights``, ``checkpoint_name``), its ``config.json`` extras (``config_fields``,
``config_class``), its norm (``norm_class``), q/k norm (``qk_norm``), attention scale, rotary
per layer (``layer_rotaries``) and, where the residual wiring differs, ``run_layers``.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from loraplex.kv.cache import PagedKVCache
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
from loraplex.model.linear import Linear, LinearFactory, select_linear_factory
from loraplex.model.loader import iter_checkpoint
from loraplex.model.lora_binding import LoRABinding
from loraplex.model.quant.formats import QuantSpec, is_quantized_tensor, unpack_projection
from loraplex.model.quant.kernels import QuantKernels
from loraplex.model.quant.weights import FP8Weight, QuantizedEmbedding, QuantWeight
from loraplex.model.spec import ModelConfig
from loraplex.model.tensor_parallel.sharding import TensorParallel, VocabShard
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

TOP_WEIGHTS = {
    "model.embed_tokens.weight": "embed_tokens",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
}
"""Canonical names of the tensors outside the layers (see ``checkpoint_name``)."""

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)\.([A-Za-z_]+)")


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
    supports_quantization: ClassVar[bool] = True
    """Whether quantized projections load (a MoE's experts have no quantized path yet)."""
    supports_tensor_parallel: ClassVar[bool] = True
    """Whether the weights shard over tensor-parallel ranks (a MoE's experts do not yet)."""

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
        self.rotaries = list({id(r): r for r in per_layer}.values())  # cos/sin once per step each
        index = {id(r): j for j, r in enumerate(self.rotaries)}
        windows = self.layer_windows()
        assert len(windows) == cfg.num_layers, "layer_windows: one window per layer"
        self.windows: tuple[int, ...] = tuple(sorted({w for w in windows if w is not None}))
        """The distinct sliding windows of the layers (the runner builds each one's masks once
        per step; a layer's ``window`` indexes them)."""
        self.layers = [
            DecoderLayer(index[id(r)], None if w is None else self.windows.index(w))
            for r, w in zip(per_layer, windows, strict=True)
        ]
        self.ops: LayerOps = select_layer_ops(dtype, device)
        """Norms with the residual, rotary, activation and decode attention (C on CPU)."""
        self.attn = Attention(
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
        self._load_groups = self.projection_groups  # the checkpoint's shapes (whole under TP)
        self._load_offsets: dict[str, int] = {}  # a projection's first column in its slot
        self.embed_tokens: torch.Tensor  # [V, D]
        self.norm: RMSNorm
        self.head: Linear
        self.linear_impl = "unset"
        self.make_linear: LinearFactory | None = None
        """The float projections' Linear factory chosen at load (the merger builds with it)."""
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
    def layer_rotaries(self) -> list[RotaryEmbedding]:
        """The rotary embedding of each layer: one shared instance per distinct rope (an
        architecture with local and global bases returns two instances, each layer its own)."""
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

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: global attention), by transformers' rule: with a
        ``sliding_window``, the ``sliding_attention`` layers of ``layer_types`` where config.json
        lists them, else the layers from ``max_window_layers`` on (Qwen2/3), else every layer
        (Mistral)."""
        c = self.cfg
        if c.sliding_window is None:
            return [None] * c.num_layers
        raw = c.raw.get("text_config", c.raw) if "hidden_size" not in c.raw else c.raw
        types = raw.get("layer_types")
        if types:
            return [c.sliding_window if t == "sliding_attention" else None for t in types]
        first = int(raw.get("max_window_layers") or 0)
        return [c.sliding_window if i >= first else None for i in range(c.num_layers)]

    def layer_weights_of(self, layer: int) -> Mapping[str, tuple[str, int]]:
        """``layer_weights`` of one layer (a MoE layer has no dense MLP: its sparse block's
        tensors are the architecture's own, see ``take_tensor``)."""
        return self.layer_weights

    def take_tensor(
        self, key: str, read: Callable[[], torch.Tensor], shape: tuple[int, ...]
    ) -> bool:
        """Load checkpoint tensor ``key`` (canonical name, ``shape``) the architecture's own way
        and return True, or False to leave it to the common loader. ``read()`` reads it in the
        model's dtype. Every tensor comes here first (a MoE's experts and router)."""
        return False

    def check_own_tensors(self, src: object) -> None:
        """Raise ModelLoadError naming what ``take_tensor`` still misses (after the last
        tensor); nothing to check for a dense architecture."""

    def checkpoint_name(self, name: str) -> str | None:
        """The canonical name (``TOP_WEIGHTS`` or ``model.layers.N.<module>.<weight|bias>``)
        of checkpoint tensor ``name``, or None to skip it (rotary buffers; a multimodal
        checkpoint's other towers)."""
        return None if name.endswith("rotary_emb.inv_freq") else name

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

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        quant: QuantSpec | None = None,
        tp: TensorParallel | None = None,
    ) -> DecoderForCausalLM:
        """Load weights tensor by tensor into their final buffers (fusing q/k/v and gate/up);
        missing, unexpected or misshapen tensors raise ModelLoadError naming the tensor.
        ``quant``: the checkpoint's quantization format, or int8/int4 to quantize at load.
        ``tp``: load only this rank's shard (each tensor checked whole, then cut)."""
        if quant is not None and not cls.supports_quantization:
            raise ModelLoadError(
                f"{cfg.architecture}: quantized bases are not supported for this architecture "
                f"({quant.label}); serve its float checkpoint"
            )
        if tp is None:
            model = cls(cfg, dtype, device)
        else:
            model = cls._sharded(cfg, dtype, device, tp, quant)
        model.quant = quant
        top, layers = model._read_checkpoint(Path(model_dir))
        model._build(top, layers)
        return model

    @classmethod
    def _sharded(
        cls,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel,
        quant: QuantSpec | None,
    ) -> DecoderForCausalLM:
        """An empty model of rank ``tp.rank``'s shard (its blocks sum their row-parallel
        outputs over the ranks; its logits are gathered on rank 0)."""
        where = f"--tensor-parallel-size {tp.size}"
        if not cls.supports_tensor_parallel:
            raise ModelLoadError(f"{where}: {cfg.architecture} does not shard yet; use 1")
        if quant is not None:
            raise ModelLoadError(
                f"{where}: quantized bases ({quant.label}) do not shard yet; serve the float "
                "checkpoint, or --tensor-parallel-size 1"
            )
        model = cls(tp.layout.local_config(cfg), dtype, device)
        model.tp, model.full_cfg = tp, cfg
        for block in model.row_parallel_blocks():
            block.reduce = tp.all_reduce
        model._gather_logits = functools.partial(tp.gather_vocab, vocab=cfg.vocab_size)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        model._load_groups = (
            *attention_groups(cfg.hidden_size, q, kv),
            *mlp_groups(cfg.hidden_size, cfg.intermediate_size),
        )
        model._load_offsets = {p: lo for _, _, parts in model._load_groups for p, lo, _ in parts}
        return model

    def row_parallel_blocks(self) -> tuple[Any, ...]:
        """The blocks whose outputs are summed over tensor-parallel ranks (their ``reduce``)."""
        return (self.attn, self.mlp)

    def _shard_slot(self, slot: str, kind: str, t: Any) -> Any:
        """This rank's part of a fused slot's full tensor (as it is on one device)."""
        if self.tp is None or slot not in LINEAR_SLOTS:
            return t
        return self.tp.shard_slot(slot, kind, t, self.full_cfg, self._load_offsets)

    def _read_checkpoint(
        self, model_dir: Path
    ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        """(top-level tensors by attribute, per layer ``{"<slot>.<weight|bias>": tensor}``)."""
        cfg, dtype, device = self.cfg, self.dtype, self.device
        top: dict[str, torch.Tensor] = {}
        layers: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_layers)]
        pending: dict[tuple[int, str], dict[int, torch.Tensor]] = {}  # parts of fused slots
        quantized: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (layer, module) -> tensors
        packed = self.quant if self.quant is not None and not self.quant.on_the_fly else None
        for name, st in iter_checkpoint(model_dir):
            key = self.checkpoint_name(name)
            if key is None or (key == "lm_head.weight" and cfg.tie_word_embeddings):
                continue  # a tied head is the embedding
            shape = tuple(st.entries[name].shape)
            if packed is not None and self._take_quantized(key, st.entries[name].dtype, packed):
                q = _LAYER_TENSOR.fullmatch(key)
                assert q is not None
                quantized.setdefault((int(q.group(1)), q.group(2)), {})[q.group(3)] = st.read(
                    name
                )  # raw dtype: unpacked once all of the module's tensors are in
                continue
            if self.take_tensor(key, functools.partial(st.read, name, dtype, device), shape):
                continue
            if key in TOP_WEIGHTS:
                self._check_shape(st.entries[name].shape, self._top_shape(key), name, model_dir)
                t = st.read(name, dtype, device)
                if self.tp is not None and key != "model.norm.weight":
                    t = self.tp.shard_vocab(t)  # the rank's vocabulary rows
                top[TOP_WEIGHTS[key]] = t
                continue
            m = _LAYER_KEY.fullmatch(key)
            entry = self.layer_weights_of(int(m.group(1))).get(m.group(2)) if m else None
            if m is None or entry is None:
                raise ModelLoadError(
                    f"{model_dir}: unexpected tensor {name!r} for {cfg.architecture}"
                )
            idx, kind = int(m.group(1)), m.group(3)
            if idx >= cfg.num_layers:
                raise ModelLoadError(
                    f"{model_dir}: unexpected tensor {name} (layer {idx} >= {cfg.num_layers})"
                )
            slot, part = entry
            nparts = Counter(s for s, _ in self.layer_weights_of(idx).values())
            want = self._layer_shape(slot, part, nparts[slot], kind, name, model_dir)
            self._check_shape(st.entries[name].shape, want, name, model_dir)
            t = st.read(name, dtype, device)
            if nparts[slot] == 1:
                t = self._shard_slot(slot, kind, t)
                layers[idx][f"{slot}.{kind}"] = self._quantize_at_load(t, slot, kind, name)
                continue
            got = pending.setdefault((idx, f"{slot}.{kind}"), {})
            got[part] = t
            if len(got) == nparts[slot]:
                fused = self._shard_slot(
                    slot, kind, torch.cat([got[p] for p in range(nparts[slot])])
                )
                layers[idx][f"{slot}.{kind}"] = self._quantize_at_load(fused, slot, kind, name)
                del pending[(idx, f"{slot}.{kind}")]
        if packed is not None:
            self._assemble_quantized(packed, quantized, layers, model_dir)
        self._check_complete(top, layers, pending, model_dir)
        self.check_own_tensors(model_dir)
        return top, layers

    def _quantize_at_load(self, t: torch.Tensor, slot: str, kind: str, name: str) -> Any:
        """A projection weight quantized as soon as it is read (``--quantization int8/int4``),
        so a float copy of only one slot is ever resident; anything else as it is."""
        spec = self.quant
        if spec is None or not spec.on_the_fly or kind != "weight" or slot not in LINEAR_SLOTS:
            return t
        try:
            return QuantWeight.quantize(t, spec.bits or 8, spec.group_size)
        except ValueError as e:
            raise ModelLoadError(f"--quantization {spec.label}: {name}: {e}") from e

    def _take_quantized(self, key: str, dtype: str, spec: QuantSpec) -> bool:
        """Whether ``key`` is a tensor of a quantized projection (it is then unpacked with its
        module's others by ``_assemble_quantized``)."""
        m = _LAYER_TENSOR.fullmatch(key)
        if m is None or int(m.group(1)) >= self.cfg.num_layers:
            return False
        entry = self.layer_weights_of(int(m.group(1))).get(m.group(2))
        return (
            entry is not None
            and entry[0] in LINEAR_SLOTS
            and is_quantized_tensor(spec, m.group(3), dtype)
        )

    def _assemble_quantized(
        self,
        spec: QuantSpec,
        quantized: dict[tuple[int, str], dict[str, torch.Tensor]],
        layers: list[dict[str, torch.Tensor]],
        src: object,
    ) -> None:
        """Unpack each quantized projection and fuse a slot's parts (q/k/v, gate/up) into one
        weight in ``layers[i]["<slot>.weight"]``; every part of a slot must be quantized."""
        by_slot: dict[tuple[int, str], dict[int, QuantWeight | FP8Weight]] = {}
        for (idx, module), tensors in quantized.items():
            weights = self.layer_weights_of(idx)
            slot, part = weights[module]
            nparts = sum(1 for s, _ in weights.values() if s == slot)
            n, k = self._layer_shape(slot, part, nparts, "weight", module, src)
            where = f"{src}: model.layers.{idx}.{module}"
            weight = unpack_projection(spec, tensors, n, k, where)
            by_slot.setdefault((idx, slot), {})[part] = weight
        for (idx, slot), parts in by_slot.items():
            modules = [m for m, (s, _) in self.layer_weights_of(idx).items() if s == slot]
            if len(parts) != len(modules):
                plain = [
                    m
                    for m, (s, p) in self.layer_weights_of(idx).items()
                    if s == slot and p not in parts
                ]
                raise ModelLoadError(
                    f"{src}: layer {idx}: {plain} not quantized while the other projections "
                    f"sharing their input are ({spec.label}); loraplex fuses them into one GEMM"
                )
            ordered = [parts[p] for p in sorted(parts)]
            try:
                fused = type(ordered[0]).cat(ordered) if len(ordered) > 1 else ordered[0]  # type: ignore[attr-defined]
            except ValueError as e:
                raise ModelLoadError(f"{src}: layer {idx} {slot}: {e}") from e
            layers[idx][f"{slot}.weight"] = fused  # type: ignore[assignment]

    def _top_shape(self, key: str) -> tuple[int, ...]:
        c = self.full_cfg
        return (c.hidden_size,) if key == "model.norm.weight" else (c.vocab_size, c.hidden_size)

    def _layer_shape(
        self, slot: str, part: int, nparts: int, kind: str, name: str, src: object
    ) -> tuple[int, ...]:
        """The shape config.json implies for part ``part`` of ``slot`` (``nparts`` parts)."""
        group = next((g for g in self._load_groups if g[0] == slot), None)
        if group is None:  # a norm: a weight of its width, never a bias
            if kind != "weight":
                raise ModelLoadError(f"{src}: unexpected tensor {name!r}")
            return (self.norm_dims(self.cfg)[slot],)
        _, d_in, cols = group
        lo, hi = (cols[part][1], cols[part][2]) if nparts == len(cols) else (0, cols[-1][2])
        return (hi - lo, d_in) if kind == "weight" else (hi - lo,)

    @staticmethod
    def _check_shape(shape: tuple[int, ...], want: tuple[int, ...], name: str, src: object) -> None:
        if tuple(shape) != want:
            raise ModelLoadError(
                f"{src}: tensor {name!r} has shape {tuple(shape)}, config.json implies {want}"
            )

    def _check_complete(
        self,
        top: dict[str, torch.Tensor],
        layers: list[dict[str, torch.Tensor]],
        pending: dict[tuple[int, str], dict[int, torch.Tensor]],
        src: object,
    ) -> None:
        """Every tensor the config needs is there: each weight, the biases it asks for, and
        every part of a fused bias the checkpoint started."""
        c = self.cfg
        for key, attr in TOP_WEIGHTS.items():
            if attr not in top and not (attr == "lm_head" and c.tie_word_embeddings):
                raise ModelLoadError(f"{src}: missing tensor {key!r}")
        biased = {"qkv": c.qkv_bias, "o": c.o_bias, "gate_up": c.mlp_bias, "down": c.mlp_bias}
        for idx, have in enumerate(layers):
            missing = []
            for module, (slot, part) in self.layer_weights_of(idx).items():
                for kind in ("weight", "bias"):
                    key = f"{slot}.{kind}"
                    started = pending.get((idx, key))
                    needed = kind == "weight" or biased.get(slot, False) or started is not None
                    if key not in have and needed and part not in (started or {}):
                        missing.append(f"model.layers.{idx}.{module}.{kind}")
            if missing:
                raise ModelLoadError(f"{src}: layer {idx} is missing tensor(s) {missing}")

    def _build(self, top: dict[str, torch.Tensor], layers: list[dict[str, torch.Tensor]]) -> None:
        """Choose the linear implementation once and build every norm and projection."""
        c, norm = self.cfg, self.norm_class
        probe = (2 * c.intermediate_size, c.hidden_size)  # gate/up: the largest projection
        self.linear_impl, make = select_linear_factory(self.device, self.dtype, probe=probe)
        self.make_linear = make
        projection = make
        if self.quant is not None:
            self.quant_kernels = QuantKernels(self.device, self.dtype)
            projection = self._quantized_factory(self.quant, self.quant_kernels, make)
        for L, w in zip(self.layers, layers, strict=True):
            for slot in LINEAR_SLOTS:
                if f"{slot}.weight" in w:  # a MoE layer has no dense gate_up / down
                    weight, bias = w.pop(f"{slot}.weight"), w.pop(f"{slot}.bias", None)
                    setattr(L, slot, projection(weight, bias))
            if self.qk_norm:
                q, k = w.pop("q_norm.weight"), w.pop("k_norm.weight")
                L.qk_norm = norm.per_head(q, k, c.num_heads, c.num_kv_heads, c.rms_norm_eps)
            for key in list(w):
                setattr(L, key.partition(".")[0], norm(w.pop(key), c.rms_norm_eps))
        self.embed_tokens = top["embed_tokens"]
        self.norm = norm(top["norm"], c.rms_norm_eps)
        if self.quant is not None and self.quant.on_the_fly:
            self._quantize_vocab(top)
        else:  # a tied head shares the embedding (a packed backend makes the head its own
            # copy); it stays in the model dtype in a quantized checkpoint, as formats leave it
            self.head = make(top.get("lm_head", self.embed_tokens), None)
        if self.quant_kernels is not None:
            self.linear_impl = f"{self.quant.label}: {self.quant_kernels.summary() or 'dequant'}"
        if self.tp is not None:  # looked up masked and summed over the ranks
            self.embed_tokens = VocabShard(self.embed_tokens, self.tp)  # type: ignore[assignment]

    def _quantize_vocab(self, top: dict[str, torch.Tensor]) -> None:
        """``--quantization int8/int4``: the embedding and the LM head as int8, one scale per
        row (the head's rows are the logits' and the lookup's, so per-row scales keep each
        token's row exact to its own range); a tied pair stays one matrix. These two matrices
        are a large share of a small model's bytes (a quarter of SmolLM2-135M's); int8 keeps
        them at a byte a weight, twice the precision of the projections' int4."""
        assert self.quant_kernels is not None
        emb = QuantWeight.quantize(top.pop("embed_tokens"), 8, None)
        self.embed_tokens = QuantizedEmbedding(emb, self.dtype)  # type: ignore[assignment]
        head = emb if "lm_head" not in top else QuantWeight.quantize(top.pop("lm_head"), 8, None)
        self.head = self.quant_kernels(head)
        if head is emb and getattr(self.head, "quant", None) is None:
            # the head's kernel keeps the matrix only in its own layout: look rows up there
            self.embed_tokens = QuantizedEmbedding(self.head, self.dtype)  # type: ignore[assignment]

    def _quantized_factory(
        self, spec: QuantSpec, kernels: QuantKernels, make: Callable[..., Linear]
    ) -> Callable[[Any, torch.Tensor | None], Linear]:
        """The projections' Linear factory on a quantized base: a quantized weight (the
        checkpoint's, or quantized at load by ``--quantization int8/int4``) goes to its kernel;
        one the checkpoint left in float (``ignore``) stays float."""

        def build(weight: Any, bias: torch.Tensor | None) -> Linear:
            if isinstance(weight, (QuantWeight, FP8Weight)):  # a checkpoint's, or at load
                return kernels(replace(weight, bias=bias))
            return make(weight, bias)  # a projection the checkpoint left in float

        return build

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
        step = LayerStep(cache, batch.attn, rope)
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
) -> torch.Tensor:
    """Pre-norm wiring: ``h += attn(ln1(h)); h += ffn_i(ln2(h))`` per layer ``i``, each residual
    add fused with the norm after it (``LayerOps.add_norm``; the last add has none); ``post``:
    the layer's norms of the attention and feed-forward outputs by attribute (Gemma's
    ``post_attn``, ``post_mlp``) applied before each add. h: [T, D] -> [T, D] (the embedding
    output, updated in place)."""
    ops, attn, layers = model.ops, model.attn, model.layers
    h, x = ops.add_norm(h, None, layers[0].ln1)
    for i, (L, ffn) in enumerate(zip(layers, ffns, strict=True)):
        a = attn(L, i, x, step)
        h, x = ops.add_norm(h, a if post is None else getattr(L, post[0])(a), L.ln2)
        m = ffn(L, i, x, step)
        if post is not None:
            m = getattr(L, post[1])(m)
        if i + 1 == len(layers):
            return h + m
        h, x = ops.add_norm(h, m, layers[i + 1].ln1)
    return h
