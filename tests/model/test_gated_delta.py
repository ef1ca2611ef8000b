"""The gated delta rule's backends against the torch one: the C decode step (the CPU backend
where it builds), and the Triton kernels (decode step, prefill chunk recurrence) under Triton's
CPU interpreter, in a pytest process of its own (``tests/interpreted.py`` says why): the checks
of ``tests/model/interpreted_gated_delta_triton.py``. The shared cases:
``tests/model/gated_delta_cases.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loraplex.model.gated_delta import GatedDeltaNet
from loraplex.model.gated_delta_cpu import CDeltaRule, DeltaRuleKernel, load_kernel
from loraplex.model.gated_delta_ops import DeltaDims, TorchDeltaRule, causal_conv
from loraplex.native.build import KERNEL_ISAS
from loraplex.testing.kernels import runnable_build
from tests.model.gated_delta_cases import DIMS, check_decode, random_inputs, random_pages


@pytest.fixture(scope="module", params=list(KERNEL_ISAS))
def kernel(request: pytest.FixtureRequest) -> DeltaRuleKernel:
    """The C kernel of each build this CPU can run (each test runs once per build)."""
    return runnable_build(load_kernel, request.param)


@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_decode_matches_torch(kernel, dims: str, dtype: torch.dtype) -> None:
    check_decode(CDeltaRule(DIMS[dims], kernel), dtype)


def test_c_decode_strided_rows(kernel) -> None:
    check_decode(CDeltaRule(DIMS["gqa"], kernel), torch.float32, strided=True)


def test_c_decode_real_head_dims(kernel) -> None:
    """Qwen3.5's head size (128) and GQA, in bfloat16 as served."""
    check_decode(CDeltaRule(DeltaDims(2, 4, 128, 128, 4), kernel), torch.bfloat16)


def test_c_decode_hands_what_it_does_not_read_to_torch(kernel) -> None:
    """float16 rows (no C element type): the torch decode's result, pages updated alike."""
    d = DIMS["gqa"]
    gen = torch.Generator().manual_seed(9)
    conv, rec = random_pages(d, torch.float16, gen)
    mixed, conv_w, g, beta = random_inputs(d, 2, torch.float16, gen)
    src, dst = torch.tensor([0, 3]), torch.tensor([1, 3])
    conv_t, rec_t = conv.clone(), rec.clone()
    want = TorchDeltaRule(d).decode(mixed, conv_w, g, beta, src, dst, conv_t, rec_t)
    got = CDeltaRule(d, kernel).decode(mixed, conv_w, g, beta, src, dst, conv, rec)
    assert torch.equal(got, want) and torch.equal(rec, rec_t) and torch.equal(conv, conv_t)


def test_cpu_block_picks_its_backend_once(
    kernel: DeltaRuleKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C decode where it builds; torch with the layer kernels switched off."""
    block = GatedDeltaNet(32, 2, 4, 16, 16, 4, 1e-6, torch.device("cpu"))
    assert type(block.rule) is CDeltaRule and block.rule.dims.hv == 4
    monkeypatch.setenv("LORAPLEX_LAYER_CPU_KERNEL", "0")
    block = GatedDeltaNet(32, 2, 4, 16, 16, 4, 1e-6, torch.device("cpu"))
    assert type(block.rule) is TorchDeltaRule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("channels", "n", "taps"), [(48, 37, 4), (20, 1, 3), (96, 300, 4)])
def test_causal_conv_is_conv1d(dtype: torch.dtype, channels: int, n: int, taps: int) -> None:
    """The prefill's time-major convolution against ``F.conv1d`` (transformers' op): float32
    sums of ``taps`` products in another order (a few ulp); bf16 outputs rounded once from
    float32 sums, so at most one bf16 step (2**-7 relative) apart where the sums straddle a
    rounding boundary."""
    g = torch.Generator().manual_seed(channels + n)
    seq = torch.randn(taps - 1 + n, channels, generator=g).to(dtype)
    w = torch.randn(channels, taps, generator=g).to(dtype)
    want = F.conv1d(seq.t()[None], w[:, None, :], groups=channels)[0].t()  # [n, C]
    got = causal_conv(seq, w)
    assert got.shape == (n, channels) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_triton_gated_delta_matches_torch_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    from tests.interpreted import run_interpreted

    # every case ran: 6 decode + 1 strided decode + 18 prefill comparisons, 1 selection check
    run_interpreted(Path(__file__).parent / "interpreted_gated_delta_triton.py", 6 + 1 + 18 + 1)


def test_skipped_snapshots_change_nothing_but_their_pages() -> None:
    """A prefill whose middle blocks get no snapshot page (the state pool had no room) gives
    the outputs and the snapshots of the pages it does write of a prefill that snapshots every
    block, and leaves the other pages untouched."""
    from loraplex.model.attention import NO_PAGE
    from loraplex.model.gated_delta_ops import TorchDeltaRule
    from tests.model.gated_delta_cases import DIMS, make_span, random_inputs, random_pages, seed

    d = DIMS["gqa"]
    gen = torch.Generator().manual_seed(seed("skip"))
    conv, rec = random_pages(d, torch.float32, gen)
    mixed, conv_w, g, beta = random_inputs(d, 60, torch.float32, gen)
    rule = TorchDeltaRule(d)
    conv_all, rec_all = conv.clone(), rec.clone()
    want = rule.prefill(mixed, conv_w, g, beta, make_span(60, 0, NO_PAGE, 16, [1, 4, 2, 6]),
                        16, conv_all, rec_all)  # fmt: skip
    got = rule.prefill(mixed, conv_w, g, beta, make_span(60, 0, NO_PAGE, 16, [NO_PAGE, 4, NO_PAGE, 6]),
                       16, conv, rec)  # fmt: skip
    assert torch.equal(got, want)
    for p in (4, 6):
        assert torch.equal(rec[p], rec_all[p]) and torch.equal(conv[p], conv_all[p])
    before = random_pages(d, torch.float32, torch.Generator().manual_seed(seed("skip")))
    for p in (1, 2):  # not written
        assert torch.equal(rec[p], before[1][p]) and torch.equal(conv[p], before[0][p])
