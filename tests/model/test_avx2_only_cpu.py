"""Running as on an AVX2-only x86 CPU (no AVX-512, no native bf16) on a bigger one.

``ATEN_CPU_CAPABILITY=avx2`` holds torch's own CPU kernels to AVX2 and ``ONEDNN_MAX_CPU_ISA=AVX2``
holds oneDNN there; loraplex's choices follow both, with no variable of its own: the C LoRA
kernel is built for AVX2 (``default_kernel_isa``, from torch's capability), bf16 is not native
(``cpu_has_fast_bf16``, which asks oneDNN too), so bf16 prompt GEMMs take the upcast path and
prefill LoRA runs compute in float32. Any test file can be run that way::

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m pytest -q tests/model/test_linear_backends.py

This test checks, in a child process, that the pair gives exactly an AVX2 CPU's choices.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from loraplex.native.build import AVX2_CPU_FLAGS, cpu_flags

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

_PROBE = """
import json, torch
from loraplex.lora.backends import cpu_slow_matmul_dtypes
from loraplex.lora.cpu_ops import load_kernel
from loraplex.native.build import default_kernel_isa
from loraplex.model.linear import cpu_has_fast_bf16, select_linear_factory
print(json.dumps({
    "torch": torch.backends.cpu.get_cpu_capability(),
    "fast_bf16": cpu_has_fast_bf16(),
    "linear": select_linear_factory(torch.device("cpu"), torch.bfloat16)[0],
    "slow": [str(d) for d in cpu_slow_matmul_dtypes()],
    "isa": default_kernel_isa(),
    "features": sorted(load_kernel().features),
}))
"""


def test_the_avx2_emulation_makes_an_avx2_cpus_choices(tmp_path) -> None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("AVX2 is an x86 instruction set")
    if not (cpu_flags() or frozenset()).issuperset(AVX2_CPU_FLAGS):
        pytest.skip("this CPU cannot run AVX2 code")
    env = {**os.environ, **AVX2_ENV, "LORAPLEX_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {
        "torch": "AVX2",
        "fast_bf16": False,
        "linear": "upcast-f32",
        "slow": ["torch.bfloat16", "torch.float16"],
        "isa": "avx2",
        "features": ["avx2", "f16c", "fma"],
    }
