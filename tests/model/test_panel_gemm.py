"""The panel GEMM kernel (``loraplex.model.panel_gemm``) on each build this CPU can run: its
products against float64, its weight read back exactly, how the model chooses it against
oneDNN, and a model served on it (the merger reading its weights back too).

Tolerances from the arithmetic: float32 sums of K products in another order than float64's
(a few ulp times sqrt(K) of the terms' size); in bf16 the products of bf16 values are exact in
float32, so the only differences are that summation order and the final rounding to bf16 (half
a bf16 ulp).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.model import linear
from loraplex.model.linear import dense_weight
from loraplex.model.panel_gemm import PanelKernel, PanelLinear, load_panel_kernel
from loraplex.testing.kernels import runnable_build

F32_EPS = torch.finfo(torch.float32).eps
BF16_HALF_ULP = 2.0**-8


@pytest.fixture(scope="module", params=["native", "avx2"])
def kernel(request: pytest.FixtureRequest) -> PanelKernel:
    """Each vector build this CPU can run (the portable build computes nothing)."""
    k = runnable_build(load_panel_kernel, request.param)
    if not k.dtypes:
        pytest.skip("this build computes no dtype with vectors")
    return k


def _dtypes(kernel: PanelKernel) -> list[torch.dtype]:
    return [d for d in (torch.float32, torch.bfloat16) if d in kernel.dtypes]


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(70, 96), (32, 33), (3, 200)])
def test_products_against_float64(kernel, rows, n, k):
    """Partial last panels, an odd K, row counts around the block size; with a bias."""
    g = torch.Generator().manual_seed(rows * 100 + n)
    for dtype in _dtypes(kernel):
        w = torch.randn(n, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype)
        x = torch.randn(rows, k, generator=g).to(dtype)
        got = PanelLinear(kernel, w, bias)(x)
        assert got.dtype == dtype and got.shape == (rows, n)
        exact = x.double() @ w.double().T + bias.double()
        terms = (x.double().abs() @ w.double().abs().T) + bias.double().abs()
        bound = 4 * k**0.5 * F32_EPS * terms
        if dtype == torch.bfloat16:
            bound = bound + BF16_HALF_ULP * exact.abs()
        assert bool(((got.double() - exact).abs() <= bound).all())
        assert torch.equal(PanelLinear(kernel, w, None).dense_weight(), w)


def test_strided_input_and_the_merger_reads_the_weight(kernel):
    g = torch.Generator().manual_seed(9)
    dtype = _dtypes(kernel)[0]
    w = torch.randn(40, 64, generator=g).to(dtype)
    lin = PanelLinear(kernel, w, None)
    wide = torch.randn(6, 128, generator=g).to(dtype)
    x = wide[:, ::2]  # inner stride 2
    torch.testing.assert_close(lin(x), lin(x.contiguous()), rtol=0, atol=0)
    got_w, got_b = dense_weight(lin, 64)
    assert torch.equal(got_w, w) and got_b is None


def test_the_choice_is_timed_against_onednn_and_logged(monkeypatch, caplog):
    linear._panel_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="loraplex.model.linear"):
        name, _ = linear.select_linear_factory(torch.device("cpu"), torch.float32, probe=(96, 64))
    assert name in ("panel", "onednn-packed")
    if linear._packed_works(torch.float32) and torch.float32 in load_panel_kernel().dtypes:
        assert "panel vs oneDNN us 1 rows" in caplog.text  # the times behind the choice
    assert linear.select_linear_factory(torch.device("cpu"), torch.float32)[0] != "panel"
    monkeypatch.setenv("LORAPLEX_LAYER_CPU_KERNEL", "0")
    linear._panel_choice.cache_clear()
    assert linear.select_linear_factory(torch.device("cpu"), torch.float32, probe=(96, 64))[0] in (
        "onednn-packed",
        "dense",
    )
    linear._panel_choice.cache_clear()


def test_a_model_on_the_panel_kernel_matches_onednn(tiny_model: Path, monkeypatch):
    """float32: the same greedy tokens, and logprobs within float32's summation-order error, as
    the oneDNN / dense build of the same model."""
    kernel = load_panel_kernel()
    if torch.float32 not in kernel.dtypes:
        pytest.skip("this CPU's panel build does not compute float32")
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    prompts = [[5, 9, 11, 2], [7, 3]]
    runs = {}
    for chosen in (True, False):
        factory = (lambda w, b: PanelLinear(kernel, w, b)) if chosen else None
        monkeypatch.setattr(linear, "_panel_choice", lambda *a, f=factory: f)
        llm = LLM(str(tiny_model), dtype="float32", enable_lora=False)
        assert (llm.engine.model.linear_impl == "panel") is chosen
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        runs[chosen] = outs
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(la.logprob - lb.logprob) <= 1e-4
            for t, v in la.top.items():
                assert abs(v - lb.top[t]) <= 1e-4
