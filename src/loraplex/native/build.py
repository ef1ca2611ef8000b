"""Building, caching, loading and checking loraplex's C kernels: the one build module.

Where a kernel lives: every C source and header is in this folder (``native/``); the Python
that implements a protocol over a kernel stays beside that protocol and loads its library
through this module:

=================  ================================================  ==========================
source             what it computes                                  loaded by
=================  ================================================  ==========================
``lora.c``         the fused LoRA shrink + expand                    ``lora/cpu_ops.py``
``panel_gemm.c``   dense GEMMs over weights packed in column panels  ``model/panel_gemm.py``
``quant_gemm.c``   every quantized GEMM: 4/8-bit weights as stored   ``model/quant/cpu_kernel.py``
                   and in column panels, W4A8
``layer_ops.c``    a decoder layer's norms, rotary, activation,      ``model/layer_ops.py``
                   decode attention
``gated_delta.c``  the gated delta rule's decode step (Qwen3.5's     ``model/gated_delta_cpu.py``
                   linear attention) over its state pages
``cpu_peak.c``     the CPU's arithmetic peak (a benchmark)           ``tools/bench/cpu_peak.py``
=================  ================================================  ==========================

What the kernels share (element types, bf16 <-> float32, the instruction sets a build has, the
float32 vector macros) is in ``kernels.h``; the column-panel layout the dense and the quantized
panel GEMMs share is in ``panel.h``; Intel AMX tiles, and a software model of them that tests run
anywhere (the ``amx-model`` build), in ``amx.h``. A new kernel is one more ``.c`` here that includes
``kernels.h`` and exports plain C functions named ``loraplex_*`` (no torch headers), and one
Python class that opens it (:func:`open_kernel`) with a self-check against a float64 or torch
reference, loaded with :func:`load_checked` (pyproject.toml's package-data ships
``native/*.c`` and ``native/*.h``).

How a kernel is built: with the system compiler (:func:`find_compiler`), once per source (its
bytes and those of every header it includes), compiler, instruction set (``KERNEL_ISAS``) and
CPU, into ``$LORAPLEX_CACHE_DIR/kernels``. That directory is private: a shared library is code,
so one found in a directory others can write is never loaded (the build then goes to a fresh
temporary directory), and only the ``KEEP_BUILDS`` newest builds of a kernel are kept. A loaded
kernel runs its self-check before first use (``KernelBuildError`` on a mismatch); callers fall
back to torch where any step fails.

Which instruction set: ``-march=native`` (with AVX512-BF16 the bf16 paths use its dot
products), except where torch's own CPU kernels run at AVX2 (an AVX2-only CPU, or
``ATEN_CPU_CAPABILITY=avx2`` on a bigger one): there a kernel is built for AVX2 + FMA + F16C with
no ``-march=native``, the build an AVX-512 machine's tests also make and check
(``isa="avx2"``), so the code an AVX2-only CPU runs is tested everywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from loraplex.paths import default_cache_dir

SOURCE_DIR = Path(__file__).parent
"""Where every kernel's C source and the shared headers are."""
ELEMENT_TYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Element types the kernels read and write (their ``*_type`` / ``e`` codes: ``F32`` and
``BF16`` in ``kernels.h``)."""
_AVX2 = ("-O3", "-mavx2", "-mfma", "-mf16c")
KERNEL_ISAS: dict[str, tuple[tuple[str, ...], ...]] = {
    "native": (
        ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"),
        ("-O3", "-march=native", "-fopenmp"),
        ("-O3", "-march=native"),
        ("-O3",),
    ),
    "avx2": ((*_AVX2, "-fopenmp"), _AVX2),
    "portable": (("-O3", "-fopenmp"), ("-O3",)),
    "amx-model": (
        ("-O3", "-march=native", "-DLORAPLEX_AMX_EMULATE", "-fopenmp"),
        ("-O3", "-march=native", "-DLORAPLEX_AMX_EMULATE"),
    ),
}
"""Compiler flag sets per instruction set a kernel can be built for, tried in order: the
first set the compiler accepts builds it. ``native``: this CPU's (``-march=native``; plain
``-O3`` for a compiler without it); ``avx2``: AVX2, FMA and F16C and nothing above (no
AVX-512), the code an AVX2-only x86 CPU runs, whichever CPU builds it (a compiler that cannot
target it fails the build: there is no fallback to another instruction set); ``portable``: the
compiler's default target (what ``native`` falls back to); ``amx-model``: ``native`` with
``native/amx.h``'s software model of the AMX tiles compiled in, so the tile code is tested on
every CPU that runs the rest of its kernel (tests only: it is far slower than either)."""
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")
"""``/proc/cpuinfo`` flags a CPU needs to run an ``avx2`` build."""
KEEP_BUILDS = 8
"""Builds of one kernel kept in the cache directory (other sources, compilers or CPUs sharing
it)."""


class KernelBuildError(RuntimeError):
    """A C kernel could not be built, loaded or verified here."""


def find_compiler() -> str | None:
    """``$CC``, else the first of cc, gcc, clang on ``PATH``."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def cpu_flags() -> frozenset[str] | None:
    """This CPU's feature flags from ``/proc/cpuinfo`` (None where it cannot say)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in info.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return None


def default_kernel_isa() -> str:
    """The ``KERNEL_ISAS`` entry the engine builds: ``avx2`` on an x86 CPU where torch's own
    CPU kernels run at AVX2 (``torch.backends.cpu.get_cpu_capability()``: an AVX2-only CPU, or
    ``ATEN_CPU_CAPABILITY=avx2`` on a bigger one), else ``native``."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "native"
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "native"
    flags = cpu_flags()
    if capability == "AVX2" and flags is not None and flags.issuperset(AVX2_CPU_FLAGS):
        return "avx2"
    return "native"


def _cpu_signature() -> str:
    """The CPU's model and feature flags: a kernel built with ``-march=native`` runs only there."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [
        line.split(":", 1)[1].strip()
        for line in info.splitlines()
        if line.startswith(("model name", "flags", "Features", "CPU part"))
    ]
    return "\n".join(dict.fromkeys(keep))  # one line per distinct value


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def source_files(source: Path) -> list[Path]:
    """``source`` and every header it includes with ``#include "..."`` (found beside the file
    that includes it, as the compiler finds it), transitively: every file a build of ``source``
    reads, in a fixed order. Includes under any ``#if`` count too (a superset is safe)."""
    found: list[Path] = []
    todo = [source]
    while todo:
        path = todo.pop(0)
        if path in found or (found and not path.is_file()):  # a missing header: the compiler says
            continue
        found.append(path)
        names = _LOCAL_INCLUDE.findall(path.read_bytes())
        todo.extend(path.parent / name.decode() for name in names)
    return found


def source_digest(source: Path) -> str:
    """SHA-256 of ``source`` and every header it includes (:func:`source_files`): what a build
    is keyed by besides the compiler, instruction set and CPU, so that editing a shared header
    rebuilds every kernel that includes it."""
    h = hashlib.sha256()
    for path in source_files(source):
        data = path.read_bytes()
        h.update(f"{path.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _private(path: Path, is_kind: Callable[[int], bool]) -> bool:
    """Of kind ``is_kind`` (``stat.S_ISDIR``, ``stat.S_ISREG``; a symlink is neither), owned by
    this user and writable by nobody else (so nobody else chose what is in it)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return is_kind(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _compile(cc: str, src: Path, dst: Path, flag_sets: Sequence[Sequence[str]]) -> None:
    """Compile ``src`` into the shared library ``dst`` with the first flag set that works."""
    errors = []
    for flags in flag_sets:
        cmd = [cc, *flags, "-shared", "-fPIC", "-o", str(dst), str(src)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"{' '.join(cmd)}: {e}")
            continue
        if done.returncode == 0:
            return
        errors.append(f"{' '.join(cmd)}: {done.stderr.strip()[-400:]}")
    raise KernelBuildError(f"cannot compile {src.name}:\n" + "\n".join(errors))


def _prune(root: Path, keep: Path, stem: str) -> None:
    """Drop all but the ``KEEP_BUILDS`` newest builds of ``stem`` (a process still using one
    keeps its mapping; a later start rebuilds it)."""
    try:
        builds = sorted(root.glob(f"{stem}-*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return
    for old in builds[KEEP_BUILDS:]:
        if old != keep:
            with contextlib.suppress(OSError):
                old.unlink()


def build_library(
    source: Path, stem: str, cache_dir: Path | None = None, *, isa: str | None = None
) -> Path:
    """Path of the shared library built from ``source`` (``stem`` names its builds) for this
    compiler, instruction set (a ``KERNEL_ISAS`` key; default ``default_kernel_isa()``) and
    CPU; built if missing, in ``cache_dir/kernels`` (default ``$LORAPLEX_CACHE_DIR``)."""
    isa = default_kernel_isa() if isa is None else isa
    flag_sets = KERNEL_ISAS.get(isa)
    if flag_sets is None:
        raise ValueError(f"unknown kernel instruction set {isa!r} (one of {sorted(KERNEL_ISAS)})")
    cc = find_compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (cc, gcc or clang on PATH, or $CC)")
    code = source_digest(source)
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"cannot run the C compiler {cc}: {e}") from e
    key = hashlib.sha256(
        b"\0".join(
            [
                code.encode(),
                cc.encode(),
                version.encode(),
                isa.encode(),
                repr(flag_sets).encode(),
                _cpu_signature().encode(),
            ]
        )
    ).hexdigest()[:20]
    root = (cache_dir if cache_dir is not None else default_cache_dir()) / "kernels"
    target = root / f"{stem}-{key}.so"
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass
    if _private(root, stat.S_ISDIR):
        if _private(target, stat.S_ISREG):
            return target
        fd, tmp = tempfile.mkstemp(dir=root, suffix=".so.tmp")
        os.close(fd)
        try:
            _compile(cc, source, Path(tmp), flag_sets)
            os.chmod(tmp, 0o700)
            os.replace(tmp, target)  # atomic: a concurrent build of the same key is identical
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _prune(root, target, stem)
        return target
    # A shared or foreign cache directory: build where only this process writes.
    private = Path(tempfile.mkdtemp(prefix="loraplex-kernel-"))
    _compile(cc, source, private / f"{stem}.so", flag_sets)
    return private / f"{stem}.so"


def _openmp_runtimes() -> frozenset[str] | None:
    """Paths of the OpenMP runtimes mapped into this process (None where /proc cannot say)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    names = ("libgomp", "libiomp", "libomp")
    return frozenset(
        line.split()[-1]
        for line in maps.splitlines()
        if any(n in line.rsplit("/", 1)[-1] for n in names)
    )


def open_kernel(library: Path, *symbols: str) -> tuple[ctypes.CDLL, list[Any], bool]:
    """Load a built kernel: ``(library, its functions named by symbols, shared_threads)``;
    ``KernelBuildError`` if it cannot be loaded or lacks a symbol. ``shared_threads``: the
    library's OpenMP runtime is torch's (loading mapped no new one), so its parallel regions may
    use torch's thread count; a second runtime would keep a second team spinning on the same
    cores, so a kernel runs on one thread then."""
    before = _openmp_runtimes()
    try:
        lib = ctypes.CDLL(str(library))
        fns = [getattr(lib, name) for name in symbols]
    except (OSError, AttributeError) as e:
        raise KernelBuildError(f"cannot load {library}: {e}") from e
    after = _openmp_runtimes()
    return lib, fns, before is not None and after is not None and after <= before


KernelT = TypeVar("KernelT")


def load_checked(
    make: Callable[[Path], KernelT],
    check: Callable[[KernelT], None],
    source: Path,
    stem: str,
    cache_dir: Path | None,
    isa: str | None,
) -> KernelT:
    """Build ``source`` (once per cache key, :func:`build_library`), load it with ``make`` and
    run ``check`` on it (raising ``KernelBuildError`` on a mismatch); memoised per process,
    source and instruction set (default ``default_kernel_isa()``)."""
    return _load_checked(make, check, source, stem, cache_dir, isa or default_kernel_isa())


@functools.cache
def _load_checked(
    make: Callable[[Path], Any],
    check: Callable[[Any], None],
    source: Path,
    stem: str,
    cache_dir: Path | None,
    isa: str,
) -> Any:
    kernel = make(build_library(source, stem, cache_dir, isa=isa))
    check(kernel)
    return kernel
