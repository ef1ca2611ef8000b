"""Where a decode step's time goes: ``python -m loraplex.tools.bench.profile_step``.

Builds an engine on a model directory (default: the demo model SmolLM2-135M-Instruct under
``~/.cache/loraplex`` if it is there, else the generated 8-layer 512-wide benchmark model of
``loraplex.tools.bench.throughput``), puts 16 sequences into decode and times decode steps with

- ``base``: no adapter; ``1 adapter``: all 16 sequences on one adapter;
- ``16 distinct``: 16 different random rank-8 adapters (q_proj/v_proj by default),

in float32 and bfloat16. For each it prints ms per step (plain steps, nothing instrumented), the
byte floor (bytes a decode step reads: weights + needed adapter rows + KV context, over the
measured read bandwidth), the compute floor (every weight times 16 rows at the arithmetic peak
``loraplex.tools.bench.cpu_peak`` measures: on a CPU without AMX the larger of the two) and a
per-step breakdown into base GEMMs, LoRA ops, attention, KV
writes/gathers, the rest of the layer stack (norms, rope, activation, residuals), logits,
sampler, batch preparation (incl. the LoRA plan) and Python/other (scheduler, engine loop).

The breakdown wraps those entry points with timers (exclusive wall time: a scope's time minus
its nested scopes'), measured in a separate pass from the plain ms/step. ``--layer-ops both`` measures the torch
layer ops and then the model's choice (the C ops on CPU) on the same engine: the profile
before and after fusing them. ``--torch-profile``
also groups ``torch.profiler`` self-CPU time by the same scopes (profiling inflates small ops),
and prints the top aten ops.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import loraplex.model.layers as layers_mod
from loraplex.engine.llm_engine import LLMEngine
from loraplex.model.layer_ops import LayerOps, TorchLayerOps
from loraplex.requests import SamplingParams
from loraplex.tools.bench.step_bytes import (
    adapter_bytes_per_step,
    kv_bytes_per_step,
    make_adapters,
    read_bandwidth_gbs,
    weight_bytes_per_step,
)

CATEGORIES = (
    "base GEMMs",
    "LoRA",
    "attention",
    "KV write/gather",
    "norms/rope/act",
    "logits",
    "sampler",
    "prepare+plan",
    "python/other",
)
SCENARIOS = ("base", "1 adapter", "16 distinct")
N_SEQS = 16
DEMO_MODEL = Path(os.path.expanduser("~/.cache/loraplex/smollm2-135m-instruct"))


# ------------------------------------------------------------------------------------ assets


def default_model_dir() -> Path:
    """The demo model if it has been prepared, else the generated benchmark model."""
    if (DEMO_MODEL / "config.json").is_file():
        return DEMO_MODEL
    from loraplex.tools.bench.throughput import build_assets

    model, _ = build_assets(Path(os.path.expanduser("~/.cache/loraplex/bench-h512")))
    return model


# ------------------------------------------------------------------------------------ timers


class ScopeTimer:
    """Exclusive wall time per category over wrapped callables (nested scopes subtracted)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # per open scope: time spent in its nested scopes
        self.record = False  # also open a torch.profiler record_function per scope

    def wrap(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                if self.record:
                    with torch.profiler.record_function(category):
                        return fn(*args, **kwargs)
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                nested = self._stack.pop()
                self.totals[category] += dt - nested
                if self._stack:
                    self._stack[-1] += dt

        return timed


@contextmanager
def instrumented(engine: LLMEngine, timer: ScopeTimer) -> Iterator[Callable[[], Any]]:
    """Wrap the step's entry points with ``timer``; yields the wrapped ``step``; restores all."""
    model, runner, cache = engine.model, engine.runner, engine.cache
    saved: list[tuple[object, str, object, bool]] = []  # (owner, attr, old, was in __dict__)

    def patch(owner: object, attr: str, category: str) -> None:
        if not hasattr(owner, attr):
            return
        own = attr in getattr(owner, "__dict__", {})
        saved.append((owner, attr, getattr(owner, attr), own))
        setattr(owner, attr, timer.wrap(category, getattr(owner, attr)))

    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            patch(layer, name, "base GEMMs")
    if model.lora is not None:
        for name in ("add", "add_group", "apply"):
            patch(model.lora, name, "LoRA")
    patch(layers_mod, "paged_attention", "attention")
    for name in ("write", "gather", "gather_decode"):
        patch(cache, name, "KV write/gather")
    patch(model, "hidden_states", "norms/rope/act")
    patch(model, "compute_logits", "logits")
    patch(engine, "sampler", "sampler")
    patch(runner, "prepare", "prepare+plan")
    try:
        yield timer.wrap("python/other", engine.step)
    finally:
        for owner, attr, old, own in reversed(saved):
            if own or owner is layers_mod:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)  # a bound method: drop the instance override


# ------------------------------------------------------------------------------------ runs


def start_decode(engine: LLMEngine, adapters: list[Any], prompt_len: int, max_tokens: int) -> None:
    """Queue one request per entry of ``adapters`` (its adapter or None) and step until every
    one is decoding."""
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, lora in enumerate(adapters):
        prompt = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, sp, lora)
    n = len(adapters)
    for _ in range(100 * (n + prompt_len)):
        running = engine.running_sequences()
        if len(running) == n and all(s.output_token_ids for s in running):
            return
        engine.step()
    raise RuntimeError(f"{n} requests did not all reach decode")


def finish(engine: LLMEngine) -> None:
    """Abort what still runs and step until the engine is idle."""
    for s in list(engine.running_sequences()):
        engine.abort_request(s.request_id)
    while engine.has_unfinished_requests():
        engine.step()


def profile_scenario(
    engine: LLMEngine, adapters: list[Any], steps: int, prompt_len: int, torch_profile: bool
) -> dict[str, Any]:
    """ms/step (median of plain steps), bytes, and the per-step breakdown for one batch mix."""
    start_decode(engine, adapters, prompt_len, max_tokens=3 * steps + 16)
    for _ in range(3):
        engine.step()  # warm-up
    slots = {s.slot for s in engine.running_sequences() if s.slot is not None}
    res: dict[str, Any] = {
        "weights": weight_bytes_per_step(engine),
        "lora": adapter_bytes_per_step(engine, slots),
        "kv": kv_bytes_per_step(engine),
    }
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    res["ms"] = statistics.median(times) * 1e3
    res["ms_min"] = min(times) * 1e3
    timer = ScopeTimer()
    with instrumented(engine, timer) as step:
        for _ in range(steps):
            step()
    res["breakdown"] = {k: timer.totals.get(k, 0.0) * 1e3 / steps for k in CATEGORIES}
    if torch_profile:
        res["profiler"], res["top_ops"] = _torch_profile(engine, max(2, steps // 4))
    finish(engine)
    return res


def _torch_profile(engine: LLMEngine, steps: int) -> tuple[dict[str, float], str]:
    """Self-CPU ms per step from torch.profiler, grouped by the innermost enclosing scope."""
    timer = ScopeTimer()
    timer.record = True
    with instrumented(engine, timer) as step:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
    totals: dict[str, float] = defaultdict(float)
    names = set(CATEGORIES)

    def assign(ev: Any, cat: str) -> None:
        if ev.name in names:
            cat = ev.name
        totals[cat] += ev.self_cpu_time_total / 1e3 / steps
        for child in ev.cpu_children:
            assign(child, cat)

    for ev in prof.events():
        if ev.cpu_parent is None:
            assign(ev, "python/other")
    top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return {k: totals.get(k, 0.0) for k in CATEGORIES}, top


def run(args: argparse.Namespace) -> None:
    model_dir = Path(args.model_dir) if args.model_dir else default_model_dir()
    targets = args.targets.split(",")
    ad_root = Path(args.adapter_dir or f"{model_dir}-lora-r{args.rank}-{'-'.join(targets)}")
    adapter_dirs = make_adapters(model_dir, ad_root, N_SEQS, args.rank, targets)
    rbw = read_bandwidth_gbs()
    from loraplex.tools.bench.lora_ops import copy_bandwidth_gbs

    cbw = copy_bandwidth_gbs()
    print(
        f"model {model_dir}; adapters rank {args.rank} on {','.join(targets)}; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; load {_loadavg()}"
    )
    print(
        f"read bandwidth {rbw:.1f} GB/s (copy {cbw:.1f} GB/s r+w); {N_SEQS} sequences, "
        f"prompt {args.prompt_len}, {args.steps} decode steps per measurement"
    )
    from loraplex import LoRARequest

    for spec in args.dtypes:
        dtype, _, quant = spec.partition("+")
        engine = LLMEngine(_config(model_dir, dtype, args.rank, quant or None))
        reqs = [LoRARequest(f"a{i}", str(p)) for i, p in enumerate(adapter_dirs)]
        mixes = {
            "base": [None] * N_SEQS,
            "1 adapter": [reqs[0]] * N_SEQS,
            "16 distinct": reqs[:N_SEQS],
        }
        chosen = engine.model.ops
        peak, itemsize = _peak_gflops(dtype), engine.model.dtype.itemsize
        if engine.model.quant is not None:  # the compute floor counts products, not bytes
            itemsize = weight_bytes_per_step(engine) / _weight_params(engine)
        steps: dict[str, float] = {}
        for ops in _layer_ops_runs(chosen, args.layer_ops):
            engine.model.use_layer_ops(ops)
            results = {name: profile_scenario(
                engine, mixes[name], args.steps, args.prompt_len, args.torch_profile
            ) for name in SCENARIOS}  # fmt: skip
            steps[ops.name] = results["base"]["ms"]
            print(
                f"\n{spec}  (linear: {engine.model.linear_impl}, lora ops: "
                f"{_ops_name(engine)}, layer ops: {ops.name})"
            )
            _print_table(results, rbw, peak, itemsize)
            if args.torch_profile:
                print("\ntorch.profiler self-CPU ms/step by scope (profiling inflates small ops):")
                _print_rows({k: r["profiler"] for k, r in results.items()})
                print(f"\ntop ops, 16 distinct:\n{results['16 distinct']['top_ops']}")
        if len(steps) == 2:
            (a, ta), (b, tb) = steps.items()
            print(
                f"\n{spec} base step: layer ops {a} {ta:.2f} ms -> {b} {tb:.2f} ms ({ta / tb:.2f}x)"
            )
        engine.model.use_layer_ops(chosen)
        del engine
    print(f"\nload average at the end: {_loadavg()}")


def _layer_ops_runs(chosen: LayerOps, which: str) -> list[LayerOps]:
    """The layer ops to measure: the model's choice, torch's, or torch's then the choice."""
    if which == "chosen" or (which == "both" and chosen.name == TorchLayerOps.name):
        return [chosen]
    return [TorchLayerOps()] if which == "torch" else [TorchLayerOps(), chosen]


def _weight_params(engine: LLMEngine) -> int:
    """Products per row a step's GEMMs run: every projection's and the head's in x out."""
    m = engine.model
    linears = [m.head, *(v for L in m.layers for v in vars(L).values())]
    return sum(lin.in_features * lin.out_features for lin in linears if hasattr(lin, "in_features"))


def _config(model_dir: Path, dtype: str, rank: int, quantization: str | None = None) -> Any:
    from loraplex.config import EngineConfig

    return EngineConfig(
        model=str(model_dir),
        dtype=dtype,
        quantization=quantization,
        enable_lora=True,
        max_loras=N_SEQS,
        max_lora_rank=max(rank, 8),
        max_num_seqs=N_SEQS,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=256 << 20,
    )


def _ops_name(engine: LLMEngine) -> str:
    return engine.model.lora.ops.name if engine.model.lora is not None else "-"


def _print_rows(rows: dict[str, dict[str, float]]) -> None:
    print(f"{'ms/step':<18}" + "".join(f"{k:>14}" for k in rows))
    for cat in CATEGORIES:
        print(f"{cat:<18}" + "".join(f"{r[cat]:>14.2f}" for r in rows.values()))
    print(f"{'sum':<18}" + "".join(f"{sum(r.values()):>14.2f}" for r in rows.values()))


def _peak_gflops(dtype: str) -> float | None:
    """The arithmetic peak of this dtype's GEMM product here (bf16 dot products, else float32
    FMAs), None where it cannot be measured."""
    from loraplex.native.build import KernelBuildError
    from loraplex.tools.bench.cpu_peak import peak_gflops

    try:
        got = peak_gflops("bf16-dot") if dtype == "bfloat16" else None
        return got or peak_gflops("fp32-fma")
    except (KernelBuildError, OSError):
        return None


def _print_table(
    results: dict[str, dict[str, Any]],
    bw_gbs: float,
    peak_gflops: float | None = None,
    itemsize: int = 4,
) -> None:
    """The breakdown, plain step times and bytes of each mix, with the byte floor and, given
    the arithmetic peak, the compute floor (``2 * sequences * weights`` flops: every weight
    times every decoding row); the step against the larger of the two ("floor"), the mixes'
    ratios against their byte floors."""
    _print_rows({k: r["breakdown"] for k, r in results.items()})
    print(f"{'plain step (med)':<18}" + "".join(f"{r['ms']:>14.2f}" for r in results.values()))
    print(f"{'plain step (min)':<18}" + "".join(f"{r['ms_min']:>14.2f}" for r in results.values()))
    mib = 2**20
    for what in ("weights", "lora", "kv"):
        print(f"{what + ' MiB':<18}" + "".join(f"{r[what] / mib:>14.3f}" for r in results.values()))
    floors = {
        k: (r["weights"] + r["lora"] + r["kv"]) / (bw_gbs * 1e9) * 1e3 for k, r in results.items()
    }
    print(f"{'byte floor ms':<18}" + "".join(f"{f:>14.2f}" for f in floors.values()))
    limits = floors
    if peak_gflops:
        compute = {
            k: 2 * N_SEQS * r["weights"] / itemsize / (peak_gflops * 1e9) * 1e3
            for k, r in results.items()
        }
        print(f"{'compute floor ms':<18}" + "".join(f"{f:>14.2f}" for f in compute.values()))
        print(f"({peak_gflops:.0f} GFLOP/s peak of this dtype's product, {N_SEQS} rows a step)")
        limits = {k: max(floors[k], compute[k]) for k in floors}
    print(
        f"{'step / floor':<18}" + "".join(f"{results[k]['ms'] / limits[k]:>14.2f}" for k in results)
    )
    base, one, many = (results[k]["ms"] for k in SCENARIOS)
    fb, f1, f16 = (floors[k] for k in SCENARIOS)
    print(
        f"throughput ratios: 16 distinct / base {base / many:.3f} (byte bound {fb / f16:.3f}); "
        f"16 distinct / 1 adapter {one / many:.3f} (byte bound {f1 / f16:.3f})"
    )


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-dir", help="model directory (default: demo model, else h512)")
    ap.add_argument("--adapter-dir", help="where the random adapters live (made if missing)")
    ap.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"],
        help="dtypes, each optionally with an on-the-fly quantization: bfloat16+int4",
    )  # fmt: skip
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q_proj,v_proj", help="comma-separated projections")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--torch-profile", action="store_true", help="also group torch.profiler")
    ap.add_argument(
        "--layer-ops",
        choices=("chosen", "torch", "both"),
        default="chosen",
        help="norms/rotary/activation/decode attention: the model's choice (the C ops on CPU), "
        "torch ops, or both side by side (before/after)",
    )
    run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
