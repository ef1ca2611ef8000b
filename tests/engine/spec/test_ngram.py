"""``ngram`` drafting (prompt lookup): exact drafts on crafted contexts, limits, the incremental
window against a from-scratch search as a sequence grows (and slides, and rolls back), and the
per-request state dropped on finish."""

from __future__ import annotations

import random

import pytest

from loraplex.config.speculative import SpeculativeConfig, parse_speculative_config
from loraplex.engine.spec.ngram import NgramProposer
from loraplex.engine.spec.proposer import NO_DRAFT
from tests.engine.spec.seqs import make_seq


def ngram(lo: int, hi: int, **kw: int) -> NgramProposer:
    return NgramProposer(
        SpeculativeConfig("ngram", 8, prompt_lookup_min=lo, prompt_lookup_max=hi), **kw
    )


def reference(tokens: list[int], lo: int, hi: int, limit: int) -> list[int]:
    """Prompt lookup by brute force: the longest n first, then its most recent earlier
    occurrence with a token after it."""
    if limit <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == tail:
                return tokens[i + n : i + n + limit]
    return []


def test_the_most_recent_occurrence_of_the_longest_ngram_drafts() -> None:
    p = ngram(2, 3)
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    toks = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 2, 3]
    seq = make_seq(toks[:10], toks[10:])
    # [8, 2, 3] never occurred before; [2, 3] did at 1..2 and at 8..9: the later one wins
    assert p.propose([seq], [4])[0].tokens == [7, 8, 2, 3]
    assert p.propose([seq], [2])[0].tokens == [7, 8]
    seq.output_token_ids.append(7)  # [2, 3, 7] at 8..10: a 3-gram now matches
    assert p.propose([seq], [8])[0].tokens == [8, 2, 3, 7]  # only the tokens that exist
    seq.output_token_ids.extend([1, 2, 3])  # [1, 2, 3] at 0..2 and 7..9: 3 beats a later 2
    assert p.propose([seq], [3])[0].tokens == [7, 8, 2]


@pytest.mark.parametrize(
    ("toks", "lo", "hi"),
    [
        ([5, 6, 7, 8, 6, 7], 3, 3),  # only a 2-gram repeats: below prompt_lookup_min
        ([1, 2, 3, 4], 1, 4),  # nothing repeats
        ([4], 1, 1),  # one token: nothing before it
    ],
)
def test_no_match_no_draft(toks: list[int], lo: int, hi: int) -> None:
    assert ngram(lo, hi).propose([make_seq(toks)], [4]) == [NO_DRAFT]


def test_limits_are_per_sequence_and_zero_drafts_nothing() -> None:
    p = ngram(1, 2)
    a, b, c = make_seq([1, 2, 3, 1, 2]), make_seq([7, 8, 9, 7]), make_seq([1, 2, 1])
    drafts = p.propose([a, b, c], [0, 1, 5])
    assert drafts[0] is NO_DRAFT and len(drafts[0]) == 0
    assert drafts[1].tokens == [8] and drafts[2].tokens == [2, 1]
    assert all(d.probs is None for d in drafts)  # deterministic drafts


@pytest.mark.parametrize(("lo", "hi", "vocab"), [(2, 4, 6), (1, 80, 2), (3, 40, 3)])
def test_matches_a_from_scratch_search_as_sequences_grow_slide_and_roll_back(
    lo: int, hi: int, vocab: int
) -> None:
    """Random low-entropy token streams, appended a few tokens a step (as verification does):
    every draft equals the brute-force lookup over the last ``window`` tokens, including after
    the window slides and after outputs shrink (the window is rebuilt); matches longer than
    one 32-token comparison block included."""
    rng = random.Random(7)
    window = 64
    p = ngram(lo, hi, window=window)
    seqs = [make_seq([rng.randrange(vocab) for _ in range(rng.randrange(1, 90))]) for _ in "ab"]
    seqs.append(make_seq([1, 0] * 40))  # periodic: every match runs to the window's start
    for step in range(200):
        limits = [rng.randrange(0, 6) for _ in seqs]
        drafts = p.propose(seqs, limits)
        for seq, k, d in zip(seqs, limits, drafts, strict=True):
            assert d.tokens == reference(seq.all_token_ids[-window:], lo, hi, k), step
        for seq in seqs:
            if step % 37 == 36 and seq.output_token_ids:
                del seq.output_token_ids[-rng.randrange(1, len(seq.output_token_ids) + 1) :]
            seq.output_token_ids.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 5)))
    assert 0 < p.memory_bytes() <= 3 * (2 * window * 4)  # each window at most 2 x 64 int32


def test_a_context_of_one_repeated_token_drafts_it() -> None:
    """Thousands of occurrences of the last token: the match extends from the most recent
    ``MAX_CANDIDATES`` of them (bounded work) and still finds the longest n."""
    p = ngram(1, 64)
    run = make_seq([7] * 20_000)  # a 64-gram of 7s last ended at 19998: one token after it
    assert p.propose([run], [5])[0].tokens == [7]
    seq = make_seq([7] * 20_000, [9, 7, 7])  # [7, 7] last ended at 19999 (at 20001: [9, 7])
    assert p.propose([seq], [5])[0].tokens == [9, 7, 7]
    seq.output_token_ids.append(9)  # [7, 7, 9] ended at 20000
    assert p.propose([seq], [3])[0].tokens == [7, 7, 9]


def test_finish_drops_the_sequences_state() -> None:
    p = ngram(1, 1)
    seqs = [make_seq([1, 2, 1, 2] * 50, rid=f"r{i}") for i in range(3)]
    p.propose(seqs, [2, 2, 2])
    assert p.memory_bytes() > 0
    for s in seqs:
        p.finish(s)
    assert p.memory_bytes() == 0
    p.finish(seqs[0])  # twice, or one never proposed for: nothing to drop


def test_built_from_the_parsed_flag() -> None:
    spec = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    p = NgramProposer(spec)
    assert (p.method, p.min_n, p.max_n) == ("ngram", 4, 4)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        ngram(3, 2)
