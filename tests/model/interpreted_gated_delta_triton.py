"""The Triton gated delta rule (decode step, prefill chunk recurrence) vs the torch backend,
run by Triton's CPU interpreter (no GPU needed).

Not collected by the suite itself: ``tests/model/test_gated_delta.py`` runs this file in its
own pytest process with ``TRITON_INTERPRET=1`` (``tests/interpreted.py`` says why). Shapes are
small: the interpreter is slow. Both backends write into their own copy of the same pages;
the whole page tensors are compared, so a write to a wrong page shows too.
"""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/model/test_gated_delta.py"
pytest.importorskip("triton")

from loraplex.model.gated_delta import GatedDeltaNet, select_delta_rule  # noqa: E402
from loraplex.model.gated_delta_ops import TorchDeltaRule  # noqa: E402
from loraplex.model.gated_delta_triton import TritonDeltaRule  # noqa: E402
from tests.model.gated_delta_cases import (  # noqa: E402
    DIMS,
    SPANS,
    TOL,
    check_decode,
    make_span,
    random_inputs,
    random_pages,
    seed,
)


@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_torch(dims: str, dtype: torch.dtype) -> None:
    check_decode(TritonDeltaRule(DIMS[dims], block_v=16), dtype)


def test_decode_strided_rows() -> None:
    check_decode(TritonDeltaRule(DIMS["gqa"]), torch.float32, strided=True)


@pytest.mark.parametrize("case", list(SPANS))
@pytest.mark.parametrize("dims", ["mha", "gqa", "odd"])
def test_prefill_matches_torch(case: str, dims: str) -> None:
    d = DIMS[dims]
    n, start, src, block, written = SPANS[case]
    gen = torch.Generator().manual_seed(seed(case, dims))
    conv, rec = random_pages(d, torch.float32, gen)
    mixed, conv_w, g, beta = random_inputs(d, n, torch.float32, gen)
    sp = make_span(n, start, src, block, written)
    conv_t, rec_t = conv.clone(), rec.clone()
    want = TorchDeltaRule(d).prefill(mixed, conv_w, g, beta, sp, block, conv_t, rec_t)
    got = TritonDeltaRule(d, block_v=16).prefill(mixed, conv_w, g, beta, sp, block, conv, rec)
    assert got.shape == (n, d.hv, d.dv)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(rec, rec_t, **TOL[torch.float32])
    torch.testing.assert_close(conv, conv_t, atol=0, rtol=0)


def test_cuda_selects_triton() -> None:
    """The block picks its backend once, by device (no GPU needed to construct it)."""
    d = DIMS["gqa"]
    assert isinstance(select_delta_rule(torch.device("cuda"), d), TritonDeltaRule)
    assert not isinstance(select_delta_rule(torch.device("cpu"), d), TritonDeltaRule)
    block = GatedDeltaNet(32, d.hk, d.hv, d.dk, d.dv, d.kernel, 1e-6, torch.device("cuda", 0))
    assert block.rule.name == "triton" and block.rule.dims == d
