"""Llama 4 text (``Llama4ForCausalLM``; ``Llama4ForConditionalGeneration``'s language model,
its vision tower skipped): Llama's layers, except that

- the rope layers (``no_rope_layers[i] == 1``; else every ``no_rope_layer_interval``-th layer
  has none) attend in chunks of ``attention_chunk_size`` (``loraplex.kv.groups.Chunked``: the
  query at ``q`` sees key ``k`` iff ``k <= q and k // size == q // size``), rotate q and k in
  the interleaved (complex) form, then L2-normalise them per head (``use_qk_norm``; a weightless
  RMSNorm of ``rms_norm_eps``);
- the NoPE layers attend globally and, with ``attn_temperature_tuning``, scale q by
  ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``;
- the layers of ``moe_layers`` (else every ``interleave_moe_layer_step``-th) have a sparse
  block (``feed_forward``): the top-1 expert (``num_experts_per_tok``) of the router's logits,
  its input times the sigmoid of that logit, experts of ``intermediate_size`` packed as
  ``experts.gate_up_proj [E, D, 2 I]`` / ``experts.down_proj [E, I, D]`` (stored in, out), plus a
  shared expert (a gated MLP of ``intermediate_size``) every token runs; the other layers have
  a dense MLP of ``intermediate_size_mlp``.

The interleaved rotary is the shared rotate-half one on q and k with each head's dims
de-interleaved (pairs ``(2i, 2i + 1)`` -> ``(i, i + hd / 2)``): scores are dot products, so q
and k permuted alike attend the same, and the L2 norm does not see the order. Checkpoint
names: ``feed_forward`` for ``mlp``, ``feed_forward.router`` for the router ``mlp.gate``.
Adapters: attention, dense MLP, shared expert (``shared_expert.{gate,up,down}_proj``), packed
experts (PEFT's ``target_parameters``), the router (``feed_forward.router``, PEFT's
``all-linear`` takes it), ``lm_head`` and ``embed_tokens``.

Under tensor parallelism nothing here is its own: the q/k path is per head, chunks are a
window kind, and the sparse block's experts and shared expert are cut as ``model/moe.py`` cuts
them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.checkpoint.modules import MoESpec
from loraplex.kv.groups import Chunked, Window
from loraplex.model.layers import Attention, DecoderLayer, LayerStep
from loraplex.model.moe import MoEConfig, MoEDecoderForCausalLM, SparseMoE, moe_config_fields
from loraplex.model.rotary import RotaryEmbedding
from loraplex.model.spec import ModelConfig
from loraplex.types import ModelLoadError


@dataclass(frozen=True)
class Llama4Config(MoEConfig):
    """Llama 4's extras: which layers rotate (and attend in chunks), q/k norm, temperature."""

    rope_layers: tuple[bool, ...] = ()
    attention_chunk_size: int | None = None
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1


def _rope_layers(c: Mapping[str, Any], n: int, source: str) -> tuple[bool, ...]:
    """Whether each layer rotates q and k (transformers' ``no_rope_layers`` rule)."""
    flags = c.get("no_rope_layers")
    if not flags:
        interval = int(c.get("no_rope_layer_interval") or 4)
        return tuple((i + 1) % interval != 0 for i in range(n))
    if not isinstance(flags, list) or len(flags) < n:
        raise ModelLoadError(f"{source}: no_rope_layers must list a 0/1 flag per layer ({n})")
    return tuple(bool(f) for f in flags[:n])


class Llama4Attention(Attention):
    """Llama's attention with Llama 4's q/k path (module docstring): :meth:`position_qk`."""

    l2_eps: float | None = None  # the q/k L2 norm's eps on rope layers (None: no norm)
    temperature: tuple[float, float] | None = None  # (floor_scale, attn_scale) on NoPE layers

    def position_qk(self, L: DecoderLayer, qk: torch.Tensor, step: LayerStep) -> torch.Tensor:
        T, n, hd = qk.shape
        if L.rope is not None:
            # interleaved pairs (2i, 2i + 1) -> rotate-half pairs (i, i + hd / 2)
            qk = qk.view(T, n, hd // 2, 2).transpose(-1, -2).reshape(T, n, hd)
            cos, sin = step.rope[L.rope]
            qk = self.ops.rotary(qk, cos, sin)
            if self.l2_eps is not None:
                x = qk.float()
                qk = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.l2_eps)).to(qk.dtype)
            return qk
        if self.temperature is None:
            return qk
        assert step.positions is not None
        floor_scale, attn_scale = self.temperature
        pos = step.positions.float()  # [T]
        scale = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
        q = (qk[:, : self.num_heads] * scale[:, None, None]).to(qk.dtype)  # [T, H, hd]
        return torch.cat((q, qk[:, self.num_heads :]), dim=1)


class Llama4SparseMoE(SparseMoE):
    """The top-k logits' sigmoids scale the chosen experts' inputs (HF's ``Llama4Router``)."""

    scale_input = True

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, e = torch.topk(logits, self.top_k, dim=-1)  # [T, k] each
        return torch.sigmoid(top.float()).to(logits.dtype), e


_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_SKIPPED = ("vision_model.", "multi_modal_projector.", "model.vision_model.",
            "model.multi_modal_projector.")  # fmt: skip
_PACKED = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj)")


class Llama4ForCausalLM(MoEDecoderForCausalLM):
    """Llama 4 Scout / Maverick's text model and its fine-tunes."""

    model_type = "llama4_text"
    config_class = Llama4Config
    cfg: Llama4Config
    attention_class = Llama4Attention
    sparse_class = Llama4SparseMoE

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        spec = MoESpec.from_hf_config({**c, "model_type": "llama4_text"})
        assert spec is not None
        chunk = c.get("attention_chunk_size")
        return dict(
            **moe_config_fields(
                c, source, num_experts=spec.num_experts, inter=spec.intermediate,
                sparse=spec.layers, norm_topk_prob=False, block=spec.block,
                in_model_dtype=True, shared=spec.shared_intermediate, packed_in_out=True,
                router=spec.router_name,
            ),
            intermediate_size=int(c.get("intermediate_size_mlp") or spec.intermediate),
            rope_layers=_rope_layers(c, int(c["num_hidden_layers"]), source),
            attention_chunk_size=int(chunk) if chunk else None,
            use_qk_norm=bool(c.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(c.get("attn_temperature_tuning", True)),
            floor_scale=float(c.get("floor_scale") or 8192),
            attn_scale=float(c.get("attn_scale", 0.1)),
        )  # fmt: skip

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        c = self.cfg
        assert isinstance(self.attn, Llama4Attention)
        self.attn.l2_eps = c.rms_norm_eps if c.use_qk_norm else None
        if c.attn_temperature_tuning:
            self.attn.temperature = (c.floor_scale, c.attn_scale)

    def layer_rotaries(self) -> list[RotaryEmbedding | None]:
        rotary = super().layer_rotaries()
        return [r if use else None for r, use in zip(rotary, self.cfg.rope_layers, strict=True)]

    @classmethod
    def windows_of(cls, c: ModelConfig) -> list[Window]:
        """Chunked attention on the ``chunked_attention`` layers of ``layer_types`` (by
        default the rope layers), global on the others."""
        assert isinstance(c, Llama4Config)
        size = c.attention_chunk_size
        raw = c.raw.get("text_config", c.raw) if "hidden_size" not in c.raw else c.raw
        types = raw.get("layer_types") or [
            "chunked_attention" if r and size else "full_attention" for r in c.rope_layers
        ]
        if size is None and "chunked_attention" in types:
            raise ModelLoadError("layer_types has chunked_attention without attention_chunk_size")
        return [Chunked(size) if t == "chunked_attention" and size else None for t in types]

    def checkpoint_name(self, name: str) -> str | None:
        """``feed_forward`` as ``mlp``, its ``router`` as ``gate`` (a multimodal checkpoint's
        language model by its text names; the other towers skipped)."""
        if name.startswith(_SKIPPED):
            return None
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        name = name.replace(".feed_forward.router.", ".mlp.gate.")
        return super().checkpoint_name(name.replace(".feed_forward.", ".mlp."))

    def take_tensor(
        self, key: str, read: Callable[[], torch.Tensor], shape: tuple[int, ...]
    ) -> bool:
        """The packed experts, stored ``[E, in, out]``, as the sparse block reads them."""
        if _PACKED.fullmatch(key) and len(shape) == 3:
            flipped = (shape[0], shape[2], shape[1])
            return super().take_tensor(key, lambda: read().transpose(1, 2).contiguous(), flipped)
        return super().take_tensor(key, read, shape)


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The language model of a Llama 4 vision-language checkpoint (text prompts only)."""

    model_type = "llama4"
