"""The Triton LoRA kernels under Triton's CPU interpreter, in a pytest process of their own.

Triton decides at import time whether ``@triton.jit`` functions (its own standard library's too)
are interpreted, so the checks in ``tests/lora/interpreted_triton_kernels.py`` need
``TRITON_INTERPRET=1`` before ``import triton``. Setting it here would leak into every later test
of the run; a child process keeps it to those checks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.engine.test_mixed_batch_architectures import FAMILIES

HERE = Path(__file__).parent


def test_triton_kernels_match_the_torch_reference_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(HERE / "interpreted_triton_kernels.py")],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    m = re.search(r"(\d+) passed", out)
    # every case ran: 22 kernel cases and one served mixed batch per architecture family
    want = 22 + len(FAMILIES) + 2  # and the two MoE architectures
    assert m is not None and int(m[1]) == want and "skipped" not in out, out
