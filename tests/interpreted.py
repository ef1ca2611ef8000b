"""Run a file of Triton checks under Triton's CPU interpreter, in a pytest process of its own.

Triton decides at import time whether ``@triton.jit`` functions (its own standard library's too)
are interpreted, so such checks need ``TRITON_INTERPRET=1`` before ``import triton``. Setting it
in this process would leak into every later test of the run; a child process keeps it to them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def run_interpreted(path: Path, want_passed: int) -> None:
    """Run the checks in ``path`` interpreted; every one of them (``want_passed``) must pass,
    none skipped."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    m = re.search(r"(\d+) passed", out)
    assert m is not None and int(m[1]) == want_passed and "skipped" not in out, out
