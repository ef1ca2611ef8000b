"""Mixture-of-experts decode against a dense model of the same active size, each against its byte
bound, and the grouped experts against transformers' per-expert loop:
``python -m loraplex.tools.bench.moe [--threads 2] [--steps 16] [--rounds 5] [--out moe.json]``.

Builds (once, under --cache-dir) a random Qwen3-MoE (hidden 512, 4 layers, 8 heads / 4 KV heads,
head_dim 64, 32 experts, top-4 renormalised, moe_intermediate_size 256, vocab 2048), a Qwen3
dense model with the same attention whose MLP has the MoE's *active* width (intermediate_size =
top_k * moe_intermediate_size = 1024), and 16 PEFT adapters for the MoE on ``q_proj`` / ``v_proj``
(``target_modules``) and the packed experts (``target_parameters``), rank 8 and 16 alternating.
Then, float32, in one run:

1. **decode**: ms per decode step (median of plain ``engine.step()`` calls once every sequence
   is decoding, as ``loraplex.tools.bench.profile_step``; the best of ``--rounds`` whole sweeps, since
   the cores are shared) at 1, 4 and 16 sequences, for the dense model and the MoE (base), and
   for the MoE with the 16 adapters, one per sequence. Beside each,
   its byte bound: the bytes the step must read (attention, norms, LM head and router weights,
   the experts some token of the step chose, each once: its gate_up and down; with adapters the
   rank rows of every (expert, adapter) pair the step routed to and of the adapters' attention
   modules; the KV context) over the read bandwidth of ``step_bytes.read_bandwidth_gbs``. The
   experts touched are recorded per layer and step from ``SparseMoE.last_counts`` (and the
   routed experts) by a pass-through wrapper around the sparse block (a few Python calls per
   layer, well under 1% of a step).
2. **grouped vs naive**: one sparse layer of the MoE on random inputs of T = 1, 16, 256 tokens:
   loraplex's ``SparseMoE`` (pairs sorted by expert once, one GEMM per expert over a contiguous
   block of rows) against transformers' eager loop (``Qwen3MoeExperts.forward``: for every
   expert hit, ``torch.where`` over its one-hot mask, gather, its GEMMs, scale, ``index_add``),
   on the same router and expert weights; and, when transformers is installed, transformers' own
   ``Qwen3MoeSparseMoeBlock`` from the same checkpoint with its default experts implementation
   (transformers 5 defaults to ``grouped_mm``: pairs sorted by expert, then torch's
   ``grouped_mm`` op, i.e. loraplex's algorithm; the eager loop is transformers 4's, and 5's
   ``experts_implementation="eager"``). Every output
   is checked equal to loraplex's (``assert_close``) before anything is timed; each time is the
   best of interleaved rounds' medians.

``--tiny`` runs the same on a small model in seconds (the smoke test's mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from loraplex.engine.llm_engine import LLMEngine
from loraplex.lora.plan import LoRABatchPlan
from loraplex.requests import SamplingParams
from loraplex.tools.bench.profile_step import finish, start_decode
from loraplex.tools.bench.step_bytes import (
    kv_bytes_per_step,
    read_bandwidth_gbs,
    weight_bytes_per_step,
)

WARMUP_STEPS = 3
PACKED_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTN_TARGETS = ["q_proj", "v_proj"]
DONE = ".built"  # written once a model directory is complete


@dataclass(frozen=True)
class Shape:
    """The benchmark's sizes: the MoE, its dense twin, the batches and the layer inputs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    vocab_size: int
    batches: tuple[int, ...]
    layer_tokens: tuple[int, ...]
    prompt_len: int

    @property
    def n_adapters(self) -> int:
        """One adapter per sequence of the largest batch."""
        return max(self.batches)

    def tag(self) -> str:
        return (
            f"h{self.hidden_size}-l{self.num_layers}-e{self.num_experts}k{self.top_k}"
            f"-i{self.moe_intermediate_size}-v{self.vocab_size}"
        )

    def common(self) -> dict[str, Any]:
        """``make_random_model`` arguments both models share (the attention, the vocabulary)."""
        return dict(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            tie_word_embeddings=False,
            with_tokenizer=False,
            init_std=0.02,
        )


FULL = Shape(512, 4, 8, 4, 64, 32, 4, 256, 2048, (1, 4, 16), (1, 16, 256), 32)
TINY = Shape(64, 2, 4, 2, 16, 8, 2, 32, 256, (1, 2), (1, 8), 8)


# ------------------------------------------------------------------------------------ assets


def build_assets(root: Path, shape: Shape) -> tuple[Path, Path, list[Path]]:
    """``(moe model, dense model, adapters)`` under ``root`` (made once, then reused)."""
    from loraplex.testing import make_random_model

    moe = root / f"qwen3moe-{shape.tag()}"
    dense = root / f"qwen3dense-{shape.tag()}"
    if not (moe / DONE).is_file():
        make_random_model(
            moe, "qwen3_moe", seed=0, intermediate_size=shape.top_k * shape.moe_intermediate_size,
            num_experts=shape.num_experts, num_experts_per_tok=shape.top_k,
            moe_intermediate_size=shape.moe_intermediate_size, norm_topk_prob=True,
            **shape.common(),
        )  # fmt: skip
        (moe / DONE).touch()
    if not (dense / DONE).is_file():
        make_random_model(
            dense, "qwen3", seed=1, intermediate_size=shape.top_k * shape.moe_intermediate_size,
            **shape.common(),
        )  # fmt: skip
        (dense / DONE).touch()
    lora = root / f"{moe.name}-lora"
    adapters = [_adapter(moe, lora / f"a{i:02d}", i) for i in range(shape.n_adapters)]
    return moe, dense, adapters


def _adapter(model: Path, out: Path, i: int) -> Path:
    """Adapter ``i`` (rank 8 for even ``i``, 16 for odd): the first of each rank is built by PEFT,
    the others are its copies with fresh random factors (same keys, shapes and config), which
    spares loading the base model once per adapter."""
    from safetensors.torch import load_file, save_file

    from loraplex.lora.peft.files import CONFIG_NAME
    from loraplex.testing import make_random_adapter

    weights = "adapter_model.safetensors"
    if (out / CONFIG_NAME).is_file() and (out / weights).is_file():
        return out
    r = 8 if i % 2 == 0 else 16
    if i < 2:
        return make_random_adapter(
            model, out, r=r, lora_alpha=2 * r, target_modules=ATTN_TARGETS,
            target_parameters=PACKED_EXPERTS, seed=100 + i, std=0.02,
        )  # fmt: skip
    template = _adapter(model, out.parent / f"a{i % 2:02d}", i % 2)
    gen = torch.Generator().manual_seed(100 + i)
    sd = load_file(str(template / weights))
    fresh = {k: 0.02 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in sd.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(fresh, str(out / weights), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text((template / CONFIG_NAME).read_text())  # last: marks it done
    return out


def make_engine(model: Path, shape: Shape, threads: int | None) -> LLMEngine:
    """A float32 engine with LoRA on (both models alike), one slot per adapter."""
    from loraplex.config import EngineConfig

    return LLMEngine(
        EngineConfig(
            model=str(model), dtype="float32", enable_lora=True, max_loras=shape.n_adapters,
            max_lora_rank=16, max_num_seqs=max(shape.batches), skip_tokenizer_init=True,
            kv_cache_memory_bytes=64 << 20, num_threads=threads, enable_prefix_caching=False,
        )
    )  # fmt: skip


# ---------------------------------------------------------------------------- step bytes


class ExpertSpy:
    """Pass-through wrapper around a MoE model's sparse block while installed (``with``):
    records per call ``(layer, rows per expert, routed experts [T, k], the step's LoRA plan)``."""

    def __init__(self, model: Any) -> None:
        self.model, self.moe = model, model.moe
        self.calls: list[tuple[int, list[int], torch.Tensor, LoRABatchPlan | None]] = []
        self._experts: torch.Tensor | None = None
        self._saved: list[Any] = []

    def __enter__(self) -> ExpertSpy:
        self._saved = list(self.model.ffns)
        self.model.ffns = [self if f is self.moe else f for f in self._saved]
        self.moe.route = self._route  # an instance attribute: shadows SparseMoE.route
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.ffns = self._saved
        del self.moe.route

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, e = type(self.moe).route(self.moe, logits)
        self._experts = e
        return w, e

    def __call__(self, L: Any, i: int, x: torch.Tensor, step: Any) -> torch.Tensor:
        out = self.moe(L, i, x, step)
        assert self._experts is not None and self.moe.last_counts is not None
        self.calls.append((i, self.moe.last_counts, self._experts, step.plan))
        return out


def moe_step_bytes(engine: LLMEngine, calls: list[tuple]) -> dict[str, float]:
    """What one MoE decode step must read, from the ``ExpertSpy`` calls of that step: the
    non-expert weights (attention, norms, router, head), the touched experts, and the LoRA rank rows of its adapters
    (attention / router modules per adapter, expert modules per routed (expert, adapter) pair)."""
    m = engine.model
    sparse = set(m.cfg.sparse_layers)
    expert_tensors = sum(m.layers[i].w_gate_up.nbytes + m.layers[i].w_down.nbytes for i in sparse)
    dense = weight_bytes_per_step(engine) - expert_tensors
    experts = touched = 0
    lora_dense = lora_experts = 0
    bank = engine.adapters.bank if engine.adapters is not None else None
    itemsize = bank.dtype.itemsize if bank is not None else 0
    plan = next((c[3] for c in calls if c[3] is not None), None)
    slot_of: dict[int, int] = {}
    if bank is not None and plan is not None:
        slot_of = {bank.slot_rows(s)[0]: s for s in bank.occupied_slots}
        for _, _, rs, re in plan.segments:  # every adapter of the step: its non-expert modules
            for key in bank.slot_modules(slot_of[rs]):
                if key not in bank.module_experts and plan.uses(key):
                    d_in, d_out = bank.module_shapes[key]
                    lora_dense += (re - rs) * (d_in + d_out) * itemsize
    for layer, counts, routed, call_plan in calls:
        L = m.layers[layer]
        per_expert = (L.w_gate_up.nbytes + L.w_down.nbytes) // m.cfg.num_experts
        hit = sum(1 for n in counts if n > 0)
        touched += hit
        experts += hit * per_expert
        if bank is None or call_plan is None:
            continue
        seg = np.full(call_plan.num_tokens, -1, dtype=np.int64)
        for j, (ts, te, _, _) in enumerate(call_plan.segments):
            seg[ts:te] = j
        pairs = {
            (e, int(seg[t])) for t, row in enumerate(routed.tolist()) for e in row if seg[t] >= 0
        }  # the (expert, adapter) pairs of the layer, each read once
        for _, j in pairs:  # an expert's rows of a slot: the same size for every expert
            _, _, rs, re = call_plan.segments[j]
            for key in bank.slot_modules(slot_of[rs]):
                if key[0] == layer and key in bank.module_experts and call_plan.uses(key):
                    d_in, d_out = bank.module_shapes[key]
                    lora_experts += (re - rs) * (d_in + d_out) * itemsize
    return dict(
        weights=dense,
        experts=experts,
        lora_dense=lora_dense,
        lora_experts=lora_experts,
        experts_touched_per_layer=touched / max(1, len(calls)),
    )


# ------------------------------------------------------------------------------------ decode


def decode_run(
    engine: LLMEngine, loras: list[Any], steps: int, prompt_len: int, bw: float
) -> dict[str, Any]:
    """Decode-step time of ``len(loras)`` sequences (``loras[i]``: sequence i's adapter or None)
    and its byte bound, averaged over the timed steps themselves. ``bytes``: ``weights`` (every
    weight but the experts': attention, norms, router, LM head; a dense model's MLP too),
    ``experts`` (the touched ones), ``lora_dense`` / ``lora_experts`` (rank rows), ``kv``."""
    n = len(loras)
    start_decode(engine, loras, prompt_len, max_tokens=WARMUP_STEPS + steps + 8)
    for _ in range(WARMUP_STEPS):
        engine.step()
    moe = getattr(engine.model, "moe", None) is not None
    times: list[float] = []
    parts: list[dict[str, float]] = []
    for _ in range(steps):
        assert len(engine.running_sequences()) == n
        kv = kv_bytes_per_step(engine)
        if moe:
            with ExpertSpy(engine.model) as spy:
                t0 = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t0
            p = moe_step_bytes(engine, spy.calls)
        else:
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            p = dict(weights=weight_bytes_per_step(engine), experts=0, lora_dense=0,
                     lora_experts=0, experts_touched_per_layer=0)  # fmt: skip
        p["kv"] = kv
        times.append(dt)
        parts.append(p)
    finish(engine)
    mean = {k: statistics.fmean(p[k] for p in parts) for k in parts[0]}
    total = sum(v for k, v in mean.items() if k != "experts_touched_per_layer")
    ms = statistics.median(times) * 1e3
    bound_ms = total / bw * 1e3
    return dict(
        batch=n,
        ms=ms,
        ms_min=min(times) * 1e3,
        tok_s=n / (ms / 1e3),
        bytes={k: v for k, v in mean.items() if k != "experts_touched_per_layer"},
        bytes_total=total,
        experts_touched_per_layer=mean["experts_touched_per_layer"],
        bound_ms=bound_ms,
        bound_tok_s=n / (bound_ms / 1e3),
        step_over_bound=ms / bound_ms,
    )


# ---------------------------------------------------------------------- grouped vs naive


def naive_moe(
    L: Any,
    experts: tuple[torch.Tensor, torch.Tensor],
    x: torch.Tensor,
    num_experts: int,
    top_k: int,
    act: Any,
) -> torch.Tensor:
    """transformers' eager sparse block (``Qwen3MoeTopKRouter`` + ``Qwen3MoeExperts.forward``,
    norm_topk_prob) on layer ``L``'s router and its ``experts`` (``w_gate_up [E, 2 I, D]``,
    ``w_down [E, D, I]`` as plain tensors): a loop over the experts hit, each masking its
    tokens out with ``torch.where``."""
    w_gate_up, w_down = experts
    logits = L.router(x)  # [T, E]
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)  # [T, k]
    top_w /= top_w.sum(dim=-1, keepdim=True)
    top_w = top_w.to(logits.dtype)
    final = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(top_i, num_classes=num_experts + 1).permute(2, 1, 0)  # [E + 1, k, T]
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in hit:
        expert_idx = expert_idx[0]
        if expert_idx == num_experts:
            continue
        pos, tok = torch.where(mask[expert_idx])
        gate, up = F.linear(x[tok], w_gate_up[expert_idx]).chunk(2, dim=-1)
        h = F.linear(act(gate) * up, w_down[expert_idx])
        h = h * top_w[tok, pos, None]
        final.index_add_(0, tok, h.to(final.dtype))
    return final


def _median_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def hf_block(model_dir: Path, layer: int) -> tuple[Any, str] | None:
    """transformers' own sparse block of ``layer`` (its default experts implementation, named
    second), loaded from the same checkpoint; None without transformers."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    impl = getattr(model.config, "_experts_implementation", None) or "eager"
    return model.model.layers[layer].mlp.eval(), str(impl)


@torch.inference_mode()
def grouped_vs_naive(
    engine: LLMEngine, tokens: tuple[int, ...], hf: tuple[Any, str] | None = None, rounds: int = 4
) -> list[dict[str, Any]]:
    """The first sparse layer's block both ways at each token count (and through ``hf``,
    transformers' own block, when given): outputs checked equal, then timed: per variant the
    best of ``rounds`` medians, the variants interleaved round by round (so a burst of machine
    noise hits them alike)."""
    from loraplex.model.layers import ACTIVATIONS, LayerStep

    m = engine.model
    moe, cfg = m.moe, m.cfg
    layer = cfg.sparse_layers[0]
    L = m.layers[layer]
    act = ACTIVATIONS[cfg.hidden_act]
    experts = (L.w_gate_up.dense(), L.w_down.dense())  # transformers' plain tensors
    step = LayerStep(cast(Any, None), cast(Any, None), [])  # no LoRA: the base path only
    g = torch.Generator().manual_seed(7)
    out = []
    for T in tokens:
        x = torch.randn(T, cfg.hidden_size, generator=g, dtype=m.dtype)
        variants = {
            "grouped": lambda x=x: moe(L, layer, x, step),
            "naive": lambda x=x: naive_moe(
                L, experts, x, cfg.num_experts, cfg.num_experts_per_tok, act
            ),
        }
        if hf is not None:
            variants["hf"] = lambda x=x: _first(hf[0](x[None])).reshape(x.shape)
        ref = variants["grouped"]()
        hit = sum(1 for n in moe.last_counts or [] if n)
        row: dict[str, Any] = dict(tokens=T, experts_hit=hit)
        for name in variants:
            if name != "grouped":
                got = variants[name]()
                torch.testing.assert_close(got, ref)  # float32: rtol 1.3e-6, atol 1e-5
                row[f"{name}_max_abs_diff"] = float((got - ref).abs().max())
        row["match"] = True  # (assert_close raised otherwise)
        reps = 10 if T <= 16 else 3
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                times[name].append(_median_ms(fn, reps))
        for name, ts in times.items():
            row[f"{name}_ms"] = min(ts)
        row["speedup"] = row["naive_ms"] / row["grouped_ms"]
        if hf is not None:
            row["hf_impl"], row["hf_speedup"] = hf[1], row["hf_ms"] / row["grouped_ms"]
        out.append(row)
    return out


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


# ------------------------------------------------------------------------------------ report


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of the benchmark, printed as it comes; returns them (the ``--out`` JSON)."""
    from loraplex import LoRARequest

    shape = TINY if args.tiny else FULL
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.cache_dir) / ("tiny" if args.tiny else "full")
    moe_dir, dense_dir, adapter_dirs = build_assets(root, shape)
    bw = read_bandwidth_gbs(16 if args.tiny else 256) * 1e9
    res: dict[str, Any] = {"meta": {}, "decode": [], "grouped_vs_naive": []}
    moe_eng = make_engine(moe_dir, shape, args.threads)
    c = moe_eng.model_config
    meta = dict(
        torch=torch.__version__, threads=torch.get_num_threads(), dtype="float32",
        read_bandwidth_gbs=bw / 1e9, load_average=_loadavg(), steps=args.steps,
        rounds=args.rounds,
        grouped=moe_eng.model.moe.grouped.name,
        lora_ops=moe_eng.model.lora.ops.name if moe_eng.model.lora is not None else "-",
        shape={**vars(shape), "dense_intermediate_size": shape.top_k * shape.moe_intermediate_size},
        moe_parameters=c.num_parameters(), moe_active_parameters=c.active_parameters(),
    )  # fmt: skip
    print(
        f"torch {meta['torch']}, {meta['threads']} threads, float32; read bandwidth "
        f"{bw / 1e9:.1f} GB/s; load average {meta['load_average']}; grouped experts: "
        f"{meta['grouped']}, LoRA ops: {meta['lora_ops']}"
    )
    print(
        f"MoE: Qwen3-MoE hidden {shape.hidden_size}, {shape.num_layers} layers, "
        f"{shape.num_heads}/{shape.num_kv_heads} heads x {shape.head_dim}, {shape.num_experts} "
        f"experts x {shape.moe_intermediate_size} (top-{shape.top_k}), vocab {shape.vocab_size}: "
        f"{c.num_parameters() / 1e6:.1f}M parameters, {c.active_parameters() / 1e6:.1f}M active"
    )
    rows: list[tuple[str, str, LLMEngine, list[Any]]] = []
    dense_eng = make_engine(dense_dir, shape, args.threads)
    meta["dense_parameters"] = dense_eng.model_config.num_parameters()
    print(
        f"dense: Qwen3, same attention, intermediate {shape.top_k * shape.moe_intermediate_size}: "
        f"{meta['dense_parameters'] / 1e6:.1f}M parameters; adapters: {shape.n_adapters} on "
        f"{'+'.join(ATTN_TARGETS)} + packed experts, rank 8/16 alternating; prompts "
        f"{shape.prompt_len} tokens; ms/step: median of {args.steps} decode steps (after "
        f"{WARMUP_STEPS}), best of {args.rounds} rounds"
    )
    res["meta"] = meta
    for b in shape.batches:
        rows.append(("dense", "base", dense_eng, [None] * b))
        rows.append(("moe", "base", moe_eng, [None] * b))
    reqs = [LoRARequest(f"a{i}", str(p)) for i, p in enumerate(adapter_dirs)]
    rows.append(("moe", f"{len(reqs)} adapters", moe_eng, reqs))
    for i, lora in enumerate(reqs):  # warm-up: every adapter into its slot
        moe_eng.add_request(f"w{i}", [10] * shape.prompt_len, SamplingParams(max_tokens=1), lora)
    while moe_eng.has_unfinished_requests():
        moe_eng.step()
    print(
        f"\n{'model':<7}{'requests':<13}{'batch':>6}{'ms/step':>9}{'tok/s':>9}{'experts':>9}"
        f"{'MB/step':>9}{'bound ms':>10}{'bound/s':>9}{'step/bound':>12}"
    )
    runs: list[list[dict[str, Any]]] = [[] for _ in rows]
    for _ in range(args.rounds):  # whole sweeps: a burst of a neighbour's load spoils one round
        for j, (model, scenario, eng, loras) in enumerate(rows):
            r = decode_run(eng, loras, args.steps, shape.prompt_len, bw)
            runs[j].append({**r, "model": model, "requests": scenario})
    for rounds in runs:
        r = {**min(rounds, key=lambda r: r["ms"]), "round_ms": [x["ms"] for x in rounds]}
        model, scenario = r["model"], r["requests"]
        res["decode"].append(r)
        ex = f"{r['experts_touched_per_layer']:.1f}" if model == "moe" else "-"
        print(
            f"{model:<7}{scenario:<13}{r['batch']:>6}{r['ms']:>9.2f}{r['tok_s']:>9.0f}{ex:>9}"
            f"{r['bytes_total'] / 1e6:>9.2f}{r['bound_ms']:>10.3f}{r['bound_tok_s']:>9.0f}"
            f"{r['step_over_bound']:>12.2f}"
        )
        sys.stdout.flush()
    del dense_eng
    by = {(r["model"], r["requests"], r["batch"]): r for r in res["decode"]}
    print(
        f"'experts': experts touched per layer per step (of {shape.num_experts}); 'bound': the "
        "step's bytes at the read bandwidth"
    )
    vs = []
    for b in shape.batches:
        m, d = by["moe", "base", b], by["dense", "base", b]
        ratio, nbytes = m["ms"] / d["ms"], m["bytes_total"] / d["bytes_total"]
        vs.append(f"batch {b} {ratio:.2f} (bytes {nbytes:.2f})")
    print("MoE / dense step time: " + ", ".join(vs))
    big = max(shape.batches)
    ad, base = by["moe", f"{len(reqs)} adapters", big], by["moe", "base", big]
    mb = {k: v / 1e6 for k, v in ad["bytes"].items()}
    print(
        f"MoE batch {big}, {len(reqs)} adapters: step MB = non-expert weights "
        f"{mb['weights']:.2f} + "
        f"experts {mb['experts']:.2f} + attention LoRA {mb['lora_dense']:.2f} + expert LoRA "
        f"{mb['lora_experts']:.2f} + KV {mb['kv']:.2f}; adapters / base throughput "
        f"{base['ms'] / ad['ms']:.3f} (byte bound {base['bytes_total'] / ad['bytes_total']:.3f})"
    )
    hf = hf_block(moe_dir, moe_eng.model.cfg.sparse_layers[0])
    res["grouped_vs_naive"] = layer_rows = grouped_vs_naive(
        moe_eng, shape.layer_tokens, hf, 2 * args.rounds
    )
    meta["hf_experts_implementation"] = hf[1] if hf is not None else None
    print(
        f"\nlayer {moe_eng.model.cfg.sparse_layers[0]}'s sparse block on random x [T, "
        f"{shape.hidden_size}]: 'naive' is transformers' eager per-expert loop (torch.where per "
        "expert), 'grouped' loraplex's SparseMoE"
        + (f", 'hf' transformers' own block (experts_implementation={hf[1]!r})" if hf else "")
        + "; every output assert_close to grouped's before timing"
    )
    head = f"{'T':>5}{'experts hit':>13}{'naive ms':>10}{'grouped ms':>12}{'naive/grouped':>15}"
    print(head + (f"{'hf ms':>9}{'hf/grouped':>12}" if hf else "") + f"{'max |diff|':>12}")
    for r in layer_rows:
        diff = max(v for k, v in r.items() if k.endswith("_max_abs_diff"))
        hf_cells = f"{r['hf_ms']:>9.3f}{r['hf_speedup']:>12.2f}" if hf else ""
        print(
            f"{r['tokens']:>5}{r['experts_hit']:>13}{r['naive_ms']:>10.3f}{r['grouped_ms']:>12.3f}"
            f"{r['speedup']:>15.2f}{hf_cells}{diff:>12.2e}"
        )
    meta["load_average_end"] = _loadavg()
    print(f"\nload average at the end: {meta['load_average_end']}")
    return res


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/loraplex/bench-moe"))
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per measurement")
    ap.add_argument(
        "--rounds", type=int, default=5, help="decode sweeps; each row keeps its best median"
    )
    ap.add_argument("--out", help="write every figure to this JSON file")
    ap.add_argument("--tiny", action="store_true", help="a small model, for a smoke test")
    args = ap.parse_args(argv)
    res = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
