"""The Triton quantized GEMM under Triton's CPU interpreter, in a pytest process of its own
(``tests/interpreted.py`` says why): the checks of ``tests/model/interpreted_quant_triton.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.interpreted import run_interpreted


def test_quantized_gemm_kernel_matches_the_reference_under_the_interpreter() -> None:
    # every case ran: 5 shapes x 2 dtypes, the refusal and the engine on the kernel
    run_interpreted(Path(__file__).parent / "interpreted_quant_triton.py", 5 * 2 + 2)
