"""Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next) over the KV cache's state pages.

A linear-attention layer keeps, per sequence, the last ``kernel - 1`` inputs of its causal
depthwise convolution and a recurrent matrix ``S [Hv, dk, dv]`` instead of growing KV. Per
token ``t`` (after the convolution, q and k L2-normalised, q scaled by ``dk ** -0.5``)::

    S = exp(g_t) * S                       # decay, g_t = -exp(A_log) * softplus(a_t + dt_bias)
    S = S + k_t (beta_t * (v_t - k_t^T S))  # the delta rule, beta_t = sigmoid(b_t)
    o_t = q_t^T S

then ``o`` is RMS-normed per value head, gated by ``silu(z)`` and projected out. Decode rows run
that recurrence batched (:func:`recurrent_step`); a prefill chunk runs the chunked form
(:func:`chunked_rule`: within a chunk the delta rule's updates condense into triangular solves)
with chunks aligned to KV blocks, so the state after every full block is at hand as the
block's snapshot (``loraplex.kv.groups``: state groups). The convolution and the recurrence run
in float32 where transformers does (the reference).

:class:`StateMetadata` says, per step and state group, which state page each sequence reads
and which pages it writes (the runner builds it from the group's block table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loraplex.model.attention import NO_PAGE, StateMetadata, StateSpan
from loraplex.model.layers import ProjectionGroup

if TYPE_CHECKING:
    from loraplex.model.layers import DecoderLayer, LayerStep


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (FLA's and transformers')."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k [B, H, dk] (normalised, q scaled), v [B, H, dv], g, beta [B, H],
    state [B, H, dk, dv] (float32) -> (o [B, H, dv], the new state)."""
    state = state * g.exp()[..., None, None]
    kv = torch.einsum("bhkv,bhk->bhv", state, k)  # what the state predicts for k
    delta = (v - kv) * beta[..., None]  # [B, H, dv]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
    lead: int = 0,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The gated delta rule over one sequence's ``L`` tokens in chunks of ``chunk``, the first
    chunk holding ``lead`` padding positions before the first token (so chunk ends fall on block
    boundaries). q, k [L, H, dk] (normalised, q scaled), v [L, H, dv], g, beta [L, H] (float32),
    state [H, dk, dv] (float32, the state before the first token). Returns (o [L, H, dv], the
    state after each chunk). Padding has beta = 0 and g = 0: it neither decays nor writes."""
    L, H = k.shape[:2]
    dv = v.shape[-1]
    n = -(-(lead + L) // chunk)
    tail = n * chunk - lead - L

    def padded(x: torch.Tensor) -> torch.Tensor:  # [L, H, *] -> [H, n, chunk, *]
        x = F.pad(x, (*([0, 0] * (x.dim() - 1)), lead, tail))
        return x.reshape(n, chunk, H, *x.shape[2:]).movedim(2, 0)

    q, k, v, g, beta = (padded(x) for x in (q, k, v, g, beta))  # [H, n, C, ...]
    kb, vb = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [H, n, C] log decay from the chunk's start
    diff = cum[..., :, None] - cum[..., None, :]  # [H, n, C, C]: decay from j to i
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = diff.masked_fill(~lower, float("-inf")).exp()
    # (I + strictly-lower(kb k^T * decay)) u = vb: the chunk's delta-rule values, condensed
    system = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, kb * cum.exp()[..., None], upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay  # [H, n, C, C] within-chunk scores
    qd = q * cum.exp()[..., None]  # queries read the chunk-start state decayed to them
    kd = k * (cum[..., -1:] - cum).exp()[..., None]  # keys decayed to the chunk's end
    end_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    out = torch.empty(H, n, chunk, dv, dtype=torch.float32, device=q.device)
    states = []
    for c in range(n):
        vn = u[:, c] - w[:, c] @ state  # [H, C, dv]: values less what the state predicts
        out[:, c] = qd[:, c] @ state + attn[:, c] @ vn
        state = state * end_decay[:, c] + kd[:, c].transpose(-1, -2) @ vn
        states.append(state)
    o = out.reshape(H, n * chunk, dv)[:, lead : lead + L].transpose(0, 1)  # [L, H, dv]
    return o, states


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
    ) -> None:
        self.hk, self.hv, self.dk, self.dv = key_heads, value_heads, key_dim, value_dim
        self.key_size, self.value_size = key_heads * key_dim, value_heads * value_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.kernel = kernel
        self.eps = eps
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
        if sm.decode_src is not None:
            rows = meta.decode_tokens
            self._decode(L, mixed[rows], g[rows], beta[rows], sm, conv_pages, rec_pages, core, rows)
        for span in sm.prefills:
            s, e = span.tok_start, span.tok_end
            self._prefill(
                L, mixed[s:e], g[s:e], beta[s:e], span, conv_pages, rec_pages, core,
                cache.block_size,
            )  # fmt: skip
        o = core.to(x.dtype).reshape(T * hv, self.dv).float()  # rounded as transformers does
        normed = F.rms_norm(o, (self.dv,), None, self.eps).to(x.dtype) * L.gnorm
        gated = (normed.float() * F.silu(z.reshape(T * hv, self.dv).float())).to(x.dtype)
        gated = gated.reshape(T, vs)
        out = L.lin_out(gated)  # [T, D]
        if lora is not None and step.plan is not None:
            lora.add(i, self.out_parts, gated, out, step.plan)
        return self.reduce(out)

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the convolved ``[N, conv]`` rows into q, k [N, Hv, dk] (normalised, q scaled,
        key heads repeated for their value heads) and v [N, Hv, dv], float32."""
        N, rep = mixed.shape[0], self.hv // self.hk
        q, k, v = mixed.float().split((self.key_size, self.key_size, self.value_size), dim=-1)
        q = l2norm(q.reshape(N, self.hk, self.dk)).repeat_interleave(rep, dim=1)
        k = l2norm(k.reshape(N, self.hk, self.dk)).repeat_interleave(rep, dim=1)
        return q * self.dk**-0.5, k, v.reshape(N, self.hv, self.dv)

    def _decode(
        self,
        L: DecoderLayer,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        sm: StateMetadata,
        conv_pages: torch.Tensor,
        rec_pages: torch.Tensor,
        core: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """One token for each decode row, states from ``decode_src`` into ``decode_dst``."""
        assert sm.decode_src is not None and sm.decode_dst is not None
        window = torch.cat((conv_pages[sm.decode_src], mixed[:, :, None]), dim=-1)  # [B, C, K]
        conv_pages.index_copy_(0, sm.decode_dst, window[:, :, 1:])
        y = F.conv1d(window, L.conv_w[:, None, :], groups=self.conv_dim)[:, :, 0]  # [B, C]
        q, k, v = self._qkv(F.silu(y))
        o, state = recurrent_step(q, k, v, g, beta, rec_pages[sm.decode_src])
        rec_pages.index_copy_(0, sm.decode_dst, state)
        core[rows] = o

    def _prefill(
        self,
        L: DecoderLayer,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        span: StateSpan,
        conv_pages: torch.Tensor,
        rec_pages: torch.Tensor,
        core: torch.Tensor,
        block_size: int,
    ) -> None:
        """One chunk of one sequence; its state after each block it fills (and after its last
        token) into that block's page."""
        K = self.kernel
        if span.src == NO_PAGE:
            prev = mixed.new_zeros(self.conv_dim, K - 1)
            state = rec_pages.new_zeros(rec_pages.shape[1:])
        else:
            prev, state = conv_pages[span.src], rec_pages[span.src]
        seq = torch.cat((prev, mixed.t()), dim=-1)  # [C, K - 1 + n]
        y = F.conv1d(seq[None], L.conv_w[:, None, :], groups=self.conv_dim)[0]  # [C, n]
        q, k, v = self._qkv(F.silu(y.t()))
        chunk = block_size  # chunks end at the block boundaries the span crosses
        lead = span.start_pos % block_size
        o, states = chunked_rule(q, k, v, g, beta, state, chunk, lead)
        core[span.tok_start : span.tok_end] = o
        for end, page in zip(span.ends, span.pages, strict=True):
            conv_pages[page] = seq[:, end : end + K - 1]
            rec_pages[page] = states[(lead + end - 1) // chunk]  # the chunk ending there
