"""The gated delta rule's two hot ops as Triton kernels (the CUDA backend of
``loraplex.model.gated_delta.DeltaRule``).

Decode (:func:`_decode_kernel`): one program per (decode row, key head). It reads the row's
source and destination page ids itself, convolves the new token with the window of its source
page (and writes the shifted window to the destination page), applies silu, l2-normalises q
and k, then for each value head of the key head (GQA: ``Hv / Hk`` of them) and each tile of
``dv`` decays the state tile read from the source page, applies the delta rule, writes it to
the destination page and emits the output. A key head's channels belong to one program: the
source and destination pages are the same page while a row stays in its block, and a second
program reading the key's window after the first one wrote it would see the next step's.
Every program loads its window tiles before a barrier and stores after it, so no thread of the
program overwrites an element another thread has yet to read.

Prefill (:func:`_chunks_kernel`): the state-independent terms of the chunked rule (triangular
solves, within-chunk scores: :func:`loraplex.model.gated_delta.chunk_terms`) are batched torch
ops; the kernel runs the chunk-to-chunk recurrence, one program per (value head, ``dv`` tile),
and stores the state after each chunk straight into that chunk's page (ids read in-kernel).
The convolution of a prefill chunk and its window snapshots stay torch ops (one each per chunk).
``tl.dot`` runs at ``ieee`` precision: float32 throughout, as the torch reference.

Both kernels also run under Triton's CPU interpreter (``TRITON_INTERPRET=1``), which is how
the test suite checks them against the torch reference on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.model.gated_delta_ops import DeltaDims, TorchDeltaRule, chunk_rows, chunk_terms


@triton.jit
def _conv_step(
    x_ptr, w_ptr, src_ptr, dst_ptr, ch, cmask, stride_cc, stride_ck, KW, BW: tl.constexpr
):
    """silu(conv) of channels ``ch`` for the new token ``x[ch]``: window ``src`` (the last
    ``KW`` inputs) then the token, weights ``w [C, KW + 1]``; the shifted window into ``dst``.
    The result is rounded to the model dtype after the convolution and after silu (torch's
    ops in that dtype), returned in float32."""
    pos = tl.arange(0, BW)[None, :]  # window positions: KW old inputs, then the new token
    new = tl.load(x_ptr + ch, mask=cmask, other=0.0)[:, None]  # [N, 1]
    at = ch[:, None] * stride_cc
    old = tl.load(src_ptr + at + pos * stride_ck, mask=cmask[:, None] & (pos < KW), other=0.0)
    nxt = tl.load(
        src_ptr + at + (pos + 1) * stride_ck, mask=cmask[:, None] & (pos + 1 < KW), other=0.0
    )  # [N, BW] the window one step on
    w = tl.load(w_ptr + ch[:, None] * (KW + 1) + pos, mask=cmask[:, None] & (pos <= KW), other=0.0)
    win = tl.where(pos == KW, new, old)
    y = tl.sum(win.to(tl.float32) * w.to(tl.float32), axis=1)  # [N]
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = (y * tl.sigmoid(y)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.debug_barrier()  # every thread has read the window before any writes it (src == dst)
    nxt = tl.where(pos + 1 == KW, new, nxt)
    tl.store(dst_ptr + at + pos * stride_ck, nxt, mask=cmask[:, None] & (pos < KW))
    return y


@triton.jit
def _decode_kernel(
    x_ptr, w_ptr, g_ptr, beta_ptr, src_ptr, dst_ptr, conv_ptr, rec_ptr, out_ptr,
    stride_xb, stride_gb, stride_bb, stride_cp, stride_cc, stride_ck,
    stride_rp, stride_rh, stride_rk, stride_ob, stride_oh,
    DK, DV, KEY_SIZE, REP, KW, SCALE,
    BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    """Row ``b``'s step for key head ``hk`` and its ``REP`` value heads (module docstring)."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    src = tl.load(src_ptr + b).to(tl.int64)
    dst = tl.load(dst_ptr + b).to(tl.int64)
    x_row = x_ptr + b.to(tl.int64) * stride_xb
    win_src = conv_ptr + src * stride_cp
    win_dst = conv_ptr + dst * stride_cp
    kk = tl.arange(0, BK)
    kmask = kk < DK
    q = _conv_step(x_row, w_ptr, win_src, win_dst, hk * DK + kk, kmask, stride_cc, stride_ck,
                   KW, BW)  # fmt: skip
    k = _conv_step(x_row, w_ptr, win_src, win_dst, KEY_SIZE + hk * DK + kk, kmask, stride_cc,
                   stride_ck, KW, BW)  # fmt: skip
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * SCALE  # [BK]
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    for j in range(REP):
        h = hk * REP + j
        decay = tl.exp(tl.load(g_ptr + b * stride_gb + h))
        beta = tl.load(beta_ptr + b * stride_bb + h)
        for v0 in range(0, DV, BV):
            vv = v0 + tl.arange(0, BV)
            vmask = vv < DV
            v = _conv_step(x_row, w_ptr, win_src, win_dst, 2 * KEY_SIZE + h * DV + vv, vmask,
                           stride_cc, stride_ck, KW, BW)  # fmt: skip
            tile = h * stride_rh + kk[:, None] * stride_rk + vv[None, :]
            smask = kmask[:, None] & vmask[None, :]
            S = tl.load(rec_ptr + src * stride_rp + tile, mask=smask, other=0.0) * decay
            delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BV]
            S = S + k[:, None] * delta[None, :]  # [BK, BV]
            o = tl.sum(S * q[:, None], axis=0)
            tl.store(rec_ptr + dst * stride_rp + tile, S, mask=smask)
            tl.store(out_ptr + b * stride_ob + h * stride_oh + vv, o, mask=vmask)


@triton.jit
def _chunks_kernel(
    qd_ptr, attn_ptr, u_ptr, w_ptr, kd_ptr, end_ptr, s0_ptr, pages_ptr, rec_ptr, out_ptr,
    N, H, C, DK, DV, stride_rp, stride_rh, stride_rk,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Value head ``h``, value columns of tile ``program_id(1)``: the recurrence over the
    ``N`` chunks of :func:`loraplex.model.gated_delta_ops.chunked_rule`, terms ``[N, H, C, *]``
    contiguous, ``s0 [H, dk, dv]``, out ``[N, H, C, dv]``; the state after chunk ``c`` into
    page ``pages[c]`` (-1: none, the block has no snapshot)."""
    h = tl.program_id(0).to(tl.int64)
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BC)
    kk = tl.arange(0, BK)
    vmask, rmask, kmask = vv < DV, rows < C, kk < DK
    smask = kmask[:, None] & vmask[None, :]
    S = tl.load(s0_ptr + h * DK * DV + kk[:, None] * DV + vv[None, :], mask=smask, other=0.0)
    rk = rmask[:, None] & kmask[None, :]
    rv = rmask[:, None] & vmask[None, :]
    for c in range(N):
        base = (c * H + h) * C  # the chunk's first row
        at_k = (base + rows[:, None]) * DK + kk[None, :]  # [BC, BK]
        at_v = (base + rows[:, None]) * DV + vv[None, :]  # [BC, BV]
        w = tl.load(w_ptr + at_k, mask=rk, other=0.0)
        u = tl.load(u_ptr + at_v, mask=rv, other=0.0)
        vn = u - tl.dot(w, S, input_precision="ieee")  # [BC, BV]
        qd = tl.load(qd_ptr + at_k, mask=rk, other=0.0)
        attn = tl.load(
            attn_ptr + (base + rows[:, None]) * C + rows[None, :],
            mask=rmask[:, None] & rmask[None, :],
            other=0.0,
        )  # [BC, BC]
        o = tl.dot(qd, S, input_precision="ieee") + tl.dot(attn, vn, input_precision="ieee")
        tl.store(out_ptr + at_v, o, mask=rv)
        kd = tl.load(kd_ptr + at_k, mask=rk, other=0.0)
        end = tl.load(end_ptr + c * H + h)
        S = S * end + tl.dot(tl.trans(kd), vn, input_precision="ieee")
        page = tl.load(pages_ptr + c).to(tl.int64)
        if page >= 0:  # -1: a block without a snapshot
            tile = page * stride_rp + h * stride_rh + kk[:, None] * stride_rk + vv[None, :]
            tl.store(rec_ptr + tile, S, mask=smask)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


class TritonDeltaRule(TorchDeltaRule):
    """:class:`~loraplex.model.gated_delta.DeltaRule` with the decode step and the prefill's
    chunk recurrence as Triton kernels (module docstring); the prefill's convolution and
    chunk terms are the torch backend's."""

    name = "triton"

    def __init__(self, dims: DeltaDims, block_v: int = 32) -> None:
        super().__init__(dims)
        self.block_v = block_v  # dv columns per program tile

    def decode(
        self, mixed: torch.Tensor, conv_w: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        src: torch.Tensor, dst: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        d = self.dims
        B = mixed.shape[0]
        out = torch.empty(B, d.hv, d.dv, dtype=torch.float32, device=mixed.device)
        if B == 0:
            return out
        assert mixed.stride(1) == 1 and rec.stride(3) == 1 and conv_w.is_contiguous()
        _decode_kernel[(B, d.hk)](
            mixed, conv_w, g, beta, src, dst, conv, rec, out,
            mixed.stride(0), g.stride(0), beta.stride(0),
            conv.stride(0), conv.stride(1), conv.stride(2),
            rec.stride(0), rec.stride(1), rec.stride(2), out.stride(0), out.stride(1),
            d.dk, d.dv, d.key_size, d.hv // d.hk, d.kernel - 1, d.dk**-0.5,
            BK=_pow2(d.dk), BV=min(self.block_v, _pow2(d.dv)), BW=_pow2(d.kernel),
        )  # fmt: skip
        return out

    def rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, state: torch.Tensor, chunk: int, lead: int, pages: list[int],
        rec: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        L, H, dv = v.shape
        dk = k.shape[-1]
        t = chunk_terms(q, k, v, g, beta, chunk, lead)
        n = t.u.shape[0]
        assert len(pages) == n and rec.stride(3) == 1
        out = torch.empty(n, H, chunk, dv, dtype=torch.float32, device=q.device)
        pages_d = torch.tensor(pages, dtype=torch.int64, device=q.device)  # [n]
        bv = min(self.block_v, _pow2(dv, 16))
        qd, attn, u, w, kd, end = (x.contiguous() for x in t)
        _chunks_kernel[(H, triton.cdiv(dv, bv))](
            qd, attn, u, w, kd, end, state.contiguous(), pages_d, rec, out,
            n, H, chunk, dk, dv, rec.stride(0), rec.stride(1), rec.stride(2),
            BC=_pow2(chunk, 16), BK=_pow2(dk, 16), BV=bv,
        )  # fmt: skip
        return chunk_rows(out, lead, L)  # [L, H, dv]
