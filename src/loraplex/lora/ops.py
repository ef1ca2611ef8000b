"""Gathered LoRA ops for a mixed batch, over one plan per engine step (``loraplex.lora.plan``).

Backends implement the small ``LoRAOps`` protocol and are chosen once at start-up by
``select_lora_ops``; the model never branches on the backend.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from loraplex.lora.plan import LoRABatchPlan, plan_lora_batch

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


NATIVE_RUN_TOKENS = 64
"""Runs longer than this compute natively in ``TorchLoRAOps.native_runs`` dtypes (measured on an
AMX Xeon: float32 wins up to 64 tokens at ranks 8 and 64, native from 128)."""


class TorchLoRAOps:
    """Fast torch path: per run one shrink GEMM, the mask multiply if coalesced, one addmm_.

    Reads each run's rows of ``a``/``bt`` once as contiguous views (no gathers, no per-row
    copies) and accumulates in place into the contiguous row slice ``out[tok_start:tok_end]``.

    ``upcast``: low-precision dtypes computed in float32 with float32 tables (``table_dtype``),
    so only ``x`` (once per module) and the result are converted. On CPU that is every
    low-precision dtype: without native GEMMs for it a bf16 ``mm`` runs ~100x slower than
    float32 (AVX2), and even with them (AMX) a rank-thin bf16 GEMM pays ~25 us of oneDNN
    overhead per call where float32 MKL pays ~5 (16 distinct rank-8 adapters on 16 decode
    tokens: 134 us per module native, 63 us upcast).

    ``native_runs``: upcast dtypes the device has fast native GEMMs for. A run of more than
    ``NATIVE_RUN_TOKENS`` tokens (prefill) computes in ``x``'s dtype with its table rows
    converted, where the native GEMM wins (512 tokens x rank 8: 126 us native, 2088 us upcast).
    """

    def __init__(
        self, upcast: Iterable[torch.dtype] = (), native_runs: Iterable[torch.dtype] = ()
    ) -> None:
        self.upcast = frozenset(upcast)
        self.native_runs = frozenset(native_runs) & self.upcast
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
        long_native = x.dtype in self.native_runs and out.dtype == x.dtype
        xc = x if x.dtype == cd else None  # x: [T, d_in] in cd, converted once, at first need
        convert_w = a.dtype != cd  # tables not in table_dtype(): correct, but converts per run
        in_place = out.dtype == cd
        for ts, te, rs, re, mask in plan.runs:
            a_run, bt_run = a[rs:re], bt[rs:re]  # [r, d_in], [r, d_out]: contiguous views
            if long_native and te - ts > NATIVE_RUN_TOKENS:
                lp = x.dtype  # a prefill-sized run: x's own dtype, the rows converted
                y = F.linear(x[ts:te], a_run.to(lp))  # [n, r]
                if mask is not None:
                    y.mul_(mask)
                out[ts:te].addmm_(y, bt_run.to(lp))  # out has x's dtype
                continue
            if xc is None:
                xc = x.to(cd)
            if convert_w:
                a_run, bt_run = a_run.to(cd), bt_run.to(cd)
            y = F.linear(xc[ts:te], a_run)  # [n, r] = [n, d_in] @ [r, d_in].T
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
    if device.type != "cpu":
        return TorchLoRAOps()
    slow = cpu_slow_matmul_dtypes()
    lowp = (torch.bfloat16, torch.float16)
    return TorchLoRAOps(upcast=lowp, native_runs=[d for d in lowp if d not in slow])


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
