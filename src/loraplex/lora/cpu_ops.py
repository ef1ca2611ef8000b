"""Fused LoRA on CPU: one C call per layer for the projections sharing an input (``cpu_kernel.c``).

At decode sizes the torch path is about nine small ops per module and run (a conversion, a
shrink and an expand GEMM, a mask, an add), each paying dispatch and an OpenMP barrier; on a thin
model with native bf16 GEMMs those calls cost more than the bytes they read, and so does the
Python around each call once the layer's GEMMs have pushed the interpreter's data out of cache.
So one call covers q/k/v (or gate/up) of a layer, over tables prepared once per module group;
per call only x, the output and the step's plan are checked, and bf16 tables are read as they
are (half the bytes of float32 ones; docs/benchmarks.md, "A C kernel for LoRA on CPU", has the
measurements). Segments of more than ``NATIVE_RUN_TOKENS`` tokens (prefill) keep the torch
path, whose GEMMs win there.

The kernel is plain C (no torch headers), built once per source, compiler, instruction set
(``KERNEL_ISAS``) and CPU with the system compiler into ``$LORAPLEX_CACHE_DIR/kernels`` (a
private directory: a shared library is code, so one found in a directory others can write is
never loaded; the build then goes to a fresh temporary directory), and checked against a
float64 reference before use. Without a compiler, ``select_lora_ops`` falls back to the torch
path with a warning.

Which instruction set: ``-march=native`` (with AVX512-BF16 the bf16 x bf16 shrink uses its dot
products), except where torch's own CPU kernels run at AVX2 (an AVX2-only CPU, or
``ATEN_CPU_CAPABILITY=avx2`` on a bigger one): there the kernel is built for AVX2 + FMA + F16C
with no ``-march=native``, the build an AVX-512 machine's tests also make and check
(``build_kernel(isa="avx2")``), so the code an AVX2-only CPU runs is tested everywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from loraplex.lora.ops import NATIVE_RUN_TOKENS, LoRAOps, ModuleTables, TorchReferenceOps
from loraplex.lora.plan import LoRABatchPlan, LoRARun, plan_lora_batch
from loraplex.paths import default_cache_dir

KERNEL_SOURCE = Path(__file__).with_name("cpu_kernel.c")
KERNEL_SYMBOL = "loraplex_lora_apply"
FEATURES_SYMBOL = "loraplex_lora_features"
FEATURE_BITS = {"avx2": 1, "fma": 2, "f16c": 4, "avx512f": 8, "avx512bf16-dot": 16}
"""What ``loraplex_lora_features()`` reports a build was compiled for (its bits)."""
ELEMENT_TYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Element types the kernel reads and writes (its ``*_type`` codes)."""
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
}
"""Compiler flag sets per instruction set the kernel can be built for, tried in order: the
first set the compiler accepts builds it. ``native``: this CPU's (``-march=native``; plain
``-O3`` for a compiler without it); ``avx2``: AVX2, FMA and F16C and nothing above (no
AVX-512), the code an AVX2-only x86 CPU runs, whichever CPU builds it (a compiler that cannot
target it fails the build: there is no fallback to another instruction set); ``portable``: the
compiler's default target (what ``native`` falls back to)."""
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")
"""``/proc/cpuinfo`` flags a CPU needs to run an ``avx2`` build."""


class KernelBuildError(RuntimeError):
    """The C kernel could not be built, loaded or verified here."""


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


def _private(path: Path, is_kind: Callable[[int], bool]) -> bool:
    """Of kind ``is_kind`` (``stat.S_ISDIR``, ``stat.S_ISREG``; a symlink is neither), owned by
    this user and writable by nobody else (so nobody else chose what is in it)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return is_kind(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


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


KEEP_BUILDS = 8
"""Builds kept in the cache directory (other sources, compilers or CPUs sharing it)."""


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


def build_kernel(
    cache_dir: Path | None = None,
    *,
    isa: str | None = None,
    source: Path = KERNEL_SOURCE,
    stem: str = "lora_cpu",
) -> Path:
    """Path of the shared library for this source (default: the LoRA kernel; ``stem`` names
    its builds), compiler, instruction set (a ``KERNEL_ISAS`` key; default
    ``default_kernel_isa()``) and CPU; built if missing."""
    isa = default_kernel_isa() if isa is None else isa
    flag_sets = KERNEL_ISAS.get(isa)
    if flag_sets is None:
        raise ValueError(f"unknown kernel instruction set {isa!r} (one of {sorted(KERNEL_ISAS)})")
    cc = find_compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (cc, gcc or clang on PATH, or $CC)")
    code = source.read_bytes()
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"cannot run the C compiler {cc}: {e}") from e
    key = hashlib.sha256(
        b"\0".join(
            [
                code,
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


class PreparedModules:
    """What the kernel needs of a fixed module group, built and checked once: table addresses,
    output columns and widths as C arrays, the tables' element type and input width."""

    def __init__(self, modules: Sequence[ModuleTables]) -> None:
        """``KernelCannotRead`` if the kernel cannot take these tables (the fallback will);
        ``ValueError`` if they disagree with each other."""
        a0 = modules[0][0]
        w_type = ELEMENT_TYPES.get(a0.dtype)
        if w_type is None:
            raise KernelCannotRead(f"tables of {a0.dtype}")
        d_in = a0.shape[1]
        for a, bt, lo, hi in modules:
            if a.dtype != a0.dtype or bt.dtype != a0.dtype:
                raise KernelCannotRead("tables of mixed dtypes")
            if not (a.is_cpu and bt.is_cpu and a.is_contiguous() and bt.is_contiguous()):
                raise KernelCannotRead("tables not contiguous on the CPU")
            if a.dim() != 2 or bt.dim() != 2 or a.shape[1] != d_in or bt.shape[0] != a.shape[0]:
                raise ValueError(f"LoRA tables disagree: a {tuple(a.shape)}, bt {tuple(bt.shape)}")
            if not 0 <= lo <= hi or hi - lo != bt.shape[1]:
                raise ValueError(f"columns [{lo}, {hi}) for a table of width {bt.shape[1]}")
        n = len(modules)
        self.modules = modules  # kept: the cache is keyed by its identity
        self.count = n
        self.w_type = w_type
        self.d_in = d_in
        self.rows = min(a.shape[0] for a, _, _, _ in modules)
        self.width = max(hi for _, _, _, hi in modules)
        self.a_ptrs = (ctypes.c_void_p * n)(*(a.data_ptr() for a, _, _, _ in modules))
        self.bt_ptrs = (ctypes.c_void_p * n)(*(bt.data_ptr() for _, bt, _, _ in modules))
        self.cols = (ctypes.c_int64 * n)(*(lo for _, _, lo, _ in modules))
        self.d_out = (ctypes.c_int64 * n)(*(hi - lo for _, _, lo, hi in modules))


class KernelSegments:
    """``(ts, te, rs, re)`` segments as the int64 array the kernel reads, and its address."""

    def __init__(self, segments: Sequence[tuple[int, int, int, int]]) -> None:
        self.array = np.array(segments, dtype=np.int64).reshape(-1, 4)  # [n, 4], C order
        self.count = self.array.shape[0]
        self.address = self.array.ctypes.data


class KernelCannotRead(Exception):
    """These tensors are outside what the kernel reads (the caller uses the torch path)."""


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
    """Build ``source`` (once per cache key, :func:`build_kernel`), load it with ``make`` and
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
    kernel = make(build_kernel(cache_dir, isa=isa, source=source, stem=stem))
    check(kernel)
    return kernel


class LoRAKernel:
    """The loaded C function with its argument types (ctypes releases the GIL while it runs)."""

    def __init__(self, library: Path) -> None:
        lib, (fn, features), self.shared_threads = open_kernel(
            library, KERNEL_SYMBOL, FEATURES_SYMBOL
        )
        features.argtypes, features.restype = [], ctypes.c_int
        bits = features()
        # what the library was compiled for (``FEATURE_BITS`` names)
        self.features = frozenset(name for name, bit in FEATURE_BITS.items() if bits & bit)
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        fn.argtypes = [
            ptr, i64, i32, i64, i64, ptr, ptr, i32, ptr, ptr, ptr, i64, i32, ptr, i64, i32
        ]  # fmt: skip
        fn.restype = i32
        self._lib, self._fn = lib, fn
        self.library = library

    def __call__(
        self, x: torch.Tensor, out: torch.Tensor, group: PreparedModules, segments: KernelSegments
    ) -> None:
        """For every module ``(a, bt, lo, hi)`` of ``group``:
        ``out[t, lo:hi] += x[t] @ a[rs:re].T @ bt[rs:re]`` for every ``(ts, te, rs, re)`` row
        of ``segments`` and ``t`` in ``[ts, te)``. The caller has checked x,
        out and the segments against ``group`` (``CPUKernelLoRAOps.apply_many``)."""
        rc = self._fn(
            x.data_ptr(), x.stride(0), ELEMENT_TYPES[x.dtype], group.d_in, group.count,
            group.a_ptrs, group.bt_ptrs, group.w_type, out.data_ptr(), group.cols, group.d_out,
            out.stride(0), ELEMENT_TYPES[out.dtype], segments.address, segments.count,
            torch.get_num_threads() if self.shared_threads else 1,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("LoRA CPU kernel: cannot allocate its scratch rows")


def load_kernel(cache_dir: Path | None = None, *, isa: str | None = None) -> LoRAKernel:
    """Build (once per cache key), load and verify the kernel for instruction set ``isa``
    (default ``default_kernel_isa()``); ``KernelBuildError`` if any step fails. Memoised per
    process and instruction set: every engine of the process shares one loaded library. The
    caller makes sure this CPU can run ``isa`` (``native`` and ``portable`` always can)."""
    return _load_kernel(cache_dir, default_kernel_isa() if isa is None else isa)


@functools.cache
def _load_kernel(cache_dir: Path | None, isa: str) -> LoRAKernel:
    kernel = LoRAKernel(build_kernel(cache_dir, isa=isa))
    _self_check(kernel)
    return kernel


def _self_check(kernel: LoRAKernel) -> None:
    """Every dtype combination the engine uses, against the float64 reference, on odd sizes
    (tails of every vector loop) and ranks 3 and 8 (the four-row blocks and their remainder)."""
    g = torch.Generator().manual_seed(0)
    segs = [(0, 2, 0, 8), (3, 4, 8, 11), (4, 7, 11, 19)]
    plan = plan_lora_batch(7, segs, torch.float32, "cpu")
    arr = KernelSegments(segs)
    for dtype in ELEMENT_TYPES:
        x = torch.randn(7, 37, generator=g).to(dtype)
        a = (torch.randn(19, 37, generator=g) * 0.3).to(dtype)
        bt = (torch.randn(19, 45, generator=g) * 0.3).to(dtype)
        a2 = (torch.randn(19, 37, generator=g) * 0.3).to(dtype)
        bt2 = (torch.randn(19, 9, generator=g) * 0.3).to(dtype)
        base = torch.randn(7, 60, generator=g).to(dtype)
        got, want = base.clone(), base.clone()
        modules = ((a, bt, 2, 47), (a2, bt2, 50, 59))
        kernel(x, got, PreparedModules(modules), arr)
        TorchReferenceOps().apply_many(x, want, modules, plan)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            diff = (got.float() - want.float()).abs().max().item()
            raise KernelBuildError(
                f"LoRA CPU kernel disagrees with the reference in {dtype} (max diff {diff:.3g})"
            )


class CPUKernelLoRAOps:
    """``LoRAOps`` over the C kernel for segments of at most ``max_run_tokens`` tokens, and
    ``fallback`` (the torch path) for longer ones, for what the kernel does not read
    (float16, tables of mixed dtypes, non-unit column strides) and for the embedding's
    gathered LoRA (``embed``).

    Tables are kept in the model's dtype where the kernel reads it (float32, bfloat16): the
    kernel widens bf16 rows as it reads them, so they cost half the bytes of float32 tables.
    Per call only ``x``, ``out`` and the plan are checked; each module group's tables are
    checked once (``PreparedModules``, kept by the identity of the ``modules`` tuple).
    """

    name = "cpu-kernel"

    def __init__(
        self, kernel: LoRAKernel, fallback: LoRAOps, max_run_tokens: int = NATIVE_RUN_TOKENS
    ) -> None:
        self.kernel = kernel
        self.fallback = fallback
        self.max_run_tokens = max_run_tokens
        self._split_of: tuple[LoRABatchPlan, KernelSegments, LoRABatchPlan | None] | None = None
        # id(modules) -> (modules, its PreparedModules or None if the kernel cannot read it)
        self._groups: dict[int, tuple[Sequence[ModuleTables], PreparedModules | None]] = {}
        self._singles: dict[tuple[int, int, int], tuple[ModuleTables]] = {}  # apply()'s groups

    def table_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if model_dtype in ELEMENT_TYPES:
            return model_dtype
        return self.fallback.table_dtype(model_dtype)

    def shrink(self, x: torch.Tensor, a: torch.Tensor, plan: LoRABatchPlan) -> torch.Tensor:
        """See ``LoRAOps.shrink`` (the fallback's: the kernel never materialises y)."""
        return self.fallback.shrink(x, a, plan)

    def expand(
        self, y: torch.Tensor, bt: torch.Tensor, out: torch.Tensor, plan: LoRABatchPlan
    ) -> None:
        """See ``LoRAOps.expand`` (the fallback's)."""
        self.fallback.expand(y, bt, out, plan)

    def embed(
        self,
        ids: torch.Tensor,
        at: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        """See ``LoRAOps.embed`` (the fallback's: a gather and one GEMM per run, once per
        step; the kernel's fused shrink has nothing to fuse here). The LM head's LoRA is an
        ``apply`` and takes the kernel."""
        self.fallback.embed(ids, at, bt, out, plan)

    def apply(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        """See ``LoRAOps.apply``: ``apply_many`` over one module (its one-module group kept
        by the tables' identity, as the model's groups are)."""
        if out.dim() != 2:
            raise ValueError(f"out must be [T, d_out], got {tuple(out.shape)}")
        key = (id(a), id(bt), out.shape[1])
        modules = self._singles.get(key)
        if modules is None or modules[0][0] is not a or modules[0][1] is not bt:
            if len(self._singles) >= 4096:
                self._singles.clear()
            modules = self._singles[key] = ((a, bt, 0, out.shape[1]),)
        self.apply_many(x, out, modules, plan)

    def apply_many(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        modules: Sequence[ModuleTables],
        plan: LoRABatchPlan,
    ) -> None:
        """See ``LoRAOps.apply_many``: one kernel call for every module's short segments."""
        if not modules:
            return
        group = self._group(modules)
        if group is None or not self._reads(x, out, group, plan):
            self.fallback.apply_many(x, out, modules, plan)
        else:
            self._run(x, out, modules, group, plan)

    def _group(self, modules: Sequence[ModuleTables]) -> PreparedModules | None:
        """The prepared group of ``modules`` (None: the kernel cannot read its tables)."""
        got = self._groups.get(id(modules))
        if got is not None and got[0] is modules:
            return got[1]
        try:
            group: PreparedModules | None = PreparedModules(modules)
        except KernelCannotRead:
            group = None
        if len(self._groups) >= 4096:
            self._groups.clear()
        self._groups[id(modules)] = (modules, group)
        return group

    @staticmethod
    def _reads(
        x: torch.Tensor, out: torch.Tensor, group: PreparedModules, plan: LoRABatchPlan
    ) -> bool:
        """Whether the kernel can take this step's ``x`` and ``out`` for ``group``: one of its
        dtypes for both, on the CPU, unit column strides, and the shapes and row bounds the
        plan implies (it trusts them; a disagreement is a caller's bug and raises). Runs once
        per module group and layer, so it reads as few attributes as it can."""
        t = plan.num_tokens
        try:
            (xt, xd), (ot, od) = x.shape, out.shape
        except ValueError:
            raise ValueError(f"x {tuple(x.shape)} and out {tuple(out.shape)} must be 2-D") from None
        if xt != t or ot != t or xd != group.d_in or od < group.width or plan.num_rows > group.rows:
            raise ValueError(
                f"x {tuple(x.shape)} / out {tuple(out.shape)} for {t} tokens and "
                f"{plan.num_rows} rows do not fit tables of input {group.d_in}, "
                f"{group.rows} rows, adding up to column {group.width}"
            )
        return (
            x.dtype in ELEMENT_TYPES
            and out.dtype in ELEMENT_TYPES
            and x.is_cpu
            and out.is_cpu
            and x.stride(1) == 1
            and out.stride(1) == 1
        )

    def _split(self, plan: LoRABatchPlan) -> tuple[KernelSegments, LoRABatchPlan | None]:
        """The plan's short segments for the kernel, its long ones as a plan of single-segment
        runs for the fallback; computed once per plan (every adapted module of a step shares it)."""
        cached = self._split_of
        if cached is not None and cached[0] is plan:
            return cached[1], cached[2]
        short = [s for s in plan.segments if s[1] - s[0] <= self.max_run_tokens]
        longs = [s for s in plan.segments if s[1] - s[0] > self.max_run_tokens]
        segments = KernelSegments(short)
        long_plan = None
        if longs:
            runs = [LoRARun(*s, None) for s in longs]
            long_plan = LoRABatchPlan(plan.num_tokens, plan.num_rows, runs, tuple(longs))
        self._split_of = (plan, segments, long_plan)
        return segments, long_plan

    def _run(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        modules: Sequence[ModuleTables],
        group: PreparedModules,
        plan: LoRABatchPlan,
    ) -> None:
        short, long_plan = self._split(plan)
        if short.count:
            self.kernel(x, out, group, short)
        if long_plan is not None:
            self.fallback.apply_many(x, out, modules, long_plan)
