"""Gathered LoRA ops for a mixed batch, over one plan per engine step (``loraplex.lora.plan``).

Backends implement the small ``LoRAOps`` protocol and are chosen once at start-up by
``loraplex.lora.backends.select_lora_ops``; the model never branches on the backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Protocol

import torch
import torch.nn.functional as F

from loraplex.lora.plan import LoRABatchPlan

# ------------------------------------------------------------------------------------ ops

ModuleTables = tuple[torch.Tensor, torch.Tensor, int, int]
"""``(a [capacity, d_in], bt [capacity, d_out], lo, hi)``: one module's tables and the columns
``[lo, hi)`` (``hi - lo = d_out``) of the fused output it adds into."""


class LoRAOps(Protocol):
    """Gathered LoRA shrink/expand over a planned mixed batch.

    Shapes: ``x [T, d_in]``, ``a [capacity, d_in]``, ``bt [capacity, d_out]``,
    ``out [T, d_out]`` (x's dtype), ``y [T, plan.num_rows]``.

    ``w_j`` below is segment ``j``'s weight (``plan.weights``, 1.0 without them); a token may
    lie in several segments (a composed request's adapters, in distinct rows; see
    ``loraplex.lora.plan``), and each adds its own delta.
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
                y[t, rs:re] = x[t] @ a[rs:re].T   # unweighted: expand applies w_j
        return y
        """
        ...

    def expand(
        self, y: torch.Tensor, bt: torch.Tensor, out: torch.Tensor, plan: LoRABatchPlan
    ) -> None:
        """Add each token's rank-row activations times its adapter's (scale * B).T, in place::

        for j, (ts, te, rs, re) in enumerate(plan.segments):
            for t in range(ts, te):
                out[t] += w_j * y[t, rs:re] @ bt[rs:re]   # y outside t's own rows: ignored
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

        expand(shrink(x, a, plan), bt, out, plan)   # out[t] += w_j x[t] @ a[rs:re].T @ bt[rs:re]
        """
        ...

    def apply_many(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        modules: Sequence[ModuleTables],
        plan: LoRABatchPlan,
    ) -> None:
        """Several modules reading the same ``x`` and adding into column ranges of one fused
        output (q/k/v of a layer), maybe in one pass::

        for a, bt, lo, hi in modules:
            apply(x, a, bt, out[:, lo:hi], plan)

        Callers pass the same ``modules`` object for the same modules (a backend may keep
        what it derives from it, keyed by identity); the tables in it never change shape.
        """
        ...

    def embed(
        self,
        ids: torch.Tensor,
        at: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        """The token embedding's LoRA, whose shrink is a gather of A by token id::

        for j, (ts, te, rs, re) in enumerate(plan.segments):
            for t in range(ts, te):
                out[t] += w_j * at[ids[t], rs:re] @ bt[rs:re]

        ``ids [T]`` token ids, ``at [vocab, capacity]`` (A transposed, contiguous),
        ``bt [capacity, d]``, ``out [T, d]`` (the looked-up embeddings).
        """
        ...


class PerModuleOps:
    """``apply_many`` as one ``apply`` per module: for backends with nothing to share."""

    def apply(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        raise NotImplementedError

    def apply_many(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        modules: Sequence[ModuleTables],
        plan: LoRABatchPlan,
    ) -> None:
        """See ``LoRAOps.apply_many``."""
        for a, bt, lo, hi in modules:
            self.apply(x, a, bt, out[:, lo:hi], plan)


class TorchReferenceOps(PerModuleOps):
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
        for j, (ts, te, rs, re) in enumerate(plan.segments):
            w = plan.segment_weight(j)
            for t in range(ts, te):
                delta = w * (y[t, rs:re].double() @ bt[rs:re].double())  # [d_out]
                out[t] = (out[t].double() + delta).to(out.dtype)

    def apply(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        for j, (ts, te, rs, re) in enumerate(plan.segments):
            w = plan.segment_weight(j)
            for t in range(ts, te):
                delta = w * ((x[t].double() @ a[rs:re].double().T) @ bt[rs:re].double())  # [d_out]
                out[t] = (out[t].double() + delta).to(out.dtype)

    def embed(
        self,
        ids: torch.Tensor,
        at: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        for j, (ts, te, rs, re) in enumerate(plan.segments):
            w = plan.segment_weight(j)
            for t in range(ts, te):
                delta = w * (at[int(ids[t]), rs:re].double() @ bt[rs:re].double())  # [d]
                out[t] = (out[t].double() + delta).to(out.dtype)


NATIVE_RUN_TOKENS = 64
"""Runs longer than this compute natively in ``TorchLoRAOps.native_runs`` dtypes; shorter ones
upcast (where each wins was measured with ``loraplex.tools.bench.lora_ops``: docs/benchmarks-history.md)."""


class TorchLoRAOps(PerModuleOps):
    """Fast torch path: per run one shrink GEMM, the mask multiply if coalesced, one addmm_.

    Reads each run's rows of ``a``/``bt`` once as contiguous views (no gathers, no per-row
    copies) and accumulates in place into the contiguous row slice ``out[tok_start:tok_end]``.

    ``upcast``: low-precision dtypes computed in float32 with float32 tables (``table_dtype``),
    so only ``x`` (once per module) and the result are converted. On CPU that is every
    low-precision dtype: without native GEMMs for it a bf16 ``mm`` is far slower than float32
    (AVX2), and even with them (AMX) a rank-thin bf16 GEMM pays more per-call overhead in
    oneDNN than float32 does in MKL.

    ``native_runs``: upcast dtypes the device has fast native GEMMs for. A run of more than
    ``NATIVE_RUN_TOKENS`` tokens (prefill) computes in ``x``'s dtype with its table rows
    converted, where the native GEMM wins. (Figures: docs/benchmarks-history.md.)
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
        # a masked run writes zeros into the rows its tokens do not use; runs of one token
        # range together are unmasked (each writes only its own rows), so no value is lost
        for ts, te, rs, re, mask in plan.runs:
            y_run = F.linear(x[ts:te], a[rs:re].to(cd))  # [n, r] = [n, d_in] @ [r, d_in].T
            if mask is not None:
                y_run.mul_(mask != 0)  # unweighted: expand applies the mask's weights
            y[ts:te, rs:re] = y_run
        return y

    def expand(
        self, y: torch.Tensor, bt: torch.Tensor, out: torch.Tensor, plan: LoRABatchPlan
    ) -> None:
        """See ``LoRAOps.expand``."""
        cd = self._compute_dtype(y.dtype, bt.dtype)
        for (ts, te, rs, re, mask), c in zip(plan.runs, plan.run_scales or repeat(1), strict=False):
            y_run = y[ts:te, rs:re].to(cd)  # [n, r]
            if mask is not None:  # y may hold values outside a token's own rows
                y_run = (y_run * mask).to(cd)  # a weighted mask is float32
            if c != 1:
                y_run = y_run * c  # a composed or scaled adapter's run
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
        # each run's scale: 1 (an int: no cast) unless a request scales its adapter
        for (ts, te, rs, re, mask), c in zip(plan.runs, plan.run_scales or repeat(1), strict=False):
            a_run, bt_run = a[rs:re], bt[rs:re]  # [r, d_in], [r, d_out]: contiguous views
            if long_native and te - ts > NATIVE_RUN_TOKENS:
                lp = x.dtype  # a prefill-sized run: x's own dtype, the rows converted
                y = F.linear(x[ts:te], a_run.to(lp))  # [n, r]
                if mask is not None:
                    y.mul_(mask)
                if c != 1:
                    y.mul_(c)
                out[ts:te].addmm_(y, bt_run.to(lp))  # out has x's dtype
                continue
            if xc is None:
                xc = x.to(cd)
            if convert_w:
                a_run, bt_run = a_run.to(cd), bt_run.to(cd)
            y = F.linear(xc[ts:te], a_run)  # [n, r] = [n, d_in] @ [r, d_in].T
            if mask is not None:
                y.mul_(mask)  # coalesced run: each token keeps only its own rows, weighted
            if c != 1:  # a weighted run (a composed or scaled adapter's): y is [n, r], small
                y.mul_(c)
            if in_place:
                out[ts:te].addmm_(y, bt_run)  # [n, d_out] += [n, r] @ [r, d_out]
            else:
                out[ts:te].add_(torch.mm(y, bt_run))  # [n, d_out], cast into out's dtype

    def embed(
        self,
        ids: torch.Tensor,
        at: torch.Tensor,
        bt: torch.Tensor,
        out: torch.Tensor,
        plan: LoRABatchPlan,
    ) -> None:
        """See ``LoRAOps.embed``: one gather of every token's rank-row activations, then
        ``expand`` (once per step, so nothing fused)."""
        if not plan.runs:
            return
        y = at[:, : plan.num_rows].index_select(0, ids)  # [T, num_rows]
        self.expand(y, bt, out, plan)
