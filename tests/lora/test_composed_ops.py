"""Composed adapters in the gathered ops: weighted segments in layers (``loraplex.lora.plan``).

A step where some tokens add several adapters' deltas, each with its own scale (negative and
fractional included), beside single-adapter, scaled single-adapter and base tokens: every
backend equals the explicit sum ``out[t] += sum_j w_j * x[t] @ A_j.T @ Bt_j`` in float64.
"""

from __future__ import annotations

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
from tests.lora.test_gathered_ops import ALWAYS_MERGE, FAST_OPS, TOL

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
