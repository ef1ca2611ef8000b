"""The gated delta rule's backends: the CPU block picks torch, and the Triton kernels (decode
step, prefill chunk recurrence) match the torch backend under Triton's CPU interpreter, in a
pytest process of its own (``tests/interpreted.py`` says why): the checks of
``tests/model/interpreted_gated_delta_triton.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.model.gated_delta import GatedDeltaNet
from loraplex.model.gated_delta_ops import TorchDeltaRule


def test_cpu_block_picks_torch_once() -> None:
    block = GatedDeltaNet(32, 2, 4, 16, 16, 4, 1e-6, torch.device("cpu"))
    assert type(block.rule) is TorchDeltaRule and block.rule.dims.hv == 4


def test_triton_gated_delta_matches_torch_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    from tests.interpreted import run_interpreted

    # every case ran: 6 decode + 1 strided decode + 15 prefill comparisons, 1 selection check
    run_interpreted(Path(__file__).parent / "interpreted_gated_delta_triton.py", 6 + 1 + 15 + 1)
