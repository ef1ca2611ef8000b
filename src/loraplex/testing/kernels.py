"""Loading a C kernel's build for a test, skipping the builds this CPU or compiler cannot run."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from loraplex.native.build import AVX2_CPU_FLAGS, KernelBuildError, cpu_flags

K = TypeVar("K")


def runnable_build(load: Callable[..., K], isa: str) -> K:
    """``load(isa=isa)``: the verified build for ``isa``; a pytest skip where this CPU cannot
    run an AVX2 build or the compiler cannot target one (``native`` and ``portable`` must
    build everywhere; a build that compiles but fails its check is a failure, not a skip)."""
    import pytest

    if isa == "avx2":
        flags = cpu_flags()
        if flags is None or not flags.issuperset(AVX2_CPU_FLAGS):
            pytest.skip(f"this CPU cannot run an AVX2 build (needs {', '.join(AVX2_CPU_FLAGS)})")
        try:
            return load(isa=isa)
        except KernelBuildError as e:
            if "cannot compile" not in str(e):
                raise
            pytest.skip(f"the compiler cannot target AVX2: {e}")
    return load(isa=isa)
