"""The Triton weight-only quantized GEMM vs a float64 reference of the dequantized weight, run by
Triton's CPU interpreter (no GPU needed).

Not collected by the suite itself: ``tests/model/test_quant_triton.py`` runs this file in its own
pytest process with ``TRITON_INTERPRET=1`` (``tests/interpreted.py`` says why). Shapes are tiny:
the interpreter is slow.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/model/test_quant_triton.py"
pytest.importorskip("triton")

from loraplex.model.quant.triton_gemm import TritonQuantLinear  # noqa: E402
from loraplex.model.quant.weights import QuantWeight  # noqa: E402

# float32: K <= 96 products of O(1) terms summed in float32; bf16: the dequantized weight and the
# output each rounded once to bf16 (2**-8 each), with margin
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}

CASES = [  # (out, in, bits, group size (None: per channel), zero points, act order, rows of x)
    (20, 64, 4, 32, True, False, 5),
    (17, 96, 4, 64, False, False, 1),  # a short last group, rows not a multiple of the tile
    (16, 64, 8, None, False, False, 18),
    (9, 64, 8, 32, True, True, 3),
    (33, 64, 4, 32, True, True, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_qgemm(case: tuple, dtype: torch.dtype) -> None:
    n, k, bits, gs, zp, act_order, rows = case
    g = torch.Generator().manual_seed(n * 1000 + k + bits)
    qw = QuantWeight.quantize(torch.randn(n, k, generator=g), bits, gs, asymmetric=zp,
                              bias=torch.randn(n, generator=g))  # fmt: skip
    if act_order:
        qw = replace(qw, perm=torch.randperm(k, generator=g))
    x = torch.randn(rows, k, generator=g).to(dtype)
    got = TritonQuantLinear(qw)(x)
    want = x.double() @ qw.dequantize(torch.float64).T + qw.bias.double()
    assert got.dtype == dtype and got.shape == (rows, n)
    err = (got.double() - want).abs().max().item()
    assert err <= TOL[dtype] * want.abs().max().item(), err


def test_refuses_what_it_cannot_read() -> None:
    from loraplex.model.quant.weights import ActQuant

    qw = QuantWeight.quantize(torch.randn(8, 64), 8, None)
    with pytest.raises(ValueError, match="unquantized activations"):
        TritonQuantLinear(replace(qw, act=ActQuant("int8")))


def test_engine_serves_a_gptq_base_on_the_triton_kernel(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole engine on the Triton kernel (what CUDA runs) for every integer projection:
    a mixed batch of adapters on a GPTQ act-order base equals the float reference."""
    from pathlib import Path

    from loraplex.model.quant import kernels
    from loraplex.testing import make_random_model
    from loraplex.testing.quant import write_gptq
    from tests.model.test_quantized_bases import _check_mixed_batch

    built: list[TritonQuantLinear] = []
    plain = kernels.QuantKernels.__call__

    def on_triton(self: kernels.QuantKernels, weight: object) -> object:
        if isinstance(weight, QuantWeight) and weight.act is None:
            built.append(TritonQuantLinear(weight))
            return built[-1]
        return plain(self, weight)

    monkeypatch.setattr(kernels.QuantKernels, "__call__", on_triton)
    tmp = Path(str(tmp_path))
    base = make_random_model(tmp / "base", "llama", hidden_size=64, intermediate_size=128)
    qdir, ref = write_gptq(base, tmp / "q", tmp / "ref", bits=4, group_size=32, sym=False,
                           act_order=True)  # fmt: skip
    _check_mixed_batch(qdir, ref, tmp)
    assert len(built) == 2 * 4  # every projection of both layers ran on the Triton kernel
