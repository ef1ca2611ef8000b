"""The LoRA batch plan of one engine step: which tokens use which rank rows, grouped into runs.

Layout (see ``loraplex.lora.slots``): every module has tables ``a [capacity, d_in]`` and
``bt [capacity, d_out]`` (``bt = (scale * B).T``) and each resident adapter owns a contiguous
range of rank rows in all of them. The runner orders the step's tokens so each adapter's tokens
are contiguous and adapters appear in increasing row order; a *segment*
``(tok_start, tok_end, row_start, row_end)`` says "these tokens use these rows". Tokens outside
every segment use the base model only. One adapter may have several segments in a row, with the
same rows and base tokens between them: an activated LoRA's tokens before its activation point
are base tokens inside that adapter's part of the step.

``plan_lora_batch`` turns segments into *runs*: one shrink GEMM + one expand GEMM each. Adjacent
segments are coalesced into one run with a 0/1 mask (each token keeps only its own rows) when the
extra masked work costs less than the dispatch of the extra GEMM pairs it saves; decode steps
(one token per adapter) become one or a few runs, prefill stays one run per segment.

Weights and composed adapters (several adapters per request, each with a scale: issue 49).
Every segment has a float *weight* (1.0 unless a request scales its adapter), and a token may
lie in several segments, one per adapter of its request: the segments come in *layers*, each
sorted and disjoint in tokens as above; layer 0 holds every adapted token's first (or only)
adapter, layer ``k`` the ``k + 1``-th component of the composed requests' tokens. A component
owns its own rows (distinct adapters never share rows), so the segments of one token never
share rows. The semantics every backend implements::

    for (ts, te, rs, re), w in zip(plan.segments, plan.weights or [1.0] * len(plan.segments)):
        for t in range(ts, te):
            out[t] += w * (x[t] @ a[rs:re].T) @ bt[rs:re]   # bt = (alpha / r * B).T

(``y = W x + sum_i scale_i * (alpha_i / r_i) * B_i A_i x``, exact for any mix of ranks and
modules: no merged weights, no slot per composition or scale.) Backends that write ``out`` from
several workers at once keep one token's segments from racing: Triton's programs run one layer
at a time; the C kernel takes every layer in one call, its threads owning tokens (each token's
segments summed in one thread, each adapter's rows read once per thread for all its tokens
there). Runs: the segments of every layer are planned together (the tokens cut into units at
every segment's ends, the same cost model's DP over the units), so a composed token's
components and its neighbours' adapters share one GEMM pair: a masked run's mask holds each
token's weight in each of its segments' rows (float32 where a weight is not 1), a run of one
segment has no mask and its weight as ``plan.run_scales[i]``. A composed decode step over the
same adapters thus costs about the runs of a plain one. A plan of unit weights (no request
scales its adapter, no composition) is exactly the plan of before (``weights`` and
``run_scales`` None): the plain path pays nothing.

The plan is backend-neutral: every backend of ``loraplex.lora.ops`` (torch, Triton) consumes it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

Segment = tuple[int, int, int, int]
"""``(tok_start, tok_end, row_start, row_end)``: tokens ``[tok_start, tok_end)`` use rows
``[row_start, row_end)`` of every module's tables."""

WeightedSegment = tuple[int, int, int, int, float]
"""A segment and the weight its delta is added with (a composed request's component scale)."""

# ------------------------------------------------------------------------------------ plan


class LoRARun(NamedTuple):
    """One shrink/expand GEMM pair over a token range and a contiguous row range."""

    tok_start: int
    tok_end: int
    row_start: int
    row_end: int
    mask: torch.Tensor | None
    """``None`` for a single segment; else ``[tok_end - tok_start, row_end - row_start]``: where
    one of the token's segments owns the row, that segment's weight (1 in a plan without
    weights), else 0 (other tokens' rows, gap rows; base tokens get all zeros). A mask holding
    a weight other than 1 is float32."""


@dataclass(frozen=True, slots=True)
class LoRABatchPlan:
    """The step's LoRA work, computed once and shared by every adapted module."""

    num_tokens: int
    num_rows: int  # max row_end over the segments: the width of shrink's y
    runs: list[LoRARun]
    segments: tuple[Segment, ...]  # the non-empty input segments: the semantics, for references
    modules: frozenset[tuple[int, str]] | None = None
    """``(layer, proj)`` modules any of the step's adapters targets; the model skips the rest
    (their rows are zero for every segment). ``None``: apply every module."""
    weights: tuple[float, ...] | None = None
    """Per segment, the weight its delta is added with; ``None``: all 1.0."""
    layers: tuple[int, ...] = (0,)
    """Index in ``segments`` where each layer starts (layer 0 at 0; see the module docstring):
    the segments of one layer are disjoint in tokens, those of different layers may overlap."""
    run_scales: tuple[float, ...] | None = None
    """Per run, the scalar its delta is multiplied by (a weighted segment's run); ``None``:
    all 1.0."""

    def layer_bounds(self) -> list[tuple[int, int]]:
        """``[start, end)`` in ``segments`` of each layer."""
        ends = (*self.layers[1:], len(self.segments))
        return list(zip(self.layers, ends, strict=True))

    def segment_weight(self, j: int) -> float:
        """The weight of segment ``j``."""
        return 1.0 if self.weights is None else self.weights[j]

    def weighted_segments(self) -> list[WeightedSegment]:
        """``(ts, te, rs, re, weight)`` of every segment, in order."""
        w = self.weights or (1.0,) * len(self.segments)
        return [(*seg, wj) for seg, wj in zip(self.segments, w, strict=True)]

    def uses(self, module: tuple[int, str]) -> bool:
        """Whether the step applies LoRA on ``module`` (some adapter of it targets it)."""
        return self.modules is None or module in self.modules


@dataclass(frozen=True, slots=True)
class LoRAPlanCosts:
    """Cost model deciding which adjacent segments share one GEMM pair.

    Cost of a run over segments i..j (``T`` tokens, ``R`` rows including gap rows)::

        run_overhead_us + (mask_overhead_us if coalesced) + mac_ns * feature_dim * T * R
            + gap_rows * feature_dim * itemsize / bandwidth

    The plan minimises the total over the step (an exact DP over the segment sequence). Rows a
    segment needs are read once whatever the partition, so only gap rows count as extra reads.

    Defaults: the torch fast path (``TorchLoRAOps``, float32 compute) on a 2-core AVX2 CPU,
    fitted by ``python -m loraplex.tools.bench.lora_ops --calibrate`` (least squares of single-run time
    over token counts, ranks and feature sizes; the fits and their spread are in
    docs/benchmarks-history.md). With them a decode step of one-token segments becomes a few runs and
    prefill segments of a few hundred tokens stay one run each, which is what the op
    microbenchmark found fastest. On a GPU the dispatch is relatively dearer and the MACs
    cheaper, so coalescing pays more; pass costs measured there.

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
    modules: frozenset[tuple[int, str]] | None = None,
    *,
    weights: Sequence[float] | None = None,
    extra: Sequence[WeightedSegment] = (),
) -> LoRABatchPlan:
    """Plan one step: group the sorted segments into runs minimising ``costs``' model.

    ``segments`` must be sorted: token ranges increasing and disjoint, row ranges increasing
    and disjoint or equal to the previous segment's (one adapter's tokens with base tokens
    between). Segments with no tokens or no rows are dropped. ``dtype``/``device``: the masks' (the
    ops' compute dtype is fine too; masks are exactly 0/1 in any float dtype). ``modules``:
    see ``LoRABatchPlan.modules``.

    ``weights``: per segment of ``segments``, its weight (None: all 1.0; a zero-weight segment
    is dropped). ``extra``: the other components of composed requests, ``(ts, te, rs, re, w)``
    each, overlapping ``segments`` in tokens; each goes to the first layer >= 1 it does not
    overlap (see the module docstring); all are planned together (``_weighted_runs``).
    """
    costs = costs or LoRAPlanCosts()
    if weights is not None and len(weights) != len(segments):
        raise ValueError(f"{len(weights)} weights for {len(segments)} segments")
    if weights is not None and not extra and all(w == 1.0 for w in weights):
        weights = None  # unit weights: the plain plan
    if weights is not None or extra:
        return _weighted_plan(num_tokens, segments, weights, extra, dtype, device, costs, modules)
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
            if i == j - 1 or (rs, r_end) != segs[i + 1][2:]:  # rows a repeat reads once
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
    return LoRABatchPlan(num_tokens, num_rows, runs, tuple(segs), modules)


def _weighted_plan(
    num_tokens: int,
    segments: Sequence[Segment],
    weights: Sequence[float] | None,
    extra: Sequence[WeightedSegment],
    dtype: torch.dtype,
    device: torch.device | str,
    costs: LoRAPlanCosts,
    modules: frozenset[tuple[int, str]] | None,
) -> LoRABatchPlan:
    """``plan_lora_batch`` with weights or extra layers: the segments of every layer are
    planned together (``_weighted_runs``), each layer's segments listed as the semantics."""
    w0 = list(weights) if weights is not None else [1.0] * len(segments)
    for w in (*w0, *(e[4] for e in extra)):
        if not math.isfinite(w):
            raise ValueError(f"segment weights must be finite, got {w}")
    kept = [(tuple(seg), w) for seg, w in zip(segments, w0, strict=True) if w != 0.0]
    segs0 = _check_segments(num_tokens, [seg for seg, _ in kept])
    # _check_segments drops empty segments: keep the weights of the others, in order
    wts0 = [w for seg, w in kept if seg[0] < seg[1] and seg[2] < seg[3]]
    # extra segments: layers >= 1, each the first that the segment does not overlap
    layer_ends: list[int] = []  # per extra layer, its last segment's tok_end
    layered: list[list[WeightedSegment]] = []
    for ts, te, rs, re, w in sorted(extra, key=lambda e: e[0]):
        if not (0 <= ts <= te <= num_tokens and 0 <= rs <= re):
            raise ValueError(f"bad segment {(ts, te, rs, re)} for {num_tokens} tokens")
        if ts == te or rs == re or w == 0.0:
            continue
        k = next((k for k, end in enumerate(layer_ends) if end <= ts), len(layer_ends))
        if k == len(layer_ends):
            layer_ends.append(te)
            layered.append([])
        layer_ends[k] = te
        layered[k].append((int(ts), int(te), int(rs), int(re), float(w)))
    all_segs: list[Segment] = list(segs0)
    all_w: list[float] = [float(w) for w in wts0]
    starts = [0]
    for layer in layered:
        starts.append(len(all_segs))
        for ts, te, rs, re, w in layer:
            all_segs.append((ts, te, rs, re))
            all_w.append(w)
    runs, scales = _weighted_runs(all_segs, all_w, dtype, torch.device(device), costs)
    num_rows = max((seg[3] for seg in all_segs), default=0)
    unit = all(w == 1.0 for w in all_w)
    return LoRABatchPlan(
        num_tokens,
        num_rows,
        runs,
        tuple(all_segs),
        modules,
        weights=None if unit else tuple(all_w),
        layers=tuple(starts),
        run_scales=None if all(c == 1.0 for c in scales) else tuple(scales),
    )


def _weighted_runs(
    segs: Sequence[Segment],
    weights: Sequence[float],
    dtype: torch.dtype,
    device: torch.device,
    costs: LoRAPlanCosts,
) -> tuple[list[LoRARun], list[float]]:
    """Runs (and their scales) for segments of any layers with weights, minimising ``costs``.

    The tokens are cut at every segment's ends into *units* (token intervals inside the same
    segments, one per layer at most, or in none: base tokens). A run covers consecutive units
    and the rows of all their segments, with a mask holding each token's weight in each of its
    segments' rows (0 elsewhere: another token's rows, gap rows), so a composed token's
    components and its neighbours' adapters share one GEMM pair; a run of one segment has no
    mask and its weight as its scale, and a unit's segments may also run one each. An exact DP
    over the units, as ``plan_lora_batch``'s over segments. Weighted masks are float32 (a
    scale like 0.3 is not exact in bfloat16); 0/1 masks have ``dtype``."""
    cuts = sorted({t for ts, te, _, _ in segs for t in (ts, te)})
    units = list(itertools.pairwise(cuts))  # [(u0, u1)]
    covering: list[list[int]] = [[] for _ in units]  # per unit, its segments (by index)
    for j, (ts, te, _, _) in enumerate(segs):
        for u in range(bisect.bisect_left(cuts, ts), bisect.bisect_left(cuts, te)):
            covering[u].append(j)
    overhead, mask_cost = costs.run_overhead_us, costs.mask_overhead_us
    mac_us = costs.mac_ns * 1e-3 * costs.feature_dim  # per token x row
    gap_us = costs.feature_dim * dtype.itemsize / (costs.bandwidth_gbs * 1e3)  # per gap row
    n = len(units)
    unit_rows = [(rs, re) for _, _, rs, re in segs]
    # best[j]: min cost of units[:j]; choice[j]: (start unit of the last run, separate runs?)
    best = [0.0] * (n + 1)
    choice: list[tuple[int, bool]] = [(0, False)] * (n + 1)
    for j in range(1, n + 1):
        u1 = units[j - 1][1]
        if not covering[j - 1]:  # base tokens: no run ends here
            best[j], choice[j] = best[j - 1], (j - 1, True)
            continue
        best_j = float("inf")
        r0, r1, used_rows = math.inf, 0, 0
        inside: set[int] = set()  # the run's segments
        rows_seen: set[tuple[int, int]] = set()  # rows a repeated adapter reads once
        for i in range(j - 1, max(-1, j - 1 - costs.max_run_segments), -1):  # run = units[i:j]
            if not covering[i]:
                continue  # a run never starts on base tokens
            for k in covering[i]:
                if k in inside:
                    continue
                inside.add(k)
                rows = unit_rows[k]
                if rows[0] < r0:
                    r0 = rows[0]
                if rows[1] > r1:
                    r1 = rows[1]
                if rows not in rows_seen:
                    rows_seen.add(rows)
                    used_rows += rows[1] - rows[0]
            pieces = len(inside)
            work = overhead + mac_us * (u1 - units[i][0]) * (r1 - r0)
            if work >= best_j:
                break
            cost = best[i] + work
            if pieces > 1:
                cost += mask_cost + gap_us * (r1 - r0 - used_rows)
            if cost < best_j:
                best_j, choice[j] = cost, (i, False)
            if i == j - 1 and pieces > 1:  # this unit's segments one run each
                sep = best[i] + sum(
                    overhead + mac_us * (u1 - units[i][0]) * (segs[k][3] - segs[k][2])
                    for k in covering[i]
                )
                if sep < best_j:
                    best_j, choice[j] = sep, (i, True)
        best[j] = best_j
    bounds: list[tuple[int, int, bool]] = []
    j = n
    while j > 0:
        i, separate = choice[j]
        if covering[j - 1]:
            bounds.append((i, j, separate))
        j = i
    runs: list[LoRARun] = []
    scales: list[float] = []
    for i, j, separate in reversed(bounds):
        t0, t1 = units[i][0], units[j - 1][1]
        inside = sorted({k for u in range(i, j) for k in covering[u]})
        if separate or len(inside) == 1:
            for k in inside:
                runs.append(LoRARun(max(segs[k][0], t0), min(segs[k][1], t1), *segs[k][2:], None))
                scales.append(float(weights[k]))
            continue
        r0 = min(segs[k][2] for k in inside)
        r1 = max(segs[k][3] for k in inside)
        mask = np.zeros((t1 - t0, r1 - r0), dtype=np.float32)  # [T_run, R_run]
        for k in inside:
            ts, te, rs, re = segs[k]
            mask[max(ts, t0) - t0 : min(te, t1) - t0, rs - r0 : re - r0] = weights[k]
        unit_mask = all(weights[k] == 1.0 for k in inside)
        mask_t = torch.from_numpy(mask).to(device=device, dtype=dtype if unit_mask else None)
        runs.append(LoRARun(t0, t1, r0, r1, mask_t))
        scales.append(1.0)
    return runs, scales


def plan_rows(plan: LoRABatchPlan, rows: Sequence[int]) -> LoRABatchPlan:
    """``plan`` over a subset of its tokens: row ``i`` of the result is token ``rows[i]``
    (ascending, e.g. the step's logits rows or a chunk of prompt positions) with that token's
    rank rows; one run per segment (no masks: the ops that read it, the LM head's, are
    vocabulary-wide, so a masked run's extra rows cost more than the runs it saves)::

        for ts, te, rs, re in plan.segments:
            the rows i with ts <= rows[i] < te form one segment (i0, i1, rs, re)

    (each with its segment's weight, in its segment's layer).
    """
    n = len(rows)
    if any(rows[i] >= rows[i + 1] for i in range(n - 1)):
        raise ValueError("rows must be strictly increasing token indices")
    if n and not 0 <= rows[0] <= rows[-1] < plan.num_tokens:
        raise ValueError(f"rows must lie in [0, {plan.num_tokens}), got {rows[0]}..{rows[-1]}")
    segs: list[Segment] = []
    weights: list[float] = []
    starts: list[int] = []
    for l0, l1 in plan.layer_bounds():
        starts.append(len(segs))
        for j in range(l0, l1):
            ts, te, rs, re = plan.segments[j]
            i0, i1 = bisect.bisect_left(rows, ts), bisect.bisect_left(rows, te)
            if i0 < i1:
                segs.append((i0, i1, rs, re))
                weights.append(plan.segment_weight(j))
    return _single_runs(n, segs, weights if plan.weights is not None else None, starts, plan)


def _single_runs(
    num_tokens: int,
    segs: list[Segment],
    weights: list[float] | None,
    starts: list[int],
    plan: LoRABatchPlan,
) -> LoRABatchPlan:
    """A plan of one run per segment (no masks), ``plan``'s modules, the given layers."""
    runs = [LoRARun(*seg, None) for seg in segs]
    num_rows = max((seg[3] for seg in segs), default=0)
    w = tuple(weights) if weights is not None else None
    return LoRABatchPlan(
        num_tokens, num_rows, runs, tuple(segs), plan.modules, w, tuple(starts) or (0,), w
    )


def token_segments(plan: LoRABatchPlan) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer of the plan: ``(seg [T] int64: each token's segment of that layer (its index
    in ``plan.segments``), -1 for tokens outside the layer, rows [S, 2]: each segment's
    (row_start, row_end), over every segment of the plan)``."""
    rows = np.zeros((len(plan.segments), 2), dtype=np.int64)
    for j, (_, _, rs, r_end) in enumerate(plan.segments):
        rows[j] = (rs, r_end)
    out = []
    for l0, l1 in plan.layer_bounds():
        seg = np.full(plan.num_tokens, -1, dtype=np.int64)
        for j in range(l0, l1):
            ts, te = plan.segments[j][:2]
            seg[ts:te] = j
        out.append((seg, rows))
    return out


def plan_expert_rows(
    plan: LoRABatchPlan,
    seg_rows: list[tuple[np.ndarray, np.ndarray]],
    tok: np.ndarray,
    expert: np.ndarray,
    capacity: int,
) -> LoRABatchPlan:
    """The LoRA plan over a layer's (token, expert) pairs sorted by expert::

        for each layer of the step's plan:
            for each maximal run p0..p1 of pairs with one expert e and one segment (ts, te, rs, re)
            of that layer (the pairs' tokens in [ts, te)):
                segment (p0, p1, e * capacity + rs, e * capacity + re), the segment's weight

    ``seg_rows``: ``token_segments(plan)``. ``tok`` / ``expert``: the sorted pairs' tokens and
    experts (``[N]`` each); the order keeps both ranges increasing (the sort is stable; a slot's
    rows lie within ``capacity``). One run per segment (no masks: an expert's rows are far apart
    from the next one's)."""
    n = len(tok)
    segs: list[Segment] = []
    weights: list[float] = []
    starts: list[int] = []
    for seg, rows in seg_rows:
        starts.append(len(segs))
        sp = seg[tok]  # [N] each pair's segment in this layer (-1: none)
        key = expert * (len(rows) + 1) + sp + 1  # [N] non-decreasing within a layer
        cuts = np.flatnonzero(np.diff(key)) + 1
        begins = np.concatenate(([0], cuts)) if n else np.zeros(0, dtype=np.int64)
        ends = np.concatenate((cuts, [n])) if n else np.zeros(0, dtype=np.int64)
        for p0, p1 in zip(begins.tolist(), ends.tolist(), strict=True):
            j = int(sp[p0])
            if j >= 0:
                base = int(expert[p0]) * capacity
                segs.append((p0, p1, base + int(rows[j, 0]), base + int(rows[j, 1])))
                weights.append(plan.segment_weight(j))
    return _single_runs(n, segs, weights if plan.weights is not None else None, starts, plan)


def _check_segments(num_tokens: int, segments: Sequence[Segment]) -> list[Segment]:
    """Validate order and bounds; return the non-empty segments as int tuples."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    kept: list[Segment] = []
    prev_te = prev_rs = prev_re = 0
    for seg in segments:
        ts, te, rs, re = seg
        if not (0 <= ts <= te <= num_tokens and 0 <= rs <= re):
            raise ValueError(f"bad segment {seg} for {num_tokens} tokens")
        if ts == te or rs == re:
            continue
        repeat = kept and (rs, re) == (prev_rs, prev_re)
        if ts < prev_te or (rs < prev_re and not repeat):
            raise ValueError(
                "segments must be sorted and disjoint in tokens, and in rows unless they "
                f"repeat the previous segment's: {seg}"
            )
        kept.append((int(ts), int(te), int(rs), int(re)))
        prev_te, prev_rs, prev_re = te, rs, re
    return kept


def _make_run(segs: Sequence[Segment], dtype: torch.dtype, device: torch.device) -> LoRARun:
    """One run over consecutive segments; a 0/1 mask when there is more than one."""
    t0, t1, r0, r1 = segs[0][0], segs[-1][1], segs[0][2], segs[-1][3]
    if len(segs) == 1:
        return LoRARun(t0, t1, r0, r1, None)
    # Label every token and row with its row range's index (a repeated range keeps its
    # predecessor's); base tokens -1, gap rows -2.
    # (numpy: a small numpy op costs a fraction of a small torch op's dispatch.)
    tok_labels = np.full(t1 - t0, -1)  # [T_run]
    row_labels = np.full(r1 - r0, -2)  # [R_run]
    k = -1
    for i, (ts, te, rs, re) in enumerate(segs):
        if i == 0 or (rs, re) != segs[i - 1][2:]:
            k += 1
        tok_labels[ts - t0 : te - t0] = k
        row_labels[rs - r0 : re - r0] = k
    mask = torch.from_numpy(tok_labels[:, None] == row_labels[None, :])  # [T_run, R_run]
    return LoRARun(t0, t1, r0, r1, mask.to(device=device, dtype=dtype))
