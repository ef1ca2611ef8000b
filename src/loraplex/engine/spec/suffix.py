"""``suffix`` drafting (suffix decoding, as Arctic Inference and vLLM's ``method: suffix`` name
it): continue a sequence the way its current ending continued before, in its own context and in
the outputs its tenant's adapter produced for earlier requests.

Two sources, each matched and walked the same way:

- **the request's own context** (prompt + outputs so far): the sequence's
  :class:`~loraplex.engine.spec.window.TokenWindow` (its last ``DEFAULT_WINDOW_TOKENS`` tokens,
  appended to incrementally) searched with numpy (from the last token's ``MAX_CANDIDATES``
  most recent occurrences, fewer for depths over 64). A trie of every suffix of a 32k-token prompt
  would be ~800k Python nodes built on the loop thread; the window answers the same question
  (which positions end with the current suffix, and what followed each) with one vectorized
  comparison per step, and holds 4 bytes per token.
- **past outputs**: one suffix tree per ``(tenant, cache_salt, adapter_key)`` (the adapter's
  digest, the ``composed:...`` key of a composition, None for the base model), built from
  finished requests' outputs in :meth:`SuffixProposer.finish`. A tenant's outputs never draft
  for another tenant, an adapter's never for another adapter; and requests with a
  ``cache_salt`` share drafts only with the same salt, as they share prefix-cache blocks (a draft
  that is accepted makes a step faster: without the salt, timing would tell one user that
  another's output was seen before, the side channel the salt closes for the prefix cache).
  The tree holds every suffix of each recorded output truncated to
  ``suffix_decoding_max_tree_depth`` tokens, each node counting the recorded suffixes that pass
  through it.

Proposal for one sequence (``D`` = ``suffix_decoding_max_tree_depth``):

1. match: the longest suffix of the context, of ``m <= D`` tokens, that occurred before with a
   token after it (own context), or that is a path of the tree with a child (past outputs;
   there the path's depth bounds ``m + draft <= D``);
2. walk: from the match, repeatedly take the most frequent next token (ties: the most recent
   occurrence's in the own context, the continuation first seen last in a tree) while its
   empirical probability (its count / the count of the occurrences continuing from here) is at
   least ``suffix_decoding_min_token_prob``, for at most
   ``min(limit, D, floor(spec_factor * m))`` tokens;
3. score: the sum over the draft of the product of the probabilities so far (the expected
   number of accepted tokens if each is accepted with its probability); the higher-scoring of
   the two drafts is proposed (ties: the longer one, then the own context's).

Learning: :meth:`SuffixProposer.finish` only keeps the output (its first
``MAX_RECORDED_TOKENS`` tokens, as an int32 array); each ``propose`` then adds at most
``LEARN_PER_STEP`` of the recorded outputs' suffixes to their trees, oldest first, so a long
output is learned over the next steps and never stalls one. The trees
(:mod:`loraplex.engine.spec.suffix_tree`) are path-compressed and live in one pool of int
arrays: no Python object per node for the garbage collector to walk.

Memory: the budget counts ``NODE_BYTES`` per live tree node (its array slots, its dict entry
at the dict's worst fill, the entry's two int objects), plus each recorded output's array and
bookkeeping (:attr:`SuffixProposer.cache_bytes`). All trees together stay under
``suffix_decoding_max_cache_bytes``, and at most ``suffix_decoding_max_cached_requests`` outputs
are recorded: beyond either, the oldest recorded outputs' contributions are removed (counts
decremented, emptied nodes freed for reuse, a tree left with no output dropped). Freed nodes
are reused, so the pool's size is the live high-water mark: ``memory_bytes`` reports what it
holds now (with the sequences' windows), tested against tracemalloc.

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
from loraplex.engine.spec.suffix_tree import NIL, CandidateDraft, SuffixForest
from loraplex.engine.spec.window import (
    DEFAULT_WINDOW_TOKENS,
    SequenceWindows,
    longest_suffix_match,
)

if TYPE_CHECKING:
    from loraplex.config.speculative import SpeculativeConfig
    from loraplex.engine.sequence import Sequence

MAX_RECORDED_TOKENS = 4096
"""The most output tokens of one finished request recorded in its past-output tree."""
LEARN_PER_STEP = 128
"""Suffixes of recorded outputs added to the trees per ``propose`` call (about 5 microseconds
each): a finished request's output is learned over the next steps, never in one stall."""

TreeKey = tuple[str | None, str | None, str | None]
"""``(tenant, cache_salt, adapter_key)``: whose outputs a past-output tree holds."""


def tree_key(seq: Sequence) -> TreeKey:
    """The past-output tree ``seq`` drafts from and teaches."""
    return (seq.tenant, seq.cache_salt, seq.adapter_key)


_TREE_BYTES = 256  # a tree's entry in the proposer's dicts
_ENTRY_BYTES = 256  # a recorded request's bookkeeping beside its token array


@dataclass
class _Tree:
    root: int  # its root in the forest
    records: int = 0  # recorded outputs (learned or waiting to be) that belong to it


def _walk_context(a: np.ndarray, ends: np.ndarray, max_len: int, min_prob: float) -> CandidateDraft:
    """The same walk over the context ``a`` ([n] int32) from the occurrences ending at
    ``ends``: at each step the tokens that followed them vote."""
    out = CandidateDraft()
    n = int(a.shape[0])
    nxt_pos = ends + 1  # every end < n - 1: each occurrence has a next token
    p = 1.0
    while len(out.tokens) < max_len and nxt_pos.size:
        nxt = a[nxt_pos]  # [occurrences] the token each one continued with
        if (nxt == nxt[0]).all():  # one continuation (a repetitive context's usual case)
            tok, top = int(nxt[0]), nxt.size
        else:
            vals, counts = np.unique(nxt, return_counts=True)
            top = int(counts.max())
            if int((counts == top).sum()) > 1:  # a tie: the most recent
                tok = int(nxt[np.isin(nxt, vals[counts == top])][-1])
            else:
                tok = int(vals[counts.argmax()])
        prob = top / nxt.size
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
        self._windows = SequenceWindows(window)
        self._forest = SuffixForest(self.depth)
        self._trees: dict[TreeKey, _Tree] = {}
        self._key_digests: dict[TreeKey, frozenset[str]] = {}
        self._recorded: OrderedDict[int, _Recorded] = OrderedDict()  # oldest first
        self._learning: deque[int] = deque()  # ids in _recorded not fully added yet, in order
        self._next_id = 0
        self._record_bytes = 0  # the records' arrays and bookkeeping
        self._forget_lock = threading.Lock()
        self._forget: set[str] = set()  # digests queued by forget_adapter (any thread)

    # -- the interface ---------------------------------------------------------------------------
    def propose(self, seqs: Seq[Sequence], limits: Seq[int]) -> list[Draft]:
        self._apply_forgets()
        self._learn(self.learn_per_step)
        return [self._one(seq, k) for seq, k in zip(seqs, limits, strict=True)]

    def finish(self, seq: Sequence) -> None:
        self._windows.drop(seq)
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
        """What the trees hold now (the pool with its spare capacity), their records, and the
        sequences' windows."""
        held = self._forest.held_bytes() + self._record_bytes + self._trees_bytes
        return held + self._windows.nbytes

    @property
    def cache_bytes(self) -> int:
        """The past-output trees' live nodes and records as the budget counts them (at most
        ``suffix_decoding_max_cache_bytes``)."""
        return self._forest.live_bytes + self._record_bytes + self._trees_bytes

    @property
    def _trees_bytes(self) -> int:
        return len(self._trees) * _TREE_BYTES

    @property
    def num_cached_requests(self) -> int:
        return len(self._recorded)

    def close(self) -> None:
        self._windows.clear()
        self._trees.clear()
        self._key_digests.clear()
        self._recorded.clear()
        self._learning.clear()
        self._forest = SuffixForest(self.depth)
        self._record_bytes = 0

    # -- drafting --------------------------------------------------------------------------------
    def _max_len(self, limit: int, m: int) -> int:
        return min(limit, self.depth, math.floor(self.spec_factor * m + 1e-9))

    def _one(self, seq: Sequence, limit: int) -> Draft:
        if limit <= 0:
            return NO_DRAFT
        a = self._windows.tokens(seq)  # [n] int32
        best = CandidateDraft()
        m, ends = longest_suffix_match(a, self.depth)
        if m:
            best = _walk_context(a, ends, self._max_len(limit, m), self.min_prob)
        tree = self._trees.get(tree_key(seq))
        if tree is not None and self.depth > 1:
            forest = self._forest
            node, k, m = forest.match(tree.root, a[-(self.depth - 1) :].tolist())
            if node != NIL:
                cand = forest.walk(node, k, self._max_len(limit, m), self.min_prob)
                if (cand.score, len(cand.tokens)) > (best.score, len(best.tokens)):
                    best = cand
        return Draft(best.tokens) if best.tokens else NO_DRAFT

    # -- past outputs ----------------------------------------------------------------------------
    def _record(self, seq: Sequence, out: list[int]) -> None:
        """Keep ``out`` for its key's tree; its suffixes are added by :meth:`_learn`."""
        key = tree_key(seq)
        tree = self._trees.get(key)
        if tree is None:
            tree = self._trees[key] = _Tree(self._forest.new_tree())
            self._key_digests[key] = frozenset(a.ref.sha256 for a in seq.adapters)
        toks = array.array("i", out)
        rec = _Recorded(key, toks, _ENTRY_BYTES + sys.getsizeof(toks))
        tree.records += 1
        self._record_bytes += rec.nbytes
        self._recorded[self._next_id] = rec
        self._learning.append(self._next_id)
        self._next_id += 1
        self._bound()

    def _learn(self, budget: int | None) -> None:
        """Add up to ``budget`` suffixes (None: all) of the recorded outputs, oldest first."""
        while self._learning and (budget is None or budget > 0):
            rid = self._learning[0]
            rec = self._recorded.get(rid)
            if rec is None or rec.added == len(rec.tokens):  # removed, or done
                self._learning.popleft()
                continue
            stop = len(rec.tokens) if budget is None else min(len(rec.tokens), rec.added + budget)
            self._forest.add(self._trees[rec.key].root, rid, rec.tokens, rec.added, stop)
            if budget is not None:
                budget -= stop - rec.added
            rec.added = stop
            self._bound()

    def _bound(self) -> None:
        """Remove the oldest recorded outputs while over either bound."""
        while self._recorded and (
            len(self._recorded) > self.max_requests or self.cache_bytes > self.max_bytes
        ):
            self._remove_oldest()

    def _remove_oldest(self) -> None:
        rid, rec = self._recorded.popitem(last=False)
        tree = self._trees[rec.key]
        self._forest.remove(tree.root, rid, rec.tokens, rec.added)
        self._record_bytes -= rec.nbytes
        tree.records -= 1
        if tree.records == 0:
            self._drop_tree(rec.key)

    def _drop_tree(self, key: TreeKey) -> None:
        tree = self._trees.pop(key)
        del self._key_digests[key]
        rids = [rid for rid, r in self._recorded.items() if r.key == key]
        for rid in rids:
            self._record_bytes -= self._recorded.pop(rid).nbytes
        self._forest.drop_tree(tree.root, rids)

    def _apply_forgets(self) -> None:
        if not self._forget:  # a racy peek is fine: a digest queued now is seen next time
            return
        with self._forget_lock:
            gone, self._forget = self._forget, set()
        for key in [k for k, ds in self._key_digests.items() if ds & gone]:
            self._drop_tree(key)
