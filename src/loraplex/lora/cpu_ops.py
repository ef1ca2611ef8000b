"""Fused LoRA on CPU: one C call per layer for the projections sharing an input (``native/lora.c``).

At decode sizes the torch path is about nine small ops per module and run (a conversion, a
shrink and an expand GEMM, a mask, an add), each paying dispatch and an OpenMP barrier; on a thin
model with native bf16 GEMMs those calls cost more than the bytes they read, and so does the
Python around each call once the layer's GEMMs have pushed the interpreter's data out of cache.
So one call covers q/k/v (or gate/up) of a layer, over tables prepared once per module group;
per call only x, the output and the step's plan are checked, and bf16 tables are read as they
are (half the bytes of float32 ones; docs/benchmarks.md, "A C kernel for LoRA on CPU", has the
measurements). Segments of more than ``NATIVE_RUN_TOKENS`` tokens (prefill) keep the torch
path, whose GEMMs win there.

The kernel is plain C (``native/lora.c``), built, cached, loaded and checked against a float64
reference before use by :mod:`loraplex.native.build` (which also chooses its instruction set:
``native``, or ``avx2`` where torch's own CPU kernels run at AVX2). Without a compiler,
``select_lora_ops`` falls back to the torch path with a warning.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from loraplex.lora.ops import NATIVE_RUN_TOKENS, LoRAOps, ModuleTables, TorchReferenceOps
from loraplex.lora.plan import LoRABatchPlan, LoRARun, plan_lora_batch
from loraplex.native.build import (
    ELEMENT_TYPES,
    SOURCE_DIR,
    KernelBuildError,
    build_library,
    load_checked,
    open_kernel,
)

KERNEL_SOURCE = SOURCE_DIR / "lora.c"
KERNEL_STEM = "lora_cpu"
"""The name of the kernel's builds in the cache (``lora_cpu-<key>.so``)."""
KERNEL_SYMBOL = "loraplex_lora_apply"
FEATURES_SYMBOL = "loraplex_lora_features"
FEATURE_BITS = {"avx2": 1, "fma": 2, "f16c": 4, "avx512f": 8, "avx512bf16-dot": 16}
"""What ``loraplex_lora_features()`` reports a build was compiled for (its bits)."""
MAX_TOKEN_SEGMENTS = 16
"""Segments one token may lie in per kernel call (``MAX_TOKEN_SEGS`` of ``native/lora.c``): a
plan with more layers runs on the fallback."""


def build_kernel(cache_dir: Path | None = None, *, isa: str | None = None) -> Path:
    """Path of the LoRA kernel's shared library for instruction set ``isa`` (default
    ``default_kernel_isa()``), built if missing (:func:`loraplex.native.build.build_library`)."""
    return build_library(KERNEL_SOURCE, KERNEL_STEM, cache_dir, isa=isa)


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
    """``(ts, te, rs, re)`` segments as the int64 array the kernel reads, and its address;
    their weights as float32 (None: all 1.0, a null pointer). Segments may overlap in tokens
    (a plan's layers), at most ``MAX_TOKEN_SEGMENTS`` on one token, never sharing rows there."""

    def __init__(
        self,
        segments: Sequence[tuple[int, int, int, int]],
        weights: Sequence[float] | None = None,
    ) -> None:
        self.array = np.array(segments, dtype=np.int64).reshape(-1, 4)  # [n, 4], C order
        self.count = self.array.shape[0]
        self.address = self.array.ctypes.data
        self.weights = None
        self.weights_address = None
        if weights is not None and any(w != 1.0 for w in weights):
            self.weights = np.array(weights, dtype=np.float32)  # [n]
            self.weights_address = self.weights.ctypes.data


class KernelCannotRead(Exception):
    """These tensors are outside what the kernel reads (the caller uses the torch path)."""


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
            ptr, i64, i32, i64, i64, ptr, ptr, i32, ptr, ptr, ptr, i64, i32, ptr, i64, ptr, i32
        ]  # fmt: skip
        fn.restype = i32
        self._lib, self._fn = lib, fn
        self.library = library

    def __call__(
        self, x: torch.Tensor, out: torch.Tensor, group: PreparedModules, segments: KernelSegments
    ) -> None:
        """For every module ``(a, bt, lo, hi)`` of ``group``:
        ``out[t, lo:hi] += w * x[t] @ a[rs:re].T @ bt[rs:re]`` for every ``(ts, te, rs, re)``
        row of ``segments`` (weight ``w``) and ``t`` in ``[ts, te)``. The caller has checked x,
        out and the segments against ``group`` (``CPUKernelLoRAOps.apply_many``)."""
        rc = self._fn(
            x.data_ptr(), x.stride(0), ELEMENT_TYPES[x.dtype], group.d_in, group.count,
            group.a_ptrs, group.bt_ptrs, group.w_type, out.data_ptr(), group.cols, group.d_out,
            out.stride(0), ELEMENT_TYPES[out.dtype], segments.address, segments.count,
            segments.weights_address, torch.get_num_threads() if self.shared_threads else 1,
        )  # fmt: skip
        if rc == 2:
            raise ValueError(f"a token lies in more than {MAX_TOKEN_SEGMENTS} LoRA segments")
        if rc != 0:
            raise MemoryError("LoRA CPU kernel: cannot allocate its scratch rows")


def load_kernel(cache_dir: Path | None = None, *, isa: str | None = None) -> LoRAKernel:
    """Build (once per cache key), load and verify the kernel for instruction set ``isa``
    (default ``default_kernel_isa()``); ``KernelBuildError`` if any step fails. Memoised per
    process and instruction set: every engine of the process shares one loaded library. The
    caller makes sure this CPU can run ``isa`` (``native`` and ``portable`` always can)."""
    return load_checked(LoRAKernel, _self_check, KERNEL_SOURCE, KERNEL_STEM, cache_dir, isa)


def _self_check(kernel: LoRAKernel) -> None:
    """Every dtype combination the engine uses, against the float64 reference, on odd sizes
    (tails of every vector loop) and ranks 3 and 8 (the four-row blocks and their remainder)."""
    g = torch.Generator().manual_seed(0)
    segs = [(0, 2, 0, 8), (3, 4, 8, 11), (4, 7, 11, 19)]
    weights = [1.0, -0.5, 2.0]  # a composed request's scales (the ones a plain step leaves out)
    extra = [(0, 4, 11, 19, 0.75)]  # a second layer: tokens 0-3 also add rows 11:19
    plan = plan_lora_batch(7, segs, torch.float32, "cpu", weights=weights, extra=extra)
    arr = KernelSegments(plan.segments, plan.weights)
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
        self._split_of: tuple[LoRABatchPlan, KernelSegments | None, LoRABatchPlan | None] | None = (
            None
        )
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

    def _split(self, plan: LoRABatchPlan) -> tuple[KernelSegments | None, LoRABatchPlan | None]:
        """The plan's short segments for the kernel, every layer's in one array (one call: the
        kernel runs each token's segments in one thread and reads an adapter's rows once for
        its tokens there), its long ones as a plan of single-segment runs for the fallback;
        computed once per plan (every adapted module of a step shares it)."""
        cached = self._split_of
        if cached is not None and cached[0] is plan:
            return cached[1], cached[2]
        if len(plan.layers) > MAX_TOKEN_SEGMENTS:  # more adapters on a token than the kernel takes
            self._split_of = (plan, None, plan)
            return None, plan
        limit = self.max_run_tokens
        short = [j for j, s in enumerate(plan.segments) if s[1] - s[0] <= limit]
        kernel_segs = None
        if short:
            segs = [plan.segments[j] for j in short]
            w = [plan.segment_weight(j) for j in short] if plan.weights is not None else None
            kernel_segs = KernelSegments(segs, w)
        longs = [j for j, s in enumerate(plan.segments) if s[1] - s[0] > limit]
        long_plan = None
        if longs:
            segs = tuple(plan.segments[j] for j in longs)
            runs = [LoRARun(*s, None) for s in segs]
            w = tuple(plan.segment_weight(j) for j in longs) if plan.weights is not None else None
            long_plan = LoRABatchPlan(
                plan.num_tokens, plan.num_rows, runs, segs, weights=w, run_scales=w
            )
        self._split_of = (plan, kernel_segs, long_plan)
        return kernel_segs, long_plan

    def _run(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        modules: Sequence[ModuleTables],
        group: PreparedModules,
        plan: LoRABatchPlan,
    ) -> None:
        short, long_plan = self._split(plan)
        if short is not None:
            self.kernel(x, out, group, short)
        if long_plan is not None:
            self.fallback.apply_many(x, out, modules, long_plan)
