"""The layers every architecture is built from: norms, rotary embeddings, the attention block,
the gated MLP, a layer's weights (``DecoderLayer``) and the per-step state the layers read.

The blocks hold only what is the same for every layer (sizes, scale, activation, LoRA groups)
and read the weights of the ``DecoderLayer`` they are called with by attribute, so the merger
can swap a fused Linear in place. Every choice (norm kind, q/k norm, activation, rope type) is
made once at construction; the per-token work is the same tensor ops for every architecture
that shares a block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraplex.model.attention import (
    AttendFn,
    AttentionMetadata,
    DecodeAttendFn,
    paged_attention,
    sdpa_attend,
    softcap_attend,
)
from loraplex.model.layer_ops import ACTIVATIONS as ACTIVATIONS
from loraplex.model.layer_ops import LayerOps
from loraplex.model.linear import Linear
from loraplex.model.norms import GemmaRMSNorm as GemmaRMSNorm
from loraplex.model.norms import RMSNorm
from loraplex.model.rotary import ROPE_TYPES as ROPE_TYPES
from loraplex.model.rotary import LinearScalingRotaryEmbedding as LinearScalingRotaryEmbedding
from loraplex.model.rotary import Llama3RotaryEmbedding as Llama3RotaryEmbedding
from loraplex.model.rotary import RotaryEmbedding as RotaryEmbedding
from loraplex.model.rotary import make_rotary as make_rotary

if TYPE_CHECKING:
    from loraplex.kv.cache import PagedKVCache
    from loraplex.lora.plan import LoRABatchPlan
    from loraplex.model.lora_binding import LoRABinding

ProjectionGroup = tuple[str, int, tuple[tuple[str, int, int], ...]]
"""``(fused Linear attribute, input features, ((proj, first column, end column), ...))``."""


# ------------------------------------------------------------------------------ layer state


class DecoderLayer:
    """One decoder layer's weights, by slot (inference only). The blocks read them by
    attribute; the merger swaps the Linear slots for merged copies and back."""

    def __init__(self, rope: int | None = 0, window: int | None = None) -> None:
        self.ln1: RMSNorm  # before attention
        self.ln2: RMSNorm  # before the MLP
        self.qkv: Linear  # [q + 2 kv, D]
        self.o: Linear  # [D, q]
        self.gate_up: Linear  # [2 I, D]
        self.down: Linear  # [D, I]
        self.qk_norm: RMSNorm | None = None  # per-head q/k norm, weight [H + KVH, hd]
        self.rope = rope  # index of this layer's rotary in the model's ``rotaries`` (None: NoPE)
        self.window = window  # index of its window's (or chunk's) masks (None: global attention)
        self.sinks: torch.Tensor | None = None  # per-head attention sink logits [H] (GPT-OSS)
        self.attend: AttendFn | None = None
        """The layer's own prefill attention (None: the block's), e.g. bound to its sinks."""
        self.decode: DecodeAttendFn | None = None
        """The layer's own decode attention (None: the model's ``LayerOps.decode_attention``)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the layer's norms and projections."""
        return sum(v.nbytes for v in vars(self).values() if hasattr(v, "nbytes"))


@dataclass(slots=True)
class LayerStep:
    """What every layer reads in one step, built once per step by the decoder."""

    cache: PagedKVCache
    attn_meta: AttentionMetadata
    rope: list[tuple[torch.Tensor, torch.Tensor]]  # per rotary of the model: cos, sin [T, 1, hd]
    input_ids: torch.Tensor | None = None  # [T] the step's tokens (Gemma 4's per-layer inputs)
    positions: torch.Tensor | None = None  # [T] each token's position (what rope was built at)
    lora: LoRABinding | None = None
    plan: LoRABatchPlan | None = None
    lora_qkv: bool = False  # an adapter of the step targets one of the group's projections
    lora_o: bool = False
    lora_gate_up: bool = False
    lora_down: bool = False


FeedForward = Callable[[DecoderLayer, int, torch.Tensor, LayerStep], torch.Tensor]
"""A layer's feed-forward block: ``ffn(L, i, x, step)`` for normed input x [T, D] -> [T, D]."""


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def attention_groups(
    hidden_size: int, q_size: int, kv_size: int
) -> tuple[ProjectionGroup, ProjectionGroup]:
    """The attention block's fused Linears: q/k/v (columns q, k, v) and o."""
    qs, kvs, d = q_size, kv_size, hidden_size
    return (
        ("qkv", d, (("q_proj", 0, qs), ("k_proj", qs, qs + kvs), ("v_proj", qs + kvs, qs + 2 * kvs))),
        ("o", qs, (("o_proj", 0, d),)),
    )  # fmt: skip


def mlp_groups(hidden_size: int, inter: int) -> tuple[ProjectionGroup, ProjectionGroup]:
    """The gated MLP's fused Linears: gate/up (columns gate, up) and down."""
    return (
        ("gate_up", hidden_size, (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter))),
        ("down", inter, (("down_proj", 0, hidden_size),)),
    )


# -------------------------------------------------------------------------------- attention


class Attention:
    """The attention block: fused q/k/v Linear, optional per-head q/k RMSNorm, RoPE, paged
    attention with ``scale`` (scores soft-capped at ``softcap`` if given), o Linear, and the
    LoRA adds of the q/k/v and o groups; rotary and decode attention through ``ops``.

    Reads ``L.qkv``, ``L.o``, ``L.rope`` (index of the layer's rotary), ``L.window`` (its
    sliding window's masks, None: global), ``L.attend`` / ``L.decode`` (the layer's own
    attention functions, None: the block's and the ops') and, with ``qk_norm``, ``L.qk_norm`` (an
    :meth:`RMSNorm.per_head` norm) of the layer it is called with."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        qk_norm: bool,
        ops: LayerOps,
        softcap: float | None = None,
    ) -> None:
        self.ops = ops
        self.softcap = softcap
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qk_size = self.q_size + self.kv_size
        self.scale = scale
        self.qk_norm = qk_norm
        # soft-capped scores need the explicit path; everyone else keeps SDPA
        self.attend: AttendFn = (
            sdpa_attend if softcap is None else functools.partial(softcap_attend, cap=softcap)
        )
        self.groups = attention_groups(hidden_size, self.q_size, self.kv_size)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _same
        """Sum of a row-parallel output over tensor-parallel ranks (one rank: as it is)."""
        self.qkv_parts, self.o_parts = (g[2] for g in self.groups)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The fused projection's output ``[T, q + 2 kv]`` as (q and k heads ``[T, H + KVH,
        hd]``, v ``[T, KVH, hd]``, the output gate ``[T, q]`` or None: ungated)."""
        T, hd = qkv.shape[0], self.head_dim
        return qkv[:, : self.qk_size].view(T, -1, hd), qkv[:, self.qk_size :].view(T, -1, hd), None

    def __call__(self, L: DecoderLayer, i: int, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Layer ``i``'s attention output [T, D] for normed input ``x [T, D]`` (writes its KV)."""
        T = x.shape[0]
        qkv = L.qkv(x)  # [T, q + 2 kv]
        if step.lora_qkv:
            step.lora.add(i, self.qkv_parts, x, qkv, step.plan)
        qk, v, gate = self.split(qkv)
        qk = self.position_qk(L, qk, step)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H, hd], [T, KVH, hd]
        a = paged_attention(
            q, k, v, i, step.cache, step.attn_meta, self.scale, L.window,
            L.attend or self.attend, L.decode or self.ops.decode_attention, self.softcap,
        ).reshape(T, self.q_size)  # fmt: skip
        if gate is not None:  # an output-gated attention's (Qwen3.5)
            a = a * torch.sigmoid(gate)
        o = L.o(a)  # [T, D]
        if step.lora_o:
            step.lora.add(i, self.o_parts, a, o, step.plan)
        return self.reduce(o)

    def position_qk(self, L: DecoderLayer, qk: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """q and k as they attend and k is cached: the layer's per-head norm, then its rotary
        (a NoPE layer's q and k as projected). qk: [T, H + KVH, hd] -> the same shape (an
        architecture whose q/k path differs overrides this: Llama 4)."""
        if self.qk_norm:
            qk = L.qk_norm(qk)
        if L.rope is not None:  # NoPE layers attend with q and k as projected
            cos, sin = step.rope[L.rope]
            qk = self.ops.rotary(qk, cos, sin)
        return qk


# -------------------------------------------------------------------------------------- MLP


class GatedMLP:
    """The gated MLP: fused gate/up Linear, ``act(gate) * up``, down Linear, and the LoRA adds
    of the gate/up and down groups; the activation through ``ops``. Reads ``L.gate_up`` and
    ``L.down``."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, ops: LayerOps
    ) -> None:
        self.inter = intermediate_size
        self.hidden_act = hidden_act
        self.ops = ops
        self.groups = mlp_groups(hidden_size, intermediate_size)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _same
        """Sum of a row-parallel output over tensor-parallel ranks (one rank: as it is)."""
        self.gate_up_parts, self.down_parts = (g[2] for g in self.groups)

    def __call__(self, L: DecoderLayer, i: int, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Layer ``i``'s MLP output [T, D] for normed input ``x [T, D]``."""
        gu = L.gate_up(x)  # [T, 2 I]
        if step.lora_gate_up:
            step.lora.add(i, self.gate_up_parts, x, gu, step.plan)
        act = self.ops.gated(gu, self.inter, self.hidden_act)  # [T, I]
        d = L.down(act)  # [T, D]
        if step.lora_down:
            step.lora.add(i, self.down_parts, act, d, step.plan)
        return self.reduce(d)
