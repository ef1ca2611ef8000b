"""The native kernels' build (``loraplex.native.build``): a build is keyed by its source and
every header that source includes, so editing a shared header rebuilds each kernel using it.
(The build cache's privacy, reuse and pruning are tested with the LoRA kernel, in
tests/lora/test_cpu_kernel.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.native import build
from loraplex.native.build import SOURCE_DIR, build_library, source_digest, source_files

KERNELS = ("lora.c", "layer_ops.c", "panel_gemm.c", "quant_gemm.c", "gated_delta.c")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_key_covers_every_included_header(tmp_path: Path) -> None:
    """A header included directly or through another header changes the digest; a system
    header (``<...>``) and a missing one do not stop it."""
    inner = _write(tmp_path / "inner.h", "#define ANSWER 41\n")
    outer = _write(tmp_path / "outer.h", '#include <stdint.h>\n#  include "inner.h"\n')
    src = _write(tmp_path / "k.c", '#include "outer.h"\n#if 0\n#include "absent.h"\n#endif\n')
    assert source_files(src) == [src, outer, inner]
    before = source_digest(src)
    inner.write_text("#define ANSWER 42\n")
    assert source_digest(src) != before
    inner.write_text("#define ANSWER 41\n")
    assert source_digest(src) == before  # the bytes, not the time they were written


def test_every_kernel_includes_the_shared_header() -> None:
    for name in KERNELS:
        assert SOURCE_DIR / "kernels.h" in source_files(SOURCE_DIR / name), name


def test_editing_an_included_header_rebuilds(tmp_path: Path) -> None:
    if build.find_compiler() is None:
        pytest.skip("no C compiler")
    header = _write(tmp_path / "value.h", "#define VALUE 1\n")
    src = _write(
        tmp_path / "k.c", '#include "value.h"\nint loraplex_value(void) { return VALUE; }\n'
    )
    first = build_library(src, "k", tmp_path / "cache", isa="portable")
    assert build_library(src, "k", tmp_path / "cache", isa="portable") == first  # reused
    header.write_text("#define VALUE 2\n")
    second = build_library(src, "k", tmp_path / "cache", isa="portable")
    assert second != first
    assert build.open_kernel(second, "loraplex_value")[1][0]() == 2
