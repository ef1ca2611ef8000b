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

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.checkpoint.modules import ATTN_PROJ_NAMES, LinearAttentionSpec
from loraplex.kv.cache import StateShape
from loraplex.model.decoder import DecoderForCausalLM, pre_norm_stack
from loraplex.model.gated_delta import GatedDeltaNet
from loraplex.model.layers import Attention, DecoderLayer, LayerStep, ProjectionGroup
from loraplex.model.norms import GemmaRMSNorm
from loraplex.model.qwen3 import QWEN3_LAYER_WEIGHTS
from loraplex.model.spec import ModelConfig
from loraplex.types import ModelLoadError

LAYER_TYPES = ("linear_attention", "full_attention")

_LINEAR_KEY = re.compile(r"model\.layers\.(\d+)\.linear_attn\.(.+)")
_LINEAR_TENSORS = (
    "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
    "out_proj.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
)  # fmt: skip


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


class GatedAttention(Attention):
    """Attention whose ``q_proj`` also yields a per-head output gate: the output is
    ``attn * sigmoid(gate)`` before ``o_proj``."""

    def __init__(self, hidden_size: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(hidden_size, *args, **kwargs)
        q2, kvs = 2 * self.q_size, self.kv_size
        self.groups: tuple[ProjectionGroup, ...] = (
            ("qkv", hidden_size, (("q_proj", 0, q2), ("k_proj", q2, q2 + kvs),
                                  ("v_proj", q2 + kvs, q2 + 2 * kvs))),
            ("o", self.q_size, (("o_proj", 0, hidden_size),)),
        )  # fmt: skip
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
    supports_quantization = False  # the linear-attention projections have no quantized path yet
    supports_tensor_parallel = False  # nor a shard plan

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

    def _linear_shapes(self) -> dict[str, tuple[int, ...]]:
        lin = self.linear
        assert lin is not None
        d, cd, vs, hv = self.cfg.hidden_size, lin.conv_dim, lin.value_size, lin.hv
        return {
            "in_proj_qkv.weight": (cd, d), "in_proj_z.weight": (vs, d),
            "in_proj_b.weight": (hv, d), "in_proj_a.weight": (hv, d),
            "out_proj.weight": (d, vs), "conv1d.weight": (cd, 1, lin.kernel),
            "dt_bias": (hv,), "A_log": (hv,), "norm.weight": (lin.dv,),
        }  # fmt: skip

    def take_tensor(
        self, key: str, read: Callable[[], torch.Tensor], shape: tuple[int, ...]
    ) -> bool:
        m = _LINEAR_KEY.fullmatch(key)
        if m is None:
            return super().take_tensor(key, read, shape)  # a MoE's sparse blocks
        layer, name = int(m.group(1)), m.group(2)
        want = self._linear_shapes().get(name) if layer in self.linear_layers else None
        if want is None:
            raise ModelLoadError(f"unexpected tensor {key!r} for {self.cfg.architecture}")
        if tuple(shape) != want:
            raise ModelLoadError(f"tensor {key!r} has shape {tuple(shape)}, expected {want}")
        self._own[(layer, name)] = read()
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
        make, own = self.make_linear, self._own
        assert make is not None
        for i in sorted(self.linear_layers):
            L = self.layers[i]
            parts = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            L.lin_in = make(torch.cat([own.pop((i, f"{p}.weight")) for p in parts]), None)
            L.lin_out = make(own.pop((i, "out_proj.weight")), None)
            L.conv_w = own.pop((i, "conv1d.weight"))[:, 0, :].contiguous()  # [C, K]
            L.A = -own.pop((i, "A_log")).float().exp()  # [Hv]
            L.dt_bias = own.pop((i, "dt_bias"))
            L.gnorm = own.pop((i, "norm.weight"))
        super().build_own()

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
