"""Gemma 2 and Gemma 3 (text): Llama's projections with Gemma's numerics and wiring.

- ``(1 + w)`` RMSNorm in float32 (``GemmaRMSNorm``), four norms per layer: the attention and
  MLP outputs are normed again before their residual adds;
- embeddings scaled by ``sqrt(hidden)`` in the model dtype, after the embedding LoRA (PEFT
  scales the LoRA delta by the same ``embed_scale``);
- GeGLU with the tanh GELU (``hidden_activation``), attention scale ``query_pre_attn_scalar ** -0.5``;
- attention soft-capping (Gemma 2) and final logit soft-capping ``tanh(x / cap) * cap``;
- sliding-window layers alternating with global ones (``layer_types``; Gemma 2 every other
  layer, Gemma 3 by ``sliding_window_pattern``), Gemma 3's local RoPE base on the local layers
  and its q/k norms.

``Gemma3ForConditionalGeneration`` checkpoints serve their language model: its tensors
(``model.language_model.*``, or ``language_model.model.*`` in older exports) map onto the
canonical names, the vision tower and projector are skipped, and the config is
``text_config``. Like transformers, it applies no final soft-cap.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.lora.plan import LoRABatchPlan
from loraplex.model.decoder import LLAMA_LAYER_WEIGHTS, DecoderForCausalLM, pre_norm_stack
from loraplex.model.layers import (
    ROPE_TYPES,
    GemmaRMSNorm,
    LayerStep,
    RotaryEmbedding,
    make_rotary,
)
from loraplex.model.spec import ModelConfig
from loraplex.types import ModelLoadError

GEMMA2_LAYER_WEIGHTS: Mapping[str, tuple[str, int]] = {
    **LLAMA_LAYER_WEIGHTS,
    "input_layernorm": ("ln1", 0),  # before attention
    "post_attention_layernorm": ("post_attn", 0),  # on the attention output
    "pre_feedforward_layernorm": ("ln2", 0),  # before the MLP
    "post_feedforward_layernorm": ("post_mlp", 0),  # on the MLP output
}

GEMMA3_LAYER_WEIGHTS: Mapping[str, tuple[str, int]] = {
    **GEMMA2_LAYER_WEIGHTS,
    "self_attn.q_norm": ("q_norm", 0),  # [head_dim]
    "self_attn.k_norm": ("k_norm", 0),  # [head_dim]
}

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    """``ModelConfig`` plus what Gemma 2 and 3 read from their text config."""

    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_types: tuple[str, ...] = ()
    """Per layer: ``sliding_attention`` (windowed, local rope) or ``full_attention``."""
    local_rope_theta: float = 10000.0
    local_rope_scaling: dict[str, Any] | None = None


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(x / cap) * cap``."""
    return torch.tanh(x / cap) * cap


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _cap(c: Mapping[str, Any], key: str) -> float | None:
    value = c.get(key)
    return float(value) if value else None


def _rope(params: Mapping[str, Any] | None, source: str) -> dict[str, Any] | None:
    """A rope-parameters mapping as ``rope_scaling`` (None for default RoPE); an unknown
    type is refused naming it."""
    if not params:
        return None
    rtype = str(params.get("rope_type", params.get("type", "default")))
    if rtype not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope_scaling type {rtype!r}; supported: {tuple(ROPE_TYPES)}"
        )
    return None if rtype == "default" else {**params, "rope_type": rtype}


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Gemma 2: sliding and global layers alternate, attention and final logits soft-capped."""

    model_type = "gemma2"
    config_class = GemmaConfig
    layer_weights = GEMMA2_LAYER_WEIGHTS
    norm_class = GemmaRMSNorm
    cfg: GemmaConfig

    sliding_window_pattern = 2
    """Without ``layer_types``: every ``pattern``-th layer is global, the others slide."""

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        if c.get("use_bidirectional_attention"):
            raise ModelLoadError(f"{source}: use_bidirectional_attention is not supported")
        layers = int(c["num_hidden_layers"])
        types = c.get("layer_types")
        if not types:
            pattern = int(c.get("sliding_window_pattern") or cls.sliding_window_pattern)
            types = [SLIDING if (i + 1) % pattern else "full_attention" for i in range(layers)]
        if len(types) != layers:
            raise ModelLoadError(f"{source}: layer_types lists {len(types)} layers, not {layers}")
        return {
            "hidden_act": str(
                c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
            ),
            "tie_word_embeddings": bool(c.get("tie_word_embeddings", True)),
            "query_pre_attn_scalar": float(c.get("query_pre_attn_scalar") or 256),
            "attn_logit_softcapping": _cap(c, "attn_logit_softcapping"),
            "final_logit_softcapping": _cap(c, "final_logit_softcapping"),
            "layer_types": tuple(str(t) for t in types),
        }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        # HF's embed_scale: a float32 scalar cast to the model dtype
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(dtype).to(device)
        cap = self.cfg.final_logit_softcapping
        self._cap_logits: Callable[[torch.Tensor], torch.Tensor] = (
            _identity if cap is None else functools.partial(_softcap, cap=cap)
        )

    @classmethod
    def windows_of(cls, c: ModelConfig) -> list[int | None]:
        assert isinstance(c, GemmaConfig)
        return [c.sliding_window if t == SLIDING else None for t in c.layer_types]

    def attention_scale(self) -> float:
        return self.cfg.query_pre_attn_scalar**-0.5

    def attention_softcap(self) -> float | None:
        return self.cfg.attn_logit_softcapping

    @classmethod
    def norm_dims(cls, c: ModelConfig) -> dict[str, int]:
        d = c.hidden_size
        return {**super().norm_dims(c), "post_attn": d, "post_mlp": d}

    def run_layers(self, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Scale the embeddings (their LoRA included), then each layer's post-normed
        attention and MLP outputs join the residual: h: [T, D] -> [T, D]."""
        ffns = [self.mlp] * len(self.layers)
        return pre_norm_stack(self, h * self.embed_scale, step, ffns, ("post_attn", "post_mlp"))

    @torch.inference_mode()
    def compute_logits(
        self, h: torch.Tensor, lora_plan: LoRABatchPlan | None = None
    ) -> torch.Tensor:
        """The shared head (with its LoRA), then the final soft-cap: float32 [N, V]."""
        return self._cap_logits(super().compute_logits(h, lora_plan))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: q/k norms, five local layers per global one by default, the local
    layers on their own RoPE base (``rope_parameters`` by layer type, or the older
    ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``)."""

    model_type = "gemma3_text"
    layer_weights = GEMMA3_LAYER_WEIGHTS
    qk_norm = True
    sliding_window_pattern = 6

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        fields = super().config_fields(c, source)
        rp = c.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
            glob, local = rp["full_attention"], rp.get(SLIDING) or {}
        else:  # the layout before rope_parameters
            glob = {"rope_theta": c.get("rope_theta"), **(c.get("rope_scaling") or {})}
            local = {"rope_theta": c.get("rope_local_base_freq")}
        fields.update(
            rope_theta=float(glob.get("rope_theta") or 1_000_000.0),
            rope_scaling=_rope(glob, source),
            local_rope_theta=float(local.get("rope_theta") or 10_000.0),
            local_rope_scaling=_rope(local, source),
        )
        return fields

    def layer_rotaries(self) -> list[RotaryEmbedding]:
        c, dt, dev = self.cfg, self.dtype, self.device
        glob = make_rotary(c.head_dim, c.rope_theta, c.rope_scaling, dt, dev)
        local = make_rotary(c.head_dim, c.local_rope_theta, c.local_rope_scaling, dt, dev)
        return [local if t == SLIDING else glob for t in c.layer_types]


_TEXT_PREFIXES = (
    ("model.language_model.", "model."),  # transformers >= 4.52
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_SKIPPED_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 vision-language checkpoint (text prompts only)."""

    model_type = "gemma3"

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        # transformers' Gemma3ForConditionalGeneration soft-caps no logits
        return {**super().config_fields(c, source), "final_logit_softcapping": None}

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_SKIPPED_PREFIXES):
            return None  # the vision tower and its projector
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                return super().checkpoint_name(new + name[len(old) :])
        return super().checkpoint_name(name)  # lm_head.weight; anything else is unexpected
