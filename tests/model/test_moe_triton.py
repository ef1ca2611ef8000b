"""The Triton grouped-experts GEMM under Triton's CPU interpreter, in a pytest process of its own.

Triton decides at import time whether ``@triton.jit`` functions (its own standard library's too)
are interpreted, so the checks in ``tests/model/interpreted_moe_triton.py`` need
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

HERE = Path(__file__).parent


def test_grouped_experts_kernel_matches_the_torch_reference_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(HERE / "interpreted_moe_triton.py")],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    m = re.search(r"(\d+) passed", out)
    # every case ran: 16 parametrized comparisons and 6 single checks
    assert m is not None and int(m[1]) == 16 + 6 and "skipped" not in out, out
