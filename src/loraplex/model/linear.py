"""Base-model linear layers behind one small protocol; the implementation is chosen at start-up.

On CPUs where oneDNN can prepack weights for the model dtype, GEMMs with few rows (decode
steps) run faster from the packed layout than through ``F.linear``'s BLAS call; elsewhere
(CUDA, or dtypes oneDNN cannot pack here) the plain path is used. On a CPU without native
bfloat16 arithmetic (no AVX512_BF16, no AMX) a bfloat16 GEMM runs slower than the same GEMM in
float32 once it has a few dozen rows, so there GEMMs with many rows (prompt chunks) are computed
in float32 from the bfloat16 weights (:class:`UpcastCPULinear`; the weights stay bfloat16 in
memory). Where loraplex's panel GEMM kernel (``panel_gemm.py``) computes the dtype with vectors,
it is timed against oneDNN on one of the model's weight shapes at start-up and used if it is
faster at decode sizes (and not much slower on a prompt chunk). The model never branches on
which one it got. (Figures: docs/benchmarks-history.md.)
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from loraplex.model.panel_gemm import PanelLinear, usable_panel_kernel

log = logging.getLogger(__name__)


class Linear(Protocol):
    """``y = x @ W.T + b`` for ``x: [T, in_features]``."""

    out_features: int
    nbytes: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """``F.linear`` over a plain weight tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]
        self.nbytes = weight.nbytes + (bias.nbytes if bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class UpcastCPULinear(DenseLinear):
    """``F.linear`` over a bfloat16 weight on a CPU without native bfloat16: an input of at
    least ``UPCAST_MIN_ROWS`` rows is multiplied in float32 (weight and input widened exactly,
    the result rounded to bfloat16 once: a bfloat16 GEMM with float32 accumulation, as the
    native kernels compute it, in another summation order); fewer rows (decode) stay bfloat16,
    where widening the weight costs more than the slow kernel."""

    UPCAST_MIN_ROWS = 64  # where upcasting starts to win (docs/benchmarks.md, bf16 without BF16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.UPCAST_MIN_ROWS:
            return F.linear(x, self.weight, self.bias)
        b = self.bias.float() if self.bias is not None else None
        return F.linear(x.float(), self.weight.float(), b).to(x.dtype)  # [T, out]


class PackedCPULinear:
    """oneDNN linear over a weight reordered once into its blocked layout (the original is freed)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.nbytes = weight.nbytes + (bias.nbytes if bias is not None else 0)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


LinearFactory = Callable[[torch.Tensor, torch.Tensor | None], Linear]


def dense_weight(lin: Linear, in_features: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W [out, in], bias)`` of a base Linear. A packed oneDNN weight is read back by
    multiplying the identity without bias: each output is one exact product, so W is exact."""
    if isinstance(lin, DenseLinear):
        return lin.weight, lin.bias
    if isinstance(lin, PanelLinear):
        return lin.dense_weight(), lin.bias
    if isinstance(lin, PackedCPULinear):
        eye = torch.eye(in_features, dtype=lin.packed.dtype, device=lin.packed.device)
        wt = torch.ops.mkldnn._linear_pointwise(eye, lin.packed, None, "none", [], "")  # [in, out]
        return wt.t().contiguous(), lin.bias
    raise TypeError(f"cannot read the weight of a {type(lin).__name__} to merge into it")


def _packed_works(dtype: torch.dtype) -> bool:
    """Probe once: can oneDNN pack and run this dtype here, with a correct result?"""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(32, 16).to(dtype)
        x = torch.randn(3, 16).to(dtype)
        got = PackedCPULinear(w, None)(x)
        return bool(torch.allclose(got.float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2))
    except (RuntimeError, AttributeError):
        return False


def cpu_has_fast_bf16() -> bool:
    """Native bf16 dot products (AVX512-BF16 or AMX) that oneDNN may use; without them bf16
    GEMMs are slow on CPU. Both must hold: the CPU has them, and oneDNN is not held below them
    (``ONEDNN_MAX_CPU_ISA=AVX2`` on an AMX CPU leaves torch without oneDNN bf16 GEMMs, as on an
    AVX2-only CPU)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpu = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    else:
        cpu = "avx512_bf16" in flags or "amx_bf16" in flags
    return cpu and _onednn_bf16()


def _onednn_bf16() -> bool:
    """Whether oneDNN computes bf16 here at its present ISA limit (True where torch cannot say)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def select_linear_factory(
    device: torch.device,
    dtype: torch.dtype,
    *,
    native_bf16: bool | None = None,
    probe: tuple[int, int] | None = None,
) -> tuple[str, LinearFactory]:
    """Pick the linear implementation for this device and dtype (once, at model load).
    ``native_bf16``: whether the CPU computes bfloat16 natively (default: ask the CPU);
    ``probe``: a weight shape ``(out, in)`` of the model, on which the panel kernel is timed
    against oneDNN where both can run (None: no panel kernel)."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        if not (cpu_has_fast_bf16() if native_bf16 is None else native_bf16):
            return "upcast-f32", UpcastCPULinear
    if device.type != "cpu":
        return "dense", DenseLinear
    packed = _packed_works(dtype)
    if probe is not None:
        panel = _panel_choice(dtype, min(probe[0], PROBE_MAX), min(probe[1], PROBE_MAX), packed)
        if panel is not None:
            return "panel", panel
    if packed:
        return "onednn-packed", PackedCPULinear
    return "dense", DenseLinear


PROBE_MAX = 4096
"""The timed probe weight is at most this many rows and columns (a 70B model's 28672 x 8192
projection would cost a second of start-up to pack and time)."""
PROBE_ROWS = (1, 16, 128)
"""Rows of x timed: one sequence decoding, a decode batch, a prompt chunk."""
PREFILL_SLOWDOWN = 1.3
"""The panel kernel is chosen for its decode times only if its prompt-chunk time is within this
factor of oneDNN's (its blocking is for few rows)."""


@functools.cache
def _panel_choice(
    dtype: torch.dtype, n: int, k: int, packed: bool
) -> Callable[[torch.Tensor, torch.Tensor | None], Linear] | None:
    """The panel kernel's factory if it builds, computes ``dtype`` with vectors and beats
    oneDNN on an ``[n, k]`` weight at decode sizes (timed once per process and shape), else
    None; the times go to the log."""
    kernel = usable_panel_kernel()
    if kernel is None or dtype not in kernel.dtypes:
        return None
    make = functools.partial(PanelLinear, kernel)
    if not packed:
        return make
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    ours, theirs = make(w, None), PackedCPULinear(w, None)
    times = {
        t: _time_pair(ours, theirs, torch.randn(t, k, generator=g).to(dtype)) for t in PROBE_ROWS
    }
    decode = sum(times[t][0] for t in PROBE_ROWS[:2]) < sum(times[t][1] for t in PROBE_ROWS[:2])
    prefill_ok = times[PROBE_ROWS[-1]][0] <= PREFILL_SLOWDOWN * times[PROBE_ROWS[-1]][1]
    chosen = decode and prefill_ok
    log.info(
        "linear %s [%d, %d]: panel vs oneDNN us %s -> %s",
        str(dtype).removeprefix("torch."), n, k,
        ", ".join(f"{t} rows {a * 1e6:.0f}/{b * 1e6:.0f}" for t, (a, b) in times.items()),
        "panel" if chosen else "oneDNN",
    )  # fmt: skip
    return make if chosen else None


@functools.cache
def expert_factory(make: LinearFactory, n: int, k: int, dtype: torch.dtype) -> LinearFactory:
    """The Linear factory for a MoE's experts of ``[n, k]``: ``make`` (the dense projections'
    choice) where it beats ``F.linear`` over the expert's slice of the packed tensor at an
    expert's decode rows, else :class:`DenseLinear` (its views of that tensor, no copy). An
    expert is far narrower than a dense projection and reads few rows, where a kernel's fixed
    cost can outweigh its bandwidth; timed once per process and shape, logged."""
    if make is DenseLinear:
        return DenseLinear
    g = torch.Generator().manual_seed(0)
    n, k = min(n, PROBE_MAX), min(k, PROBE_MAX)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    ours, plain = make(w, None), DenseLinear(w, None)
    rows = (1, 8)  # one sequence's token; a decode batch's share of an expert
    times = {t: _time_pair(ours, plain, torch.randn(t, k, generator=g).to(dtype)) for t in rows}
    chosen = sum(a for a, _ in times.values()) < sum(b for _, b in times.values())
    log.info(
        "experts %s [%d, %d]: %s vs F.linear us %s -> %s",
        str(dtype).removeprefix("torch."), n, k, getattr(make, "__name__", type(ours).__name__),
        ", ".join(f"{t} rows {a * 1e6:.0f}/{b * 1e6:.0f}" for t, (a, b) in times.items()),
        "kernel" if chosen else "F.linear",
    )  # fmt: skip
    return make if chosen else DenseLinear


def _time_pair(a: Linear, b: Linear, x: torch.Tensor, reps: int = 9) -> tuple[float, float]:
    """The fastest of ``reps`` calls of ``a(x)`` and of ``b(x)``, the calls alternated (a
    machine's drift reaches both alike) after a warm-up call of each. The fastest, not the
    median: on a shared machine a call descheduled for a time slice (several ms on 2 busy
    cores) says nothing of the kernel, and on a loaded one most calls may be."""
    a(x), b(x)
    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for lin, out in ((a, runs[0]), (b, runs[1])):
            t0 = time.perf_counter()
            lin(x)
            out.append(time.perf_counter() - t0)
    return min(runs[0]), min(runs[1])
