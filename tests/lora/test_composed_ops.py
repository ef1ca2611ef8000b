"""Composed adapters in the gathered ops: weighted segments in layers (``loraplex.lora.plan``).

A step where some tokens add several adapters' deltas, each with its own scale (negative and
fractional included), beside single-adapter, scaled single-adapter and base tokens: every
backend equals the explicit sum ``out[t] += sum_j w_j * x[t] @ A_j.T @ Bt_j`` in float64.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from loraplex.lora.ops import TorchReferenceOps
from loraplex.lora.plan import (
    LoRABatchPlan,
    plan_expert_rows,
    plan_lora_batch,
    plan_rows,
    token_segments,
)
from tests.lora.test_gathered_ops import ALWAYS_MERGE, FAST_OPS, NEVER_MERGE, TOL

# tokens 0-1 base; 2-4 adapter X (rows 0:8); 5 composition X*0.5 + Y*-1.5 + Z*2; 6-7 adapter
# Y (rows 8:12) at scale 0.25 (a per-request lora_scale); 8-10 composition Y*1 + Z*-0.75;
# 11 adapter Z (rows 12:44) alone; 12 base.
T, CAP = 13, 48
X, Y, Z = (0, 8), (8, 12), (12, 44)
PRIMARY = [(2, 5, *X), (5, 6, *X), (6, 8, *Y), (8, 11, *Y), (11, 12, *Z)]
WEIGHTS = [1.0, 0.5, 0.25, 1.0, 1.0]
EXTRA = [(5, 6, *Y, -1.5), (5, 6, *Z, 2.0), (8, 11, *Z, -0.75)]


def composed_plan(dtype: torch.dtype, costs=None) -> LoRABatchPlan:
    return plan_lora_batch(T, PRIMARY, dtype, "cpu", costs, weights=WEIGHTS, extra=EXTRA)


def explicit(
    x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, base: torch.Tensor
) -> torch.Tensor:
    """The semantics, written out: every (tokens, rows, weight) triple adds its delta."""
    out = base.double().clone()
    for ts, te, rs, re, w in [(*s, w) for s, w in zip(PRIMARY, WEIGHTS, strict=True)] + EXTRA:
        out[ts:te] += w * (x[ts:te].double() @ a[rs:re].double().T) @ bt[rs:re].double()
    return out


def test_the_plan_layers_a_composition_over_its_tokens() -> None:
    plan = composed_plan(torch.float32)
    # layer 0: one segment per adapted token; layer 1: Y of token 5, Z of 8-10; layer 2: Z of 5
    assert plan.layers == (0, 5, 7)
    assert plan.segments[5:] == ((5, 6, *Y), (8, 11, *Z), (5, 6, *Z))
    assert plan.weights == (1.0, 0.5, 0.25, 1.0, 1.0, -1.5, -0.75, 2.0)
    assert plan.run_scales is None or len(plan.run_scales) == len(plan.runs)
    for l0, l1 in plan.layer_bounds():  # each layer is disjoint in tokens
        toks = [t for ts, te, _, _ in plan.segments[l0:l1] for t in range(ts, te)]
        assert len(toks) == len(set(toks))


def test_a_unit_weight_plan_is_the_plain_plan() -> None:
    segs = [(0, 2, 0, 8), (2, 3, 8, 12)]
    plain = plan_lora_batch(4, segs, torch.float32, "cpu")
    weighted = plan_lora_batch(4, segs, torch.float32, "cpu", weights=[1.0, 1.0])
    assert plain.weights is None and plain.run_scales is None and plain.layers == (0,)
    assert weighted.weights is None and weighted.run_scales is None
    assert [r[:4] for r in plain.runs] == [r[:4] for r in weighted.runs]


def test_zero_weights_drop_their_segments_and_bad_weights_are_refused() -> None:
    plan = plan_lora_batch(
        4, [(0, 2, 0, 8), (2, 3, 8, 12)], torch.float32, "cpu", weights=[0.0, 2.0],
        extra=[(0, 2, 8, 12, 0.0)],
    )  # fmt: skip
    assert plan.segments == ((2, 3, 8, 12),) and plan.weights == (2.0,)
    with pytest.raises(ValueError, match="finite"):
        plan_lora_batch(4, [(0, 2, 0, 8)], torch.float32, "cpu", weights=[float("nan")])


@pytest.mark.parametrize("variant", [*FAST_OPS, "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("coalesce", [False, True])
def test_every_backend_adds_each_component_with_its_scale(
    variant: str, dtype: torch.dtype, coalesce: bool
) -> None:
    g = torch.Generator().manual_seed(49)
    d_in, d_out = 40, 24
    x = torch.randn(T, d_in, generator=g).to(dtype)
    a = (0.3 * torch.randn(CAP, d_in, generator=g)).to(dtype)
    bt = (0.3 * torch.randn(CAP, d_out, generator=g)).to(dtype)
    a2 = (0.3 * torch.randn(CAP, d_in, generator=g)).to(dtype)
    bt2 = (0.3 * torch.randn(CAP, 9, generator=g)).to(dtype)
    base = torch.randn(T, d_out + 9, generator=g).to(dtype)
    if variant == "reference":
        ops, table_dtype = TorchReferenceOps(), None
    else:
        factory, table_dtype = FAST_OPS[variant]
        ops = factory()
    tabs = [t.to(table_dtype) if table_dtype else t for t in (a, bt, a2, bt2)]
    plan = composed_plan(dtype, ALWAYS_MERGE if coalesce else None)
    got = base.clone()
    modules = ((tabs[0], tabs[1], 0, d_out), (tabs[2], tabs[3], d_out, d_out + 9))
    ops.apply_many(x, got, modules, plan)
    want = torch.cat(
        (explicit(x, a, bt, base[:, :d_out]), explicit(x, a2, bt2, base[:, d_out:])), dim=1
    )
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    # shrink then expand (the tensor-parallel path) agrees too
    got2 = base[:, :d_out].clone()
    ops.expand(ops.shrink(x, tabs[0], plan), tabs[1], got2, plan)
    torch.testing.assert_close(got2.double(), want[:, :d_out], **TOL[dtype])


@pytest.mark.parametrize("variant", ["native", "cpu-kernel", "reference"])
def test_embedding_head_rows_and_expert_rows_keep_the_weights(variant: str) -> None:
    g = torch.Generator().manual_seed(7)
    vocab, d = 30, 16
    at = 0.3 * torch.randn(vocab, CAP, generator=g)
    bt = 0.3 * torch.randn(CAP, d, generator=g)
    ids = torch.randint(0, vocab, (T,), generator=g)
    ops = TorchReferenceOps() if variant == "reference" else FAST_OPS[variant][0]()
    plan = composed_plan(torch.float32)
    got = torch.zeros(T, d)
    ops.embed(ids, at, bt, got, plan)
    want = explicit(torch.eye(vocab)[ids], at.T.contiguous(), bt, torch.zeros(T, d))
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
    # the LM head's rows: a subset of the tokens keeps each one's components and scales
    rows = [1, 5, 7, 9, 11]
    head = plan_rows(plan, rows)
    x = torch.randn(T, d, generator=g)
    a = 0.3 * torch.randn(CAP, d, generator=g)
    got = torch.zeros(len(rows), d)
    ops.apply(x[rows], a, bt, got, head)
    torch.testing.assert_close(
        got.double(), explicit(x, a, bt, torch.zeros(T, d))[rows], **TOL[torch.float32]
    )
    # MoE: (token, expert) pairs sorted by expert, rows offset by expert * capacity
    tok = torch.tensor([0, 5, 9, 2, 5, 8, 11, 6]).numpy()
    exp = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]).numpy()
    rows_plan = plan_expert_rows(plan, token_segments(plan), tok, exp, CAP)
    ae = 0.3 * torch.randn(2 * CAP, d, generator=g)
    be = 0.3 * torch.randn(2 * CAP, d, generator=g)
    got = torch.zeros(len(tok), d)
    ops.apply(x[tok], ae, be, got, rows_plan)
    for p, (t, e) in enumerate(zip(tok.tolist(), exp.tolist(), strict=True)):
        sl = slice(e * CAP, (e + 1) * CAP)
        want_t = explicit(x, ae[sl], be[sl], torch.zeros(T, d))[t]
        torch.testing.assert_close(got[p].double(), want_t, **TOL[torch.float32])


def _random_composition(seed: int, max_layers: int = 4):
    """Layer-0 segments over random tokens (base tokens between), plus up to ``max_layers - 1``
    more components on random token ranges, in rows of their own; weights from a set with a
    negative one, 0 (dropped) and 1; some tokens only in a later layer."""
    rng = random.Random(seed)
    segs, weights, t, r = [], [], rng.randint(0, 2), 0
    for _ in range(rng.randint(1, 8)):
        n, rank = rng.randint(1, 4), rng.randint(1, 12)
        segs.append((t, t + n, r, r + rank))
        weights.append(rng.choice([1.0, 1.0, 0.5, -1.5]))
        t, r = t + n + rng.randint(0, 2), r + rank + rng.randint(0, 2)
    extra_rows = []
    for _ in range(max_layers - 1):  # each component's adapter: rows no layer-0 segment uses
        rank = rng.randint(1, 12)
        extra_rows.append((r, r + rank))
        r += rank
    extra = []
    for rs, re in extra_rows:
        for _ in range(rng.randint(0, 3)):
            ts = rng.randint(0, max(t - 1, 0))
            te = min(t, ts + rng.randint(1, 4))
            if all(te <= e0 or ts >= e1 for e0, e1, s0, _, _ in extra if s0 == rs):
                extra.append((ts, te, rs, re, rng.choice([1.0, 0.25, -0.75, 0.0, 2.0])))
    return t, segs, weights, extra, r


def _dense(num_tokens: int, rows: int, triples) -> torch.Tensor:
    """``W [T, rows]``: the weight each token adds each row with (float64)."""
    w = torch.zeros(num_tokens, rows, dtype=torch.float64)
    for (ts, te, rs, re), v in triples:
        w[ts:te, rs:re] += v if not isinstance(v, torch.Tensor) else v.double()
    return w


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("costs", [None, NEVER_MERGE, ALWAYS_MERGE], ids=["plan", "seg", "merged"])
def test_the_runs_add_exactly_the_segments_weights(seed: int, costs) -> None:
    """Whatever the runs (masked over several layers' segments, one segment with its scale,
    one per segment), each token adds each of its rows with its segment's weight, once."""
    t, segs, weights, extra, rows = _random_composition(seed)
    plan = plan_lora_batch(t, segs, torch.bfloat16, "cpu", costs, weights=weights, extra=extra)
    want = _dense(
        t, rows, [((ts, te, rs, re), w) for ts, te, rs, re, w in plan.weighted_segments()]
    )
    scales = plan.run_scales or [1.0] * len(plan.runs)
    got = _dense(
        t,
        rows,
        [
            ((ts, te, rs, re), c if m is None else m * c)
            for (ts, te, rs, re, m), c in zip(plan.runs, scales, strict=True)
        ],
    )
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for run in plan.runs:  # a weight such as -0.75 is kept exactly (float32, not bfloat16)
        if run.mask is not None and not torch.all((run.mask == 0) | (run.mask == 1)):
            assert run.mask.dtype == torch.float32
    for (ts, te, _, _, m), (us, ue, _, _, n) in itertools.combinations(plan.runs, 2):
        if ts < ue and us < te:  # runs sharing tokens are unmasked (one segment's rows each)
            assert m is None and n is None


def test_a_composed_decode_step_takes_about_the_runs_of_a_plain_one() -> None:
    """16 decode tokens over 16 adapters, then each also composing its neighbour's adapter at
    0.5: the second layer shares the first one's GEMM pairs (the rows are those of the same
    16 adapters), instead of a run per token."""
    rows = [(16 * i, 16 * i + (8 if i % 2 == 0 else 16)) for i in range(16)]
    segs = [(i, i + 1, *rows[i]) for i in range(16)]
    extra = [(i, i + 1, *rows[(i + 1) % 16], 0.5) for i in range(16)]
    plain = plan_lora_batch(16, segs, torch.float32, "cpu")
    composed = plan_lora_batch(16, segs, torch.float32, "cpu", extra=extra)
    assert len(composed.runs) <= len(plain.runs) + 1 < len(segs)


@pytest.mark.parametrize("variant", ["native", "upcast", "cpu-kernel", "cpu-kernel-f32-tables"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_random_compositions_match_the_reference(variant: str, dtype: torch.dtype, seed: int):
    """Random compositions of up to 4 adapters beside single and base tokens, planned with the
    default costs: each backend equals the float64 reference."""
    t, segs, weights, extra, rows = _random_composition(100 + seed)
    g = torch.Generator().manual_seed(seed)
    d_in, d_out = 33, 40
    x = torch.randn(t, d_in, generator=g).to(dtype)
    factory, table_dtype = FAST_OPS[variant]
    a = (0.3 * torch.randn(rows, d_in, generator=g)).to(table_dtype or dtype)
    bt = (0.3 * torch.randn(rows, d_out, generator=g)).to(table_dtype or dtype)
    base = torch.randn(t, d_out, generator=g).to(dtype)
    plan = plan_lora_batch(t, segs, dtype, "cpu", weights=weights, extra=extra)
    got, want = base.clone(), base.double()
    factory().apply(x, a, bt, got, plan)
    for ts, te, rs, re, w in plan.weighted_segments():
        want[ts:te] += w * (x[ts:te].double() @ a[rs:re].double().T) @ bt[rs:re].double()
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
