"""Gathered LoRA ops vs the per-token float64 reference, and the batch planner."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.lora.backends import (
    DEFAULT_BACKENDS,
    LoRAOpsBackend,
    cpu_slow_matmul_dtypes,
    select_lora_ops,
)
from loraplex.lora.ops import NATIVE_RUN_TOKENS, TorchLoRAOps, TorchReferenceOps
from loraplex.lora.plan import LoRABatchPlan, LoRAPlanCosts, plan_lora_batch

LOWP = (torch.bfloat16, torch.float16)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NEVER_MERGE = LoRAPlanCosts(run_overhead_us=0.0, mask_overhead_us=0.0)
ALWAYS_MERGE = LoRAPlanCosts(mac_ns=0.0, mask_overhead_us=0.0, bandwidth_gbs=1e12)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _cpu_kernel_ops():
    from loraplex.lora.cpu_ops import CPUKernelLoRAOps, load_kernel

    return CPUKernelLoRAOps(load_kernel(), TorchLoRAOps(upcast=LOWP, native_runs=LOWP))


# Fast-path variants (factory, table dtype or None for x's): native compute in x's dtype, the
# CPU upcast (float32 tables) path, and the C kernel (short segments; the prefill cases' long
# ones on its torch fallback).
FAST_OPS = {
    "native": (TorchLoRAOps, None),
    "upcast": (lambda: TorchLoRAOps(upcast=LOWP), torch.float32),
    "upcast-lowp-tables": (lambda: TorchLoRAOps(upcast=LOWP), None),  # converts per run
    # float32 tables; runs past NATIVE_RUN_TOKENS (the prefill cases) in x's dtype
    "upcast-native-long": (lambda: TorchLoRAOps(upcast=LOWP, native_runs=LOWP), torch.float32),
    "cpu-kernel": (_cpu_kernel_ops, None),
    "cpu-kernel-f32-tables": (_cpu_kernel_ops, torch.float32),
}


def random_case(
    rng: random.Random,
    *,
    n_segments: int,
    tokens: tuple[int, int],
    max_rank: int = 64,
    with_gaps: bool = True,
) -> tuple[int, list[tuple[int, int, int, int]], int]:
    """Sorted segments with random ranks, empty segments, base tokens, gap rows, and (with
    gaps) repeats of the previous segment's rows after base tokens (an activated LoRA's rows
    before its activation point, in a step with several of its sequences).

    Returns (num_tokens, segments, table rows).
    """
    segs, t, r = [], 0, 0
    for _ in range(n_segments):
        if with_gaps and segs and rng.random() < 0.25:
            t += rng.randint(1, 3)  # the same adapter again, after base tokens
            n = rng.randint(*tokens)
            segs.append((t, t + n, segs[-1][2], segs[-1][3]))
            t += n
            continue
        if with_gaps and rng.random() < 0.4:
            t += rng.randint(1, 3)  # base-model tokens before / between segments
        if with_gaps and rng.random() < 0.3:
            r += rng.randint(1, 8)  # gap rows (resident slot not in this step)
        n = 0 if rng.random() < 0.15 else rng.randint(*tokens)  # some empty segments
        rank = rng.randint(1, max_rank)
        segs.append((t, t + n, r, r + rank))
        t, r = t + n, r + rank
    if with_gaps:
        t += rng.randint(0, 3)  # base tokens after the last segment
    return t, segs, r + rng.randint(0, 8)


def make_tensors(T: int, rows: int, d_in: int, d_out: int, dtype, table_dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d_in, generator=g).to(device, dtype)  # x: [T, d_in]
    a = (torch.randn(rows, d_in, generator=g) / d_in**0.5).to(device, table_dtype)
    bt = (torch.randn(rows, d_out, generator=g) / 4).to(device, table_dtype)
    out = torch.randn(T, d_out, generator=g).to(device, dtype)  # out: [T, d_out]
    return x, a, bt, out


CASES = [
    # (name, n_segments, tokens per segment)
    ("decode", 16, (1, 1)),
    ("prefill", 4, (30, 120)),
    ("mixed", 10, (1, 40)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("variant", list(FAST_OPS))
@pytest.mark.parametrize("costs", [None, NEVER_MERGE, ALWAYS_MERGE], ids=["plan", "seg", "merged"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_ops_match_reference(case, costs, variant, dtype, device, seed):
    _, n_segments, tokens = case
    rng = random.Random(f"{case[0]}-{seed}")
    T, segs, rows = random_case(rng, n_segments=n_segments, tokens=tokens)
    d_in, d_out = rng.randint(16, 256), rng.randint(16, 256)
    make_ops, table_dtype = FAST_OPS[variant]
    ops = make_ops()
    table_dtype = table_dtype or dtype
    x, a, bt, out = make_tensors(T, rows, d_in, d_out, dtype, table_dtype, device, seed)
    plan = plan_lora_batch(T, segs, table_dtype, device, costs)
    ref = TorchReferenceOps()
    tol = TOL[dtype]

    expected = out.clone()
    ref.apply(x, a, bt, expected, plan)
    got = out.clone()
    ops.apply(x, a, bt, got, plan)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **tol)

    # shrink/expand separately agree with the reference too.
    y_ref = ref.shrink(x, a, plan)  # [T, num_rows]
    y = ops.shrink(x, a, plan)
    assert y.shape == (T, plan.num_rows)
    torch.testing.assert_close(y.to(y_ref.dtype), y_ref, **tol)
    got2 = out.clone()
    ops.expand(y, bt, got2, plan)
    torch.testing.assert_close(got2, expected, **tol)


def test_planner_shapes_decode_and_prefill():
    segs, r = [], 0
    for i in range(16):
        rank = 8 if i % 2 == 0 else 16
        segs.append((i, i + 1, r, r + rank))
        r += rank
    decode = plan_lora_batch(16, segs, torch.float32, "cpu")
    assert 1 <= len(decode.runs) <= 4  # decode coalesces
    assert any(run.mask is not None for run in decode.runs)
    prefill_segs = [(200 * i, 200 * i + 200, rs, re) for i, (_, _, rs, re) in enumerate(segs)]
    prefill = plan_lora_batch(16 * 200, prefill_segs, torch.float32, "cpu")  # stays segmented
    assert len(prefill.runs) == 16 and all(run.mask is None for run in prefill.runs)


def test_planner_runs_cover_segments_and_masks_are_exact():
    T, segs = 12, [(1, 3, 0, 4), (3, 3, 4, 6), (4, 5, 6, 7), (6, 9, 9, 13)]
    plan = plan_lora_batch(T, segs, torch.float32, "cpu", ALWAYS_MERGE)
    assert plan.num_tokens == T and plan.num_rows == 13
    assert plan.segments == ((1, 3, 0, 4), (4, 5, 6, 7), (6, 9, 9, 13))  # empty one dropped
    (run,) = plan.runs
    assert run[:4] == (1, 9, 0, 13)
    expected = torch.zeros(8, 13)
    expected[0:2, 0:4] = 1  # tokens 1-2, rows 0-3
    expected[3:4, 6:7] = 1  # token 4, row 6 (token 3 is a base token; rows 4-5 unused)
    expected[5:8, 9:13] = 1  # tokens 6-8, rows 9-12 (token 5 base; rows 7-8 gap)
    assert torch.equal(run.mask, expected)


def test_empty_batches():
    ops = select_lora_ops("cpu")
    for T, segs in ((0, []), (5, []), (5, [(2, 2, 0, 8)])):
        plan = plan_lora_batch(T, segs, torch.float32, "cpu")
        assert plan.runs == [] and plan.num_rows == 0
        x, a, bt, out = make_tensors(T, 8, 16, 24, torch.float32, torch.float32, "cpu", 0)
        before = out.clone()
        ops.apply(x, a, bt, out, plan)
        assert torch.equal(out, before)
        assert ops.shrink(x, a, plan).shape == (T, 0)


@pytest.mark.parametrize(
    "segs",
    [
        [(0, 2, 0, 4), (1, 3, 4, 8)],  # overlapping tokens
        [(0, 2, 4, 8), (2, 3, 0, 4)],  # rows not increasing
        [(0, 9, 0, 4)],  # past num_tokens
        [(2, 1, 0, 4)],  # negative length
    ],
)
def test_planner_rejects_bad_segments(segs):
    with pytest.raises(ValueError):
        plan_lora_batch(4, segs, torch.float32, "cpu")


def test_planner_prefers_fewer_runs_when_dispatch_dominates():
    segs = [(i, i + 1, 8 * i, 8 * i + 8) for i in range(8)]
    cheap_dispatch = LoRAPlanCosts(run_overhead_us=0.01)
    assert len(plan_lora_batch(8, segs, torch.float32, "cpu", cheap_dispatch).runs) == 8
    costly_dispatch = LoRAPlanCosts(run_overhead_us=1e4)
    assert len(plan_lora_batch(8, segs, torch.float32, "cpu", costly_dispatch).runs) == 1


def test_select_lora_ops_and_backend_registration():
    ops = select_lora_ops("cpu")
    assert ops.name == "cpu-kernel"  # CI has a C compiler: the kernel must build and pass
    assert ops.table_dtype(torch.float32) == torch.float32

    class Fake:
        name = "fake"

    fake = LoRAOpsBackend("fake", lambda d: d.type == "cpu", lambda d: Fake())
    assert select_lora_ops("cpu", (fake, *DEFAULT_BACKENDS)).name == "fake"
    assert select_lora_ops("cpu", (fake, *DEFAULT_BACKENDS), name="torch").name.startswith("torch")
    with pytest.raises(ValueError):
        select_lora_ops("meta")


def test_upcast_ops_use_float32_tables_for_bf16():
    assert TorchLoRAOps(upcast=LOWP).table_dtype(torch.bfloat16) == torch.float32
    assert TorchLoRAOps().table_dtype(torch.bfloat16) == torch.bfloat16


def test_cpu_default_tables_and_long_runs():
    """On CPU the default is the C kernel with tables in the model's dtype where it reads it
    (float32, bfloat16) and float32 tables for float16 (the torch path's); its fallback keeps
    long runs native only where that GEMM is fast. ``name="torch"`` still picks the torch path,
    which keeps float32 tables for every low-precision dtype."""
    ops = select_lora_ops("cpu")
    assert ops.table_dtype(torch.bfloat16) == torch.bfloat16
    assert ops.table_dtype(torch.float16) == ops.table_dtype(torch.float32) == torch.float32
    fallback = ops.fallback
    assert isinstance(fallback, TorchLoRAOps)
    assert fallback.native_runs == set(LOWP) - set(cpu_slow_matmul_dtypes())
    torch_ops = select_lora_ops("cpu", name="torch")
    assert isinstance(torch_ops, TorchLoRAOps)
    assert torch_ops.table_dtype(torch.bfloat16) == torch.float32


def test_a_long_run_takes_the_native_path():
    """A run past NATIVE_RUN_TOKENS computes with bf16-rounded table rows (the native GEMM);
    a short one keeps the float32 rows: visible as exact agreement with each computation."""
    g = torch.Generator().manual_seed(0)
    n = NATIVE_RUN_TOKENS + 1
    x = torch.randn(n + 1, 16, generator=g).bfloat16()
    a, bt = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
    plan = plan_lora_batch(n + 1, [(0, n, 0, 4)], torch.float32, "cpu", costs=NEVER_MERGE)
    short = plan_lora_batch(n + 1, [(n, n + 1, 0, 4)], torch.float32, "cpu", costs=NEVER_MERGE)
    ops = TorchLoRAOps(upcast=LOWP, native_runs=LOWP)
    out = torch.zeros(n + 1, 8, dtype=torch.bfloat16)
    ops.apply(x, a, bt, out, plan)
    want = torch.zeros(n, 8, dtype=torch.bfloat16)
    want.addmm_(torch.nn.functional.linear(x[:n], a.bfloat16()), bt.bfloat16())
    assert torch.equal(out[:n], want) and not out[n].any()
    ops.apply(x, a, bt, out, short)
    want_short = (x[n:].float() @ a.T @ bt).bfloat16()
    assert torch.equal(out[n:], want_short)


def test_plan_is_plain_data():
    plan = plan_lora_batch(3, [(0, 3, 0, 2)], torch.float32, "cpu")
    assert isinstance(plan, LoRABatchPlan)
    assert plan.runs[0] == (0, 3, 0, 2, None)


def _modelled_cost(segs, groups, costs: LoRAPlanCosts, itemsize: int = 4) -> float:
    """The documented cost model, summed over runs (groups: list of (i, j) into segs)."""
    total = 0.0
    for i, j in groups:
        ts, te, rs, re = segs[i][0], segs[j - 1][1], segs[i][2], segs[j - 1][3]
        total += costs.run_overhead_us + costs.mac_ns * 1e-3 * costs.feature_dim * (te - ts) * (
            re - rs
        )
        if j - i > 1:
            used = sum(s[3] - s[2] for s in segs[i:j])
            gap = re - rs - used
            total += costs.mask_overhead_us + gap * costs.feature_dim * itemsize / (
                costs.bandwidth_gbs * 1e3
            )
    return total


@pytest.mark.parametrize("seed", range(20))
def test_planner_is_optimal_for_its_cost_model(seed):
    """The DP (with its pruning) matches brute force over every partition."""
    rng = random.Random(seed)
    T, segs, _ = random_case(
        rng, n_segments=rng.randint(1, 8), tokens=rng.choice([(1, 1), (1, 30)]), max_rank=32
    )
    costs = LoRAPlanCosts(run_overhead_us=rng.choice([5.0, 25.0, 100.0]))
    plan = plan_lora_batch(T, segs, torch.float32, "cpu", costs)
    kept = list(plan.segments)
    n = len(kept)
    first = {s[0]: k for k, s in enumerate(kept)}  # tok_start -> segment index
    last = {s[1]: k + 1 for k, s in enumerate(kept)}  # tok_end -> one past it
    got = [(first[r.tok_start], last[r.tok_end]) for r in plan.runs]
    best = min(_modelled_cost(kept, _groups(n, cuts), costs) for cuts in range(2 ** max(n - 1, 0)))
    assert _modelled_cost(kept, got, costs) == pytest.approx(best)


def _groups(n: int, cuts: int) -> list[tuple[int, int]]:
    """Partition of range(n) into consecutive groups; bit k of cuts cuts after segment k."""
    groups, start = [], 0
    for k in range(n - 1):
        if cuts >> k & 1:
            groups.append((start, k + 1))
            start = k + 1
    if n:
        groups.append((start, n))
    return groups


class _W:
    """One module's adapter weights in the shape ``LoRASlotBank.set_lora`` reads."""

    def __init__(self, r: int, d_in: int, d_out: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.a = torch.randn(r, d_in, generator=g)  # [r, d_in]
        self.b = torch.randn(d_out, r, generator=g)  # [d_out, r]
        self.scale = 2.0


def test_step_modules_follow_set_and_reset_lora():
    """The plan's module set is what the step's adapters target, across loads, resets and the
    compaction that moves rows; modules outside it are skipped and the rest still add."""
    from loraplex.lora.slots import LoRASlotBank
    from loraplex.model.lora_binding import LoRABinding

    shapes = {(layer, p): (16, 24) for layer in range(2) for p in ("q_proj", "k_proj", "v_proj")}
    bank = LoRASlotBank(shapes, max_loras=3, max_lora_rank=4, dtype=torch.float32, device="cpu")
    lora = LoRABinding(bank, TorchLoRAOps())
    qv = {(0, "q_proj"): _W(2, 16, 24, 1), (1, "v_proj"): _W(2, 16, 24, 2)}
    k = {(0, "k_proj"): _W(4, 16, 24, 3)}
    bank.set_lora(0, qv)
    assert lora.modules_for([0]) == {(0, "q_proj"), (1, "v_proj")}
    bank.set_lora(1, k)
    assert lora.modules_for([1]) == {(0, "k_proj")}
    assert lora.modules_for([0, 1]) == {(0, "q_proj"), (1, "v_proj"), (0, "k_proj")}
    bank.reset_lora(0)
    bank.set_lora(2, {(1, "k_proj"): _W(4, 16, 24, 4)})  # rows 0..1 free: fragmented -> compacts
    bank.set_lora(0, k)  # the slot now holds another adapter
    assert lora.modules_for([0]) == {(0, "k_proj")}
    assert lora.modules_for([2]) == {(1, "k_proj")}
    assert lora.modules_for([]) == frozenset()

    rs, re = bank.slot_rows(2)
    x = torch.randn(3, 16)  # [T, d_in]
    plan = plan_lora_batch(3, [(0, 3, rs, re)], torch.float32, "cpu", modules=lora.modules_for([2]))
    untouched, added = torch.zeros(3, 24), torch.zeros(3, 48)
    lora.add(0, [("k_proj", 0, 24)], x, untouched, plan)  # not a module of slot 2: skipped
    lora.add(1, [("q_proj", 0, 24), ("k_proj", 24, 48)], x, added, plan)  # q skipped, k added
    assert torch.equal(untouched, torch.zeros(3, 24))
    assert torch.equal(added[:, :24], torch.zeros(3, 24))
    a, bt = bank.tables(1, "k_proj")
    expected = x @ a[rs:re].T @ bt[rs:re]  # [T, d_out]
    torch.testing.assert_close(added[:, 24:], expected)
