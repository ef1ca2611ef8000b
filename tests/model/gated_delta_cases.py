"""The cases both backends of the gated delta rule are checked on against the torch one (the C
decode step: ``test_gated_delta.py``; the Triton kernels: ``interpreted_gated_delta_triton.py``):
layer sizes, random pages and inputs, prefill spans, tolerances."""

from __future__ import annotations

import zlib

import torch

from loraplex.model.attention import NO_PAGE, StateSpan
from loraplex.model.gated_delta_ops import DeltaDims, DeltaRule, TorchDeltaRule

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


def seed(*parts: object) -> int:
    """A seed that is the same in every process (``hash()`` of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def random_pages(
    d: DeltaDims, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """Random conv pages [P, C, K-1] (dtype) and recurrent pages [P, Hv, dk, dv] (float32)."""
    conv = torch.randn(PAGES, d.conv_dim, d.kernel - 1, generator=gen).to(dtype)
    rec = torch.randn(PAGES, d.hv, d.dk, d.dv, generator=gen) * 0.3
    return conv, rec


def random_inputs(d: DeltaDims, n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    """mixed [n, C] (dtype), conv_w [C, K] (dtype), g, beta [n, Hv] float32."""
    mixed = torch.randn(n, d.conv_dim, generator=gen).to(dtype)
    conv_w = (torch.randn(d.conv_dim, d.kernel, generator=gen) / d.kernel**0.5).to(dtype)
    g = -torch.rand(n, d.hv, generator=gen) * 2
    beta = torch.rand(n, d.hv, generator=gen)
    return mixed, conv_w, g, beta


def make_span(n: int, start_pos: int, src: int, block: int, pages: list[int]) -> StateSpan:
    """A chunk of ``n`` tokens from ``start_pos``: a snapshot at each block end it crosses,
    then its end (``pages``: one per block it touches; NO_PAGE: that block's snapshot is not
    taken, as where the state pool has no room)."""
    lead = start_pos % block
    ends = [*range(block - lead, n, block), n]
    assert len(ends) == len(pages) and pages[-1] != NO_PAGE
    kept = [(e, p) for e, p in zip(ends, pages, strict=True) if p != NO_PAGE]
    return StateSpan(0, n, start_pos, src, [e for e, _ in kept], [p for _, p in kept])


SPANS = {
    # name: (tokens, start position, source page, block, pages written)
    "fresh": (37, 0, NO_PAGE, 16, [0, 3, 5]),
    "resumed-partial-block": (30, 21, 2, 16, [2, 4, 6]),  # lead 5; writes its source page
    "inside-one-block": (5, 3, 1, 16, [1]),
    "block-8": (20, 4, 3, 8, [3, 0, 6]),  # chunks narrower than tl.dot's 16 (padded)
    "ends-on-a-block": (28, 4, 5, 16, [5, 1]),
    "snapshots-skipped": (60, 0, NO_PAGE, 16, [NO_PAGE, 4, NO_PAGE, 6]),  # only some blocks'
}


def check_decode(rule: DeltaRule, dtype: torch.dtype, strided: bool = False) -> None:
    """``rule``'s decode step against the torch backend's on its dims: a row moving to a new
    page and rows staying on theirs (source == destination); ``strided``: the rows a column
    slice of a wider in-projection output (row stride > C), as the layer passes them. Both
    write into their own copy of the same pages; the whole page tensors are compared, so a
    write to a wrong page shows too."""
    d = rule.dims  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(seed(d, dtype, strided))
    conv, rec = random_pages(d, dtype, gen)
    mixed, conv_w, g, beta = random_inputs(d, 3, dtype, gen)
    if strided:
        mixed = torch.cat((mixed, torch.randn(3, 9, generator=gen).to(dtype)), 1)[:, : d.conv_dim]
    src = torch.tensor([4, 1, 6])
    dst = torch.tensor([2, 1, 6])  # row 0 moves on, rows 1 and 2 stay in their block
    conv_t, rec_t = conv.clone(), rec.clone()
    want = TorchDeltaRule(d).decode(mixed, conv_w, g, beta, src, dst, conv_t, rec_t)
    got = rule.decode(mixed, conv_w, g, beta, src, dst, conv, rec)
    assert got.shape == (3, d.hv, d.dv) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(rec, rec_t, **TOL[dtype])
    torch.testing.assert_close(conv, conv_t, atol=0, rtol=0)  # moved, not computed
