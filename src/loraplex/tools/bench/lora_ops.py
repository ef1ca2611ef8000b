"""Microbenchmark of the gathered LoRA ops for one engine step: ``python -m loraplex.tools.bench.lora_ops``.

Model: h512, 8 layers, intermediate 1536, GQA 8 heads / 4 kv heads (head_dim 64), all 7
projections adapted, ranks alternating 8/16, ``max_loras`` 16. For decode (16 tokens) and prefill
(16 x 26 tokens) with 1, 4 and 16 distinct adapters, float32 and bfloat16, it prints the time of
the LoRA ops for the whole step (plan + every layer x module) next to

- ``floor``: bytes of the adapter rows the step needs / copy bandwidth measured here, and
  ``+act`` with the activations added (read x, read + write out: what bounds prefill);
- ``base``: the step's base GEMMs (``F.linear`` per module, same dtype);
- ``per-seg`` / ``merged``: the same step planned one run per segment / one run for everything,
  to check the planner's choice against both extremes.

All timings are best-of-N, variants interleaved, because the box is shared and noisy.
``--calibrate`` measures the constants behind ``LoRAPlanCosts``' defaults.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.checkpoint.modules import projection_shapes
from loraplex.lora.backends import select_lora_ops
from loraplex.lora.ops import LoRAOps
from loraplex.lora.plan import LoRABatchPlan, LoRAPlanCosts, plan_lora_batch
from loraplex.lora.slots import LoRASlotBank

HIDDEN, LAYERS, INTER, HEADS, KV_HEADS, HEAD_DIM = 512, 8, 1536, 8, 4, 64
MAX_LORAS, MAX_RANK = 16, 16
PER_SEGMENT = LoRAPlanCosts(run_overhead_us=0.0, mask_overhead_us=0.0)  # never coalesce
ALL_MERGED = LoRAPlanCosts(mac_ns=0.0, mask_overhead_us=0.0, bandwidth_gbs=1e12)  # always


def module_shapes() -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, proj) -> (d_in, d_out) of the benchmark model."""
    per_layer = projection_shapes(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER)
    return {(layer, p): s for layer in range(LAYERS) for p, s in per_layer.items()}


@dataclass
class _Weights:
    a: torch.Tensor
    b: torch.Tensor
    scale: float


def best_of(fn: Callable[[], object], reps: int, inner: int = 1) -> float:
    """Best wall time of ``inner`` calls, over ``reps`` repetitions, in seconds per call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def copy_bandwidth_gbs(mib: int = 256) -> float:
    """Copy bandwidth (bytes read + written per second) of a large float32 copy, in GB/s."""
    src = torch.randn(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    t = best_of(lambda: dst.copy_(src), reps=5)
    return 2 * src.numel() * 4 / t / 1e9


def build_bank(ops: LoRAOps, dtype: torch.dtype) -> tuple[LoRASlotBank, list[int]]:
    """A full bank: slot s holds a random adapter of rank 8 (even s) or 16 (odd s)."""
    shapes = module_shapes()
    bank = LoRASlotBank(shapes, MAX_LORAS, MAX_RANK, ops.table_dtype(dtype), "cpu")
    ranks = [8 if s % 2 == 0 else 16 for s in range(MAX_LORAS)]
    for slot, r in enumerate(ranks):
        weights = {
            key: _Weights(torch.randn(r, d_in) / d_in**0.5, torch.randn(d_out, r) / r, 2.0)
            for key, (d_in, d_out) in shapes.items()
        }
        bank.set_lora(slot, weights)
    return bank, ranks


def segments_for(bank: LoRASlotBank, n_adapters: int, tokens_per_req: int, reqs: int = 16):
    """``reqs`` requests spread evenly over the first ``n_adapters`` slots, grouped by slot."""
    segs, t = [], 0
    for slot in range(n_adapters):
        n = tokens_per_req * reqs // n_adapters
        rs, re = bank.slot_rows(slot)
        segs.append((t, t + n, rs, re))
        t += n
    return t, segs


def lora_step(ops: LoRAOps, bank: LoRASlotBank, xs: dict, outs: dict, plan_args: tuple) -> None:
    """One step: plan once, then apply for every layer x module."""
    plan = plan_lora_batch(*plan_args)
    for (layer, proj), x in xs.items():
        a, bt = bank.tables(layer, proj)
        ops.apply(x, a, bt, outs[(layer, proj)], plan)


def run_table(reps: int) -> None:
    ops = select_lora_ops("cpu")
    shapes = module_shapes()
    feature_dim = round(sum(i + o for i, o in shapes.values()) / len(shapes))
    costs = LoRAPlanCosts(feature_dim=feature_dim)
    bw = copy_bandwidth_gbs()
    print(
        f"ops backend: {ops.name}; copy bandwidth {bw:.1f} GB/s; threads {torch.get_num_threads()}"
    )
    print(f"model h{HIDDEN} x {LAYERS} layers, i{INTER}, 7 projections; ranks 8/16; times in ms\n")
    header = (
        f"{'step':<8}{'dtype':<9}{'adap':>4}{'runs':>5}{'lora':>8}{'floor':>7}{'xfloor':>7}"
        f"{'+act':>7}{'xact':>6}{'base':>8}{'lora/base':>10}{'per-seg':>8}{'merged':>8}"
    )
    print(header)
    print("-" * len(header))
    for step, tokens_per_req in (("decode", 1), ("prefill", 26)):
        for dtype in (torch.float32, torch.bfloat16):
            bank, ranks = build_bank(ops, dtype)
            base_w = {k: torch.randn(o, i, dtype=dtype) / i**0.5 for k, (i, o) in shapes.items()}
            for n_ad in (1, 4, 16):
                T, segs = segments_for(bank, n_ad, tokens_per_req)
                xs = {k: torch.randn(T, i, dtype=dtype) for k, (i, _) in shapes.items()}
                outs = {k: torch.zeros(T, o, dtype=dtype) for k, (_, o) in shapes.items()}
                variants = {
                    name: (T, segs, ops.table_dtype(dtype), "cpu", c)
                    for name, c in (("plan", costs), ("seg", PER_SEGMENT), ("all", ALL_MERGED))
                }
                n_runs = len(plan_lora_batch(*variants["plan"]).runs)
                times = {name: float("inf") for name in variants}
                for _ in range(reps):  # interleave variants: the box is noisy
                    for name, args in variants.items():
                        step_fn = functools.partial(lora_step, ops, bank, xs, outs, args)
                        t = best_of(step_fn, reps=1)
                        times[name] = min(times[name], t)
                item = bank.tables(0, "q_proj")[0].element_size()
                needed = sum(
                    ranks[s] * (i + o) * item for s in range(n_ad) for (i, o) in shapes.values()
                )
                # Activations too: read x, read + write out, in the model dtype.
                act = T * sum(i + 2 * o for i, o in shapes.values()) * dtype.itemsize
                floor, act_floor = needed / (bw * 1e9), (needed + act) / (bw * 1e9)
                base = _time_base(xs, base_w, reps)
                lora = times["plan"]
                print(
                    f"{step:<8}{str(dtype)[6:]:<9}{n_ad:>4}{n_runs:>5}{lora * 1e3:>8.2f}"
                    f"{floor * 1e3:>7.2f}{lora / floor:>7.1f}{act_floor * 1e3:>7.2f}"
                    f"{lora / act_floor:>6.1f}{base * 1e3:>8.2f}{lora / base:>10.2f}"
                    f"{times['seg'] * 1e3:>8.2f}{times['all'] * 1e3:>8.2f}"
                )
    print(
        "\nlora: planned LoRA ops for the step (plan included); floor: adapter bytes needed /"
        "\ncopy bandwidth; +act: adding x read and out read + write; x...: lora / that floor;"
        "\nbase: F.linear of every module (bf16 base on AVX2 has no fast GEMM: slow, shown as is);"
        "\nper-seg / merged: LoRA step with one run per segment / everything coalesced."
    )


def _time_base(xs: dict, base_w: dict, reps: int) -> float:
    """Base GEMMs of the step; very slow bf16 steps are timed on one layer and scaled."""
    keys = list(xs)
    x0 = xs[keys[0]]
    slow = x0.dtype == torch.bfloat16 and x0.shape[0] > 64
    if slow:
        keys = [k for k in keys if k[0] == 0]
        reps = 1

    def step() -> None:
        for k in keys:
            F.linear(xs[k], base_w[k])

    t = best_of(step, reps=reps)
    return t * LAYERS if slow else t


def calibrate() -> None:
    """Measure the constants of ``LoRAPlanCosts`` with the selected backend.

    Fits ``time(run) = run_overhead + mac_ns * T * R * (d_in + d_out)`` over single runs of
    decode- and prefill-like shapes (least squares on relative error), so the overhead is the
    effective one of small GEMMs, not only the Python dispatch.
    """
    ops = select_lora_ops("cpu")
    dt = torch.float32

    def timed_run(T: int, R: int, d_in: int, d_out: int, segs: list | None = None) -> float:
        x, out = torch.randn(T, d_in), torch.zeros(T, d_out)  # x: [T, d_in], out: [T, d_out]
        a, bt = torch.randn(R, d_in), torch.randn(R, d_out)
        plan: LoRABatchPlan = plan_lora_batch(T, segs or [(0, T, 0, R)], dt, "cpu", ALL_MERGED)
        return best_of(lambda: ops.apply(x, a, bt, out, plan), reps=10, inner=4) * 1e6

    samples = []  # (macs, us)
    for d_in, d_out in ((512, 512), (512, 1536)):
        for T in (1, 4, 16, 64, 208):
            for R in (8, 16, 48, 192):
                samples.append((T * R * (d_in + d_out), timed_run(T, R, d_in, d_out)))
    # Relative least squares for us = c0 + c1 * macs: rows scaled by 1 / us.
    A = torch.tensor([[1.0 / us, m / us] for m, us in samples], dtype=torch.float64)
    c0, c1 = torch.linalg.lstsq(A, torch.ones(len(samples), 1, dtype=torch.float64)).solution
    for m, us in samples[::5]:
        print(
            f"  run with {m / 1e6:7.3f} M MAC: {us:8.1f} us (fit {c0.item() + c1.item() * m:8.1f})"
        )
    # Mask multiply of a coalesced decode run (y: [16, 192]).
    y, mask = torch.randn(16, 192), torch.ones(16, 192)
    mask_us = best_of(lambda: y.mul_(mask), reps=10, inner=50) * 1e6
    bw = copy_bandwidth_gbs()
    print(
        f"run_overhead_us={c0.item():.1f} mac_ns={c1.item() * 1e3:.4f} "
        f"mask_overhead_us={mask_us:.1f} bandwidth_gbs={bw:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", action="store_true", help="measure LoRAPlanCosts constants")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per variant")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.calibrate:
        calibrate()
    else:
        run_table(args.reps)


if __name__ == "__main__":
    main()
