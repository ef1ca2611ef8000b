"""Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next) over the KV cache's state pages.

A linear-attention layer keeps, per sequence, the last ``kernel - 1`` inputs of its causal
depthwise convolution and a recurrent matrix ``S [Hv, dk, dv]`` instead of growing KV. Per
token ``t`` (after the convolution, q and k L2-normalised, q scaled by ``dk ** -0.5``)::

    S = exp(g_t) * S                       # decay, g_t = -exp(A_log) * softplus(a_t + dt_bias)
    S = S + k_t (beta_t * (v_t - k_t^T S))  # the delta rule, beta_t = sigmoid(b_t)
    o_t = q_t^T S

then ``o`` is RMS-normed per value head, gated by ``silu(z)`` and projected out. The
convolution and the recurrence over the state pages are a :class:`DeltaRule` backend chosen
once by device (``gated_delta_ops``: the ops and the torch backend, decode rows batched, a
prefill chunk in the chunked form with chunks aligned to KV blocks, so the state after every
full block is at hand as the block's snapshot, ``loraplex.kv.groups``: state groups;
``gated_delta_cpu``: the decode step in C; ``gated_delta_triton``: the CUDA kernels). They run
in float32 where transformers does.

:class:`StateMetadata` says, per step and state group, which state page each sequence reads
and which pages it writes (the runner builds it from the group's block table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loraplex.model.gated_delta_ops import DeltaDims, DeltaRule, TorchDeltaRule
from loraplex.model.layers import ProjectionGroup

if TYPE_CHECKING:
    from loraplex.model.layers import DecoderLayer, LayerStep


def select_delta_rule(device: torch.device, dims: DeltaDims) -> DeltaRule:
    """The backend for ``device``, chosen once at load: Triton's on CUDA; on CPU the C decode
    step where its kernel builds (``gated_delta_cpu``), else torch's."""
    if device.type == "cuda":
        try:
            from loraplex.model.gated_delta_triton import TritonDeltaRule
        except ImportError:  # no triton: the torch ops run on CUDA too
            return TorchDeltaRule(dims)
        return TritonDeltaRule(dims)
    if device.type == "cpu":
        from loraplex.model.gated_delta_cpu import load_delta_rule_kernel

        c = load_delta_rule_kernel(dims)
        if c is not None:
            return c
    return TorchDeltaRule(dims)


class GatedDeltaNet:
    """The linear-attention block: fused in-projection (``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``), causal depthwise convolution, the gated delta rule over the
    layer's state pages, gated RMSNorm and ``out_proj``, with the LoRA adds of both groups.

    Reads ``L.lin_in``, ``L.lin_out`` (Linears), ``L.conv_w [C, K]``, ``L.A [Hv]`` (``-exp(A_log)``
    in float32), ``L.dt_bias [Hv]`` and ``L.gnorm [dv]`` of the layer it is called with."""

    def __init__(
        self,
        hidden: int,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        kernel: int,
        eps: float,
        device: torch.device,
    ) -> None:
        self.hk, self.hv, self.dk, self.dv = key_heads, value_heads, key_dim, value_dim
        self.dims = DeltaDims(key_heads, value_heads, key_dim, value_dim, kernel)
        self.key_size, self.value_size = self.dims.key_size, self.dims.value_size
        self.conv_dim = self.dims.conv_dim
        self.kernel = kernel
        self.eps = eps
        self.rule = select_delta_rule(device, self.dims)  # the backend, once, by device
        cd, vs, hv, d = self.conv_dim, self.value_size, value_heads, hidden
        self.groups: tuple[ProjectionGroup, ProjectionGroup] = (
            ("lin_in", d, (("in_proj_qkv", 0, cd), ("in_proj_z", cd, cd + vs),
                           ("in_proj_b", cd + vs, cd + vs + hv),
                           ("in_proj_a", cd + vs + hv, cd + vs + 2 * hv))),
            ("lin_out", vs, (("out_proj", 0, d),)),
        )  # fmt: skip
        self.in_parts, self.out_parts = (g[2] for g in self.groups)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t

    def __call__(self, L: DecoderLayer, i: int, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Layer ``i``'s output [T, D] for normed input ``x [T, D]`` (reads and writes its
        state pages, ``step.attn_meta.states``)."""
        T = x.shape[0]
        proj = L.lin_in(x)  # [T, conv + value + 2 Hv]
        lora = step.lora
        if lora is not None and step.plan is not None:
            lora.add(i, self.in_parts, x, proj, step.plan)
        cd, vs, hv = self.conv_dim, self.value_size, self.hv
        mixed, z = proj[:, :cd], proj[:, cd : cd + vs]
        b, a = proj[:, cd + vs : cd + vs + hv], proj[:, cd + vs + hv :]
        beta = b.sigmoid().float()  # [T, Hv]
        g = L.A * F.softplus(a.float() + L.dt_bias)  # [T, Hv] log decay, float32
        cache, meta = step.cache, step.attn_meta
        sm = meta.states[cache.group_of[i]]
        conv_pages, rec_pages = cache.layer_state(i)  # [P, C, K-1], [P, Hv, dk, dv]
        core = torch.empty(T, hv, self.dv, dtype=torch.float32, device=x.device)
        rule = self.rule
        if sm.decode_src is not None:
            assert sm.decode_dst is not None
            rows = meta.decode_tokens
            core[rows] = rule.decode(mixed[rows], L.conv_w, g[rows], beta[rows], sm.decode_src,
                                     sm.decode_dst, conv_pages, rec_pages)  # fmt: skip
        for span in sm.prefills:
            s, e = span.tok_start, span.tok_end
            core[s:e] = rule.prefill(mixed[s:e], L.conv_w, g[s:e], beta[s:e], span,
                                     cache.block_size, conv_pages, rec_pages)  # fmt: skip
        o = core.to(x.dtype).reshape(T * hv, self.dv).float()  # rounded as transformers does
        normed = F.rms_norm(o, (self.dv,), None, self.eps).to(x.dtype) * L.gnorm
        gated = (normed.float() * F.silu(z.reshape(T * hv, self.dv).float())).to(x.dtype)
        gated = gated.reshape(T, vs)
        out = L.lin_out(gated)  # [T, D]
        if lora is not None and step.plan is not None:
            lora.add(i, self.out_parts, gated, out, step.plan)
        return self.reduce(out)
