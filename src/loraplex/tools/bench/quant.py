"""Quantized bases on CPU: int8 and int4 against bfloat16 and float32, side by side in one run.

    python -m loraplex.tools.bench.quant [--shape llama-1b smollm2] [--new-tokens 32]

For each shape (a random model of Llama-3.2-1B's or SmolLM2-135M's shape, built once under
``--cache-dir``) and each mode (``float32``, ``bfloat16``, and ``--quantization int8`` / ``int4``
over each), a fresh process loads the model with 16 distinct rank-16 adapters on all seven
projections and reports:

- the resident bytes of the base (RSS growth over the load, and the weights' own bytes);
- decode tok/s of a decode-heavy workload: 16 sequences (16-token prompts, ``--new-tokens``
  forced tokens), each with its own adapter; the same without adapters; and one sequence with
  one adapter (the byte-bound case);
- the byte floor of a decode step (base weights + the 16 adapters' rows at the measured read
  bandwidth) and the distance from it; and which kernel the start-up choice picked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                     head_dim=64, intermediate_size=8192, vocab_size=128256,
                     tie_word_embeddings=True),
    "smollm2": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=256, vocab_size=30100, tie_word_embeddings=True),  # its test
}  # fmt: skip
MODES = (
    "float32", "bfloat16", "bfloat16+int8", "bfloat16+int4", "float32+int8", "float32+int4",
    "bfloat16+W4A8",
)  # fmt: skip
CHECKPOINT_MODES = ("W4A8",)
"""Modes served from a checkpoint written once from the float model (compressed-tensors'
preset, as llm-compressor writes it, in groups of 128 or the largest of 64 / 32 that divides
the widths) instead of quantized at load."""
N_ADAPTERS = 16
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(root: Path, shape: str) -> tuple[Path, list[Path]]:
    """The shape's random bfloat16 model and its 16 rank-16 adapters (built once)."""
    import torch

    from loraplex.testing import make_random_adapter, make_random_model

    base = root / shape / "model"
    if not (base / "config.json").is_file():
        make_random_model(base, "llama", with_tokenizer=False, dtype=torch.bfloat16,
                          init_std=0.02, **SHAPES[shape])  # fmt: skip
    adapters = []
    for i in range(N_ADAPTERS):
        d = root / shape / f"adapter{i:02d}"
        if not (d / "adapter_config.json").is_file():
            make_random_adapter(base, d, r=16, lora_alpha=32, target_modules=ALL_PROJ,
                                seed=100 + i, std=0.02)  # fmt: skip
        adapters.append(d)
    return base, adapters


_RUN = r"""
import json, sys, time
import torch
from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.tools.bench.step_bytes import read_bandwidth_gbs, weight_bytes_per_step

def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'): return int(line.split()[1]) * 1024

model, mode, new_tokens, adapters = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
dtype = mode.partition('+')[0]
quant = sys.argv[6] or None  # None: the checkpoint's own quantization_config
torch.set_num_threads(int(sys.argv[5]))
before = rss()
llm = LLM(model, dtype=dtype, quantization=quant or None, enable_lora=True, max_loras=16,
          max_lora_rank=16, max_num_seqs=16, skip_tokenizer_init=True,
          kv_cache_memory_bytes=256 << 20, num_threads=int(sys.argv[5]))
e = llm.engine
loaded = rss() - before - e.cache.nbytes - e.adapters.bank.nbytes
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(100, 30000, (16,), generator=g).tolist() for _ in range(16)]
reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

def rate(ps, lr):
    t = time.perf_counter()
    out = llm.generate(ps, sp, lora_request=lr)
    return sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t)

rate(prompts, reqs)  # warm-up: every adapter into its slot
res = dict(mode=mode, weights=e.model.nbytes, rss_weights=loaded, kernels=e.model.linear_impl)
res['tok_s_16_adapters'] = max(rate(prompts, reqs) for _ in range(2))
res['tok_s_16_base'] = max(rate(prompts, None) for _ in range(2))
res['tok_s_1_adapter'] = max(rate(prompts[:1], reqs[:1]) for _ in range(2))
bank = e.adapters.bank
res['step_bytes_base'] = weight_bytes_per_step(e)
res['step_bytes_adapter'] = 16 * 16 * sum(  # 16 adapters x rank 16 rows of A and B^T
    (a.shape[1] + bt.shape[1]) * a.element_size()
    for key in bank.module_shapes if key[0] >= 0 for a, bt in [bank.tables(*key)])
res['bandwidth_gbs'] = read_bandwidth_gbs()
print(json.dumps(res))
"""


def checkpoint(model: Path, scheme: str) -> Path:
    """The ``scheme`` checkpoint of ``model`` (written once beside it; its float reference,
    which the benchmark does not read, removed)."""
    import shutil

    from loraplex.testing.compressed import write_compressed_tensors

    out = model.parent / f"model-{scheme.lower()}"
    if not (out / "config.json").is_file():
        cfg = json.loads((model / "config.json").read_text())
        widths = (cfg["hidden_size"], cfg["intermediate_size"])
        group = next(g for g in (128, 64, 32) if all(w % g == 0 for w in widths))
        ref = model.parent / f"model-{scheme.lower()}-reference"
        write_compressed_tensors(model, out, ref, scheme, group_size=group)
        shutil.rmtree(ref, ignore_errors=True)
    return out


def run_mode(model: Path, adapters: list[Path], mode: str, new_tokens: int, threads: int) -> dict:
    quant = mode.partition("+")[2]
    if quant in CHECKPOINT_MODES:  # served from its checkpoint, not quantized at load
        model, quant = checkpoint(model, quant), ""
    args = [str(model), mode, str(new_tokens), json.dumps([str(a) for a in adapters]),
            str(threads), quant]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{mode}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(shape: str, rows: list[dict]) -> None:
    mib = 2**20
    bf16 = next((r for r in rows if r["mode"] == "bfloat16"), rows[0])
    fastest_float = max(
        (r for r in rows if "+" not in r["mode"]), key=lambda r: r["tok_s_16_adapters"]
    )
    print(f"\n{shape}: decode tok/s (16 seqs x 16 adapters | 16 seqs base | 1 seq 1 adapter), "
          "base resident MiB, step floor")  # fmt: skip
    print(f"{'mode':<16}{'16 adapt':>10}{'16 base':>10}{'1 adapt':>10}{'vs best float':>14}"
          f"{'weights':>10}{'RSS':>9}{'x bf16':>8}{'floor ms':>10}{'x floor':>9}")  # fmt: skip
    for r in rows:
        floor_ms = (r["step_bytes_base"] + r["step_bytes_adapter"]) / (r["bandwidth_gbs"] * 1e6)
        step_ms = 16 / r["tok_s_16_adapters"] * 1e3
        print(
            f"{r['mode']:<16}{r['tok_s_16_adapters']:>10.1f}{r['tok_s_16_base']:>10.1f}"
            f"{r['tok_s_1_adapter']:>10.1f}"
            f"{r['tok_s_16_adapters'] / fastest_float['tok_s_16_adapters']:>13.2f}x"
            f"{r['weights'] / mib:>10.0f}{r['rss_weights'] / mib:>9.0f}"
            f"{r['rss_weights'] / bf16['rss_weights']:>8.2f}{floor_ms:>10.1f}"
            f"{step_ms / floor_ms:>9.2f}"
        )
    for r in rows:
        print(f"  {r['mode']}: {r['kernels'][:300]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loraplex.tools.bench.quant", description=__doc__)
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/loraplex/bench-quant"))
    ap.add_argument("--shape", nargs="+", choices=list(SHAPES), default=["llama-1b", "smollm2"])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    for shape in args.shape:
        model, adapters = build(Path(args.cache_dir), shape)
        rows = []
        for mode in args.modes:
            rows.append(run_mode(model, adapters, mode, args.new_tokens, args.threads))
            print(json.dumps(rows[-1]), flush=True)
        report(shape, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
