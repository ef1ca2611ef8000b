"""Triton kernels for the gathered LoRA ops (the CUDA backend), over the rank-row layout.

Segmented GEMMs in the style of punica's SGMV, adapted to ``loraplex.lora.slots``: segment ``s``
says tokens ``[ts, te)`` use rank rows ``[rs, re)`` of every module's tables. One program
computes one (segment, token tile, output tile); it reads only its segment's rows, so each
adapter's weights are read once per token tile and a rank-8 adapter never touches the rows of a
rank-64 one. Tiles are converted to float32 before ``tl.dot``: ``ieee`` precision for float32
models (exact), ``tf32`` otherwise (exact for bf16/fp16 inputs, whose mantissas fit in tf32).

The embedding's LoRA (``embed``) is the expand kernel reading y's rows at the tokens' ids in
the transposed A table: its shrink is a gather.

Weighted plans (a composed request's scales, ``loraplex.lora.plan``): the expand multiplies
each segment's tile by its weight; it is launched once per layer of the plan, so no two
programs add into one token's output row (a shrink writes each (token, row) cell once).

The kernels also run under Triton's CPU interpreter (``TRITON_INTERPRET=1``), which is how the
test suite checks them against the torch reference on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.lora.ops import PerModuleOps
from loraplex.lora.plan import LoRABatchPlan


@triton.jit
def _segment(seg_ptr, seg):
    """(tok_start, tok_end, row_start, row_end) of segment ``seg`` from the [S, 4] table."""
    base = seg_ptr + 4 * seg
    return tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3)


@triton.jit
def _tile(ptr, rows, cols, stride, rmask, cmask):
    """ptr[rows, cols] as float32, zero where masked: a [len(rows), len(cols)] tile."""
    return tl.load(
        ptr + rows[:, None] * stride + cols[None, :],
        mask=rmask[:, None] & cmask[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    seg_ptr,
    d_in,
    stride_x,
    stride_a,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
):
    """y[t, r] = sum_k x[t, k] * a[r, k] for t in [ts, te), r in [rs, re) of one segment."""
    ts, te, rs, re = _segment(seg_ptr, tl.program_id(0))
    toks = ts + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] token indices
    rows = rs + tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rank rows
    tmask = toks < te
    rmask = rows < re
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < d_in
        x = _tile(x_ptr, toks, ks, stride_x, tmask, kmask)  # [BM, BK]
        a = _tile(a_ptr, rows, ks, stride_a, rmask, kmask)  # [BN, BK]
        acc += tl.dot(x, tl.trans(a), input_precision=PREC)
    tl.store(
        y_ptr + toks[:, None] * stride_y + rows[None, :], acc, mask=tmask[:, None] & rmask[None, :]
    )


@triton.jit
def _expand_kernel(
    y_ptr,
    bt_ptr,
    out_ptr,
    seg_ptr,
    ids_ptr,
    d_out,
    stride_y,
    stride_bt,
    stride_out,
    w_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
    GATHER: tl.constexpr,
    WEIGHTED: tl.constexpr,
):
    """out[t, c] += w * sum_{r in [rs, re)} y[t, r] * bt[r, c] for t in [ts, te) of one segment
    (``w``: the segment's weight with ``WEIGHTED``, else 1); with ``GATHER`` y's row of token t
    is ``ids[t]`` (the embedding: y is A transposed)."""
    ts, te, rs, re = _segment(seg_ptr, tl.program_id(0))
    toks = ts + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
    tmask = toks < te
    cmask = cols < d_out
    if GATHER:
        y_rows = tl.load(ids_ptr + toks, mask=tmask, other=0)  # [BM] token ids
    else:
        y_rows = toks
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(rs, re, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        rmask = rows < re
        y = _tile(y_ptr, y_rows, rows, stride_y, tmask, rmask)  # [BM, BK]
        bt = _tile(bt_ptr, rows, cols, stride_bt, rmask, cmask)  # [BK, BN]
        acc += tl.dot(y, bt, input_precision=PREC)
    if WEIGHTED:
        acc = acc * tl.load(w_ptr + tl.program_id(0))
    ptrs = out_ptr + toks[:, None] * stride_out + cols[None, :]
    omask = tmask[:, None] & cmask[None, :]
    cur = tl.load(ptrs, mask=omask, other=0.0).to(tl.float32)
    tl.store(ptrs, (cur + acc).to(out_ptr.dtype.element_ty), mask=omask)


class TritonLoRAOps(PerModuleOps):
    """``LoRAOps`` over ``plan.segments`` with the kernels above (coalesced runs are not needed:
    one launch covers every segment)."""

    name = "triton"
    BLOCK_M = 16
    SHRINK_N, SHRINK_K = 16, 64
    EXPAND_N, EXPAND_K = 64, 16

    def __init__(self) -> None:
        # (plan, segment table, max tokens, max rows, per layer (segments, weights or None,
        # max tokens)); holds the plan so its identity stays unique
        self._meta: tuple[LoRABatchPlan, torch.Tensor, int, int, list] | None = None

    def table_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def _segments(self, plan: LoRABatchPlan, device: torch.device) -> tuple[torch.Tensor, int, int]:
        """Segment table [S, 4] int32 on the device, built once per plan (shared by all modules)."""
        return self._plan_meta(plan, device)[:3]

    def _plan_meta(self, plan: LoRABatchPlan, device: torch.device) -> tuple:
        """``(segments [S, 4], max tokens, max rows, layers)``: ``layers`` per layer of the plan
        ``(its segments [S_l, 4], their weights [S_l] float32 or None, max tokens)``."""
        if self._meta is None or self._meta[0] is not plan or self._meta[1].device != device:
            segs = torch.tensor(plan.segments, dtype=torch.int32).reshape(-1, 4).to(device)
            max_t = max((te - ts for ts, te, _, _ in plan.segments), default=0)
            max_r = max((re - rs for _, _, rs, re in plan.segments), default=0)
            w_all = None
            if plan.weights is not None:
                w_all = torch.tensor(plan.weights, dtype=torch.float32).to(device)  # [S]
            layers = []
            for l0, l1 in plan.layer_bounds():
                if l1 > l0:
                    lt = max(te - ts for ts, te, _, _ in plan.segments[l0:l1])
                    layers.append((segs[l0:l1], None if w_all is None else w_all[l0:l1], lt))
            self._meta = (plan, segs, max_t, max_r, layers)
        return self._meta[1:]

    @staticmethod
    def _precision(*tensors: torch.Tensor) -> str:
        """``ieee`` for float32 models (exact); ``tf32`` holds bf16/fp16 inputs exactly."""
        return "ieee" if any(t.dtype == torch.float32 for t in tensors) else "tf32"

    def shrink(self, x: torch.Tensor, a: torch.Tensor, plan: LoRABatchPlan) -> torch.Tensor:
        """See ``LoRAOps.shrink``; y is float32 [T, plan.num_rows]."""
        y = torch.zeros(plan.num_tokens, plan.num_rows, dtype=torch.float32, device=x.device)
        segs, max_t, max_r = self._segments(plan, x.device)
        if not plan.segments:
            return y
        x = x.contiguous()  # x: [T, d_in]
        grid = (segs.shape[0], triton.cdiv(max_t, self.BLOCK_M), triton.cdiv(max_r, self.SHRINK_N))
        _shrink_kernel[grid](
            x, a, y, segs, x.shape[1], x.stride(0), a.stride(0), y.stride(0),
            BLOCK_M=self.BLOCK_M, BLOCK_N=self.SHRINK_N, BLOCK_K=self.SHRINK_K,
            PREC=self._precision(x, a),
        )  # fmt: skip
        return y

    def expand(
        self, y: torch.Tensor, bt: torch.Tensor, out: torch.Tensor, plan: LoRABatchPlan
    ) -> None:
        """See ``LoRAOps.expand``; ``out`` may be a column slice (row stride != width)."""
        layers = self._plan_meta(plan, out.device)[3]
        if not plan.segments:
            return
        if out.stride(1) != 1:
            raise ValueError("TritonLoRAOps.expand needs out with unit column stride")
        # y is a float32 accumulator: the precision follows the model's tables
        self._expand_layers(y.contiguous(), bt, out, None, layers, self._precision(bt))

    def _expand_layers(
        self,
        y: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        ids: torch.Tensor | None,
        layers: list,
        prec: str,
    ) -> None:
        """The expand kernel over each layer of a plan, one launch per layer (disjoint tokens
        within it); ``ids``: y's row of each token (the embedding's gather), else its own."""
        d_out = out.shape[1]
        for segs, w, max_t in layers:
            grid = (
                segs.shape[0],
                triton.cdiv(max_t, self.BLOCK_M),
                triton.cdiv(d_out, self.EXPAND_N),
            )
            _expand_kernel[grid](
                y, bt, out, segs, segs if ids is None else ids, d_out, y.stride(0),
                bt.stride(0), out.stride(0), segs if w is None else w,
                BLOCK_M=self.BLOCK_M, BLOCK_N=self.EXPAND_N, BLOCK_K=self.EXPAND_K,
                PREC=prec, GATHER=ids is not None, WEIGHTED=w is not None,
            )  # fmt: skip

    def embed(
        self,
        ids: torch.Tensor,
        at: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        """See ``LoRAOps.embed``: the expand kernel reading each token's rank-row activations
        straight from row ``ids[t]`` of ``at`` (no gathered copy)."""
        layers = self._plan_meta(plan, out.device)[3]
        if not plan.segments:
            return
        if out.stride(1) != 1 or at.stride(1) != 1:
            raise ValueError("TritonLoRAOps.embed needs out and at with unit column stride")
        self._expand_layers(at, bt, out, ids, layers, self._precision(at, bt))

    def apply(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        """See ``LoRAOps.apply``: two launches, y kept in float32 between them."""
        self.expand(self.shrink(x, a, plan), bt, out, plan)
