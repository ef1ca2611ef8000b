"""Tensor parallelism on one CPU host: TP=2 with 1 thread per rank against TP=1 with 2 threads,
side by side in one run, on the same random model, adapters and prompts.

    python -m loraplex.tools.bench.tp [--shape llama-1b] [--dtype bfloat16] [--new-tokens 32]

For each setting (``tp1`` then ``tp2``, or as ``--order`` says, in fresh processes) it loads the
model with 16 distinct rank-16 adapters on all seven projections and reports decode tok/s for
16 sequences x 16 adapters, 16 base sequences and one sequence with one adapter; for TP=2 also
rank 0's time per step inside the collectives (the row-parallel all-reduces, the embedding's,
the logits' gather; it includes waiting for the other rank), through gloo and through shared
memory (``2s``, ``LORAPLEX_TP_SHM=1``), and the slot writes' time (each
adapter's whole weights handed to the worker, through shared memory or with ``2g`` pickled
through the process group, and its cut written on both ranks) against TP=1's plain slot write.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from loraplex.tools.bench.quant import SHAPES, build

_RUN = r"""
import json, sys, time
import torch
from loraplex import LLM, LoRARequest, SamplingParams

model, tp, dtype, new_tokens, adapters = (sys.argv[1], int(sys.argv[2]), sys.argv[3],
                                          int(sys.argv[4]), json.loads(sys.argv[5]))
if sys.argv[6] == "group":  # slot writes' weights pickled through the process group
    from loraplex.lora.tensor_parallel import SharedWeights

    def no_shm(cls, plain):
        raise OSError("the benchmark's process-group setting")

    SharedWeights.write = classmethod(no_shm)
threads = 2 // tp
llm = LLM(model, dtype=dtype, tensor_parallel_size=tp, num_threads=threads, enable_lora=True,
          max_loras=16, max_lora_rank=16, max_num_seqs=16, skip_tokenizer_init=True,
          kv_cache_memory_bytes=256 << 20)
e = llm.engine
shard = getattr(e.model, "_model", e.model)  # rank 0's shard behind the TP driver
timed = {"collective": 0.0, "calls": 0, "slot_write": 0.0, "slot_writes": 0, "gather": 0.0,
         "gathers": 0}

def timer(fn, key, count):
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            timed[key] += time.perf_counter() - t
            timed[count] += 1
    return run

if tp > 1:
    shard.attn.reduce = timer(shard.attn.reduce, "collective", "calls")
    shard.mlp.reduce = timer(shard.mlp.reduce, "collective", "calls")
    shard._gather_logits = timer(timer(shard._gather_logits, "gather", "gathers"),
                                 "collective", "calls")

    class TimedLookup:  # the vocab-parallel lookup and its all-reduce
        def __init__(self, inner):
            self.inner, self.nbytes = inner, inner.nbytes
            self.lookup = timer(inner.__getitem__, "collective", "calls")
        def __getitem__(self, ids):
            return self.lookup(ids)

    shard.embed_tokens = TimedLookup(shard.embed_tokens)
bank = e.adapters.bank
for name in ("replace_lora", "set_lora"):
    setattr(bank, name, timer(getattr(bank, name), "slot_write", "slot_writes"))
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(100, 30000, (16,), generator=g).tolist() for _ in range(16)]
reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

def rate(ps, lr):
    for k in ("collective", "calls", "gather", "gathers"):
        timed[k] = 0
    steps0 = e.num_steps
    t = time.perf_counter()
    out = llm.generate(ps, sp, lora_request=lr)
    dt = time.perf_counter() - t
    steps = e.num_steps - steps0
    return (sum(len(o.outputs[0].token_ids) for o in out) / dt, 1e3 * dt / steps,
            1e3 * timed["collective"] / steps, timed["calls"] / steps,
            1e3 * timed["gather"] / steps)

rate(prompts, reqs)  # warm-up: every adapter into its slot (the slot writes)
res = dict(tp=tp, threads=threads, kernels=shard.linear_impl,
           slot_write_ms=1e3 * timed["slot_write"] / max(1, timed["slot_writes"]),
           slot_writes=timed["slot_writes"])
for key, ps, lr in (("16_adapters", prompts, reqs), ("16_base", prompts, None),
                    ("1_adapter", prompts[:1], reqs[:1])):
    best = max((rate(ps, lr) for _ in range(2)), key=lambda r: r[0])
    res[key] = dict(tok_s=best[0], step_ms=best[1], collective_ms=best[2], calls=best[3],
                    gather_ms=best[4])
print(json.dumps(res))
e.shutdown()
"""


def run(model: Path, adapters: list[Path], setting: str, dtype: str, new_tokens: int) -> dict:
    """One setting in a fresh process: ``"1"``, ``"2"`` (gloo step traffic), ``"2s"`` (shared
    memory step traffic); a ``g`` after either: slot writes' weights through the process group
    instead of shared memory."""
    tp = int(setting.rstrip("sg"))
    step_shm, slot_group = "s" in setting, "g" in setting
    args = [str(model), str(tp), dtype, str(new_tokens), json.dumps([str(a) for a in adapters]),
            "group" if slot_group else "shm"]  # fmt: skip
    env = {**os.environ, "LORAPLEX_TP_SHM": "1" if step_shm else "0"}
    out = subprocess.run(
        [sys.executable, "-c", _RUN, *args], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise RuntimeError(f"tp={setting}: {out.stderr.strip()[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["comm"] = "" if tp == 1 else ("shm" if step_shm else "gloo")
    res["slots"] = "" if tp == 1 else ("group" if slot_group else "shm")
    return res


def report(shape: str, dtype: str, rows: list[dict]) -> None:
    one = next(r for r in rows if r["tp"] == 1)
    print(f"\n{shape} {dtype}: decode (tok/s | ms per step | ms per step in collectives)")
    print(f"{'setting':<27}{'16 seqs x 16 adapters':>26}{'16 base':>24}{'1 seq 1 adapter':>24}"
          f"{'slot write ms':>15}")  # fmt: skip
    for r in rows:
        cells = ""
        for key in ("16_adapters", "16_base", "1_adapter"):
            c = r[key]
            cells += f"{c['tok_s']:>9.1f} {c['step_ms']:>6.1f} {c['collective_ms']:>6.2f}  "
        name = f"TP={r['tp']} x {r['threads']} {r['comm']}" + (
            f", slots {r['slots']}" if r["slots"] else ""
        )
        print(f"{name:<27}{cells}{r['slot_write_ms']:>13.1f}")
    for r in rows:
        if r["tp"] > 1:
            for key in ("16_adapters", "16_base", "1_adapter"):
                print(f"  TP={r['tp']} {r['comm']} / TP=1 tok/s {key}: "
                      f"{r[key]['tok_s'] / one[key]['tok_s']:.2f}x; collectives "
                      f"{r[key]['collective_ms']:.2f} ms of {r[key]['step_ms']:.1f} ms per step "
                      f"({r[key]['calls']:.0f} calls; the logits' gather "
                      f"{r[key]['gather_ms']:.2f} ms)")  # fmt: skip
            print(f"  {r['comm']}, weights via {r['slots']}: slot write (whole weights to the "
                  f"worker + both cuts): {r['slot_write_ms']:.1f} ms vs "
                  f"{one['slot_write_ms']:.1f} ms at TP=1")  # fmt: skip
    print(f"  kernels: {one['kernels'][:200]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loraplex.tools.bench.tp", description=__doc__)
    ap.add_argument("--shape", choices=list(SHAPES), default="llama-1b")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--order",
        default="1,2g,2,2s",
        help="settings in run order: a TP size, 's' after it for the shared-memory step "
        "traffic instead of gloo's, 'g' for slot writes' weights through the process group "
        "instead of shared memory (default: 1,2g,2,2s)",
    )
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/loraplex-bench-quant"))
    args = ap.parse_args(argv)
    model, adapters = build(args.cache_dir, args.shape)
    rows = [
        run(model, adapters, setting, args.dtype, args.new_tokens)
        for setting in args.order.split(",")
    ]
    report(args.shape, args.dtype, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
