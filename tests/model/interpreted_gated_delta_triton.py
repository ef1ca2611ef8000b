"""The Triton gated delta rule (decode step, prefill chunk recurrence) vs the torch backend,
run by Triton's CPU interpreter (no GPU needed).

Not collected by the suite itself: ``tests/model/test_gated_delta.py`` runs this file in its
own pytest process with ``TRITON_INTERPRET=1`` (``tests/interpreted.py`` says why). Shapes are
small: the interpreter is slow. Both backends write into their own copy of the same pages;
the whole page tensors are compared, so a write to a wrong page shows too.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/model/test_gated_delta.py"
pytest.importorskip("triton")

from loraplex.model.attention import NO_PAGE, StateSpan  # noqa: E402
from loraplex.model.gated_delta import GatedDeltaNet, select_delta_rule  # noqa: E402
from loraplex.model.gated_delta_ops import DeltaDims, TorchDeltaRule  # noqa: E402
from loraplex.model.gated_delta_triton import TritonDeltaRule  # noqa: E402

PAGES = 7

DIMS = {
    # name: key heads, value heads, dk, dv, kernel
    "mha": DeltaDims(2, 2, 16, 16, 4),
    "gqa": DeltaDims(2, 4, 16, 32, 4),  # Hv = 2 Hk, dv over two tiles of 16
    "odd": DeltaDims(1, 3, 12, 20, 3),  # dims no power of two, kernel 3
}

# float32: the same float32 arithmetic in another order, through a few dozen steps of a
# contraction (states O(1)). bfloat16: the convolution's output and silu are rounded to
# bf16 (8-bit mantissa) in both backends, but a sum in another order may round across a
# bf16 step: one ulp (2**-8 relative) of an O(1) input to the rule, with margin.
TOL: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def _seed(*parts: object) -> int:
    """A seed that is the same in every process (``hash()`` of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def _pages(d: DeltaDims, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random conv pages [P, C, K-1] (dtype) and recurrent pages [P, Hv, dk, dv] (float32)."""
    conv = torch.randn(PAGES, d.conv_dim, d.kernel - 1, generator=gen).to(dtype)
    rec = torch.randn(PAGES, d.hv, d.dk, d.dv, generator=gen) * 0.3
    return conv, rec


def _inputs(d: DeltaDims, n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    """mixed [n, C] (dtype), conv_w [C, K] (dtype), g, beta [n, Hv] float32."""
    mixed = torch.randn(n, d.conv_dim, generator=gen).to(dtype)
    conv_w = (torch.randn(d.conv_dim, d.kernel, generator=gen) / d.kernel**0.5).to(dtype)
    g = -torch.rand(n, d.hv, generator=gen) * 2
    beta = torch.rand(n, d.hv, generator=gen)
    return mixed, conv_w, g, beta


@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_torch(dims: str, dtype: torch.dtype) -> None:
    """Rows moving to a new page and rows staying on theirs (source == destination)."""
    d = DIMS[dims]
    gen = torch.Generator().manual_seed(_seed(dims, dtype))
    conv, rec = _pages(d, dtype, gen)
    mixed, conv_w, g, beta = _inputs(d, 3, dtype, gen)
    src = torch.tensor([4, 1, 6])
    dst = torch.tensor([2, 1, 6])  # row 0 moves on, rows 1 and 2 stay in their block
    conv_t, rec_t = conv.clone(), rec.clone()
    want = TorchDeltaRule(d).decode(mixed, conv_w, g, beta, src, dst, conv_t, rec_t)
    got = TritonDeltaRule(d, block_v=16).decode(mixed, conv_w, g, beta, src, dst, conv, rec)
    assert got.shape == (3, d.hv, d.dv) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(rec, rec_t, **TOL[dtype])
    torch.testing.assert_close(conv, conv_t, atol=0, rtol=0)  # moved, not computed


def test_decode_strided_rows() -> None:
    """The decode rows as a column slice of the wider in-projection output (row stride > C),
    as the layer passes them."""
    d = DIMS["gqa"]
    gen = torch.Generator().manual_seed(5)
    conv, rec = _pages(d, torch.float32, gen)
    wide, conv_w, g, beta = _inputs(d, 4, torch.float32, gen)
    wide = torch.cat((wide, torch.randn(4, 9, generator=gen)), dim=1)
    mixed = wide[:, : d.conv_dim]
    src, dst = torch.tensor([0, 3, 5, 2]), torch.tensor([1, 3, 6, 2])
    conv_t, rec_t = conv.clone(), rec.clone()
    want = TorchDeltaRule(d).decode(mixed, conv_w, g, beta, src, dst, conv_t, rec_t)
    got = TritonDeltaRule(d).decode(mixed, conv_w, g, beta, src, dst, conv, rec)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(rec, rec_t, **TOL[torch.float32])
    torch.testing.assert_close(conv, conv_t, atol=0, rtol=0)


def _span(n: int, start_pos: int, src: int, block: int, pages: list[int]) -> StateSpan:
    """A chunk of ``n`` tokens from ``start_pos``: a snapshot at each block end it crosses,
    then its end (``pages``: one per block it touches)."""
    lead = start_pos % block
    ends = [*range(block - lead, n, block), n]
    assert len(ends) == len(pages)
    return StateSpan(0, n, start_pos, src, ends, pages)


SPANS = {
    # name: (tokens, start position, source page, block, pages written)
    "fresh": (37, 0, NO_PAGE, 16, [0, 3, 5]),
    "resumed-partial-block": (30, 21, 2, 16, [2, 4, 6]),  # lead 5; writes its source page
    "inside-one-block": (5, 3, 1, 16, [1]),
    "block-8": (20, 4, 3, 8, [3, 0, 6]),  # chunks narrower than tl.dot's 16 (padded)
    "ends-on-a-block": (28, 4, 5, 16, [5, 1]),
}


@pytest.mark.parametrize("span", list(SPANS))
@pytest.mark.parametrize("dims", ["mha", "gqa", "odd"])
def test_prefill_matches_torch(span: str, dims: str) -> None:
    d = DIMS[dims]
    n, start, src, block, pages = SPANS[span]
    gen = torch.Generator().manual_seed(_seed(span, dims))
    conv, rec = _pages(d, torch.float32, gen)
    mixed, conv_w, g, beta = _inputs(d, n, torch.float32, gen)
    sp = _span(n, start, src, block, pages)
    conv_t, rec_t = conv.clone(), rec.clone()
    want = TorchDeltaRule(d).prefill(mixed, conv_w, g, beta, sp, block, conv_t, rec_t)
    got = TritonDeltaRule(d, block_v=16).prefill(mixed, conv_w, g, beta, sp, block, conv, rec)
    assert got.shape == (n, d.hv, d.dv)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(rec, rec_t, **TOL[torch.float32])
    torch.testing.assert_close(conv, conv_t, atol=0, rtol=0)


def test_cuda_selects_triton_and_cpu_torch() -> None:
    """The block picks its backend once, by device (no GPU needed to construct it)."""
    d = DIMS["gqa"]
    assert isinstance(select_delta_rule(torch.device("cuda"), d), TritonDeltaRule)
    assert type(select_delta_rule(torch.device("cpu"), d)) is TorchDeltaRule
    block = GatedDeltaNet(32, d.hk, d.hv, d.dk, d.dv, d.kernel, 1e-6, torch.device("cuda", 0))
    assert block.rule.name == "triton" and block.rule.dims == d
