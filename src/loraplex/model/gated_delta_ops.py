"""The gated delta rule's ops (Gated DeltaNet: Qwen3.5, Qwen3-Next) and their torch backend.

Per token ``t`` (after the convolution, q and k L2-normalised, q scaled by ``dk ** -0.5``)::

    S = exp(g_t) * S                       # decay, g_t = -exp(A_log) * softplus(a_t + dt_bias)
    S = S + k_t (beta_t * (v_t - k_t^T S))  # the delta rule, beta_t = sigmoid(b_t)
    o_t = q_t^T S

Decode rows run that recurrence batched (:func:`recurrent_step`); a prefill chunk runs the
chunked form (:func:`chunked_rule`: within a chunk the delta rule's updates condense into
triangular solves) with chunks aligned to KV blocks, so the state after every full block is at
hand as the block's snapshot. :class:`DeltaRule` is what a backend does over the KV cache's
state pages (the convolution included); :class:`TorchDeltaRule` is the reference (and the
backend where no other applies); ``gated_delta_cpu`` runs its decode step in C on CPU,
``gated_delta_triton`` both ops as Triton kernels on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from loraplex.model.attention import NO_PAGE, StateSpan


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


class ChunkTerms(NamedTuple):
    """A sequence's chunked gated delta rule before the chunk-to-chunk recurrence, each over
    ``[n, H, C, ...]`` (``n`` chunks of ``C`` positions, padding included; chunk-major, so a
    chunk's terms are contiguous), float32."""

    qd: torch.Tensor  # [n, H, C, dk] queries decayed from the chunk's start
    attn: torch.Tensor  # [n, H, C, C] within-chunk scores (causal, decayed)
    u: torch.Tensor  # [n, H, C, dv] the chunk's condensed delta-rule values
    w: torch.Tensor  # [n, H, C, dk] what they lose to the chunk-start state, per key
    kd: torch.Tensor  # [n, H, C, dk] keys decayed to the chunk's end
    end_decay: torch.Tensor  # [n, H] the decay over the whole chunk


def chunk_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int,
    lead: int,
) -> ChunkTerms:
    """The state-independent part of :func:`chunked_rule` (its arguments, less the state)."""
    L, H = k.shape[:2]
    n = -(-(lead + L) // chunk)
    tail = n * chunk - lead - L

    def padded(x: torch.Tensor) -> torch.Tensor:  # [L, H, *] -> [n, H, chunk, *]
        x = F.pad(x, (*([0, 0] * (x.dim() - 1)), lead, tail))
        return x.reshape(n, chunk, H, *x.shape[2:]).transpose(1, 2).contiguous()

    q, k, v, g, beta = (padded(x) for x in (q, k, v, g, beta))  # [n, H, C, ...]
    kb, vb = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [n, H, C] log decay from the chunk's start
    diff = cum[..., :, None] - cum[..., None, :]  # [n, H, C, C]: decay from j to i
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = diff.masked_fill(~lower, float("-inf")).exp()
    # (I + strictly-lower(kb k^T * decay)) u = vb: the chunk's delta-rule values, condensed
    system = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, kb * cum.exp()[..., None], upper=False, unitriangular=True
    )
    return ChunkTerms(
        qd=q * cum.exp()[..., None],  # queries read the chunk-start state decayed to them
        attn=(q @ k.transpose(-1, -2)) * decay,
        u=u,
        w=w,
        kd=k * (cum[..., -1:] - cum).exp()[..., None],
        end_decay=cum[..., -1].exp(),
    )


def chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
    lead: int = 0,
    into: list[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The gated delta rule over one sequence's ``L`` tokens in chunks of ``chunk``, the first
    chunk holding ``lead`` padding positions before the first token (so chunk ends fall on block
    boundaries). q, k [L, H, dk] (normalised, q scaled), v [L, H, dv], g, beta [L, H] (float32),
    state [H, dk, dv] (float32, the state before the first token). Returns (o [L, H, dv], the
    state after each chunk: new tensors, or ``into[c]`` where given (not None), e.g. state
    pages; the first may be ``state`` itself). Padding has beta = 0 and g = 0: it neither decays nor
    writes::

        for c in chunks:
            vn = u[c] - w[c] @ S;  o[c] = qd[c] @ S + attn[c] @ vn
            S = end_decay[c] * S + kd[c]^T @ vn         # snapshot c
    """
    L, H, dv = v.shape
    t = chunk_terms(q, k, v, g, beta, chunk, lead)
    n = t.u.shape[0]
    out = torch.empty(n, H, chunk, dv, dtype=torch.float32, device=q.device)
    states = []
    for c in range(n):
        vn = torch.baddbmm(t.u[c], t.w[c], state, alpha=-1)  # [H, C, dv]: u less w @ state
        torch.bmm(t.attn[c], vn, out=out[c])
        out[c].baddbmm_(t.qd[c], state)
        nxt = into[c] if into is not None else None
        if nxt is None:
            nxt = torch.empty_like(state)
        torch.mul(state, t.end_decay[c, :, None, None], out=nxt)  # may be state itself
        nxt.baddbmm_(t.kd[c].transpose(-1, -2), vn)
        states.append(nxt)
        state = nxt
    return chunk_rows(out, lead, L), states


def chunk_rows(out: torch.Tensor, lead: int, L: int) -> torch.Tensor:
    """``[n, H, C, dv]`` per chunk position -> ``[L, H, dv]`` per token (padding dropped)."""
    n, H, C, dv = out.shape
    return out.transpose(1, 2).reshape(n * C, H, dv)[lead : lead + L]


def causal_conv(seq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The depthwise causal convolution over time-major ``seq [K - 1 + n, C]`` (the window,
    then the new rows) with ``w [C, K]``: ``y[t] = sum_i seq[t + i] * w[:, i]`` summed in
    float32 tap by tap and rounded once to seq's dtype, ``[n, C]`` (``F.conv1d``'s result,
    which on CPU is up to 1.8 times slower in float32 and needs channel-major copies)."""
    K = w.shape[1]
    n = seq.shape[0] - K + 1
    s, wf = seq.float(), w.float()
    y = s[:n] * wf[:, 0]  # [n, C]
    for i in range(1, K):
        y.addcmul_(s[i : i + n], wf[:, i])
    return y.to(seq.dtype)


@dataclass(frozen=True)
class DeltaDims:
    """A linear-attention layer's sizes: key/value heads and head dims, convolution kernel."""

    hk: int
    hv: int
    dk: int
    dv: int
    kernel: int

    @property
    def key_size(self) -> int:
        return self.hk * self.dk

    @property
    def value_size(self) -> int:
        return self.hv * self.dv

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_size + self.value_size


class DeltaRule(Protocol):
    """The convolution and the gated delta rule over state pages, one backend per device
    (``loraplex.model.gated_delta.select_delta_rule``). ``mixed`` rows are the in-projection's ``[N, conv_dim]`` in
    the model dtype, ``conv_w [C, K]``, ``g``/``beta [N, Hv]`` float32, pages as
    ``cache.layer_state``: ``conv [P, C, K-1]`` (model dtype), ``rec [P, Hv, dk, dv]``
    (float32). Outputs are ``[N, Hv, dv]`` float32."""

    name: str

    def decode(
        self, mixed: torch.Tensor, conv_w: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        src: torch.Tensor, dst: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """One token per row: window and state from page ``src[b]``, new ones into
        ``dst[b]`` (the same page when the row stays in its block)::

            x = silu(conv_w . [conv[src], mixed]);  conv[dst] = window[1:]
            q, k, v = split(x) (q, k l2-normed, q * dk^-0.5, key heads repeated)
            o, rec[dst] = recurrent_step(q, k, v, g, beta, rec[src])"""
        ...

    def prefill(
        self, mixed: torch.Tensor, conv_w: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        span: StateSpan, block_size: int, conv: torch.Tensor, rec: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """One chunk of one sequence (``span``): from page ``span.src`` (NO_PAGE: zeros), the
        chunked rule with chunks ending at block ends; the window and state after
        ``span.ends[j]`` tokens into ``span.pages[j]``."""
        ...


class TorchDeltaRule:
    """:class:`DeltaRule` in torch ops (the reference)."""

    name = "torch"

    def __init__(self, dims: DeltaDims) -> None:
        self.dims = dims

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the convolved ``[N, conv]`` rows into q, k [N, Hv, dk] (normalised, q scaled,
        key heads repeated for their value heads) and v [N, Hv, dv], float32."""
        d = self.dims
        N, rep = x.shape[0], d.hv // d.hk
        q, k, v = x.float().split((d.key_size, d.key_size, d.value_size), dim=-1)
        q = l2norm(q.reshape(N, d.hk, d.dk)).repeat_interleave(rep, dim=1)
        k = l2norm(k.reshape(N, d.hk, d.dk)).repeat_interleave(rep, dim=1)
        return q * d.dk**-0.5, k, v.reshape(N, d.hv, d.dv)

    def decode(
        self, mixed: torch.Tensor, conv_w: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        src: torch.Tensor, dst: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        window = torch.cat((conv[src], mixed[:, :, None]), dim=-1)  # [B, C, K]
        conv.index_copy_(0, dst, window[:, :, 1:])
        y = F.conv1d(window, conv_w[:, None, :], groups=self.dims.conv_dim)[:, :, 0]  # [B, C]
        q, k, v = self.qkv(F.silu(y))
        o, state = recurrent_step(q, k, v, g, beta, rec[src])
        rec.index_copy_(0, dst, state)
        return o

    def prefill(
        self, mixed: torch.Tensor, conv_w: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        span: StateSpan, block_size: int, conv: torch.Tensor, rec: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        K = self.dims.kernel
        if span.src == NO_PAGE:
            prev = mixed.new_zeros(self.dims.conv_dim, K - 1)
            state = rec.new_zeros(rec.shape[1:])
        else:
            prev, state = conv[span.src], rec[span.src]
        seq = torch.cat((prev.t(), mixed))  # [K - 1 + n, C], time-major
        q, k, v = self.qkv(F.silu(causal_conv(seq, conv_w)))
        lead = span.start_pos % block_size  # chunks end at the block boundaries the span crosses
        pages = [NO_PAGE] * -(-(lead + mixed.shape[0]) // block_size)  # per chunk: its snapshot
        for end, page in zip(span.ends, span.pages, strict=True):
            conv[page] = seq[end : end + K - 1].t()
            pages[(lead + end - 1) // block_size] = page
        return self.rule(q, k, v, g, beta, state, block_size, lead, pages, rec)

    def rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, state: torch.Tensor, chunk: int, lead: int, pages: list[int],
        rec: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """:func:`chunked_rule`, the state after chunk ``j`` into ``rec[pages[j]]`` (a chunk
        whose page is NO_PAGE: a block without a snapshot, its state only carried on)."""
        into = [rec[p] if p != NO_PAGE else None for p in pages]
        return chunked_rule(q, k, v, g, beta, state, chunk, lead, into)[0]
