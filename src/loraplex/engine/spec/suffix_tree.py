"""Depth-bounded suffix trees of token runs with counts, for suffix decoding's past outputs.

A tree records every suffix of each added run, truncated to ``depth`` tokens; a node counts
the recorded suffixes that pass through it (or end at it), so ``count(child) / count(node)`` is
how often the path continued with the child's token.

All trees of one proposer live in one :class:`SuffixForest`: a pool of int arrays (count,
token, first child, next / previous sibling, tail) indexed by node id, and one dict
``parent * 2**32 + token -> child``. No Python object per node: a few hundred thousand nodes
cost the garbage collector nothing (a trie of ``__slots__`` objects made each full collection
of the server process walk all of them: 0.4 s at 500k nodes, measured). Freed ids are reused.

Path compression: a suffix seen once is one node plus a **tail**, a slice ``run[pos:end]`` of
its recorded run standing for the count-1 chain below it; the tail is materialized one token
at a time where a second suffix follows it (so outputs cost nodes where they repeat, not
``depth`` nodes per token). Invariant: only a node with count 1 has a tail, and then no child.

Bytes: :attr:`SuffixForest.live_bytes` counts ``NODE_BYTES`` per live node (its slots in the
arrays, its dict entry at the dict's worst fill and the two int objects of that entry): the
budget is enforced on it, so the pool's high-water mark stays under the budget;
:meth:`SuffixForest.held_bytes` is what the pool holds now (arrays with their spare capacity,
the dict's table), which tests check against tracemalloc.
"""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass, field

NIL = -1
_STRIDE = 1 << 32  # edge key: parent * _STRIDE + token (token ids < 2**31)


def _allocated(nbytes: int) -> int:
    """What the allocator hands out for ``nbytes`` (16-byte granules)."""
    return -(-nbytes // 16) * 16


_EDGE_INT_BYTES = _allocated(sys.getsizeof((1 << 40) + 1)) + _allocated(sys.getsizeof(1 << 20))
"""An edge's key and value int objects."""
_DICT_ENTRY_BYTES = 120
"""The most a dict's table holds per entry: after a resize it has 3 to 6 slots per entry
(1 to 4 index bytes each, by its size) and 2/3 of its slots as 24-byte entries; 35 to 60
bytes while only growing, up to 120 once deletions made it resize at a low fill."""
_SLOT_BYTES = 48
"""One node's slots: seven int32 arrays, one int64 and the free list's int32 (40 bytes), with
the pool's and the arrays' own spare capacity (1/16 each)."""
NODE_BYTES = _SLOT_BYTES + _DICT_ENTRY_BYTES + _EDGE_INT_BYTES
"""A live node's bytes as the budget counts them (232: an upper bound of what it holds)."""


@dataclass
class CandidateDraft:
    """A proposal and its score (the expected number of tokens accepted)."""

    tokens: list[int] = field(default_factory=list)
    score: float = 0.0


class SuffixForest:
    """Every tree's nodes in one pool (see the module doc). A tree is its root's id."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.cnt = array.array("i")  # [nodes] suffixes through the node
        self.tok = array.array("i")  # [nodes] the node's token (-1: a root)
        self.kid = array.array("i")  # [nodes] first child (NIL: none)
        self.nxt = array.array("i")  # [nodes] next sibling
        self.prv = array.array("i")  # [nodes] previous sibling
        self.trun = array.array("q")  # [nodes] the tail's run id (NIL: no tail)
        self.tpos = array.array("i")  # [nodes] the tail is runs[trun][tpos:tend]
        self.tend = array.array("i")
        self.free = array.array("i")  # ids to reuse
        self.edges: dict[int, int] = {}  # parent * _STRIDE + token -> child
        self.runs: dict[int, array.array] = {}  # run id -> its tokens (tails point into them)
        self.live = 0  # nodes in use, roots included

    # -- bytes -----------------------------------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        return self.live * NODE_BYTES

    def held_bytes(self) -> int:
        if not self.cnt:
            return 0  # as built
        arrays = (self.cnt, self.tok, self.kid, self.nxt, self.prv, self.trun, self.tpos)
        held = sum(sys.getsizeof(a) for a in (*arrays, self.tend, self.free))
        return held + sys.getsizeof(self.edges) + len(self.edges) * _EDGE_INT_BYTES

    # -- nodes -----------------------------------------------------------------------------------
    def _grow(self) -> None:
        """Add ``64 + capacity / 16`` free ids (one extend per array, not eight appends per
        node)."""
        base, k = len(self.cnt), 64 + len(self.cnt) // 16
        nil, zero = array.array("i", [NIL]) * k, array.array("i", [0]) * k
        for a in (self.tok, self.kid, self.nxt, self.prv):
            a.extend(nil)
        for a in (self.cnt, self.tpos, self.tend):
            a.extend(zero)
        self.trun.extend(array.array("q", [NIL]) * k)
        self.free.extend(range(base + k - 1, base - 1, -1))  # pop() hands out `base` first

    def _new(self, tok: int, count: int) -> int:
        if not self.free:
            self._grow()
        i = self.free.pop()
        self.cnt[i], self.tok[i], self.kid[i] = count, tok, NIL
        self.nxt[i], self.prv[i], self.trun[i] = NIL, NIL, NIL
        self.live += 1
        return i

    def new_tree(self) -> int:
        """A new empty tree: its root's id."""
        return self._new(-1, 0)

    def _link(self, parent: int, child: int) -> None:
        head = self.kid[parent]
        self.nxt[child], self.prv[child] = head, NIL
        if head != NIL:
            self.prv[head] = child
        self.kid[parent] = child
        self.edges[parent * _STRIDE + self.tok[child]] = child

    def _unlink(self, parent: int, child: int) -> None:
        p, n = self.prv[child], self.nxt[child]
        if p == NIL:
            self.kid[parent] = n
        else:
            self.nxt[p] = n
        if n != NIL:
            self.prv[n] = p
        del self.edges[parent * _STRIDE + self.tok[child]]

    def _leaf(self, rid: int, run: array.array, j: int, end: int) -> int:
        """A count-1 node for ``run[j]`` whose tail is ``run[j + 1 : end]``."""
        node = self._new(run[j], 1)
        if j + 1 < end:
            self.trun[node], self.tpos[node], self.tend[node] = rid, j + 1, end
        return node

    def _expand(self, node: int) -> None:
        """Materialize the first token of ``node``'s tail (a second suffix reaches it)."""
        rid, pos, end = self.trun[node], self.tpos[node], self.tend[node]
        self.trun[node] = NIL
        self._link(node, self._leaf(rid, self.runs[rid], pos, end))

    def _free_subtree(self, node: int) -> None:
        """Return ``node`` (already unlinked from its parent) and everything below it."""
        stack = [node]
        while stack:
            n = stack.pop()
            c = self.kid[n]
            while c != NIL:
                del self.edges[n * _STRIDE + self.tok[c]]
                stack.append(c)
                c = self.nxt[c]
            self.trun[n] = NIL
            self.free.append(n)
            self.live -= 1

    # -- trees -----------------------------------------------------------------------------------
    def add(self, root: int, rid: int, run: array.array, start: int, stop: int) -> None:
        """Record the suffixes of ``run`` (registered as ``rid`` on its first add) starting in
        ``[start, stop)``, each truncated to ``depth`` tokens."""
        self.runs[rid] = run
        cnt, trun, edges = self.cnt, self.trun, self.edges
        n, depth = len(run), self.depth
        for s in range(start, stop):
            end = min(s + depth, n)
            node = root
            cnt[node] += 1
            for j in range(s, end):
                if trun[node] != NIL:
                    self._expand(node)
                child = edges.get(node * _STRIDE + run[j])
                if child is None:
                    self._link(node, self._leaf(rid, run, j, end))
                    break
                cnt[child] += 1
                node = child
            else:
                if trun[node] != NIL:  # the suffix ends here: the node counts 2
                    self._expand(node)

    def remove(self, root: int, rid: int, run: array.array, stop: int) -> None:
        """Undo :meth:`add` of ``run``'s suffixes starting before ``stop``: decrement along
        each; a node no suffix passes through any more goes with the one chain below it."""
        cnt, edges = self.cnt, self.edges
        n, depth = len(run), self.depth
        for s in range(stop):
            node = root
            cnt[node] -= 1
            for j in range(s, min(s + depth, n)):
                child = edges[node * _STRIDE + run[j]]
                cnt[child] -= 1
                if cnt[child] == 0:
                    self._unlink(node, child)
                    self._free_subtree(child)
                    break
                node = child
        self.runs.pop(rid, None)

    def drop_tree(self, root: int, rids: list[int]) -> None:
        """Free a whole tree and forget its runs."""
        self._free_subtree(root)
        for rid in rids:
            self.runs.pop(rid, None)

    # -- drafting --------------------------------------------------------------------------------
    def _follow(self, root: int, path: list[int]) -> tuple[int, int] | None:
        """Where ``path`` leads from ``root`` if it is a path with a continuation: ``(node,
        k)``, ``k`` tokens into ``node``'s tail (0: at ``node``); None otherwise."""
        trun, tpos, tend, edges = self.trun, self.tpos, self.tend, self.edges
        node, k = root, 0
        for t in path:
            rid = trun[node]
            if rid != NIL:
                p = tpos[node] + k
                if p >= tend[node] or self.runs[rid][p] != t:
                    return None
                k += 1
                continue
            child = edges.get(node * _STRIDE + t)
            if child is None:
                return None
            node = child
        more = tpos[node] + k < tend[node] if trun[node] != NIL else self.kid[node] != NIL
        return (node, k) if more else None

    def match(self, root: int, ctx: list[int]) -> tuple[int, int, int]:
        """The longest suffix of ``ctx`` that is a path of the tree with a continuation:
        ``(node, k, m)``, the path of ``m`` tokens ending ``k`` tokens into ``node``'s tail (0:
        at ``node``); ``(NIL, 0, 0)`` when no suffix is.

        A binary search on ``m``, ``O(len(ctx) log len(ctx))`` lookups: the tree holds every
        substring (of at most ``depth`` tokens) of its runs, so if ``ctx[-m:]`` continues, so
        does every shorter suffix. (A run still being learned holds only its first suffixes:
        there the search may settle on a shorter match, never on a wrong one.)"""
        best = self._follow(root, [])
        if best is None:
            return NIL, 0, 0
        lo, hi = 0, len(ctx)  # ctx[-lo:] continues; longer than hi is not tried
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = self._follow(root, ctx[len(ctx) - mid :])
            if found is None:
                hi = mid - 1
            else:
                lo, best = mid, found
        if lo == 0:
            return NIL, 0, 0
        return best[0], best[1], lo

    def walk(self, node: int, k: int, max_len: int, min_prob: float) -> CandidateDraft:
        """From ``node`` (``k`` tokens into its tail), follow the child most suffixes continue
        with (ties: the child first seen last) while its share of the node's count is at least
        ``min_prob``, for at most ``max_len`` tokens; a tail's tokens have probability 1 (one
        suffix). Score: the sum of the running products of the probabilities."""
        cnt, kid, nxt, trun = self.cnt, self.kid, self.nxt, self.trun
        out = CandidateDraft()
        p = 1.0
        while len(out.tokens) < max_len:
            rid = trun[node]
            if rid != NIL:
                start = self.tpos[node] + k
                rest = self.runs[rid][start : self.tend[node]][: max_len - len(out.tokens)]
                out.tokens.extend(rest)
                out.score += p * len(rest)
                break
            c = kid[node]
            if c == NIL:
                break
            best, top = c, cnt[c]
            c = nxt[c]
            while c != NIL:
                if cnt[c] > top:
                    best, top = c, cnt[c]
                c = nxt[c]
            prob = top / cnt[node]
            if prob < min_prob:
                break
            p *= prob
            out.tokens.append(self.tok[best])
            out.score += p
            node, k = best, 0
        return out
