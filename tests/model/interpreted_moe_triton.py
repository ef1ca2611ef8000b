"""The Triton grouped-experts GEMM vs a float64 torch reference, run by Triton's CPU interpreter
(no GPU needed).

Not collected by the suite itself: Triton reads ``TRITON_INTERPRET`` when it is imported, so
``tests/model/test_moe_triton.py`` runs this file in its own pytest process with the variable set,
and no other test of the run sees it. Shapes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/model/test_moe_triton.py"
pytest.importorskip("triton")

from loraplex.model import moe_triton  # noqa: E402
from loraplex.model.moe_triton import TritonGroupedExperts, tile_table  # noqa: E402


def _seed(*parts: object) -> int:
    """A seed that is the same in every process (``hash()`` of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def _offsets(counts: list[int]) -> torch.Tensor:
    """[E + 1] int64 prefix sums of ``counts``."""
    return torch.tensor([0, *counts]).cumsum(0)


def _reference(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """out[rows of e] = x[rows of e] @ w[e].T in float64, one expert at a time."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = x[start : start + n].double() @ w[e].double().T
            start += n
    return out


def _inputs(counts: list[int], k: int, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x [N, K], w [E, M, K] (scaled so outputs are O(1)) in ``dtype``, and the offsets."""
    g = torch.Generator().manual_seed(_seed(counts, k, m))
    x = torch.randn(sum(counts), k, generator=g).to(dtype)
    w = (torch.randn(len(counts), m, k, generator=g) / k**0.5).to(dtype)
    return x, w, _offsets(counts)


# Tolerances from each dtype's arithmetic: float32 accumulation over K <= 48 of O(1) terms, and
# for bf16/fp16 the output's rounding (half an ulp: 2**-8 for bf16's 8-bit mantissa, 2**-11
# for fp16's 11 bits), with a factor 2 of margin; the inputs themselves are exact in float32.
TOL: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-5, rtol=2**-7),
    torch.float16: dict(atol=1e-5, rtol=2**-10),
}

CASES = {
    # name: rows per expert
    "uneven": [5, 0, 17, 1, 0, 9],  # zero-count experts in the middle, one > one block
    "first-last-empty": [0, 7, 20, 0],
    "below-one-block": [3, 0, 2],  # N < BLOCK_T
    "one-expert": [33],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,m", [(48, 40), (20, 33)])  # the second: neither a multiple of 16
def test_grouped_matches_reference(case: str, dtype: torch.dtype, k: int, m: int) -> None:
    counts = CASES[case]
    x, w, offsets = _inputs(counts, k, m, dtype)
    out = TritonGroupedExperts()(x, w, offsets, counts)
    assert out.shape == (sum(counts), m) and out.dtype == dtype
    torch.testing.assert_close(out.double(), _reference(x, w, counts), **TOL[dtype])


def test_float16() -> None:
    counts = [4, 0, 19]
    x, w, offsets = _inputs(counts, 24, 18, torch.float16)
    out = TritonGroupedExperts()(x, w, offsets, counts)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), _reference(x, w, counts), **TOL[torch.float16])


def test_experts_without_rows_are_never_read() -> None:
    """The unused experts' weights are NaN: any load of them into a result would show."""
    counts = [0, 6, 0, 18, 0]
    x, w, offsets = _inputs(counts, 40, 24, torch.float32)
    for e, n in enumerate(counts):
        if n == 0:
            w[e] = float("nan")
    out = TritonGroupedExperts()(x, w, offsets, counts)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _reference(x, w, counts), **TOL[torch.float32])


def test_no_rows() -> None:
    """N == 0 (every expert empty): an empty [0, M] and no launch."""
    counts = [0, 0, 0]
    x, w, offsets = _inputs(counts, 16, 24, torch.bfloat16)
    out = TritonGroupedExperts()(x, w, offsets, counts)
    assert out.shape == (0, 24) and out.dtype == torch.bfloat16


def test_non_contiguous_x() -> None:
    """x a column slice of a wider tensor (row stride != K): read through its strides."""
    counts = [9, 0, 12]
    _, w, offsets = _inputs(counts, 20, 17, torch.float32)
    wide = torch.randn(sum(counts), 50, generator=torch.Generator().manual_seed(3))
    x = wide[:, 5:25]
    assert not x.is_contiguous()
    out = TritonGroupedExperts()(x, w, offsets, counts)
    torch.testing.assert_close(out.double(), _reference(x, w, counts), **TOL[torch.float32])


def test_tile_table_skips_empty_experts_and_never_spans_two() -> None:
    got = tile_table([0, 5, 0, 20, 16, 0], 16).tolist()
    assert got == [[1, 0], [3, 5], [3, 21], [4, 25]]
    assert tile_table([0, 0], 16).shape == (0, 2)


class _CountingKernel:
    """Wraps a Triton kernel to record the grid of every launch."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.grids.append(grid)
        return self.kernel[grid]


def test_one_launch_with_programs_only_for_experts_with_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = [5, 0, 17, 0, 1]
    x, w, offsets = _inputs(counts, 16, 40, torch.float32)
    counting = _CountingKernel(moe_triton._grouped_kernel)
    monkeypatch.setattr(moe_triton, "_grouped_kernel", counting)
    grouped = TritonGroupedExperts(block_t=16, block_m=16, block_k=16)
    out = grouped(x, w, offsets, counts)
    # tiles: 1 (expert 0) + 2 (expert 2) + 1 (expert 4); ceil(40 / 16) = 3 output tiles
    assert counting.grids == [(4, 3)]
    torch.testing.assert_close(out.double(), _reference(x, w, counts), **TOL[torch.float32])
