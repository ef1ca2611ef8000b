"""``suffix`` drafting (suffix decoding, as Arctic Inference and vLLM's ``method: suffix`` name
it): continue a sequence the way its current ending continued before, in its own context and in
the outputs its tenant's adapter produced for earlier requests.

Two sources, each matched and walked the same way:

- **the request's own context** (prompt + outputs so far): the sequence's
  :class:`~loraplex.engine.spec.window.TokenWindow` (its last ``DEFAULT_WINDOW_TOKENS`` tokens,
  appended to incrementally) searched with numpy. A trie of every suffix of a 32k-token prompt
  would be ~800k Python nodes built on the loop thread; the window answers the same question
  (which positions end with the current suffix, and what followed each) with one vectorized
  comparison per step, and holds 4 bytes per token.
- **past outputs**: one suffix tree per ``(tenant, cache_salt, adapter_key)`` (the adapter's
  digest, the ``composed:...`` key of a composition, None for the base model), built from
  finished requests' outputs in :meth:`SuffixProposer.finish`. A tenant's outputs never draft
  for another tenant, an adapter's never for another adapter; and requests with a
  ``cache_salt`` share drafts only with the same salt, as they share prefix-cache blocks (a draft
  that is accepted makes a step faster: without the salt, timing would tell one user that
  another's output was seen before, the side channel the salt closes for the prefix cache). The tree holds every suffix of each recorded output
  truncated to ``suffix_decoding_max_tree_depth`` tokens, each node counting the recorded
  suffixes that pass through it.

Proposal for one sequence (``D`` = ``suffix_decoding_max_tree_depth``):

1. match: the longest suffix of the context, of ``m <= D`` tokens, that occurred before with a
   token after it (own context), or that is a path of the tree with a child (past outputs;
   there the path's depth bounds ``m + draft <= D``);
2. walk: from the match, repeatedly take the most frequent next token (ties: the most recent
   one in the own context, the first recorded in a tree) while its empirical probability
   (its count / the count of the occurrences continuing from here) is at least
   ``suffix_decoding_min_token_prob``, for at most ``min(limit, D, floor(spec_factor * m))``
   tokens;
3. score: the sum over the draft of the product of the probabilities so far (the expected
   number of accepted tokens if each is accepted with its probability); the higher-scoring of
   the two drafts is proposed (ties: the longer one, then the own context's).

Learning: :meth:`SuffixProposer.finish` only keeps the output (its first
``MAX_RECORDED_TOKENS`` tokens, as an int32 array); each ``propose`` then adds at most
``LEARN_PER_STEP`` of the recorded outputs' suffixes to their trees, oldest first, so a long
output is learned over the next steps and never stalls one. A suffix seen once is one node
plus a :class:`_Tail` (a slice of its recorded array standing for the rest of its path, count 1
each), materialized a token at a time only where a second suffix follows it: a tree costs
nodes where outputs repeat, not ``depth`` nodes per token.

Memory (the past-output trees; ``memory_bytes`` adds the windows): every node is counted as
``NODE_BYTES`` (its ``__slots__`` object with the GC header and its token's int object, as the
allocator rounds them), every tail as ``TAIL_BYTES``, plus ``sys.getsizeof`` of each child dict
(a node with one child points at it directly, a dict only from two children on), plus each
recorded output's array and bookkeeping; a test checks the sum against tracemalloc. All trees
together stay under ``suffix_decoding_max_cache_bytes``, and at most
``suffix_decoding_max_cached_requests`` outputs are recorded: beyond either, the oldest
recorded outputs' contributions are removed (counts decremented, emptied nodes pruned, a tree
left with no output dropped).

:meth:`SuffixProposer.forget_adapter` may come from any thread (the adapter cache evicts on
loader threads): it only queues the digest under a lock; the loop thread drops every tree whose
adapters include it at its next ``propose`` or ``finish``.
"""

from __future__ import annotations

import array
import math
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from loraplex.engine.spec.proposer import NO_DRAFT, Draft, Proposer
from loraplex.engine.spec.window import DEFAULT_WINDOW_TOKENS, TokenWindow, longest_suffix_match

if TYPE_CHECKING:
    from loraplex.config.speculative import SpeculativeConfig
    from loraplex.engine.sequence import Sequence

MAX_RECORDED_TOKENS = 4096
"""The most output tokens of one finished request recorded in its past-output tree."""
LEARN_PER_STEP = 128
"""Suffixes of recorded outputs added to the trees per ``propose`` call (3 to 9 microseconds
each): a finished request's output is learned over the next steps, never in one stall."""

TreeKey = tuple[str | None, str | None, str | None]
"""``(tenant, cache_salt, adapter_key)``: whose outputs a past-output tree holds."""


def tree_key(seq: Sequence) -> TreeKey:
    """The past-output tree ``seq`` drafts from and teaches."""
    return (seq.tenant, seq.cache_salt, seq.adapter_key)


class _Tail:
    """The rest of a node's only suffix, kept as a slice of its recorded run: the tokens
    ``run[pos:end]`` would each be a node with count 1. Materialized one token at a time once a
    second suffix passes through (a path compression: a token seen once costs one node, not
    one per depth level)."""

    __slots__ = ("end", "pos", "run")

    def __init__(self, run: array.array, pos: int, end: int) -> None:
        self.run, self.pos, self.end = run, pos, end


class _Node:
    """One trie node: ``count`` recorded suffixes pass through it (or end at it); ``kids`` is
    None (nothing below), the only child, ``{token: child}`` from two children on, or a
    :class:`_Tail` (only while ``count == 1``)."""

    __slots__ = ("count", "kids", "tok")

    def __init__(self, tok: int, count: int = 0) -> None:
        self.tok = tok
        self.count = count
        self.kids: _Node | dict[int, _Node] | _Tail | None = None


def _allocated(nbytes: int) -> int:
    """What the allocator hands out for ``nbytes`` (16-byte granules)."""
    return -(-nbytes // 16) * 16


_INT_BYTES = _allocated(sys.getsizeof(1 << 20))
NODE_BYTES = _allocated(sys.getsizeof(_Node(1 << 20))) + _INT_BYTES
"""A node's own bytes: its object (GC header included) and its token's int object, each as
allocated."""
TAIL_BYTES = _allocated(sys.getsizeof(_Tail(array.array("i"), 0, 0))) + 2 * _INT_BYTES
"""A tail's bytes: its object and its two int objects (its run is counted once, recorded)."""
_TREE_BYTES = NODE_BYTES + 256  # the tree object, its root and its slot in the proposer's dict
_ENTRY_BYTES = 256  # a recorded request's bookkeeping beside its token array


def _child(node: _Node, tok: int) -> _Node | None:
    """The materialized child for ``tok`` (a node with a tail has none)."""
    kids = node.kids
    if type(kids) is dict:
        return kids.get(tok)
    if type(kids) is _Node:
        return kids if kids.tok == tok else None
    return None


def _best_child(kids: _Node | dict[int, _Node]) -> _Node:
    """The child most suffixes continue with (ties: the first recorded)."""
    if type(kids) is not dict:
        return kids  # type: ignore[return-value]
    best = None
    for c in kids.values():
        if best is None or c.count > best.count:
            best = c
    assert best is not None
    return best


class _SuffixTree:
    """The depth-bounded suffixes of recorded token runs, with counts (see the module doc)."""

    __slots__ = ("depth", "dict_bytes", "nodes", "records", "root", "tails")

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.records = 0  # recorded runs (learned or waiting to be) that belong to the tree
        self.root = _Node(-1)
        self.nodes = 0  # below the root
        self.tails = 0
        self.dict_bytes = 0  # sys.getsizeof of every child dict

    @property
    def nbytes(self) -> int:
        return _TREE_BYTES + self.nodes * NODE_BYTES + self.tails * TAIL_BYTES + self.dict_bytes

    def _attach(self, node: _Node, child: _Node) -> None:
        kids = node.kids
        if kids is None:
            node.kids = child
        elif type(kids) is dict:
            before = sys.getsizeof(kids)
            kids[child.tok] = child
            self.dict_bytes += sys.getsizeof(kids) - before
        else:
            d = {kids.tok: kids, child.tok: child}  # type: ignore[union-attr]
            node.kids = d
            self.dict_bytes += sys.getsizeof(d)
        self.nodes += 1

    def _detach(self, node: _Node, tok: int) -> None:
        kids = node.kids
        if type(kids) is not dict:
            node.kids = None
            return
        before = sys.getsizeof(kids)
        del kids[tok]
        if len(kids) == 1:  # back to a direct pointer: a dict only from two children on
            node.kids = next(iter(kids.values()))
            self.dict_bytes -= before
        else:
            self.dict_bytes += sys.getsizeof(kids) - before

    def _leaf(self, run: array.array, j: int, end: int) -> _Node:
        """A new count-1 node for ``run[j]`` whose tail is ``run[j + 1 : end]``."""
        node = _Node(run[j], 1)
        if j + 1 < end:
            node.kids = _Tail(run, j + 1, end)
            self.tails += 1
        return node

    def _expand(self, node: _Node) -> None:
        """Materialize the first token of ``node``'s tail (a second suffix reaches it)."""
        tail = node.kids
        assert type(tail) is _Tail
        self.tails -= 1
        node.kids = None
        self._attach(node, self._leaf(tail.run, tail.pos, tail.end))

    def add(self, run: array.array, start: int = 0, stop: int | None = None) -> None:
        """Record the suffixes of ``run`` that start in ``[start, stop)`` (each truncated to
        ``depth`` tokens; ``stop`` None: all)."""
        n, depth = len(run), self.depth
        for s in range(start, n if stop is None else stop):
            end = min(s + depth, n)
            node = self.root
            node.count += 1
            for j in range(s, end):
                if type(node.kids) is _Tail:
                    self._expand(node)
                child = _child(node, run[j])
                if child is None:
                    self._attach(node, self._leaf(run, j, end))
                    break
                child.count += 1
                node = child
            else:
                if type(node.kids) is _Tail:  # the suffix ends here: the node counts 2
                    self._expand(node)

    def remove(self, run: array.array, stop: int | None = None) -> None:
        """Undo :meth:`add` of ``run``'s suffixes starting before ``stop`` (None: all):
        decrement along each; a node no suffix passes through any more is pruned with the one
        chain below it."""
        n, depth = len(run), self.depth
        for s in range(n if stop is None else stop):
            node = self.root
            node.count -= 1
            for j in range(s, min(s + depth, n)):
                child = _child(node, run[j])
                assert child is not None, "removing a run that was never added"
                child.count -= 1
                if child.count == 0:
                    self._detach(node, run[j])
                    self._uncount_chain(child)
                    break
                node = child

    def _uncount_chain(self, node: _Node | None) -> None:
        """Uncount a pruned node and the chain below it (one suffix: no dicts)."""
        while node is not None:
            self.nodes -= 1
            kids = node.kids
            if type(kids) is _Tail:
                self.tails -= 1
                return
            assert type(kids) is not dict
            node = kids  # type: ignore[assignment]

    def match(self, ctx: list[int]) -> tuple[_Node | None, int, int]:
        """The longest suffix of ``ctx`` that is a path with a continuation: ``(node, k, m)``,
        the path ending ``k`` tokens into ``node``'s tail (0: at ``node``), of ``m`` tokens;
        ``(None, 0, 0)`` when no suffix is."""
        for s in range(len(ctx)):
            node, k = self.root, 0
            for t in ctx[s:]:
                kids = node.kids
                if type(kids) is _Tail:
                    if kids.pos + k >= kids.end or kids.run[kids.pos + k] != t:
                        break
                    k += 1
                    continue
                child = _child(node, t)
                if child is None:
                    break
                node = child
            else:
                kids = node.kids
                if kids is not None and (type(kids) is not _Tail or kids.pos + k < kids.end):
                    return node, k, len(ctx) - s
        return None, 0, 0


@dataclass
class _Candidate:
    tokens: list[int]
    score: float = 0.0


_NONE = _Candidate([])


def _walk_tree(node: _Node, k: int, max_len: int, min_prob: float) -> _Candidate:
    """Follow the most frequent child from ``node`` (``k`` tokens into its tail), see the
    module doc's step 2; a tail is one suffix: each of its tokens has probability 1."""
    out = _Candidate([])
    p = 1.0
    while len(out.tokens) < max_len:
        kids = node.kids
        if kids is None:
            break
        if type(kids) is _Tail:
            rest = kids.run[kids.pos + k : kids.end][: max_len - len(out.tokens)]
            out.tokens.extend(rest)
            out.score += p * len(rest)
            break
        child = _best_child(kids)
        prob = child.count / node.count
        if prob < min_prob:
            break
        p *= prob
        out.tokens.append(child.tok)
        out.score += p
        node = child
    return out


def _walk_context(a: np.ndarray, ends: np.ndarray, max_len: int, min_prob: float) -> _Candidate:
    """The same walk over the context ``a`` ([n] int32) from the occurrences ending at
    ``ends``: at each step the tokens that followed them vote."""
    out = _Candidate([])
    n = int(a.shape[0])
    nxt_pos = ends + 1  # every end < n - 1: each occurrence has a next token
    p = 1.0
    while len(out.tokens) < max_len and nxt_pos.size:
        nxt = a[nxt_pos]  # [occurrences] the token each one continued with
        vals, counts = np.unique(nxt, return_counts=True)
        top = counts.max()
        if counts.size > 1 and int((counts == top).sum()) > 1:  # a tie: the most recent
            tok = int(nxt[np.isin(nxt, vals[counts == top])][-1])
        else:
            tok = int(vals[counts.argmax()])
        prob = float(top) / nxt.size
        if prob < min_prob:
            break
        p *= prob
        out.tokens.append(tok)
        out.score += p
        nxt_pos = nxt_pos[nxt == tok] + 1
        nxt_pos = nxt_pos[nxt_pos < n]
    return out


@dataclass
class _Recorded:
    key: TreeKey
    tokens: array.array  # int32: a finished request's output, for the key's tree
    nbytes: int
    added: int = 0  # its suffixes starting before this are in the tree


class SuffixProposer(Proposer):
    """Suffix decoding over each request's context and its tenant's adapter's past outputs."""

    method = "suffix"

    def __init__(
        self,
        spec: SpeculativeConfig,
        *,
        window: int = DEFAULT_WINDOW_TOKENS,
        learn_per_step: int = LEARN_PER_STEP,
    ) -> None:
        self.learn_per_step = learn_per_step
        self.depth = spec.suffix_decoding_max_tree_depth
        self.spec_factor = spec.suffix_decoding_max_spec_factor
        self.min_prob = spec.suffix_decoding_min_token_prob
        self.max_requests = spec.suffix_decoding_max_cached_requests
        self.max_bytes = spec.suffix_decoding_max_cache_bytes
        self.window = window
        self._windows: dict[Sequence, TokenWindow] = {}
        self._trees: dict[TreeKey, _SuffixTree] = {}
        self._key_digests: dict[TreeKey, frozenset[str]] = {}
        self._recorded: OrderedDict[int, _Recorded] = OrderedDict()  # oldest first
        self._learning: deque[int] = deque()  # ids in _recorded not fully added yet, in order
        self._next_id = 0
        self._cache_bytes = 0
        self._forget_lock = threading.Lock()
        self._forget: set[str] = set()  # digests queued by forget_adapter (any thread)

    # -- the interface ---------------------------------------------------------------------------
    def propose(self, seqs: Seq[Sequence], limits: Seq[int]) -> list[Draft]:
        self._apply_forgets()
        self._learn(self.learn_per_step)
        return [self._one(seq, k) for seq, k in zip(seqs, limits, strict=True)]

    def finish(self, seq: Sequence) -> None:
        self._windows.pop(seq, None)
        self._apply_forgets()
        out = seq.output_token_ids
        if not out or self.max_requests <= 0:
            return
        self._record(seq, out[:MAX_RECORDED_TOKENS])

    def learn_all(self) -> None:
        """Add every recorded output's remaining suffixes now (tests, an idle engine)."""
        self._apply_forgets()
        self._learn(None)

    def forget_adapter(self, digest: str) -> None:
        with self._forget_lock:
            self._forget.add(digest)

    def memory_bytes(self) -> int:
        return self._cache_bytes + sum(w.nbytes for w in list(self._windows.values()))

    @property
    def cache_bytes(self) -> int:
        """Bytes of all past-output trees and their records (bounded by the config)."""
        return self._cache_bytes

    @property
    def num_cached_requests(self) -> int:
        return len(self._recorded)

    def close(self) -> None:
        self._windows.clear()
        self._trees.clear()
        self._key_digests.clear()
        self._recorded.clear()
        self._learning.clear()
        self._cache_bytes = 0

    # -- drafting --------------------------------------------------------------------------------
    def _max_len(self, limit: int, m: int) -> int:
        return min(limit, self.depth, math.floor(self.spec_factor * m + 1e-9))

    def _one(self, seq: Sequence, limit: int) -> Draft:
        if limit <= 0:
            return NO_DRAFT
        win = self._windows.get(seq)
        if win is None:
            win = self._windows[seq] = TokenWindow(self.window)
        a = win.sync(seq)  # [n] int32
        best = _NONE
        m, ends = longest_suffix_match(a, self.depth)
        if m:
            best = _walk_context(a, ends, self._max_len(limit, m), self.min_prob)
        tree = self._trees.get(tree_key(seq))
        if tree is not None and self.depth > 1:
            node, k, m = tree.match(a[-(self.depth - 1) :].tolist())
            if node is not None:
                cand = _walk_tree(node, k, self._max_len(limit, m), self.min_prob)
                if (cand.score, len(cand.tokens)) > (best.score, len(best.tokens)):
                    best = cand
        return Draft(best.tokens) if best.tokens else NO_DRAFT

    # -- past outputs ----------------------------------------------------------------------------
    def _record(self, seq: Sequence, out: list[int]) -> None:
        """Keep ``out`` for its key's tree; its suffixes are added by :meth:`_learn`."""
        key = tree_key(seq)
        tree = self._trees.get(key)
        if tree is None:
            tree = self._trees[key] = _SuffixTree(self.depth)
            self._key_digests[key] = frozenset(a.ref.sha256 for a in seq.adapters)
            self._cache_bytes += tree.nbytes
        toks = array.array("i", out)
        rec = _Recorded(key, toks, _ENTRY_BYTES + sys.getsizeof(toks))
        tree.records += 1
        self._cache_bytes += rec.nbytes
        self._recorded[self._next_id] = rec
        self._learning.append(self._next_id)
        self._next_id += 1
        self._bound()

    def _learn(self, budget: int | None) -> None:
        """Add up to ``budget`` suffixes (None: all) of the recorded outputs, oldest first."""
        while self._learning and (budget is None or budget > 0):
            rec = self._recorded.get(self._learning[0])
            if rec is None or rec.added == len(rec.tokens):  # removed, or done
                self._learning.popleft()
                continue
            stop = len(rec.tokens) if budget is None else min(len(rec.tokens), rec.added + budget)
            tree = self._trees[rec.key]
            before = tree.nbytes
            tree.add(rec.tokens, rec.added, stop)
            self._cache_bytes += tree.nbytes - before
            if budget is not None:
                budget -= stop - rec.added
            rec.added = stop
            self._bound()

    def _bound(self) -> None:
        """Remove the oldest recorded outputs while over either bound."""
        while self._recorded and (
            len(self._recorded) > self.max_requests or self._cache_bytes > self.max_bytes
        ):
            self._remove_oldest()

    def _remove_oldest(self) -> None:
        _, rec = self._recorded.popitem(last=False)
        tree = self._trees[rec.key]
        before = tree.nbytes
        tree.remove(rec.tokens, rec.added)
        tree.records -= 1
        self._cache_bytes -= before - tree.nbytes + rec.nbytes
        if tree.records == 0:
            self._drop_tree(rec.key)

    def _drop_tree(self, key: TreeKey) -> None:
        tree = self._trees.pop(key)
        del self._key_digests[key]
        self._cache_bytes -= tree.nbytes
        for rid in [rid for rid, r in self._recorded.items() if r.key == key]:
            self._cache_bytes -= self._recorded.pop(rid).nbytes

    def _apply_forgets(self) -> None:
        if not self._forget:  # a racy peek is fine: a digest queued now is seen next time
            return
        with self._forget_lock:
            gone, self._forget = self._forget, set()
        for key in [k for k, ds in self._key_digests.items() if ds & gone]:
            self._drop_tree(key)
