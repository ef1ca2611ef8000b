"""Gemma 4 (text): Gemma 3's layers (four ``x * w`` norms, GeGLU, scaled embeddings, five
sliding layers per full one) with these differences, as transformers' ``modeling_gemma4``:

- every norm is ``(x / rms(x)) * w`` in float32 (no ``1 +``: ``Float32ScaleRMSNorm``);
- attention scores are not scaled (scale 1: the q/k norms set their size); v is RMS-normed
  too, without a weight;
- the full-attention layers rotate with the ``proportional`` rope (``partial_rotary_factor``
  0.25 of each head, frequencies over the whole head), the sliding ones with default RoPE,
  each from ``rope_parameters[layer type]``;
- per-layer inputs (``hidden_size_per_layer_input`` P > 0): a second stream beside the
  residual, computed once per step from the token ids and the scaled embeddings::

      tok = embed_tokens_per_layer[ids] * sqrt(P)                       # [T, L, P]
      ctx = norm_P(per_layer_model_projection(h0) * D ** -0.5)            # [T, L, P]
      per_layer = (ctx + tok) * 2 ** -0.5

  and after each layer's MLP: ``h += norm(per_layer_projection(gelu(per_layer_input_gate(h))
  * per_layer[:, i]))``, then ``h *= layer_scalar`` (a checkpoint scalar per layer);
- KV sharing (``num_kv_shared_layers``): the last layers have no k/v projections; each
  attends over the KV of the last earlier layer of its type (it writes none);
- ``attention_k_eq_v`` (the 31B): the full layers have no v projection; their values are the
  keys' projection before the k norm (then v-normed), over ``num_global_key_value_heads``;
- layers of their own shape (``checkpoint.gemma4_layers.layer_geometry``): the full-attention
  layers' heads are ``global_head_dim`` wide (512 beside the sliding layers' 256 in the
  released models; ``per_layer_config`` in transformers 5's saves), and with
  ``use_double_wide_mlp`` the KV-sharing layers' MLP is twice as wide. One attention block and
  one MLP block per distinct shape; the KV cache holds each layer in its own shape;
- the final logit soft-cap applies to ``Gemma4ForConditionalGeneration`` too.

Tensor parallelism cuts each layer by its own heads (its own head size and KV heads: a KV
head count below the ranks is replicated, per layer) and its own MLP width, as the Llama cut
does; the q/k norms (per head) and the layer scalars stay whole. A KV-sharing layer's q keeps
the rank's heads and reads the rank's KV heads of its source layer, which the same per-layer
rule chose. The per-layer stream stays whole on every rank, computed redundantly from the
(whole) residual after the row-parallel all-reduces, so it is added once; only its
vocabulary-sized table ``embed_tokens_per_layer`` is vocab-cut (looked up masked and summed
over the ranks, as the embedding). LoRA on the per-layer projections is whole on every rank.

``Gemma4ForConditionalGeneration`` serves its language model (``model.language_model.*``);
the vision and audio towers and their embedders are skipped. The MoE block (``enable_moe_block``,
the 26B-A4B) is ``model/gemma4_moe.py``'s (the registry picks that class from config.json; each
layer's feed-forward output is :meth:`Gemma4ForCausalLM.feed_forward`). Refused at start-up,
naming the field: ``per_layer_config`` overrides other than head size and KV heads,
bidirectional attention over everything, and a per-layer vocabulary smaller than the model's;
quantized bases are refused too, and under tensor parallelism a layer whose KV heads do not
split over the ranks.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from loraplex.checkpoint import gemma4_layers
from loraplex.checkpoint.gemma4_layers import FULL, SLIDING
from loraplex.checkpoint.modules import (
    PER_LAYER_INPUT_PROJ_NAMES,
    PER_LAYER_MODEL_PROJECTION,
    VOCAB_LAYER,
    per_layer_input_shapes,
    projection_shapes,
)
from loraplex.model.attention import paged_attention
from loraplex.model.decoder import LLAMA_LAYER_WEIGHTS
from loraplex.model.gemma import _SKIPPED_PREFIXES, Gemma3ForCausalLM, GemmaConfig
from loraplex.model.layers import (
    ACTIVATIONS,
    Attention,
    DecoderLayer,
    GatedMLP,
    LayerStep,
    ProjectionGroup,
    RotaryEmbedding,
    attention_groups,
    make_rotary,
    mlp_groups,
)
from loraplex.model.linear import Linear
from loraplex.model.norms import Float32ScaleRMSNorm
from loraplex.model.quant.weights import QuantizedEmbedding, QuantWeight
from loraplex.model.spec import ModelConfig
from loraplex.model.tensor_parallel.sharding import ShardLayout, TensorParallel, VocabShard
from loraplex.types import ModelLoadError

GEMMA4_LAYER_WEIGHTS: Mapping[str, tuple[str, int]] = {
    **LLAMA_LAYER_WEIGHTS,
    "input_layernorm": ("ln1", 0),
    "post_attention_layernorm": ("post_attn", 0),
    "pre_feedforward_layernorm": ("ln2", 0),
    "post_feedforward_layernorm": ("post_mlp", 0),
    "self_attn.q_norm": ("q_norm", 0),  # [head_dim], applied per head
    "self_attn.k_norm": ("k_norm", 0),
}
SHARED_KV_LAYER_WEIGHTS: Mapping[str, tuple[str, int]] = {
    k: v
    for k, v in GEMMA4_LAYER_WEIGHTS.items()
    if k not in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm")
}
"""A KV-sharing layer's: no k/v projections, no k norm (its q projection is the layer's own
tensor, see ``Gemma4ForCausalLM.take_tensor``)."""
K_EQ_V_LAYER_WEIGHTS: Mapping[str, tuple[str, int]] = {
    k: v for k, v in GEMMA4_LAYER_WEIGHTS.items() if k != "self_attn.v_proj"
}
"""A layer whose values are its keys' projection (``attention_k_eq_v``): q and k only."""

_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_PLE_TOP = {  # canonical name -> attribute
    "model.embed_tokens_per_layer.weight": "embed_tokens_per_layer",  # [V_ple, L * P]
    "model.per_layer_model_projection.weight": "per_layer_model_projection",  # [L * P, D]
    "model.per_layer_projection_norm.weight": "per_layer_projection_norm",  # [P]
}
_OWN_LAYER = re.compile(
    r"model\.layers\.(\d+)\.(per_layer_input_gate\.weight|per_layer_projection\.weight"
    r"|post_per_layer_input_norm\.weight|layer_scalar|self_attn\.q_proj\.weight)"
)


@dataclass(frozen=True)
class Gemma4Config(GemmaConfig):
    """``GemmaConfig`` plus Gemma 4's per-layer inputs and KV sharing."""

    hidden_size_per_layer_input: int = 0
    """P: the width of each layer's input of the per-layer stream (0: no such stream)."""
    vocab_size_per_layer_input: int = 0
    kv_source: tuple[int, ...] = ()
    """Per layer: the layer whose KV it attends over (itself, or for a KV-sharing layer the last
    earlier layer of its type with its own k/v)."""
    geometry: tuple[tuple[int, int, int], ...] = ()
    """Per layer: ``(head_dim, kv_heads, intermediate)``."""
    values_from_keys: tuple[bool, ...] = ()
    """Per layer: its values are its keys' projection (``attention_k_eq_v``, full layers)."""

    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        return [(kvh, hd) for hd, kvh, _ in self.geometry]

    def layer_norm_params(self, layer: int) -> int:
        """Four norms of the hidden size, q/k norms of the layer's head size (no k norm where
        it shares KV), the per-layer output norm."""
        own_k = self.kv_source[layer] == layer
        per_layer = self.hidden_size if self.hidden_size_per_layer_input else 0
        return 4 * self.hidden_size + self.geometry[layer][0] * (1 + own_k) + per_layer

    def _modules(self) -> tuple[tuple[dict[str, tuple[int, int]], ...], dict]:
        text = self.raw.get("text_config")
        return per_layer_input_shapes(
            text if isinstance(text, dict) else self.raw, self.module_shapes
        )

    def layer_modules(self) -> tuple[dict[str, tuple[int, int]], ...]:
        if not self._modules()[0]:
            return ()
        return tuple(self.layer_module_shapes(i) for i in range(self.num_layers))

    def layer_module_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        """The modules ``config.json`` gives ``layer``, each of this config's heads and MLP
        width (a tensor-parallel rank's cut: ``Gemma4ForCausalLM.shard_config``); the
        per-layer input modules as they are."""
        layers = self._modules()[0]
        if not layers:
            return self.module_shapes
        hd, kvh, inter = self.geometry[layer]
        own = projection_shapes(self.hidden_size, self.num_heads, kvh, hd, inter)
        return {p: own.get(p, dims) for p, dims in layers[layer].items()}

    def layer_view(self, layer: int) -> Gemma4Config:
        """This config with ``layer``'s head size, KV heads and MLP width as the model's (what
        the Llama-shaped tensor-parallel cut of that layer reads)."""
        hd, kvh, inter = self.geometry[layer]
        return replace(self, head_dim=hd, num_kv_heads=kvh, intermediate_size=inter)

    def outer_module_shapes(self) -> dict[str, tuple[int, int]]:
        return {**super().outer_module_shapes(), **self._modules()[1]}

    def num_parameters(self) -> int:
        """Each layer's own projections (no k/v in a KV-sharing layer), its four norms of the
        hidden size, q/k norms of its head size (no k norm where it shares KV) and per-layer
        input modules; the embedding, final norm, and the per-layer stream's embedding,
        projection and norm. The layer scalars are buffers, not parameters."""
        d, n, p = self.hidden_size, self.num_layers, self.hidden_size_per_layer_input
        total = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        for i in range(n):
            shapes = self.layer_module_shapes(i).items()  # an expert module: each expert's
            total += sum(a * b * max(1, self.module_experts(p)) for p, (a, b) in shapes)
            total += self.layer_norm_params(i)
        # the per-layer stream's embedding, model projection and norm
        return total + (p * (self.vocab_size_per_layer_input * n + n * d + 1) if p else 0)


def _kv_heads_field(c: Gemma4Config, layer: int) -> str:
    """The config.json field that sets ``layer``'s KV heads (``layer_geometry``'s rule)."""
    text = c.raw.get("text_config")
    raw = text if isinstance(text, dict) else c.raw
    per_layer = raw.get("per_layer_config")
    if isinstance(per_layer, Mapping):
        over = per_layer.get(str(layer)) or per_layer.get(layer) or {}  # type: ignore[call-overload]
        if "num_key_value_heads" in over:
            return f"per_layer_config[{layer}].num_key_value_heads"
    elif c.values_from_keys[layer] and raw.get("num_global_key_value_heads"):
        return "num_global_key_value_heads"
    return "num_key_value_heads"


def _with_values_from_keys(groups: tuple[ProjectionGroup, ...]) -> tuple[ProjectionGroup, ...]:
    """Attention groups whose q/k/v Linear is q and k only (``attention_k_eq_v``)."""
    name, d_in, parts = groups[0]
    return ((name, d_in, parts[:2]), *groups[1:])


def _refuse(c: Mapping[str, Any], source: str, moe: bool = False) -> None:
    """One line naming what this server cannot run (see the module docstring; ``moe``: the
    class serves the MoE block, ``model/gemma4_moe.py``)."""
    for layer, over in (c.get("per_layer_config") or {}).items():
        other = sorted(set(over) - {"head_dim", "num_key_value_heads"})
        if other:
            raise ModelLoadError(
                f"{source}: per_layer_config of layer {layer} overrides {other}, not supported"
            )
    ple_vocab = c.get("vocab_size_per_layer_input")
    if c.get("hidden_size_per_layer_input") and ple_vocab and int(ple_vocab) < int(c["vocab_size"]):
        raise ModelLoadError(
            f"{source}: vocab_size_per_layer_input {ple_vocab} < vocab_size {c['vocab_size']} "
            "(tokens without a per-layer input) is not supported"
        )
    if bool(c.get("enable_moe_block")) != moe:
        want = "Gemma4MoeForCausalLM" if not moe else "Gemma4ForCausalLM"
        raise ModelLoadError(
            f"{source}: enable_moe_block={bool(c.get('enable_moe_block'))}: a {want} config "
            "(the registry picks the class from config.json)"
        )
    if c.get("use_bidirectional_attention") == "all":
        raise ModelLoadError(f"{source}: use_bidirectional_attention 'all' is not supported")


class Gemma4Attention(Attention):
    """Gemma 4's attention: q, k, v normed per head (v without a weight), rotary on q and k,
    unscaled scores; a KV-sharing layer projects only q and attends over its source layer's KV
    (this step's rows from that layer's :meth:`__call__`, the rest from the cache)."""

    def __init__(
        self,
        kv_source: list[int],
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]],
        eps: float,
        values_from_keys: bool,
        *args: Any,
    ) -> None:
        super().__init__(*args)
        if values_from_keys:  # q and k only: v is k's projection
            self.groups = _with_values_from_keys(self.groups)
            self.qkv_parts = self.groups[0][2]
        self.values_from_keys = values_from_keys
        self.kv_source = kv_source
        self.eps = eps
        self.q_parts = self.qkv_parts[:1]  # a KV-sharing layer's q/k/v Linear is q alone
        self.shared = shared
        """This step's k and v [T, KVH, hd] of each source layer (one dict for every block of
        the model, reset by ``run_layers``)."""

    def __call__(self, L: DecoderLayer, i: int, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        T, hd, H = x.shape[0], self.head_dim, self.num_heads
        src = self.kv_source[i]
        qkv = L.qkv(x)  # [T, q + 2 kv]; [T, q + kv]: v from k; [T, q] where it shares KV
        if step.lora_qkv:
            step.lora.add(i, self.qkv_parts if src == i else self.q_parts, x, qkv, step.plan)
        q = L.q_norm(qkv[:, : self.q_size].view(T, H, hd))  # [T, H, hd]
        if src == i:
            k = qkv[:, self.q_size : self.qk_size].view(T, -1, hd)  # [T, KVH, hd]
            v = k if self.values_from_keys else qkv[:, self.qk_size :].view(T, -1, hd)
            qk = torch.cat((q, L.k_norm(k)), dim=1)  # [T, H + KVH, hd]
            v = F.rms_norm(v.float(), (hd,), None, self.eps).to(v.dtype)  # [T, KVH, hd]
        else:
            qk = q
        if L.rope is not None:
            cos, sin = step.rope[L.rope]
            qk = self.ops.rotary(qk.contiguous(), cos, sin)
        q = qk[:, :H]
        if src == i:
            k = qk[:, H:]
            self.shared[i] = (k, v)
        else:
            k, v = self.shared[src]
        a = paged_attention(
            q, k, v, src, step.cache, step.attn_meta, self.scale, L.window, self.attend,
            self.ops.decode_attention, self.softcap, write=src == i,
        ).reshape(T, self.q_size)  # fmt: skip
        o = L.o(a)  # [T, D]
        if step.lora_o:
            step.lora.add(i, self.o_parts, a, o, step.plan)
        return self.reduce(o)


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 4 text (see the module docstring)."""

    model_type = "gemma4_text"
    config_class = Gemma4Config
    layer_weights = GEMMA4_LAYER_WEIGHTS
    norm_class = Float32ScaleRMSNorm
    qk_norm = False  # q and k norms are the layer's own slots (a KV-sharing layer has no k's)
    supports_quantized_checkpoints = False  # no format reader knows its own projections (the
    # per-layer stream's, a KV-sharing layer's q); --quantization int8/int4 quantizes them
    cfg: Gemma4Config
    serves_moe_block = False
    """Whether this class serves ``enable_moe_block`` configs (``model/gemma4_moe.py``)."""

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        _refuse(c, source, cls.serves_moe_block)
        types = gemma4_layers.layer_types(c)
        rp = c.get("rope_parameters") or {}
        rope = {t: rp.get(t) or _DEFAULT_ROPE[t] for t in (SLIDING, FULL)}
        plain = {k: v for k, v in c.items() if k not in ("use_bidirectional_attention",)}
        fields = super().config_fields(
            {**plain, "layer_types": types, "rope_parameters": rope}, source
        )
        shared = int(c.get("num_kv_shared_layers") or 0)
        try:
            sources = gemma4_layers.kv_sources(types, shared)
        except ValueError as e:
            raise ModelLoadError(f"{source}: {e}") from None
        return {
            **fields,
            "hidden_size_per_layer_input": int(c.get("hidden_size_per_layer_input") or 0),
            "vocab_size_per_layer_input": int(
                c.get("vocab_size_per_layer_input") or c["vocab_size"]
            ),
            "kv_source": tuple(sources),
            "geometry": tuple(gemma4_layers.layer_geometry(c)),
            "values_from_keys": tuple(gemma4_layers.values_from_keys(c)),
        }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        c = self.cfg
        self._shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        kinds = [(*g, t) for g, t in zip(c.geometry, c.values_from_keys, strict=True)]
        blocks: dict[tuple[int, int, int, bool], tuple[Gemma4Attention, GatedMLP]] = {}
        for kind in dict.fromkeys(kinds):  # one attention and one MLP block per shape
            hd, kvh, inter, tied = kind
            attn_args = (c.hidden_size, c.num_heads, kvh, hd, 1.0, False, self.ops, None)
            blocks[kind] = (
                Gemma4Attention(list(c.kv_source), self._shared, c.rms_norm_eps, tied, *attn_args),
                GatedMLP(c.hidden_size, inter, c.hidden_act, self.ops),
            )
        self.attns = [blocks[kind][0] for kind in kinds]
        self.mlps = [blocks[kind][1] for kind in kinds]
        self.attn, self.mlp = self.attns[0], self.mlps[0]
        self.blocks = list(blocks.values())
        self.act: Callable[[torch.Tensor], torch.Tensor] = ACTIVATIONS[c.hidden_act]
        self._own: dict[str, torch.Tensor] = {}  # per-layer-input tensors, until build_own
        P, L = c.hidden_size_per_layer_input, c.num_layers
        self.ple_scale = torch.tensor(P**0.5).to(dtype).to(device)  # HF: float32, to the dtype
        # [V_ple, L * P]; under tensor parallelism the rank's vocabulary rows
        self.embed_tokens_per_layer: torch.Tensor | VocabShard | None = None
        self.per_layer_model_projection: Linear | None = None  # [L * P, D]
        self.per_layer_projection_norm: Float32ScaleRMSNorm | None = None  # [P]
        # the per-layer stream's LoRA groups: (proj, first column, end column)
        self.ple_gate_parts = (("per_layer_input_gate", 0, P),)
        self.ple_proj_parts = (("per_layer_projection", 0, c.hidden_size),)
        self.ple_model_parts = ((PER_LAYER_MODEL_PROJECTION, 0, L * P),)
        self._ple_shapes = {
            "embed_tokens_per_layer": (c.vocab_size_per_layer_input, L * P),
            "per_layer_model_projection": (L * P, c.hidden_size),
            "per_layer_projection_norm": (P,),
        }

    def layer_weights_of(self, layer: int) -> Mapping[str, tuple[str, int]]:
        if self.cfg.kv_source[layer] != layer:
            return SHARED_KV_LAYER_WEIGHTS
        return K_EQ_V_LAYER_WEIGHTS if self.cfg.values_from_keys[layer] else self.layer_weights

    def layer_rotaries(self) -> list[RotaryEmbedding | None]:
        """Gemma 3's two ropes, each over its layers' own head size."""
        c, dt, dev = self.cfg, self.dtype, self.device
        sizes = {t: hd for t, (hd, _, _) in zip(c.layer_types, c.geometry, strict=True)}
        glob = make_rotary(sizes.get(FULL, c.head_dim), c.rope_theta, c.rope_scaling, dt, dev)
        local = make_rotary(
            sizes.get(SLIDING, c.head_dim), c.local_rope_theta, c.local_rope_scaling, dt, dev
        )
        return [local if t == SLIDING else glob for t in c.layer_types]

    def layer_projection_groups(self, layer: int) -> tuple[ProjectionGroup, ...]:
        return (*self.attns[layer].groups, *self.mlps[layer].groups)

    def row_parallel_blocks(self) -> tuple[Any, ...]:
        return tuple(block for pair in self.blocks for block in pair)

    # -- tensor parallelism: each layer cut by its own heads and MLP width ----------------------
    @classmethod
    def shard_config(cls, cfg: ModelConfig, layout: ShardLayout) -> ModelConfig:
        """The rank's heads, and per layer its KV heads and MLP columns; ModelLoadError naming
        the field that sets a layer's KV heads where they do not split."""
        assert isinstance(cfg, Gemma4Config)
        size = layout.size
        for i, (_, kvh, _) in enumerate(cfg.geometry):
            if kvh % size and size % kvh:
                raise ModelLoadError(
                    f"--tensor-parallel-size {size}: layer {i}: {_kv_heads_field(cfg, i)}={kvh} "
                    f"neither divides nor is a multiple of {size}"
                )
        geometry = tuple(
            (hd, lay.num_kv_heads, lay.intermediate)
            for (hd, _, _), lay in zip(cfg.geometry, _layer_layouts(cfg, layout), strict=True)
        )
        return replace(layout.local_config(cfg), geometry=geometry)

    @functools.cached_property
    def _layer_cuts(self) -> list[tuple[TensorParallel, Gemma4Config]]:
        """Per layer: the rank's tensor-parallel plan of it and the whole config seen with its
        shape (``Gemma4Config.layer_view``)."""
        tp, c = self.tp, self.full_cfg
        assert tp is not None and isinstance(c, Gemma4Config)
        layouts = _layer_layouts(c, tp.layout)
        return [(replace(tp, layout=lay), c.layer_view(i)) for i, lay in enumerate(layouts)]

    def whole_projection_groups(self, layer: int) -> tuple[ProjectionGroup, ...]:
        c = self.full_cfg
        assert isinstance(c, Gemma4Config)
        hd, kvh, inter = c.geometry[layer]
        attn = attention_groups(c.hidden_size, c.num_heads * hd, kvh * hd)
        if c.values_from_keys[layer]:
            attn = _with_values_from_keys(attn)  # type: ignore[assignment]
        return (*attn, *mlp_groups(c.hidden_size, inter))

    def shard_slot(
        self, layer: int, slot: str, kind: str, t: torch.Tensor, offsets: dict[str, int]
    ) -> torch.Tensor | None:
        tp, view = self._layer_cuts[layer]
        return tp.shard_slot(slot, kind, t, view, offsets)

    def shard_lora(
        self, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-layer input projections' LoRA whole (their stream is whole on every rank);
        the layer's others cut by its own shape."""
        if key[1] in PER_LAYER_INPUT_PROJ_NAMES:
            return a, b
        tp, view = self._layer_cuts[key[0]]
        return tp.shard_lora(key[1], a, b, view)

    def layer_norm_dims(self, layer: int) -> dict[str, int]:
        hd = self.cfg.geometry[layer][0]
        return {**self.norm_dims(self.cfg), "q_norm": hd, "k_norm": hd}

    def use_layer_ops(self, ops: Any) -> None:
        self.ops = ops
        for attn, mlp in self.blocks:
            attn.ops = mlp.ops = ops

    def _own_shape(self, key: str) -> tuple[int, ...] | None:
        """The shape of one of the architecture's own tensors in the (whole) checkpoint
        (None: not one of them)."""
        c = self.full_cfg
        assert isinstance(c, Gemma4Config)
        if key in _PLE_TOP:
            return self._ple_shapes[_PLE_TOP[key]] if c.hidden_size_per_layer_input else None
        m = _OWN_LAYER.fullmatch(key)
        if m is None or int(m.group(1)) >= c.num_layers:
            return None
        name, P, D = m.group(2), c.hidden_size_per_layer_input, c.hidden_size
        if name == "layer_scalar":
            return (1,)
        if name == "self_attn.q_proj.weight":  # a KV-sharing layer's q alone
            layer = int(m.group(1))
            q = c.num_heads * c.geometry[layer][0]
            return None if c.kv_source[layer] == layer else (q, D)
        if not P:
            return None
        return {"per_layer_input_gate.weight": (P, D), "per_layer_projection.weight": (D, P),
                "post_per_layer_input_norm.weight": (D,)}[name]  # fmt: skip

    def take_tensor(
        self, key: str, read: Callable[[], torch.Tensor], shape: tuple[int, ...]
    ) -> bool:
        want = self._own_shape(key)
        if want is None:
            return super().take_tensor(key, read, shape)  # a MoE's sparse blocks
        if tuple(shape) != want:
            raise ModelLoadError(
                f"tensor {key!r} has shape {tuple(shape)}, config.json implies {want}"
            )
        self._own[key] = read()
        return True

    def _own_keys(self) -> list[str]:
        c = self.cfg
        keys = list(_PLE_TOP) if c.hidden_size_per_layer_input else []
        for i in range(c.num_layers):
            names = ["layer_scalar"]
            if c.hidden_size_per_layer_input:
                names += ["per_layer_input_gate.weight", "per_layer_projection.weight",
                          "post_per_layer_input_norm.weight"]  # fmt: skip
            if c.kv_source[i] != i:
                names.append("self_attn.q_proj.weight")
            keys += [f"model.layers.{i}.{n}" for n in names]
        return keys

    def check_own_tensors(self, src: object) -> None:
        missing = [k for k in self._own_keys() if k not in self._own]
        if missing:
            raise ModelLoadError(
                f"{src}: missing tensor(s) {missing[:4]}{'...' if len(missing) > 4 else ''}"
            )
        super().check_own_tensors(src)

    def build_own(self) -> None:
        own, eps, make = self._own, self.cfg.rms_norm_eps, self.own_projection
        tp = self.tp
        if self.cfg.hidden_size_per_layer_input:
            table = own.pop("model.embed_tokens_per_layer.weight")  # [V_ple, L * P]
            # a rank's vocabulary rows of it (V_ple >= V: rows past V are never looked up);
            # quantized at load as the embedding is (int8, one scale per row)
            self.embed_tokens_per_layer = (
                table if tp is None else VocabShard(tp.shard_vocab(table), tp)
            )
            if self.quant is not None and self.quant.on_the_fly:
                rows = QuantWeight.quantize(table, 8, None)
                self.embed_tokens_per_layer = QuantizedEmbedding(rows, self.dtype)
            name = "model.per_layer_model_projection"
            self.per_layer_model_projection = make(own.pop(f"{name}.weight"), None, name)
            self.per_layer_projection_norm = Float32ScaleRMSNorm(
                own.pop("model.per_layer_projection_norm.weight"), eps
            )
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            L.layer_scalar = own.pop(p + "layer_scalar")  # [1]
            if self.cfg.kv_source[i] != i:  # q alone: [H * hd, D], the rank's heads of it
                q = own.pop(p + "self_attn.q_proj.weight")
                if tp is not None:
                    cut, view = self._layer_cuts[i]
                    q = q.index_select(0, cut.layout.proj_rows("q_proj", view)).contiguous()
                L.qkv = make(q, None, f"{p}self_attn.q_proj")
            if self.cfg.hidden_size_per_layer_input:
                gate, proj = f"{p}per_layer_input_gate", f"{p}per_layer_projection"
                L.ple_gate = make(own.pop(f"{gate}.weight"), None, gate)  # [P, D]
                L.ple_proj = make(own.pop(f"{proj}.weight"), None, proj)  # [D, P]
                L.ple_norm = Float32ScaleRMSNorm(
                    own.pop(p + "post_per_layer_input_norm.weight"), eps
                )
        super().build_own()

    def per_layer_inputs(
        self, h: torch.Tensor, ids: torch.Tensor, step: LayerStep, lora: bool
    ) -> torch.Tensor:
        """The per-layer stream: h [T, D] (the scaled embeddings), ids [T] -> [T, L, P]
        (``lora``: an adapter of the step targets ``per_layer_model_projection``)."""
        c = self.cfg
        T, L, P = h.shape[0], c.num_layers, c.hidden_size_per_layer_input
        assert self.embed_tokens_per_layer is not None and self.per_layer_model_projection
        assert self.per_layer_projection_norm is not None
        tok = (self.embed_tokens_per_layer[ids] * self.ple_scale).view(T, L, P)
        ctx = self.per_layer_model_projection(h)  # [T, L * P]
        if lora:
            step.lora.add(VOCAB_LAYER, self.ple_model_parts, h, ctx, step.plan)
        ctx = self.per_layer_projection_norm((ctx * c.hidden_size**-0.5).view(T, L, P))
        return (ctx + tok) * 2.0**-0.5

    def run_layers(self, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Gemma 3's sandwich-normed layers, each followed by its per-layer input (with the
        LoRAs of its gate and projection) and scaled by its ``layer_scalar``: h [T, D] (the
        embedding lookup) -> [T, D]."""
        h = h * self.embed_scale
        ple, on = None, [False] * 3
        if step.lora is not None and step.plan is not None:
            groups = (self.ple_gate_parts, self.ple_proj_parts, self.ple_model_parts)
            on = step.lora.active(step.plan, groups)
        if self.cfg.hidden_size_per_layer_input:
            assert step.input_ids is not None
            ple = self.per_layer_inputs(h, step.input_ids, step, on[2])  # [T, L, P]
        ops = self.ops
        self._shared.clear()
        for i, (L, attn, mlp) in enumerate(zip(self.layers, self.attns, self.mlps, strict=True)):
            h, x = ops.add_norm(h, None, L.ln1)
            h, x = ops.add_norm(h, L.post_attn(attn(L, i, x, step)), L.ln2)
            h = h + L.post_mlp(self.feed_forward(L, i, mlp, h, x, step))
            if ple is not None:
                g = L.ple_gate(h)  # [T, P]
                if on[0]:
                    step.lora.add(i, self.ple_gate_parts, h, g, step.plan)
                g = self.act(g) * ple[:, i]
                p = L.ple_proj(g)  # [T, D]
                if on[1]:
                    step.lora.add(i, self.ple_proj_parts, g, p, step.plan)
                h = h + L.ple_norm(p)
            h = h * L.layer_scalar
        self._shared.clear()
        return h

    def feed_forward(
        self, L: DecoderLayer, i: int, mlp: GatedMLP, h: torch.Tensor, x: torch.Tensor,
        step: LayerStep,
    ) -> torch.Tensor:  # fmt: skip
        """Layer ``i``'s feed-forward output before ``post_feedforward_layernorm``: its MLP
        of ``x`` (the normed residual ``h``; the MoE variant adds its sparse block of ``h``)."""
        return mlp(L, i, x, step)

    @property
    def nbytes(self) -> int:
        extra = [self.embed_tokens_per_layer, self.per_layer_model_projection,
                 self.per_layer_projection_norm]  # fmt: skip
        return super().nbytes + sum(t.nbytes for t in extra if t is not None)


def _layer_layouts(c: Gemma4Config, layout: ShardLayout) -> list[ShardLayout]:
    """Rank ``layout.rank``'s shard of each layer of ``c`` (its own head size and KV heads:
    replicated per layer where they are fewer than the ranks)."""
    return [ShardLayout.of(c.layer_view(i), layout.rank, layout.size) for i in range(c.num_layers)]


_TEXT_PREFIXES = (("model.language_model.", "model."),)
_GEMMA4_SKIPPED = (*_SKIPPED_PREFIXES, "model.audio_tower.", "model.embed_vision.",
                   "model.embed_audio.")  # fmt: skip


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The language model of a Gemma 4 multimodal checkpoint (text prompts only; unlike
    Gemma 3's, transformers soft-caps its logits)."""

    model_type = "gemma4"

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_GEMMA4_SKIPPED):
            return None  # the vision and audio towers and their embedders
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                return super().checkpoint_name(new + name[len(old) :])
        return super().checkpoint_name(name)
