"""The scheduler and drafts: a drafted decode row runs ``1 + k`` tokens when the step's token
budget and the free KV blocks hold them, fewer drafts when they do not, and never preempts a
sequence to make room for a draft; rejected positions are not counted as computed."""

from __future__ import annotations

from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import Sequence
from loraplex.kv.block_pool import BlockPool
from loraplex.requests import SamplingParams


def _decoding(s: Scheduler, **prompts: int) -> list[Sequence]:
    """Sequences whose prompts ran (one step) and that sampled their first token (one token to
    run each)."""
    seqs = [
        Sequence(rid, None, list(range(1, n + 1)), SamplingParams(max_tokens=32), 32)
        for rid, n in prompts.items()
    ]
    for seq in seqs:
        s.add(seq)
    batch = s.schedule()
    assert len(batch.items) == len(seqs)
    s.after_step(batch)
    for seq in seqs:
        seq.output_token_ids.append(7)
    return seqs


def test_a_draft_fits_the_budget_and_the_blocks_or_shrinks() -> None:
    pool = BlockPool(6, 4, enable_prefix_caching=False)  # 6 blocks of 4 tokens
    s = Scheduler(pool, None, max_num_seqs=4, max_num_batched_tokens=4)
    s.max_num_batched_tokens = 64
    a, b = _decoding(s, a=8, b=7)  # 2 blocks each; a's next token (position 8) needs a 3rd
    s.max_num_batched_tokens = 4
    a.spec_tokens = [1, 2, 3, 4, 5]
    b.spec_tokens = [9, 9]
    batch = s.schedule()
    # a first: the budget of 4 tokens holds its token and 3 drafts; b gets what is left (0)
    assert dict((x.request_id, n) for x, n in batch.items) == {"a": 4}
    assert a.spec_tokens == [1, 2, 3] and b.spec_tokens == [9, 9]
    assert batch.num_preempted == 0
    # 2 of a's 3 drafts rejected: 1 + 1 positions computed, the rest written but not counted
    s.after_step(batch, {a: 2})
    assert a.num_computed_tokens == 10


def test_a_draft_never_preempts_anyone() -> None:
    pool = BlockPool(5, 4, enable_prefix_caching=False)
    s = Scheduler(pool, None, max_num_seqs=4, max_num_batched_tokens=64)
    a, _ = _decoding(s, a=8, b=7)  # 4 blocks taken, 1 free; a's next position needs it
    a.spec_tokens = [1, 2, 3, 4, 5, 6]  # 7 positions from 8: 2 more blocks, only 1 free
    batch = s.schedule()
    assert batch.num_preempted == 0 and len(s.running) == 2
    n = dict((x.request_id, k) for x, k in batch.items)["a"]
    assert n == 1 and a.spec_tokens == []  # the draft went, not the other sequence


def test_drafts_ride_only_on_decode_rows() -> None:
    pool = BlockPool(16, 4, enable_prefix_caching=False)
    s = Scheduler(pool, None, max_num_seqs=4, max_num_batched_tokens=64)
    seq = Sequence("p", None, list(range(1, 11)), SamplingParams(max_tokens=8), 8)
    seq.spec_tokens = [1, 2]  # stale: its prompt has not run
    s.add(seq)
    batch = s.schedule()
    assert batch.items == [(seq, 10)]
    s.after_step(batch)
    seq.output_token_ids.append(3)
    seq.spec_tokens = [4, 5]
    seq.num_computed_tokens -= 3  # as if preempted work were being recomputed: not decoding
    batch = s.schedule()
    assert batch.items == [(seq, 4)] and seq.spec_tokens == []
