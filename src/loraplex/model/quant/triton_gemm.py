"""The weight-only quantized GEMM as one Triton kernel (the CUDA path of ``QuantWeight``).

Reads the :class:`~loraplex.model.quant.weights.QuantWeight` layout as stored: one program per
(row tile of x, tile of output features) walks K in blocks of 32 columns (one packed block of
the int4 layout: byte ``16 b + i`` holds column ``32 b + i`` in its low nibble and ``32 b + i +
16`` in its high one), unpacks the tile's weights, subtracts the group's zero point, scales by
its scale and accumulates ``x @ W.T`` in float32 with ``tl.dot`` (``ieee`` precision for
float32 x, ``tf32`` otherwise: exact for bf16/fp16 operands, and the dequantized weight is
rounded to x's dtype first, as a bf16 GEMM on dequantized weights would be). Act-order weights
gather x by ``perm`` on the host first.

Checked against a float64 reference under Triton's CPU interpreter (``TRITON_INTERPRET=1``),
which is how the suite runs it without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from loraplex.model.quant.linear import QuantLinearBase
from loraplex.model.quant.weights import QuantWeight


@triton.jit
def _qgemm_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    T,
    N,
    K,
    G,
    GS,
    stride_xt,
    stride_ot,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):
    """out[t, n] = sum_k x[t, k] * s[n, k // GS] * (q[n, k] - z[n, k // GS]), one tile."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BN]
    rmask = rows < T
    cmask = cols < N
    i = tl.arange(0, 32)  # the columns of one packed block
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 32):
        ks = k0 + i  # [32]
        kmask = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + ks[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        )  # [BT, 32]
        m = cmask[:, None] & kmask[None, :]
        if BITS == 4:
            byte = tl.load(
                q_ptr + cols[:, None] * (K // 2) + (k0 // 2 + i % 16)[None, :], mask=m, other=0
            ).to(tl.int32)  # [BN, 32] the byte holding each column
            v = (byte >> ((i // 16) * 4)[None, :]) & 15
        else:
            v = tl.load(q_ptr + cols[:, None] * K + ks[None, :], mask=m, other=0).to(tl.int32)
        g = ks // GS  # [32]
        s = tl.load(s_ptr + cols[:, None] * G + g[None, :], mask=m, other=0.0)  # [BN, 32]
        w = v.to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + cols[:, None] * G + g[None, :], mask=m, other=0).to(tl.float32)
            w = w - z
        w = (w * s).to(x.dtype)  # the dequantized weight in x's dtype
        acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=PREC)
    tl.store(
        out_ptr + rows[:, None] * stride_ot + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & cmask[None, :],
    )


class TritonQuantLinear(QuantLinearBase):
    """A ``Linear`` over a :class:`QuantWeight` on the GPU, in one launch per call (module
    docstring). Tiles are small under the interpreter, whose cost grows with the tile."""

    name = "triton-qgemm"

    def __init__(self, weight: QuantWeight) -> None:
        if weight.act is not None:
            raise ValueError("the Triton kernel reads unquantized activations only")
        if weight.in_features % 32:
            raise ValueError("the Triton kernel needs in_features a multiple of 32")
        super().__init__(weight)
        small = os.environ.get("TRITON_INTERPRET") == "1"
        self.block_t = 16  # tl.dot needs >= 16
        self.block_n = 16 if small else 64

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        assert isinstance(q, QuantWeight)
        x = self._gather(x).contiguous()
        t = x.shape[0]
        out = x.new_empty(t, self.out_features)
        if t == 0:
            return out
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        zeros = q.zeros if q.zeros is not None else q.scales  # unread without zero points
        grid = (triton.cdiv(t, self.block_t), triton.cdiv(self.out_features, self.block_n))
        _qgemm_kernel[grid](
            x, q.q, q.scales, zeros, out, t, self.out_features, self.in_features,
            q.scales.shape[1], q.group_size, x.stride(0), out.stride(0),
            BITS=q.bits, HAS_ZEROS=q.zeros is not None, BLOCK_T=self.block_t,
            BLOCK_N=self.block_n, PREC=prec,
        )  # fmt: skip
        return self._add_bias(out)
