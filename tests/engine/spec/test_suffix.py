"""``suffix`` drafting: exact drafts from a request's own context and from past outputs, the
better-scoring source winning, past outputs isolated per tenant and per adapter (compositions
included), the byte and request bounds with honest byte counts, ``forget_adapter`` from any
thread, and the adapter cache's evictions reaching the proposer."""

from __future__ import annotations

import array
import dataclasses
import random
import threading
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest

from loraplex.config.speculative import SpeculativeConfig, parse_speculative_config
from loraplex.engine.spec.proposer import NO_DRAFT
from loraplex.engine.spec.suffix import SuffixProposer
from loraplex.engine.spec.suffix_tree import NIL, NODE_BYTES, SuffixForest
from tests.engine.spec.seqs import adapter, make_seq

SPEC = SpeculativeConfig("suffix", 8)  # vLLM's defaults: depth 24, factor 1.0, min prob 0.1
A, B = adapter("a"), adapter("b")
OUT = [100, 101, 102, 103, 104, 105, 106, 107, 108, 109]  # a past output


def suffix(**kw: object) -> SuffixProposer:
    return SuffixProposer(dataclasses.replace(SPEC, **kw))  # type: ignore[arg-type]


def drafted(p: SuffixProposer, seq: object, limit: int = 8) -> list[int]:
    return p.propose([seq], [limit])[0].tokens  # type: ignore[list-item]


def learned(p: SuffixProposer, output: list[int], **kw: object) -> None:
    """A finished request with ``output`` (its prompt shares nothing with the tests'), learned
    at once (the engine's steps would learn it over the next few ``propose`` calls)."""
    p.finish(make_seq([1], output, **kw))  # type: ignore[arg-type]
    p.learn_all()


# -- the request's own context ------------------------------------------------------------------


def test_own_context_follows_the_majority_continuation() -> None:
    # the longest earlier match is [1, 2] (m = 2: at most floor(1.0 x 2) tokens); after it
    # came 3 twice and 9 once (3: 2/3), and after [1, 2, 3] came 4 both times
    seq = make_seq([1, 2, 3, 4, 5, 1, 2, 9, 8, 1, 2, 3, 4, 6, 7, 1, 2])
    assert drafted(suffix(), seq) == [3, 4]
    assert drafted(suffix(), seq, 1) == [3]
    assert drafted(suffix(suffix_decoding_min_token_prob=0.7), seq) == []


def test_own_context_draft_length_and_probability_bounds() -> None:
    ctx = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 50, 7, 8, 9]  # [7, 8, 9] repeats: m = 3
    assert drafted(suffix(), make_seq(ctx)) == [10, 11, 12]  # floor(1.0 x 3)
    assert drafted(suffix(suffix_decoding_max_spec_factor=0.5), make_seq(ctx)) == [10]
    assert drafted(suffix(suffix_decoding_max_spec_factor=3.0), make_seq(ctx)) == [
        *range(10, 17),
        50,
    ]  # 9 > limit 8: the limit
    assert drafted(suffix(suffix_decoding_max_spec_factor=3.0), make_seq(ctx), 2) == [10, 11]
    assert drafted(suffix(suffix_decoding_max_tree_depth=2), make_seq(ctx)) == [10, 11]  # m = 2
    assert drafted(suffix(suffix_decoding_max_spec_factor=0.3), make_seq(ctx)) == []
    # after [5]: 1, 2, 3, 4 once each: 1/4 < min prob 0.3 -> nothing
    split = [5, 1, 5, 2, 5, 3, 5, 4, 5]
    strict = suffix(suffix_decoding_min_token_prob=0.3)
    assert strict.propose([make_seq(split)], [4]) == [NO_DRAFT]
    # at 0.25 all four tie: the most recent continuation
    assert drafted(suffix(suffix_decoding_min_token_prob=0.25), make_seq(split)) == [4]


def test_limit_zero_and_no_match_draft_nothing() -> None:
    p = suffix()
    learned(p, OUT)
    seq = make_seq([100, 101, 7, 100, 101, 8, 100, 101])
    assert p.propose([seq, make_seq([1, 2, 3])], [0, 4]) == [NO_DRAFT, NO_DRAFT]
    # own context: 7 or 8 after [100, 101] (1/2); the past output: 102 (1 of 1) wins
    assert drafted(p, seq, 1) == [102]


# -- past outputs ---------------------------------------------------------------------------------


def test_past_outputs_draft_for_the_same_tenant_salt_and_adapter_only() -> None:
    p = suffix()
    learned(p, OUT, tenant="t0", adapters=[A])
    ctx = [5, 6, 102, 103, 104]  # m = 3 in t0/A's past output; nothing repeats in the context
    assert drafted(p, make_seq(ctx, tenant="t0", adapters=[A])) == [105, 106, 107]
    assert drafted(p, make_seq(ctx, tenant="t1", adapters=[A])) == []  # another tenant
    assert drafted(p, make_seq(ctx, tenant="t0", adapters=[B])) == []  # another adapter
    assert drafted(p, make_seq(ctx, tenant="t0")) == []  # the base model
    assert drafted(p, make_seq(ctx, tenant=None, adapters=[A])) == []  # no tenant is a key too
    salted = make_seq(ctx, tenant="t0", adapters=[A], cache_salt="user-1")
    assert drafted(p, salted) == []  # a salt shares only with the same salt
    learned(p, OUT, tenant="t0", adapters=[A], cache_salt="user-1")
    assert drafted(p, salted) == [105, 106, 107]
    assert drafted(p, make_seq(ctx, tenant="t0", adapters=[A], cache_salt="user-2")) == []
    comp = make_seq(ctx, tenant="t0", adapters=[A, B], scales=(1.0, 0.5))
    assert drafted(p, comp) == []  # a composition has its own key
    learned(p, OUT, tenant="t0", adapters=[A, B], scales=(1.0, 0.5))
    assert drafted(p, comp) == [105, 106, 107]
    learned(p, OUT, tenant="t1")
    assert drafted(p, make_seq(ctx, tenant="t1")) == [105, 106, 107]
    assert drafted(p, make_seq(ctx, tenant="t0")) == []


def test_the_better_scoring_source_wins() -> None:
    """Own context: after [9, 7, 8] came 1 and 2 (1/2 each; the tie goes to the most recent),
    then certain tokens: score 0.5 + 0.5 + 0.5; the past output continues [9, 7, 8] with
    3, 4, 5 every time: score 3 wins. And the other way round."""
    p = suffix()
    ctx = [9, 7, 8, 1, 9, 7, 8, 2, 9, 7, 8]
    assert drafted(p, make_seq(ctx)) == [2, 9, 7]  # m = 3
    learned(p, [9, 7, 8, 3, 4, 5])
    assert drafted(p, make_seq(ctx)) == [3, 4, 5]
    q = suffix()
    learned(q, [7, 8, 3, 4, 7, 8, 5, 6])  # 1/2 each: worse than own context's certain run
    ctx = [9, 7, 8, 9, 7, 8]  # own: after [9, 7, 8] came 9 (1 of 1), m = 3
    assert drafted(q, make_seq(ctx)) == [9, 7, 8]


def test_past_outputs_follow_the_most_frequent_continuation() -> None:
    p, strict = suffix(), suffix(suffix_decoding_min_token_prob=0.7)
    for q in (p, strict):
        for out in ([7, 8, 3, 4], [7, 8, 5, 6], [7, 8, 3, 4]):
            learned(q, out)
    ctx = make_seq([9, 7, 8])  # after [7, 8]: 3 (2 of 3), then 4 (2 of 2)
    assert drafted(p, ctx) == [3, 4] and drafted(strict, ctx) == []
    tie = suffix()
    learned(tie, [7, 8, 3])
    learned(tie, [7, 8, 5])
    assert drafted(tie, ctx, 1) == [5]  # a tie: the continuation first seen last


def test_past_output_drafts_stop_at_the_tree_depth() -> None:
    p = suffix(suffix_decoding_max_tree_depth=4, suffix_decoding_max_spec_factor=4.0)
    learned(p, OUT)
    assert drafted(p, make_seq([1, 100])) == [101, 102, 103]  # depth 4: 1 matched + 3
    assert drafted(p, make_seq([1, 100, 101, 102])) == [103]  # 3 matched + 1


def test_finish_drops_the_window_and_records_the_output() -> None:
    p = suffix()
    seqs = [make_seq([3, 4, 3, 4] * 20, [3], rid=f"r{i}") for i in range(3)]
    p.propose(seqs, [4, 4, 4])
    windows = p._windows.nbytes
    assert len(p._windows) == 3 and p.memory_bytes() == windows > 0 and p.cache_bytes == 0
    for s in seqs:
        p.finish(s)
    assert not p._windows and p.num_cached_requests == 3 and p.cache_bytes > 0
    trees = p._forest.held_bytes() + 256 * len(p._trees)
    assert p.memory_bytes() == trees + sum(r.nbytes for r in p._recorded.values())
    assert suffix(suffix_decoding_max_cached_requests=0).cache_bytes == 0
    none = suffix(suffix_decoding_max_cached_requests=0)
    none.finish(seqs[0])
    assert none.memory_bytes() == 0 and none.num_cached_requests == 0


# -- memory ---------------------------------------------------------------------------------------


def children(f: SuffixForest, node: int) -> list[int]:
    out, c = [], f.kid[node]
    while c != NIL:
        out.append(c)
        c = f.nxt[c]
    return out


def count_tree(f: SuffixForest, root: int) -> int:
    """The nodes of the tree at ``root`` (root included), checking on the way that every
    count is positive, that children never count more than their parent, that only count-1
    nodes keep a tail (and no child), and that the edge index and sibling links agree."""
    nodes, stack = 0, [root]
    while stack:
        n = stack.pop()
        nodes += 1
        kids = children(f, n)
        if f.trun[n] != NIL:
            assert f.cnt[n] == 1 and not kids and f.tpos[n] < f.tend[n]
        assert sum(f.cnt[c] for c in kids) <= f.cnt[n]
        prev = NIL
        for c in kids:
            assert f.cnt[c] > 0 and f.prv[c] == prev and f.edges[n * (1 << 32) + f.tok[c]] == c
            prev = c
        stack.extend(kids)
    return nodes


def check_trees(p: SuffixProposer) -> None:
    """Every tree's bookkeeping matches a walk of the pool: its records, its root's count, the
    live nodes and edges, the runs the tails may point into, and the bytes the budget counts."""
    f, nodes = p._forest, 0
    for key, tree in p._trees.items():
        recs = [r for r in p._recorded.values() if r.key == key]
        assert tree.records == len(recs) > 0 and f.cnt[tree.root] == sum(r.added for r in recs)
        nodes += count_tree(f, tree.root)
    assert nodes == f.live and len(f.edges) == nodes - len(p._trees)
    assert set(f.runs) == {rid for rid, r in p._recorded.items() if r.added > 0}
    records = sum(r.nbytes for r in p._recorded.values())
    assert p.cache_bytes == nodes * NODE_BYTES + records + 256 * len(p._trees)


def paths(f: SuffixForest, root: int) -> Counter[tuple[int, ...]]:
    """Every path of the tree with its count, tails read as the count-1 nodes they stand for."""
    out: Counter[tuple[int, ...]] = Counter()
    stack: list[tuple[int, tuple[int, ...]]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if f.trun[node] != NIL:
            for t in f.runs[f.trun[node]][f.tpos[node] : f.tend[node]]:
                path = (*path, t)
                out[path] = 1
            continue
        for c in children(f, node):
            out[(*path, f.tok[c])] = f.cnt[c]
            stack.append((c, (*path, f.tok[c])))
    return out


def substrings(runs: list[list[int]], depth: int) -> Counter[tuple[int, ...]]:
    """By brute force: each run's substrings of at most ``depth`` tokens, counted."""
    out: Counter[tuple[int, ...]] = Counter()
    for run in runs:
        for s in range(len(run)):
            for e in range(s + 1, min(s + depth, len(run)) + 1):
                out[tuple(run[s:e])] += 1
    return out


@pytest.mark.parametrize("vocab", [2, 5, 40])
def test_compressed_tree_counts_every_substring_through_adds_and_removals(vocab: int) -> None:
    """Tails stand for count-1 chains: the tree's paths and counts equal a brute-force count of
    the recorded runs' substrings (up to the depth) after every add and every removal, and the
    bookkeeping matches a walk."""
    rng = random.Random(vocab)
    depth = 5
    f = SuffixForest(depth)
    other = f.new_tree()  # a second tree in the same pool, which nothing may disturb
    f.add(other, 1000, array.array("i", [1, 0, 1, 1]), 0, 4)
    root = f.new_tree()
    live: dict[int, array.array] = {}
    for step in range(60):
        if live and rng.random() < 0.4:
            rid = rng.choice(list(live))
            run = live.pop(rid)
            f.remove(root, rid, run, len(run))
        else:
            run = array.array("i", [rng.randrange(vocab) for _ in range(rng.randrange(1, 14))])
            live[step] = run
            f.add(root, step, run, 0, len(run))
        subs = substrings([list(r) for r in live.values()], depth)
        assert paths(f, root) == subs, step
        for _ in range(5):  # the match is the longest suffix followed by a token somewhere
            ctx = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
            longest = max(
                (m for m in range(1, min(len(ctx), depth - 1) + 1)
                 if any(k[:-1] == tuple(ctx[len(ctx) - m :]) for k in subs if len(k) == m + 1)),
                default=0,
            )  # fmt: skip
            node, _, m = f.match(root, ctx[-(depth - 1) :])
            assert m == longest and (node == NIL) == (m == 0), (step, ctx)
        assert f.cnt[root] == sum(len(r) for r in live.values())
        assert count_tree(f, root) + count_tree(f, other) == f.live
        assert paths(f, other) == substrings([[1, 0, 1, 1]], depth)
    f.drop_tree(root, list(live))
    assert f.live == count_tree(f, other) and set(f.runs) == {1000}


def test_outputs_are_learned_over_the_next_steps() -> None:
    """``finish`` only keeps the output; each ``propose`` adds at most ``learn_per_step`` of its
    suffixes (oldest first), so a long output never stalls one step; the bounds hold and a
    half-learned output is removed exactly."""
    p = SuffixProposer(SPEC, learn_per_step=100)
    first = list(range(1000, 1250))
    p.finish(make_seq([1], first))
    p.finish(make_seq([1], OUT))
    cnt, root = p._forest.cnt, p._trees[("t0", None, None)].root
    assert cnt[root] == 0 and p.num_cached_requests == 2
    ctx = make_seq([5, 102, 103])
    assert drafted(p, ctx) == [] and cnt[root] == 100  # the first 100 of the first
    check_trees(p)
    for _ in range(2):
        drafted(p, ctx)
    assert cnt[root] == 260 and drafted(p, ctx) == [104, 105]  # 250 + 10: all of it
    p.finish(make_seq([1], first))
    drafted(p, make_seq([2]))  # half of it learned
    p.max_requests = 2
    p._bound()  # the oldest (the first output) goes
    check_trees(p)
    p.max_requests = 1
    p._bound()  # and OUT, leaving the half-learned one: removed exactly as far as it went
    check_trees(p)
    p.max_requests = 0
    p._bound()
    assert p.cache_bytes == 0 and not p._trees


def test_request_bound_removes_the_oldest_outputs() -> None:
    p = suffix(suffix_decoding_max_cached_requests=3)
    for i in range(10):
        learned(p, [1000 * i + j for j in range(20)])
        assert p.num_cached_requests == min(i + 1, 3)
        check_trees(p)
    assert drafted(p, make_seq([2, 6000, 6001])) == []  # removed: request 6 of 10
    assert drafted(p, make_seq([2, 7000, 7001])) == [7002, 7003]  # kept: the last three
    for _ in range(3):  # the same output thrice: counts add up, removals take them away
        learned(p, OUT)
    assert p.num_cached_requests == 3 and len(p._trees) == 1
    check_trees(p)


def test_byte_bound_holds_under_many_requests_and_empties_cleanly() -> None:
    bound = 1 << 20
    p = suffix(suffix_decoding_max_cache_bytes=bound)
    rng = random.Random(3)
    tenants, adapters = ["t0", "t1", "t2"], [[], [A], [B]]
    for i in range(300):
        out = [rng.randrange(50) for _ in range(rng.randrange(1, 120))]
        learned(p, out, tenant=rng.choice(tenants), adapters=rng.choice(adapters))
        assert 0 < p.cache_bytes <= bound and p.memory_bytes() <= 1.1 * bound
        if i % 50 == 0:
            check_trees(p)
    assert 1 < p.num_cached_requests < 300
    check_trees(p)
    while p._recorded:
        p._remove_oldest()
    assert p.cache_bytes == 0 and not p._trees and not p._key_digests
    assert p._forest.live == 0 and not p._forest.edges and not p._forest.runs


def test_tree_bytes_are_counted_honestly() -> None:
    """What the pool holds covers what Python really allocates for it (tracemalloc), within a
    margin for allocator rounding, and the budget's per-node count covers what it holds."""
    rng = random.Random(5)
    for vocab in (4, 60, 50_000):
        run = array.array("i", [rng.randrange(vocab) + 1000 for _ in range(2000)])
        tracemalloc.start()
        try:
            f = SuffixForest(24)
            root = f.new_tree()
            f.add(root, 0, run, 0, len(run))
            traced, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        held = f.held_bytes()
        assert 0.95 * traced <= held <= 1.5 * traced, (vocab, traced, held)
        assert traced <= f.live_bytes and held <= f.live_bytes, (vocab, f.live_bytes)
        f.remove(root, 0, run, len(run))
        assert f.live == 1 and not f.edges and f.cnt[root] == 0 and not f.runs


# -- forgetting adapters -----------------------------------------------------------------------


def test_forget_adapter_drops_its_trees_and_its_compositions() -> None:
    p = suffix()
    ctx = [5, 102, 103]
    for tenant in ("t0", "t1"):
        learned(p, OUT, tenant=tenant, adapters=[A])
        learned(p, OUT, tenant=tenant, adapters=[B])
    learned(p, OUT, tenant="t0", adapters=[B, A], scales=(0.5, 1.0))
    learned(p, OUT, tenant="t0")
    before = p.cache_bytes
    p.forget_adapter(A.ref.sha256)
    p.propose([], [])  # applied on the loop thread's next call
    assert len(p._trees) == 3 and 0 < p.cache_bytes < before and p.num_cached_requests == 3
    comp = make_seq(ctx, tenant="t0", adapters=[B, A], scales=(0.5, 1.0))
    assert drafted(p, make_seq(ctx, tenant="t0", adapters=[A])) == []
    assert drafted(p, make_seq(ctx, tenant="t1", adapters=[A])) == []
    assert drafted(p, comp) == []
    assert drafted(p, make_seq(ctx, tenant="t1", adapters=[B])) == [104, 105]
    assert drafted(p, make_seq(ctx, tenant="t0")) == [104, 105]
    check_trees(p)
    learned(p, OUT, tenant="t0", adapters=[A])  # an adapter back in memory learns anew
    assert drafted(p, make_seq(ctx, tenant="t0", adapters=[A])) == [104, 105]


def test_forget_adapter_from_other_threads_while_the_loop_drafts() -> None:
    """Loader threads forget adapters while the loop thread proposes and finishes: no error,
    the bookkeeping stays exact, and every forgotten adapter's trees are gone afterwards."""
    p = suffix(suffix_decoding_max_cache_bytes=1 << 20)
    names = [adapter(f"x{i}") for i in range(6)]
    rng = random.Random(11)
    stop = threading.Event()
    errors: list[BaseException] = []

    def loader(seed: int) -> None:
        r = random.Random(seed)
        try:
            while not stop.is_set():
                p.forget_adapter(r.choice(names).ref.sha256)
        except BaseException as e:  # pragma: no cover (reported below)
            errors.append(e)

    threads = [threading.Thread(target=loader, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(400):
            a = rng.choice(names)
            out = [rng.randrange(30) for _ in range(rng.randrange(1, 40))]
            learned(p, out, adapters=[a])
            seq = make_seq(out[: rng.randrange(1, len(out) + 1)], adapters=[a], rid=f"q{i}")
            p.propose([seq], [4])
            p.finish(seq)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    p.propose([], [])
    check_trees(p)
    for a in names:
        p.forget_adapter(a.ref.sha256)
    p.propose([], [])
    assert p.cache_bytes == 0 and not p._trees and p.num_cached_requests == 0


def test_the_adapter_caches_evictions_reach_the_proposer(tmp_path: Path) -> None:
    """A real :class:`TieredAdapterCache` evicting an adapter's host copy (the count cap) makes
    the wired proposer forget what that adapter's outputs taught it."""
    from tests.cache.test_tiered_cache import make_cache, resolve, spec
    from tests.s3fixture import write_adapter

    cache = make_cache(max_loras=1, max_cpu_loras=1)
    p = suffix()
    cache.add_eviction_listener(p.forget_adapter)
    (p0, _), (p1, _) = (write_adapter(tmp_path / f"a{i}", seed=i) for i in range(2))
    a0 = resolve(cache, spec("a0", p0))
    learned(p, OUT, adapters=[a0])  # a real host copy's identity
    cache.release(a0)
    ctx = make_seq([5, 102, 103], adapters=[a0])
    assert drafted(p, ctx) == [104, 105]
    a1 = resolve(cache, spec("a1", p1))  # room for a1: a0's copy leaves host memory
    assert cache.tier_of(a0.ref.sha256) is None
    assert drafted(p, ctx) == [] and p.cache_bytes == 0
    cache.release(a1)


def test_built_from_the_parsed_flag() -> None:
    spec = parse_speculative_config('{"method": "suffix", "suffix_decoding_max_tree_depth": 8}')
    p = SuffixProposer(spec)
    assert (p.method, p.depth, spec.num_speculative_tokens) == ("suffix", 8, 8)
    with pytest.raises(ValueError, match="suffix_decoding_max_cache_bytes"):
        parse_speculative_config('{"method": "suffix", "suffix_decoding_max_cache_bytes": 1}')
