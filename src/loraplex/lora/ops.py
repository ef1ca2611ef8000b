"""Gathered LoRA ops for a mixed batch: one plan per engine step, shared by every adapted module.

Layout (see ``loraplex.lora.slots``): every module has tables ``a [capacity, d_in]`` and
``bt [capacity, d_out]`` (``bt = (scale * B).T``) and each resident adapter owns a contiguous
range of rank rows in all of them. The runner orders the step's tokens so each adapter's tokens
are contiguous and adapters appear in increasing row order; a *segment*
``(tok_start, tok_end, row_start, row_end)`` says "these tokens use these rows". Tokens outside
every segment use the base model only.

``plan_lora_batch`` turns segments into *runs*: one shrink GEMM + one expand GEMM each. Adjacent
segments are coalesced into one run with a 0/1 mask (each token keeps only its own rows) when the
extra masked work costs less than the dispatch of the extra GEMM pairs it saves; decode steps
(one token per adapter) become one or a few runs, prefill stays one run per segment.

Backends implement the small ``LoRAOps`` protocol and are chosen once at start-up by
``select_lora_ops``; the model never branches on the backend.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

Segment = tuple[int, int, int, int]
"""``(tok_start, tok_end, row_start, row_end)``: tokens ``[tok_start, tok_end)`` use rows
``[row_start, row_end)`` of every module's tables."""

# ------------------------------------------------------------------------------------ plan


class LoRARun(NamedTuple):
    """One shrink/expand GEMM pair over a token range and a contiguous row range."""

    tok_start: int
    tok_end: int
    row_start: int
    row_end: int
    mask: torch.Tensor | None
    """``None`` for a single segment; else ``[tok_end - tok_start, row_end - row_start]`` 0/1,
    1 where the token's segment owns the row (coalesced segments, base tokens get all zeros)."""


@dataclass(frozen=True, slots=True)
class LoRABatchPlan:
    """The step's LoRA work, computed once and shared by every adapted module."""

    num_tokens: int
    num_rows: int  # max row_end over the segments: the width of shrink's y
    runs: list[LoRARun]
    segments: tuple[Segment, ...]  # the non-empty input segments: the semantics, for references


@dataclass(frozen=True, slots=True)
class LoRAPlanCosts:
    """Cost model deciding which adjacent segments share one GEMM pair.

    Cost of a run over segments i..j (``T`` tokens, ``R`` rows including gap rows)::

        run_overhead_us + (mask_overhead_us if coalesced) + mac_ns * feature_dim * T * R
            + gap_rows * feature_dim * itemsize / bandwidth

    The plan minimises the total over the step (an exact DP over the segment sequence). Rows a
    segment needs are read once whatever the partition, so only gap rows count as extra reads.

    Defaults: torch fast path (``TorchLoRAOps``, float32 compute) on the 2-core AMD EPYC
    (AVX2) dev box, from ``python -m loraplex.bench.lora_ops --calibrate`` (best of repeats;
    the box is shared and noisy, three calibrations spread as shown):

    - least-squares fit of single-run time over T 1..208, R 8..192, d_in + d_out 1024/2048:
      ``run_overhead_us`` 23-37 (slicing + two small GEMMs: a 16x512x8 GEMM alone takes
      ~12 us here) and ``mac_ns`` 0.022-0.035 (~35 GMAC/s over two cores);
    - mask multiply of a [16, 192] run: ~2.5 us;
    - copy bandwidth (read + write, 256 MiB): 10-16 GB/s.

    With these, a decode step of 16 one-token segments (ranks 8/16) becomes 1-4 runs and
    prefill segments of a few hundred tokens stay one run each. Whole decode steps of the
    benchmark model (``python -m loraplex.bench.lora_ops``) stream the tables from DRAM and
    measure within noise of each other for 1-16 runs, while coalescing all of a 16 x 26 token
    prefill is ~2x slower, which the model avoids. On a GPU the dispatch is relatively dearer
    and the MACs cheaper, so coalescing pays more; pass costs measured there.

    ``feature_dim`` is the mean ``d_in + d_out`` over adapted modules; pass the model's
    (the default, 1536, is a small Llama's).
    """

    run_overhead_us: float = 25.0
    mask_overhead_us: float = 2.5
    mac_ns: float = 0.025
    feature_dim: int = 1536
    bandwidth_gbs: float = 15.0
    max_run_segments: int = 64  # bounds the DP and the mask size


def plan_lora_batch(
    num_tokens: int,
    segments: Sequence[Segment],
    dtype: torch.dtype,
    device: torch.device | str,
    costs: LoRAPlanCosts | None = None,
) -> LoRABatchPlan:
    """Plan one step: group the sorted segments into runs minimising ``costs``' model.

    ``segments`` must be sorted: token ranges and row ranges both increasing and disjoint.
    Segments with no tokens or no rows are dropped. ``dtype``/``device``: the masks' (the
    ops' compute dtype is fine too; masks are exactly 0/1 in any float dtype).
    """
    costs = costs or LoRAPlanCosts()
    segs = _check_segments(num_tokens, segments)
    num_rows = max((s[3] for s in segs), default=0)
    itemsize = dtype.itemsize
    overhead, mask_cost = costs.run_overhead_us, costs.mask_overhead_us
    mac_us = costs.mac_ns * 1e-3 * costs.feature_dim  # per token x row
    gap_us = costs.feature_dim * itemsize / (costs.bandwidth_gbs * 1e3)  # per gap row
    n = len(segs)
    # best[j]: min cost of segs[:j]; cut[j]: start of the last run in that optimum.
    best = [0.0] * (n + 1)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        te, re = segs[j - 1][1], segs[j - 1][3]
        best_j, used_rows = float("inf"), 0
        for i in range(j - 1, max(-1, j - 1 - costs.max_run_segments), -1):  # run = segs[i:j]
            ts, _, rs, r_end = segs[i]
            used_rows += r_end - rs
            work = overhead + mac_us * (te - ts) * (re - rs)
            # work only grows as i decreases and best[] >= 0: no earlier start can do better.
            if work >= best_j:
                break
            cost = best[i] + work
            if i < j - 1:
                cost += mask_cost + gap_us * (re - rs - used_rows)
            if cost < best_j:
                best_j, cut[j] = cost, i
        best[j] = best_j
    bounds: list[tuple[int, int]] = []
    j = n
    while j > 0:
        bounds.append((cut[j], j))
        j = cut[j]
    device = torch.device(device)
    runs = [_make_run(segs[i:j], dtype, device) for i, j in reversed(bounds)]
    return LoRABatchPlan(num_tokens=num_tokens, num_rows=num_rows, runs=runs, segments=tuple(segs))


def _check_segments(num_tokens: int, segments: Sequence[Segment]) -> list[Segment]:
    """Validate order and bounds; return the non-empty segments as int tuples."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    kept: list[Segment] = []
    prev_te = prev_re = 0
    for seg in segments:
        ts, te, rs, re = seg
        if not (0 <= ts <= te <= num_tokens and 0 <= rs <= re):
            raise ValueError(f"bad segment {seg} for {num_tokens} tokens")
        if ts == te or rs == re:
            continue
        if ts < prev_te or rs < prev_re:
            raise ValueError(f"segments must be sorted and disjoint in tokens and rows: {seg}")
        kept.append((int(ts), int(te), int(rs), int(re)))
        prev_te, prev_re = te, re
    return kept


def _make_run(segs: Sequence[Segment], dtype: torch.dtype, device: torch.device) -> LoRARun:
    """One run over consecutive segments; a 0/1 mask when there is more than one."""
    t0, t1, r0, r1 = segs[0][0], segs[-1][1], segs[0][2], segs[-1][3]
    if len(segs) == 1:
        return LoRARun(t0, t1, r0, r1, None)
    # Label every token and row with its segment index; base tokens -1, gap rows -2.
    # (numpy: small torch ops cost ~5-20 us each on the dev box, numpy ones < 1 us.)
    tok_labels = np.full(t1 - t0, -1)  # [T_run]
    row_labels = np.full(r1 - r0, -2)  # [R_run]
    for k, (ts, te, rs, re) in enumerate(segs):
        tok_labels[ts - t0 : te - t0] = k
        row_labels[rs - r0 : re - r0] = k
    mask = torch.from_numpy(tok_labels[:, None] == row_labels[None, :])  # [T_run, R_run]
    return LoRARun(t0, t1, r0, r1, mask.to(device=device, dtype=dtype))


# ------------------------------------------------------------------------------------ ops


class LoRAOps(Protocol):
    """Gathered LoRA shrink/expand over a planned mixed batch.

    Shapes: ``x [T, d_in]``, ``a [capacity, d_in]``, ``bt [capacity, d_out]``,
    ``out [T, d_out]`` (x's dtype), ``y [T, plan.num_rows]``.
    """

    name: str

    def table_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the slot bank's tables should have for this backend."""
        ...

    def shrink(self, x: torch.Tensor, a: torch.Tensor, plan: LoRABatchPlan) -> torch.Tensor:
        """Project tokens onto their adapter's rank rows::

        y = zeros(T, plan.num_rows)
        for ts, te, rs, re in plan.segments:
            for t in range(ts, te):
                y[t, rs:re] = x[t] @ a[rs:re].T
        return y
        """
        ...

    def expand(
        self, y: torch.Tensor, bt: torch.Tensor, out: torch.Tensor, plan: LoRABatchPlan
    ) -> None:
        """Add each token's rank-row activations times its adapter's (scale * B).T, in place::

        for ts, te, rs, re in plan.segments:
            for t in range(ts, te):
                out[t] += y[t, rs:re] @ bt[rs:re]   # y outside a token's own rows: ignored
        """
        ...

    def apply(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        """The hot path; may skip materialising y::

        expand(shrink(x, a, plan), bt, out, plan)   # out[t] += x[t] @ a[rs:re].T @ bt[rs:re]
        """
        ...


class TorchReferenceOps:
    """Per-token loop in float64 over ``plan.segments``: the semantic reference (tests only)."""

    name = "torch-reference"

    def table_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def shrink(self, x: torch.Tensor, a: torch.Tensor, plan: LoRABatchPlan) -> torch.Tensor:
        y = torch.zeros(plan.num_tokens, plan.num_rows, dtype=torch.float64, device=x.device)
        for ts, te, rs, re in plan.segments:
            for t in range(ts, te):
                y[t, rs:re] = x[t].double() @ a[rs:re].double().T  # [r]
        return y.to(torch.promote_types(x.dtype, a.dtype))

    def expand(
        self, y: torch.Tensor, bt: torch.Tensor, out: torch.Tensor, plan: LoRABatchPlan
    ) -> None:
        for ts, te, rs, re in plan.segments:
            for t in range(ts, te):
                delta = y[t, rs:re].double() @ bt[rs:re].double()  # [d_out]
                out[t] = (out[t].double() + delta).to(out.dtype)

    def apply(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        for ts, te, rs, re in plan.segments:
            for t in range(ts, te):
                delta = (x[t].double() @ a[rs:re].double().T) @ bt[rs:re].double()  # [d_out]
                out[t] = (out[t].double() + delta).to(out.dtype)


class TorchLoRAOps:
    """Fast torch path: per run one shrink GEMM, the mask multiply if coalesced, one addmm_.

    Reads each run's rows of ``a``/``bt`` once as contiguous views (no gathers, no per-row
    copies) and accumulates in place into the contiguous row slice ``out[tok_start:tok_end]``.

    ``upcast``: low-precision dtypes computed in float32, for CPUs without native GEMMs for
    them (on AVX2 a bf16 ``mm`` runs ~100x slower than float32). ``table_dtype`` is float32
    for those, so only ``x`` (once per module) and the result are converted.
    """

    def __init__(self, upcast: Iterable[torch.dtype] = ()) -> None:
        self.upcast = frozenset(upcast)
        self.name = "torch-upcast" if self.upcast else "torch"

    def table_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self._compute_dtype(model_dtype, model_dtype)

    def _compute_dtype(self, x_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
        dtype = torch.promote_types(x_dtype, w_dtype)
        return torch.float32 if dtype in self.upcast else dtype

    def shrink(self, x: torch.Tensor, a: torch.Tensor, plan: LoRABatchPlan) -> torch.Tensor:
        """See ``LoRAOps.shrink``; y has the compute dtype."""
        cd = self._compute_dtype(x.dtype, a.dtype)
        x = x.to(cd)  # x: [T, d_in]; no-op unless upcasting
        y = torch.zeros(plan.num_tokens, plan.num_rows, dtype=cd, device=x.device)
        for ts, te, rs, re, mask in plan.runs:
            y_run = F.linear(x[ts:te], a[rs:re].to(cd))  # [n, r] = [n, d_in] @ [r, d_in].T
            if mask is not None:
                y_run.mul_(mask)
            y[ts:te, rs:re] = y_run
        return y

    def expand(
        self, y: torch.Tensor, bt: torch.Tensor, out: torch.Tensor, plan: LoRABatchPlan
    ) -> None:
        """See ``LoRAOps.expand``."""
        cd = self._compute_dtype(y.dtype, bt.dtype)
        for ts, te, rs, re, mask in plan.runs:
            y_run = y[ts:te, rs:re].to(cd)  # [n, r]
            if mask is not None:
                y_run = y_run * mask  # y may hold values outside a token's own rows
            delta = torch.mm(y_run, bt[rs:re].to(cd))  # [n, d_out]
            out[ts:te].add_(delta)

    def apply(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        """See ``LoRAOps.apply``: per run a shrink GEMM, the mask, and addmm_ into ``out``."""
        cd = self._compute_dtype(x.dtype, a.dtype)
        if x.dtype != cd:
            x = x.to(cd)  # x: [T, d_in], converted once per module rather than per run
        convert_w = a.dtype != cd  # tables not in table_dtype(): correct, but converts per run
        in_place = out.dtype == cd
        for ts, te, rs, re, mask in plan.runs:
            a_run, bt_run = a[rs:re], bt[rs:re]  # [r, d_in], [r, d_out]: contiguous views
            if convert_w:
                a_run, bt_run = a_run.to(cd), bt_run.to(cd)
            y = F.linear(x[ts:te], a_run)  # [n, r] = [n, d_in] @ [r, d_in].T
            if mask is not None:
                y.mul_(mask)  # coalesced run: each token keeps only its own rows
            if in_place:
                out[ts:te].addmm_(y, bt_run)  # [n, d_out] += [n, r] @ [r, d_out]
            else:
                out[ts:te].add_(torch.mm(y, bt_run))  # [n, d_out], cast into out's dtype


# ------------------------------------------------------------------------------------ selection


@dataclass(frozen=True, slots=True)
class LoRAOpsBackend:
    """A registrable backend: ``select_lora_ops`` takes the first one that supports the device."""

    name: str
    supports: Callable[[torch.device], bool]
    create: Callable[[torch.device], LoRAOps]


def cpu_slow_matmul_dtypes() -> tuple[torch.dtype, ...]:
    """Low-precision dtypes oneDNN has no fast CPU GEMM for here (both on AVX2)."""
    slow = []
    for dtype, probe in (
        (torch.bfloat16, "_is_mkldnn_bf16_supported"),
        (torch.float16, "_is_mkldnn_fp16_supported"),
    ):
        try:
            fast = bool(getattr(torch.ops.mkldnn, probe)())
        except (AttributeError, RuntimeError):
            fast = False
        if not fast:
            slow.append(dtype)
    return tuple(slow)


def _create_torch_ops(device: torch.device) -> LoRAOps:
    return TorchLoRAOps(upcast=cpu_slow_matmul_dtypes() if device.type == "cpu" else ())


def _triton_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def _create_triton_ops(device: torch.device) -> LoRAOps:
    """Triton kernels, after a start-up self-check on ``device`` against the torch path;
    if they fail to compile or disagree, the torch path is used instead (with a warning)."""
    from loraplex.lora.triton_ops import TritonLoRAOps

    ops = TritonLoRAOps()
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 32, generator=g).to(device)
        a = torch.randn(24, 32, generator=g).to(device)
        bt = torch.randn(24, 48, generator=g).to(device)
        plan = plan_lora_batch(5, [(0, 2, 0, 8), (3, 5, 8, 24)], torch.float32, device)
        got, want = torch.zeros(5, 48, device=device), torch.zeros(5, 48, device=device)
        ops.apply(x, a, bt, got, plan)
        TorchLoRAOps().apply(x, a, bt, want, plan)
        if not torch.allclose(got, want, atol=1e-3, rtol=1e-3):
            raise RuntimeError(f"max difference {(got - want).abs().max().item():.3g}")
    except Exception as e:  # any compile or launch failure: keep serving on the torch path
        warnings.warn(
            f"Triton LoRA kernels unusable on {device} ({e}); using the torch path", stacklevel=2
        )
        return _create_torch_ops(device)
    return ops


TRITON_BACKEND = LoRAOpsBackend(
    name="triton", supports=_triton_available, create=_create_triton_ops
)
TORCH_BACKEND = LoRAOpsBackend(
    name="torch", supports=lambda device: device.type in ("cpu", "cuda"), create=_create_torch_ops
)
DEFAULT_BACKENDS: tuple[LoRAOpsBackend, ...] = (TRITON_BACKEND, TORCH_BACKEND)
"""In preference order: Triton kernels on CUDA when triton is installed, else the torch path."""


def select_lora_ops(
    device: torch.device | str,
    backends: Sequence[LoRAOpsBackend] = DEFAULT_BACKENDS,
    name: str | None = None,
) -> LoRAOps:
    """Choose the LoRA ops backend once at start-up: ``name`` if given, else the first that fits."""
    device = torch.device(device)
    for backend in backends:
        if (name is None or backend.name == name) and backend.supports(device):
            return backend.create(device)
    wanted = f"{name!r}" if name else "any backend"
    raise ValueError(f"no LoRA ops backend ({wanted}) supports device {device}")
