"""The Triton LoRA kernels under Triton's CPU interpreter, in a pytest process of their own
(``tests/interpreted.py`` says why): the checks of ``tests/lora/interpreted_triton_kernels.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.engine.test_mixed_batch_architectures import FAMILIES
from tests.interpreted import run_interpreted


def test_triton_kernels_match_the_torch_reference_under_the_interpreter() -> None:
    # every case ran: 26 kernel cases, one served mixed batch per architecture family, the
    # two MoE architectures, an activated LoRA's mixed batch, and composed adapters (2 kernel
    # cases, a served Llama and Qwen3-MoE batch)
    want = 26 + len(FAMILIES) + 2 + 1 + 4
    run_interpreted(Path(__file__).parent / "interpreted_triton_kernels.py", want)
