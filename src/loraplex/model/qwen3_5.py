"""Qwen3.5 (dense): a hybrid of Gated DeltaNet linear attention and gated full attention.

What differs from Llama:
- ``layer_types``: most layers (three of every four in the released models) are
  ``linear_attention`` (``model/gated_delta.py``): a per-sequence recurrent state instead of
  KV, kept in the KV cache's state groups; the others are ``full_attention``;
- full attention: ``q_proj`` yields each head's query and an output gate (``[2 q, hidden]``,
  per head query then gate); the attention output is multiplied by ``sigmoid(gate)`` before
  ``o_proj``; per-head q/k norms; a partial rotary (``partial_rotary_factor``, 0.25; the
  multimodal rope's sections coincide for text positions);
- every RMSNorm is ``(1 + w)`` in float32 (Gemma's), except the linear attention's gated norm
  (``w * x``, then ``* silu(z)``);
- ``Qwen3_5ForConditionalGeneration``: the language model of the vision-language checkpoint
  (``model.language_model.*``; the vision tower is skipped).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from loraplex.checkpoint.modules import ATTN_PROJ_NAMES, LINEAR_ATTN_PROJ_NAMES, LinearAttentionSpec
from loraplex.kv.cache import StateShape
from loraplex.model.decoder import DecoderForCausalLM, pre_norm_stack
from loraplex.model.gated_delta import GatedDeltaNet
from loraplex.model.layers import Attention, DecoderLayer, LayerStep, ProjectionGroup
from loraplex.model.norms import GemmaRMSNorm
from loraplex.model.qwen3 import QWEN3_LAYER_WEIGHTS
from loraplex.model.spec import ModelConfig
from loraplex.model.tensor_parallel.sharding import ShardLayout
from loraplex.types import ModelLoadError

LAYER_TYPES = ("linear_attention", "full_attention")

_LINEAR_KEY = re.compile(r"model\.layers\.(\d+)\.linear_attn\.(.+)")
_LINEAR_TENSORS = (
    *(f"{p}.weight" for p in LINEAR_ATTN_PROJ_NAMES), "conv1d.weight", "dt_bias", "A_log",
    "norm.weight",
)  # fmt: skip


def linear_tensor_shapes(lin: LinearAttentionSpec) -> dict[str, tuple[int, ...]]:
    """The shape of each of a linear-attention layer's checkpoint tensors (``_LINEAR_TENSORS``)."""
    d, hv = lin.hidden, lin.value_heads
    ks, vs = lin.key_heads * lin.key_dim, hv * lin.value_dim
    cd = 2 * ks + vs  # the convolution's channels: q, k, v
    return {
        "in_proj_qkv.weight": (cd, d), "in_proj_z.weight": (vs, d),
        "in_proj_b.weight": (hv, d), "in_proj_a.weight": (hv, d),
        "out_proj.weight": (d, vs), "conv1d.weight": (cd, 1, lin.kernel),
        "dt_bias": (hv,), "A_log": (hv,), "norm.weight": (lin.value_dim,),
    }  # fmt: skip


@dataclass(frozen=True)
class Qwen3_5Config(ModelConfig):
    """``ModelConfig`` with the linear-attention layers and the gated query."""

    linear: LinearAttentionSpec | None = None

    @property
    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """A full-attention layer's projections: ``q_proj`` also yields the output gate."""
        shapes = ModelConfig.module_shapes.fget(self)  # type: ignore[attr-defined]
        shapes["q_proj"] = (self.hidden_size, 2 * self.num_heads * self.head_dim)
        return shapes

    def linear_spec(self) -> LinearAttentionSpec | None:
        return self.linear

    def layer_module_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        shapes = super().layer_module_shapes(layer)  # a MoE's sparse layers: its block's
        if self.linear is None or layer not in self.linear.layers:
            return shapes
        rest = {p: d for p, d in shapes.items() if p not in ATTN_PROJ_NAMES}
        return {**self.linear.shapes, **rest}

    def layer_modules(self) -> tuple[dict[str, tuple[int, int]], ...]:
        """Every layer's modules: linear-attention layers differ from full ones."""
        return tuple(self.layer_module_shapes(i) for i in range(self.num_layers))

    def layer_norm_params(self, layer: int) -> int:
        """A layer's norms and, in a linear-attention layer, its convolution, decay terms and
        gated norm (the byte model's small parameters beside the projections)."""
        lin = self.linear
        if lin is None or layer not in lin.layers:
            return 2 * self.hidden_size + 2 * self.head_dim
        conv = 2 * lin.key_heads * lin.key_dim + lin.value_heads * lin.value_dim
        return 2 * self.hidden_size + conv * lin.kernel + 2 * lin.value_heads + lin.value_dim

    def num_parameters(self) -> int:
        """Parameters as loaded: each layer's projections (every expert of a MoE's) and small
        parameters, the embedding and an untied head."""
        total = sum(
            sum(a * b * max(1, self.module_experts(p)) for p, (a, b) in shapes.items())
            + self.layer_norm_params(i)
            for i, shapes in enumerate(self.layer_modules())
        )
        embed = self.vocab_size * self.hidden_size
        return total + embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size


def gated_attention_groups(
    hidden_size: int, q_size: int, kv_size: int
) -> tuple[ProjectionGroup, ProjectionGroup]:
    """``attention_groups`` with ``q_proj`` twice as wide: each head's query, then its gate."""
    q2, kvs = 2 * q_size, kv_size
    return (
        ("qkv", hidden_size, (("q_proj", 0, q2), ("k_proj", q2, q2 + kvs),
                              ("v_proj", q2 + kvs, q2 + 2 * kvs))),
        ("o", q_size, (("o_proj", 0, hidden_size),)),
    )  # fmt: skip


class GatedAttention(Attention):
    """Attention whose ``q_proj`` also yields a per-head output gate: the output is
    ``attn * sigmoid(gate)`` before ``o_proj``."""

    def __init__(self, hidden_size: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(hidden_size, *args, **kwargs)
        self.groups: tuple[ProjectionGroup, ...] = gated_attention_groups(
            hidden_size, self.q_size, self.kv_size
        )
        self.qkv_parts, self.o_parts = (g[2] for g in self.groups)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        T, H, hd, q2 = qkv.shape[0], self.num_heads, self.head_dim, 2 * self.q_size
        qg = qkv[:, :q2].view(T, H, 2 * hd)  # per head: query, then gate
        k = qkv[:, q2 : q2 + self.kv_size].view(T, -1, hd)
        qk = torch.cat((qg[..., :hd], k), dim=1)  # [T, H + KVH, hd]
        v = qkv[:, q2 + self.kv_size :].view(T, -1, hd)
        return qk, v, qg[..., hd:].reshape(T, self.q_size)


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Qwen3.5 dense text models (``Qwen3_5ForCausalLM``)."""

    model_type = "qwen3_5_text"
    config_class = Qwen3_5Config
    layer_weights = QWEN3_LAYER_WEIGHTS
    norm_class = GemmaRMSNorm
    qk_norm = True
    supports_quantized_checkpoints = (
        False  # no format reader knows the linear-attention projections
    )

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        n = int(c["num_hidden_layers"])
        types = c.get("layer_types")
        if not isinstance(types, list) or len(types) != n or not set(types) <= set(LAYER_TYPES):
            raise ModelLoadError(
                f"{source}: layer_types must list {n} of {LAYER_TYPES}, got {types!r}"
            )
        try:
            linear = LinearAttentionSpec.from_hf_config(c)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: linear attention config: {e}") from e
        if linear is not None and linear.value_heads % linear.key_heads:
            raise ModelLoadError(
                f"{source}: linear_num_value_heads {linear.value_heads} is not a multiple of "
                f"linear_num_key_heads {linear.key_heads}"
            )
        rope = c.get("rope_parameters") or {}
        factor = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
        fields: dict[str, Any] = {"linear": linear}
        if rope.get("rope_type", "default") == "default" and factor != 1.0:
            fields["rope_scaling"] = {"rope_type": "default", "partial_rotary_factor": factor}
        return fields

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        assert isinstance(cfg, Qwen3_5Config)
        self.attn = GatedAttention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            self.attention_scale(), self.qk_norm, self.ops,
        )  # fmt: skip
        lin = cfg.linear
        self.linear_layers = frozenset(lin.layers if lin is not None else ())
        self.linear: GatedDeltaNet | None = None
        if lin is not None:
            self.linear = GatedDeltaNet(
                cfg.hidden_size, lin.key_heads, lin.value_heads, lin.key_dim, lin.value_dim,
                lin.kernel, cfg.rms_norm_eps, device,
            )  # fmt: skip
        self.projection_groups = (*self.attn.groups, *self.mlp.groups)
        self._group_parts = tuple(parts for _, _, parts in self.projection_groups)
        self.mixers: list[Callable[[DecoderLayer, int, torch.Tensor, LayerStep], torch.Tensor]]
        self.mixers = [
            self.linear if i in self.linear_layers and self.linear else self.attn
            for i in range(cfg.num_layers)
        ]
        self._own: dict[tuple[int, str], torch.Tensor] = {}
        if not hasattr(self, "ffns"):  # a MoE's sparse blocks were set by its base class
            self.ffns = [self.mlp] * cfg.num_layers

    # -- the recurrent layers ----------------------------------------------------------------
    def state_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.linear_layers))

    def state_shape(self) -> StateShape | None:
        if self.linear is None:
            return None
        lin = self.linear
        return StateShape((lin.conv_dim, lin.kernel - 1), (lin.hv, lin.dk, lin.dv))

    def layer_weights_of(self, layer: int) -> Mapping[str, tuple[str, int]]:
        weights = super().layer_weights_of(layer)  # a MoE's sparse layers: no dense MLP
        if layer not in self.linear_layers:
            return weights
        return {k: v for k, v in weights.items() if not k.startswith("self_attn.")}

    def take_tensor(
        self, key: str, read: Callable[[], torch.Tensor], shape: tuple[int, ...]
    ) -> bool:
        m = _LINEAR_KEY.fullmatch(key)
        if m is None:
            return super().take_tensor(key, read, shape)  # a MoE's sparse blocks
        layer, name = int(m.group(1)), m.group(2)
        lin = self.full_cfg.linear  # type: ignore[attr-defined]  # the checkpoint's (whole)
        want = linear_tensor_shapes(lin).get(name) if layer in self.linear_layers else None
        if want is None:
            raise ModelLoadError(f"unexpected tensor {key!r} for {self.cfg.architecture}")
        if tuple(shape) != want:
            raise ModelLoadError(f"tensor {key!r} has shape {tuple(shape)}, expected {want}")
        t = read()
        rows = self.shard_rows.get(name.removesuffix(".weight")) if self.tp is not None else None
        if rows is not None:  # the rank's heads: out_proj's input columns, others' rows
            t = t.index_select(1 if name == "out_proj.weight" else 0, rows).contiguous()
        self._own[(layer, name)] = t
        return True

    def check_own_tensors(self, src: object) -> None:
        missing = [
            f"model.layers.{i}.linear_attn.{n}"
            for i in sorted(self.linear_layers)
            for n in _LINEAR_TENSORS
            if (i, n) not in self._own
        ]
        if missing:
            raise ModelLoadError(f"{src}: missing tensor(s) {missing[:6]}")
        super().check_own_tensors(src)

    def build_own(self) -> None:
        own, make = self._own, self.own_projection  # quantized at load as q/k/v/o are
        for i in sorted(self.linear_layers):
            L = self.layers[i]
            parts = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            where = f"model.layers.{i}.linear_attn"
            fused = torch.cat([own.pop((i, f"{p}.weight")) for p in parts])
            L.lin_in = make(fused, None, f"{where}.in_proj_*")
            L.lin_out = make(own.pop((i, "out_proj.weight")), None, f"{where}.out_proj")
            L.conv_w = own.pop((i, "conv1d.weight"))[:, 0, :].contiguous()  # [C, K]
            L.A = -own.pop((i, "A_log")).float().exp()  # [Hv]
            L.dt_bias = own.pop((i, "dt_bias"))
            L.gnorm = own.pop((i, "norm.weight"))
        super().build_own()

    # -- tensor parallelism: cut by heads. A full-attention rank keeps its heads' query and
    #    gate rows of q_proj (and Llama's cut of the rest); a linear-attention rank its key
    #    heads' q and k rows with the value heads that read them (value head j reads key head
    #    j // (Hv / Hk): a rank's contiguous value heads read its contiguous key heads), their
    #    v, z, a, b rows, convolution channels and decay terms, and out_proj's input columns
    #    (row-parallel: its output summed over the ranks). The gated norm [dv] is whole.
    @classmethod
    def shard_config(cls, cfg: ModelConfig, layout: ShardLayout) -> ModelConfig:
        """The rank's heads, and of the linear-attention layers' (``linear_num_value_heads``
        is a multiple of ``linear_num_key_heads``: it splits when they do)."""
        local = super().shard_config(cfg, layout)
        lin, size = getattr(cfg, "linear", None), layout.size
        if lin is None:
            return local
        if lin.key_heads % size:
            raise ModelLoadError(
                f"--tensor-parallel-size {size}: linear_num_key_heads={lin.key_heads} is not "
                f"a multiple of {size}"
            )
        heads = replace(lin, key_heads=lin.key_heads // size, value_heads=lin.value_heads // size)
        return replace(local, linear=heads)

    @functools.cached_property
    def shard_rows(self) -> dict[str, torch.Tensor]:
        """The rank's rows (out_proj: input columns) of each tensor or LoRA module cut by
        heads its own way, in the whole layout: q_proj, the linear attention's (by module or
        tensor name; ``norm`` is whole)."""
        tp, c, local = self.tp, self.full_cfg, self.cfg
        assert tp is not None and isinstance(c, Qwen3_5Config) and isinstance(local, Qwen3_5Config)

        def heads(n: int, width: int) -> torch.Tensor:  # the rank's n heads of width rows
            return torch.arange(tp.rank * n * width, (tp.rank + 1) * n * width)

        rows = {"q_proj": heads(local.num_heads, 2 * c.head_dim)}  # each head: query, gate
        lin, mine = c.linear, local.linear
        if lin is None or mine is None:
            return rows
        k, ks = heads(mine.key_heads, lin.key_dim), lin.key_heads * lin.key_dim
        v, hv = heads(mine.value_heads, lin.value_dim), heads(mine.value_heads, 1)
        qkv = torch.cat((k, ks + k, 2 * ks + v))  # [q | k | v] channels
        return {**rows, "in_proj_qkv": qkv, "conv1d": qkv, "in_proj_z": v, "out_proj": v,
                "in_proj_b": hv, "in_proj_a": hv, "A_log": hv, "dt_bias": hv}  # fmt: skip

    def whole_projection_groups(self, layer: int) -> tuple[ProjectionGroup, ...]:
        c = self.full_cfg
        _, _, *mlp = super().whole_projection_groups(layer)  # Llama's attention, then the MLP's
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return (*gated_attention_groups(c.hidden_size, q, kv), *mlp)

    def shard_slot(
        self, layer: int, slot: str, kind: str, t: torch.Tensor, offsets: dict[str, int]
    ) -> torch.Tensor | None:
        if slot != "qkv":
            return super().shard_slot(layer, slot, kind, t, offsets)
        assert self.tp is not None
        lay, c = self.tp.layout, self.full_cfg
        rows = torch.cat(
            (
                self.shard_rows["q_proj"] + offsets["q_proj"],
                *(lay.proj_rows(p, c) + offsets[p] for p in ("k_proj", "v_proj")),
            )
        )
        return t.index_select(0, rows).contiguous()

    def shard_lora(
        self, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.shard_rows.get(key[1])
        if rows is None:
            return super().shard_lora(key, a, b)
        assert self.tp is not None
        return self.tp.cut_lora(key[1], a, b, rows, self.full_cfg)

    def row_parallel_blocks(self) -> tuple[Any, ...]:
        return (*super().row_parallel_blocks(), *([self.linear] if self.linear else []))

    # -- forward -----------------------------------------------------------------------------
    def run_layers(self, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        return pre_norm_stack(self, h, step, self.ffns, mixers=self.mixers)


_TEXT_PREFIXES = (("model.language_model.", "model."),)
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.")


def text_checkpoint_name(name: str, canonical: Callable[[str], str | None]) -> str | None:
    """The language model's canonical name of a Qwen3.5 vision-language checkpoint's tensor
    ``name`` (``model.language_model.*``), through ``canonical``; None for the vision tower and
    the multi-token-prediction head, which text serving never runs."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return canonical(new + name[len(old) :])
    return canonical(name)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The language model of a Qwen3.5 vision-language checkpoint (text prompts only)."""

    model_type = "qwen3_5"

    def checkpoint_name(self, name: str) -> str | None:
        return text_checkpoint_name(name, super().checkpoint_name)
