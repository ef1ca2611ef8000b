"""The grouped mixture-of-experts GEMM as one Triton kernel (the CUDA backend of
``loraplex.model.moe.GroupedExperts``).

The rows are sorted by expert, so expert ``e``'s rows are the block ``[offsets[e],
offsets[e+1])``. The host cuts every expert's block into row tiles of ``BLOCK_T`` (a tile never
spans two experts) and lists them in a ``[num_tiles, 2]`` int32 table of (expert, first row),
built from ``counts`` with numpy. One launch covers a grid of (row tile, output tile); each
program reads its expert from the table, its rows' end from ``offsets`` and computes
``x[rows] @ w[e, cols].T`` over K. An expert without rows has no tile, so no program exists
for it and no byte of its weights is read. Tiles are converted to float32 before ``tl.dot``:
``ieee`` precision for float32 operands (exact), ``tf32`` otherwise (exact for bf16/fp16
inputs, whose mantissas fit in tf32).

The kernel also runs under Triton's CPU interpreter (``TRITON_INTERPRET=1``), which is how the
test suite checks it against a torch reference on machines without a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    tiles_ptr,
    offsets_ptr,
    M,
    K,
    stride_xn,
    stride_xk,
    stride_we,
    stride_wm,
    stride_wk,
    stride_on,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
):
    """out[t, m] = sum_k x[t, k] * w[e, m, k] for the rows t of one tile, all of expert e."""
    e = tl.load(tiles_ptr + 2 * tl.program_id(0)).to(tl.int64)  # the tile's expert
    start = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)  # its first row
    end = tl.load(offsets_ptr + e + 1)  # the end of expert e's rows
    rows = start.to(tl.int64) + tl.arange(0, BLOCK_T)  # [BT] rows of x and out
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] output features
    rmask = rows < end
    cmask = cols < M
    w_e = w_ptr + e * stride_we  # expert e's [M, K] weights
    acc = tl.zeros((BLOCK_T, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xn + ks[None, :] * stride_xk,
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BT, BK]
        w = tl.load(
            w_e + cols[:, None] * stride_wm + ks[None, :] * stride_wk,
            mask=cmask[:, None] & kmask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BM, BK]
        acc += tl.dot(x, tl.trans(w), input_precision=PREC)
    tl.store(
        out_ptr + rows[:, None] * stride_on + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & cmask[None, :],
    )


def tile_table(counts: list[int], block_t: int) -> np.ndarray:
    """(expert, first row) of every row tile, [num_tiles, 2] int32: each expert's block of
    ``counts[e]`` rows cut into ``ceil(counts[e] / block_t)`` tiles, none for an empty expert."""
    c = np.asarray(counts, dtype=np.int64)  # [E]
    n_tiles = -(-c // block_t)  # [E] tiles per expert
    expert = np.repeat(np.arange(len(c)), n_tiles)  # [num_tiles]
    first_tile = np.cumsum(n_tiles) - n_tiles  # [E] index of each expert's first tile
    first_row = np.cumsum(c) - c  # [E] offsets[e]
    within = np.arange(len(expert)) - first_tile[expert]  # [num_tiles] tile index in its expert
    start = first_row[expert] + within * block_t
    return np.stack([expert, start], axis=1).astype(np.int32)


class TritonGroupedExperts:
    """``GroupedExperts`` in one Triton launch per call (module docstring). Block sizes are
    small under the interpreter, whose cost grows with the tile size."""

    name = "triton-grouped"

    def __init__(
        self, block_t: int | None = None, block_m: int | None = None, block_k: int | None = None
    ) -> None:
        small = os.environ.get("TRITON_INTERPRET") == "1"
        self.block_t = block_t or (16 if small else 32)  # rows per tile (tl.dot needs >= 16)
        self.block_m = block_m or (16 if small else 64)  # output features per tile
        self.block_k = block_k or (16 if small else 64)  # reduction step
        # the last call's tile table on its device: a layer's two GEMMs share one routing
        self._tiles: tuple[tuple[int, ...], torch.device, torch.Tensor] | None = None

    def prepare(self, w: torch.Tensor, make: object) -> torch.Tensor:
        """The experts as they are: one ``[E, M, K]`` tensor the kernel indexes."""
        return w

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        """Grouped GEMM over rows sorted by expert: ``x [N, K]``, ``w [E, M, K]`` (nn.Linear
        orientation), ``offsets [E + 1]`` int64 on x's device and ``counts`` the same as E
        Python ints. Returns ``out [N, M]`` in x's dtype with ``out[offsets[e]:offsets[e+1]] =
        x[offsets[e]:offsets[e+1]] @ w[e].T``, accumulated in float32; an expert without rows
        is never read."""
        n, k = x.shape
        m = w.shape[1]
        out = x.new_empty(n, m)  # [N, M]
        if n == 0:
            return out
        key = tuple(counts)
        cached = self._tiles
        if cached is not None and cached[0] == key and cached[1] == x.device:
            tiles_d = cached[2]
        else:
            tiles_d = torch.from_numpy(tile_table(counts, self.block_t)).to(x.device)
            self._tiles = (key, x.device, tiles_d)  # [num_tiles, 2] int32
        if len(tiles_d) == 0:
            return out
        prec = "ieee" if torch.float32 in (x.dtype, w.dtype) else "tf32"
        grid = (len(tiles_d), triton.cdiv(m, self.block_m))
        _grouped_kernel[grid](
            x, w, out, tiles_d, offsets, m, k,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
            BLOCK_T=self.block_t, BLOCK_M=self.block_m, BLOCK_K=self.block_k, PREC=prec,
        )  # fmt: skip
        return out
