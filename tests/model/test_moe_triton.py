"""The Triton grouped-experts GEMM under Triton's CPU interpreter, in a pytest process of its own
(``tests/interpreted.py`` says why): the checks of ``tests/model/interpreted_moe_triton.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.interpreted import run_interpreted


def test_grouped_experts_kernel_matches_the_torch_reference_under_the_interpreter() -> None:
    # every case ran: 16 parametrized comparisons and 6 single checks
    run_interpreted(Path(__file__).parent / "interpreted_moe_triton.py", 16 + 6)
