"""KV bytes one sequence holds, before and after windowed KV-cache groups, for Gemma 2 and
Gemma 3 shapes: the real scheduler and block pool run one sequence (prompt in chunks of
``max_num_batched_tokens``, then decodes) with no model, and the blocks it holds are counted.

"before": one group of every layer (windowed layers kept their full KV); "after": the groups
``loraplex.kv.groups.kv_cache_groups`` makes of the layers' windows. Bytes per block are a
page of the group's layers (``PagedKVCache.bytes_per_block``); bfloat16, block size 16.

    python scripts/kv_window_memory.py [--budget 8] [--contexts 8192 32768] [--simulate 1]

"sequences in budget": how many hold the context at once while the last of them prefills
(``(blocks - peak) // held + 1``). ``--simulate K``: for the first K shapes, run sequences
(prompts 64 tokens short of the first context, decoding up to it, then holding it) through
the scheduler with a pool of the budget's blocks, from one more than that estimate down, until
they all reach the context together without a preemption (slow: minutes for Gemma 3 1B).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from loraplex import SamplingParams
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import Sequence
from loraplex.kv.block_pool import BlockPool
from loraplex.kv.cache import PagedKVCache
from loraplex.kv.groups import KVCacheGroup, kv_cache_groups, layers_per_group

MiB = 1 << 20


@dataclass(frozen=True)
class Shape:
    name: str
    windows: tuple[int | None, ...]  # per layer (None: global)
    kv_heads: int
    head_dim: int


def _gemma3(name: str, layers: int, kv_heads: int, window: int) -> Shape:
    """Every 6th layer global (sliding_window_pattern 6)."""
    ws = tuple(None if (i + 1) % 6 == 0 else window for i in range(layers))
    return Shape(name, ws, kv_heads, 256)


SHAPES = (
    Shape("Gemma 2 2B", tuple(4096 if i % 2 == 0 else None for i in range(26)), 4, 256),
    _gemma3("Gemma 3 1B", 26, 1, 512),
    _gemma3("Gemma 3 4B", 34, 4, 1024),
)


def held_blocks(
    groups: list[KVCacheGroup], context: int, block_size: int, chunk: int
) -> tuple[int, int]:
    """(blocks held while decoding at ``context`` tokens, peak over the run) for one sequence
    through the real Scheduler and BlockPool."""
    need = sum(-(-context // block_size) for _ in groups) + 8
    pool = BlockPool(need, block_size)
    sched = Scheduler(pool, None, max_num_seqs=1, max_num_batched_tokens=chunk, kv_groups=groups)
    prompt = [(7 * i) % 1000 + 3 for i in range(context - 1)]
    seq = Sequence("one", None, prompt, SamplingParams(max_tokens=2, ignore_eos=True), 2)
    sched.add(seq)
    peak = decode = 0
    while seq.num_computed_tokens < context:
        batch = sched.schedule()
        peak = max(peak, len(seq.block_ids))
        if seq.num_computed_tokens + batch.items[0][1] == seq.num_tokens:
            decode = len(seq.block_ids)  # the step whose query sits at position context - 1
            seq.output_token_ids.append(5)
        sched.after_step(batch)
    return decode, peak


def fit(num_blocks: int, decode: int, peak: int) -> int:
    """Sequences that hold ``decode`` blocks each while one more prefills (``peak``)."""
    return max(0, num_blocks - peak) // decode + (num_blocks >= peak)


def together(
    groups: list[KVCacheGroup], num_blocks: int, n: int, context: int, block_size: int, chunk: int
) -> tuple[int, int]:
    """(sequences holding ``context`` tokens at once, preemptions) when ``n`` sequences of
    ``context - 64``-token prompts decode up to ``context`` tokens in a pool of ``num_blocks``."""
    pool = BlockPool(num_blocks, block_size)
    sched = Scheduler(pool, None, max_num_seqs=n, max_num_batched_tokens=chunk, kv_groups=groups)
    sp = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    seqs = [
        Sequence(str(i), None, [(i * 7919 + j) % 30000 + 3 for j in range(context - 64)], sp, 1)
        for i in range(n)
    ]
    for q in seqs:
        sched.add(q)
    while min(q.num_computed_tokens for q in seqs) < context - 1 and not sched.num_preemptions:
        batch = sched.schedule()
        if batch.empty:  # the rest wait for blocks nobody frees
            break
        for q, k in batch.items:
            if q.num_computed_tokens + k == q.num_tokens < context:
                q.output_token_ids.append(5)  # at the context it stops and holds its blocks
        sched.after_step(batch)
    return sum(q.num_computed_tokens >= context - 1 for q in seqs), sched.num_preemptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=8.0, help="KV budget in GiB (default 8)")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--simulate", type=int, default=0, metavar="K", help="see the docstring")
    a = p.parse_args()
    budget = int(a.budget * (1 << 30))
    print(f"bfloat16, block {a.block_size}, prefill chunks of {a.chunk}, budget {a.budget} GiB")
    print("model | groups (layers/page) | context | before MiB | after MiB (peak in prefill) "
          "| saved | sequences in budget before -> after")  # fmt: skip
    for s in SHAPES:
        before = [KVCacheGroup(tuple(range(len(s.windows))))]  # windowed layers kept all
        after = kv_cache_groups(s.windows)
        rows = []
        for ctx in a.contexts:
            out = []
            for groups in (before, after):
                page = PagedKVCache.bytes_per_block(
                    layers_per_group(groups), a.block_size, s.kv_heads, s.head_dim, torch.bfloat16
                )
                decode, peak = held_blocks(groups, ctx, a.block_size, a.chunk)
                blocks = budget // page - (len(groups) > 1)  # the engine's trash page
                out.append((decode * page, peak * page, fit(blocks, decode, peak)))
            (b, _, nb), (f, fp, nf) = out
            rows.append(
                f"{s.name} | {len(after)} ({layers_per_group(after)}) | {ctx} | {b / MiB:.0f} | "
                f"{f / MiB:.0f} ({fp / MiB:.0f}) | {1 - f / b:.0%} | {nb} -> {nf}"
            )
        print("\n".join(rows))
        if a.simulate > SHAPES.index(s):
            ctx = a.contexts[0]
            for groups in (before, after):
                page = PagedKVCache.bytes_per_block(
                    layers_per_group(groups), a.block_size, s.kv_heads, s.head_dim, torch.bfloat16
                )
                blocks = budget // page - (len(groups) > 1)  # the engine's trash page
                n = fit(blocks, *held_blocks(groups, ctx, a.block_size, a.chunk)) + 1
                while (got := together(groups, blocks, n, ctx, a.block_size, a.chunk)) != (n, 0):
                    print(f"  {len(groups)} group(s): {n} sequences: {got[0]} reach {ctx} "
                          f"tokens together, {got[1]} preemptions")  # fmt: skip
                    n -= 1
                print(f"  {len(groups)} group(s): {n} sequences hold {ctx} tokens at once")


if __name__ == "__main__":
    main()
