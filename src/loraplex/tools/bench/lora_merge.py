"""Single-adapter throughput: merged into the base weights vs base vs the unmerged adapter.

Offline ``LLM.generate`` on the benchmark model (``loraplex.tools.bench.throughput``'s 8-layer
512-wide model and its prompts), every prompt on the same adapter. Three configurations run
interleaved (A B C D A B C D), best of ``--repeats``: the base model (no adapter), the adapter
through the gathered LoRA ops (merging off), the adapter merged after ``--merge-after``
single-adapter steps (``lora_merge_after_steps``; the merge is built off the engine thread, and
the first steps run unmerged until it is ready) and the base model on the merging engine
(``base_m``: each of its runs unmerges, the next merged run re-installs the kept build).

    python -m loraplex.tools.bench.lora_merge --out /tmp/lp-bench [--dtype float32] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _rate(llm: Any, prompts: list[list[int]], sp: Any, lora: Any) -> float:
    t0 = time.perf_counter()
    res = llm.generate(prompts, sp, lora_request=[lora] * len(prompts))
    return sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="assets directory (reused)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--merge-after", type=int, default=4)
    ap.add_argument("--adapter", type=int, default=1, help="index of the benchmark adapter")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)

    from loraplex import LLM, LoRARequest, SamplingParams
    from loraplex.tools.bench.throughput import build_assets, make_prompts

    model, adapters = build_assets(args.out)
    prompts = make_prompts(args.prompts)
    common: dict[str, Any] = dict(
        dtype=args.dtype,
        max_loras=4,
        max_lora_rank=16,
        max_num_seqs=max(16, args.prompts),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=256 << 20,
    )
    if args.threads:
        common["num_threads"] = args.threads
    plain = LLM(str(model), enable_lora=True, **common)
    merging = LLM(str(model), enable_lora=True, lora_merge_after_steps=args.merge_after, **common)
    a = adapters[args.adapter]
    lora = LoRARequest(a.name, a)
    sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    runs: dict[str, Callable[[], float]] = {
        "base": lambda: _rate(plain, prompts, sp, None),
        "unmerged": lambda: _rate(plain, prompts, sp, lora),
        "merged": lambda: _rate(merging, prompts, sp, lora),
        "base_m": lambda: _rate(merging, prompts, sp, None),  # base on the merging engine
    }
    for fn in runs.values():
        fn()  # warm-up: loads the adapter, builds the merge once
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for k, fn in runs.items():
            best[k] = max(best.get(k, 0.0), fn())
    same = [
        r.outputs[0].token_ids for r in merging.generate(prompts[:2], sp, lora_request=[lora] * 2)
    ] == [r.outputs[0].token_ids for r in plain.generate(prompts[:2], sp, lora_request=[lora] * 2)]
    assert merging.engine.merger is not None
    load = os.getloadavg()[0]
    print(
        f"single adapter ({a.name}), {args.prompts} prompts x {args.new_tokens} new tokens, "
        f"{args.dtype}, best of {args.repeats} (loadavg {load:.2f}); merges installed: "
        f"{merging.engine.merger.merges}"
    )
    print(f"{'config':<10}{'tok/s':>9}{'/ base':>9}")
    for k, v in best.items():
        print(f"{k:<10}{v:>9.1f}{v / best['base']:>9.3f}")
    print(
        f"merged / base = {best['merged'] / best['base']:.3f} (target >= 0.97); "
        f"merged / unmerged = {best['merged'] / best['unmerged']:.3f}; "
        f"greedy tokens merged == unmerged on 2 prompts: {same}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
