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
from loraplex.engine.spec.suffix import SuffixProposer, _Node, _SuffixTree, _Tail
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


def test_past_output_drafts_stop_at_the_tree_depth() -> None:
    p = suffix(suffix_decoding_max_tree_depth=4, suffix_decoding_max_spec_factor=4.0)
    learned(p, OUT)
    assert drafted(p, make_seq([1, 100])) == [101, 102, 103]  # depth 4: 1 matched + 3
    assert drafted(p, make_seq([1, 100, 101, 102])) == [103]  # 3 matched + 1


def test_finish_drops_the_window_and_records_the_output() -> None:
    p = suffix()
    seqs = [make_seq([3, 4, 3, 4] * 20, [3], rid=f"r{i}") for i in range(3)]
    p.propose(seqs, [4, 4, 4])
    assert p.memory_bytes() > p.cache_bytes == 0
    for s in seqs:
        p.finish(s)
    assert p.memory_bytes() == p.cache_bytes > 0 and p.num_cached_requests == 3
    assert suffix(suffix_decoding_max_cached_requests=0).cache_bytes == 0
    none = suffix(suffix_decoding_max_cached_requests=0)
    none.finish(seqs[0])
    assert none.memory_bytes() == 0 and none.num_cached_requests == 0


# -- memory ---------------------------------------------------------------------------------------


def count_tree(node: _Node) -> tuple[int, int]:
    """(nodes, tails) below ``node`` by walking the trie, checking on the way that every
    count is positive, that children never count more than their parent, and that only
    count-1 nodes keep a tail."""
    kids = node.kids
    if type(kids) is _Tail:
        assert node.count == 1 and kids.pos < kids.end
        return 0, 1
    children = [] if kids is None else list(kids.values()) if type(kids) is dict else [kids]
    assert len(children) != 1 or type(kids) is not dict  # a dict only from two children on
    assert sum(c.count for c in children) <= node.count
    nodes, tails = 0, 0
    for c in children:
        assert c.count > 0
        sub_nodes, sub_tails = count_tree(c)
        nodes, tails = nodes + 1 + sub_nodes, tails + sub_tails
    return nodes, tails


def check_trees(p: SuffixProposer) -> None:
    """Every tree's node and tail counts match a walk, and the total bytes are the trees' and
    records' sum."""
    total = 0
    for key, tree in p._trees.items():
        recs = [r for r in p._recorded.values() if r.key == key]
        assert tree.records == len(recs) > 0 and tree.root.count == sum(r.added for r in recs)
        assert count_tree(tree.root) == (tree.nodes, tree.tails)
        total += tree.nbytes
    total += sum(r.nbytes for r in p._recorded.values())
    assert total == p.cache_bytes


def paths(tree: _SuffixTree) -> Counter[tuple[int, ...]]:
    """Every path of the tree with its count, tails read as the count-1 nodes they stand for."""
    out: Counter[tuple[int, ...]] = Counter()

    def visit(node: _Node, path: tuple[int, ...]) -> None:
        kids = node.kids
        if type(kids) is _Tail:
            for i in range(kids.pos, kids.end):
                path = (*path, kids.run[i])
                out[path] = 1
            return
        children = [] if kids is None else list(kids.values()) if type(kids) is dict else [kids]
        for c in children:
            out[(*path, c.tok)] = c.count
            visit(c, (*path, c.tok))

    visit(tree.root, ())
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
    tree = _SuffixTree(depth)
    live: list[array.array] = []
    for step in range(60):
        if live and rng.random() < 0.4:
            run = live.pop(rng.randrange(len(live)))
            tree.remove(run)
        else:
            run = array.array("i", [rng.randrange(vocab) for _ in range(rng.randrange(1, 14))])
            tree.add(run)
            live.append(run)
        assert paths(tree) == substrings([list(r) for r in live], depth), step
        assert count_tree(tree.root) == (tree.nodes, tree.tails)
        assert tree.root.count == sum(len(r) for r in live)


def test_outputs_are_learned_over_the_next_steps() -> None:
    """``finish`` only keeps the output; each ``propose`` adds at most ``learn_per_step`` of its
    suffixes (oldest first), so a long output never stalls one step; the bounds hold and a
    half-learned output is removed exactly."""
    p = SuffixProposer(SPEC, learn_per_step=100)
    first = list(range(1000, 1250))
    p.finish(make_seq([1], first))
    p.finish(make_seq([1], OUT))
    tree = p._trees[("t0", None, None)]
    assert tree.root.count == 0 and p.num_cached_requests == 2
    ctx = make_seq([5, 102, 103])
    assert drafted(p, ctx) == [] and tree.root.count == 100  # the first 100 of the first
    check_trees(p)
    for _ in range(2):
        drafted(p, ctx)
    assert tree.root.count == 260 and drafted(p, ctx) == [104, 105]  # 250 + 10: all of it
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
        assert 0 < p.cache_bytes <= bound
        if i % 50 == 0:
            check_trees(p)
    assert 1 < p.num_cached_requests < 300
    check_trees(p)
    while p._recorded:
        p._remove_oldest()
    assert p.cache_bytes == 0 and not p._trees and not p._key_digests


def test_tree_bytes_are_counted_honestly() -> None:
    """The tree's estimate covers what Python really allocates for it (tracemalloc), within
    a margin for allocator rounding."""
    rng = random.Random(5)
    for vocab in (4, 60, 50_000):
        run = array.array("i", [rng.randrange(vocab) + 1000 for _ in range(2000)])
        tracemalloc.start()
        try:
            tree = _SuffixTree(24)
            tree.add(run)
            traced, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert traced <= tree.nbytes <= 1.5 * traced, (vocab, traced, tree.nbytes)
        tree.remove(run)
        assert (tree.nodes, tree.tails, tree.dict_bytes, tree.root.kids) == (0, 0, 0, None)


# -- forgetting adapters ----------------------------------------------------------------------------


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
