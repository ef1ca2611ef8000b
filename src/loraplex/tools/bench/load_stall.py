"""Do adapter loads stall the decode step? Step time with a slot load every step vs none.

A steady decode batch (``--steady`` sequences on two resident adapters) runs on the benchmark
model (``loraplex.tools.bench.throughput``'s 8-layer 512-wide model, 16 all-projection adapters);
every step one short request (a few prompt tokens, one output token) arrives. In ``loads`` mode
its adapter cycles over more adapters than the free slots hold, so every arrival loads a slot
(host memory -> device rows); in ``none`` mode it cycles over adapters already in slots. The
compute per step is the same in both: only the slot copies differ. Modes alternate (A B A B)
and each figure is the best of ``--repeats`` rounds.

    python -m loraplex.tools.bench.load_stall --out /tmp/lp-bench [--dtype float32] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("none", "loads")
STEADY_ADAPTERS = 2
CHURN_SLOTS = 4


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def run_mode(engine: Any, adapters: list[Path], mode: str, steps: int, steady: int) -> dict:
    """One measured round; returns step-time percentiles (ms) and the loads seen."""
    from loraplex.requests import LoRARequest, SamplingParams

    loads: list[float] = []
    observer = lambda stage, s: loads.append(s) if stage in ("activation", "h2d") else None  # noqa: E731
    engine.adapters.load_observers.append(observer)
    warm = 10
    long = SamplingParams(temperature=0, max_tokens=steps + warm + 40, ignore_eos=True)
    for i in range(steady):
        a = adapters[i % STEADY_ADAPTERS]
        engine.add_request(f"{mode}-steady-{i}", [100 + i] * 8, long, LoRARequest(a.name, a))
    churn = adapters[STEADY_ADAPTERS:]
    if mode == "none":
        churn = churn[:CHURN_SLOTS]  # as many as the free slots: resident after warm-up
    short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times: list[float] = []
    loads_before = 0
    for k in range(warm + steps):
        a = churn[k % len(churn)]
        engine.add_request(f"{mode}-churn-{k}", [200 + k % 50] * 4, short, LoRARequest(a.name, a))
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if k == warm - 1:
            loads_before = len(loads)
        if k >= warm:
            times.append(dt)
    while engine.has_unfinished_requests():
        for rid in list(engine.requests):
            engine.abort_request(rid)
    engine.adapters.load_observers.remove(observer)
    ms = [t * 1e3 for t in times]
    return {
        "p50": _pct(ms, 50),
        "p99": _pct(ms, 99),
        "mean": statistics.fmean(ms),
        "max": max(ms),
        "loads_per_step": (len(loads) - loads_before) / steps,
        "load_ms": statistics.fmean(loads[loads_before:]) * 1e3 if len(loads) > loads_before else 0,
    }


def write_alone(engine: Any, adapter: Path, rounds: int = 50) -> float:
    """Median ms of one slot write (a host copy over a retired adapter's rows) with nothing
    else running, into a bank shaped like the engine's: the load's own cost."""
    from loraplex.lora.adapter import load_peft_adapter
    from loraplex.lora.slots import LoRASlotBank

    bank = engine.adapters.bank
    spare = LoRASlotBank(bank.module_shapes, 2, bank.max_lora_rank, bank.dtype, bank.device)
    source = load_peft_adapter(
        adapter, engine.adapters.spec, max_lora_rank=bank.max_lora_rank, dtype=bank.dtype
    ).slot_source
    spare.set_lora(0, source)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        spare.replace_lora(0, source)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="assets directory (reused)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--steady", type=int, default=8, help="decoding sequences")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)

    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.tools.bench.throughput import build_assets

    model, adapters = build_assets(args.out)
    cfg = EngineConfig(
        model=str(model),
        enable_lora=True,
        max_loras=STEADY_ADAPTERS + CHURN_SLOTS,
        max_cpu_loras=len(adapters),
        max_lora_rank=16,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        num_threads=args.threads or None,
        max_num_seqs=64,
    )
    engine = LLMEngine(cfg)
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for mode in MODES:
            r = run_mode(engine, adapters, mode, args.steps, args.steady)
            if mode not in best or r["p99"] < best[mode]["p99"]:
                best[mode] = r
    alone = write_alone(engine, adapters[-1])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"step time, {args.steady} decoding + 1 arrival/step, {args.dtype}, {args.steps} steps, "
        f"best of {args.repeats} (loadavg {load:.2f})"
    )
    print(
        f"{'mode':<7}{'p50 ms':>9}{'p99 ms':>9}{'mean':>8}{'max':>8}{'loads/step':>12}{'load ms':>9}"
    )
    for mode in MODES:
        r = best[mode]
        print(
            f"{mode:<7}{r['p50']:>9.2f}{r['p99']:>9.2f}{r['mean']:>8.2f}{r['max']:>8.2f}"
            f"{r['loads_per_step']:>12.2f}{r['load_ms']:>9.2f}"
        )
    print(
        f"p99 loads / none = {best['loads']['p99'] / best['none']['p99']:.3f}x (target <= 1.1x); "
        f"p50 {best['loads']['p50'] / best['none']['p50']:.3f}x"
    )
    print(
        f"one slot write with nothing else running: {alone:.2f} ms "
        f"(a load every step costs at least that much CPU per step)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
