"""A sequence's block tables, one per KV-cache group, over one shared block pool (and the
state pool of recurrent layers' snapshots).

The scheduler asks this manager, never the pool, for a sequence's blocks: how many more a
sequence needs, taking them, giving them back, dropping the blocks a windowed group no longer
needs, and prefix-cache lookups and registrations under per-group keys
(:func:`~loraplex.kv.groups.group_block_key` of the chained block hashes, which it takes as
given). With one group every call is what the pool alone did before groups.

State groups (``KVCacheGroup.state``: a recurrent layer's state snapshots) take their pages from
a second pool, ``state_pool``; every call below counts and releases each group's pages in its
own pool. A state group needs one page for the last block a step reaches (the running state);
the blocks a chunk fills before it get a snapshot page only while the state pool keeps
``reserve`` pages free beyond it (else their entries are NULL), so snapshots never cost a
running sequence its page. A state group is keyed and looked up as a windowed group whose live
part is the block before the hit's end (the snapshot the recurrence resumes from), and it never
takes the cached snapshots after it: the sequence recomputes those positions and writes its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.kv.block_pool import BlockPool
from loraplex.kv.groups import NULL_BLOCK, KVCacheGroup, group_block_key

BlockTables = list[list[int]]
"""One block table per group (entry ``b``: positions ``[b * block_size, (b + 1) *
block_size)``; ``NULL_BLOCK`` once released). An empty list: no blocks yet."""


class KVCacheManager:
    """Block tables per KV-cache group over ``pool`` (``groups`` default: one group)."""

    def __init__(
        self,
        pool: BlockPool,
        groups: Sequence[KVCacheGroup] | None = None,
        state_pool: BlockPool | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.groups = list(groups or [KVCacheGroup(())])
        self.windowed = [
            g for g, grp in enumerate(self.groups) if grp.window is not None or grp.state
        ]
        self.full = [g for g, grp in enumerate(self.groups) if grp.window is None and not grp.state]
        self.state_pool = state_pool
        if state_pool is None and any(grp.state for grp in self.groups):
            raise ValueError("KV-cache state groups need a state pool")
        self.pools = [state_pool if grp.state else pool for grp in self.groups]
        """Per group: the pool its pages come from."""
        self.state_groups = [g for g, grp in enumerate(self.groups) if grp.state]
        self._one_pool = state_pool is None

    def _needed(self, g: int, table: list[int] | None, n: int) -> int:
        """Pages group ``g`` must take to cover ``n`` blocks (a state group: the last one)."""
        have = len(table) if table else 0
        if g in self.state_groups:
            return int(n > have)
        return max(0, n - have)

    def fits(self, tables: BlockTables, num_tokens: int, hits: BlockTables = ()) -> bool:
        """Whether every pool has the free pages to extend ``tables`` to ``num_tokens``
        positions, the prefix hit's pages ``hits`` (not taken yet) taken first."""
        if self._one_pool:
            return self.blocks_needed(tables, num_tokens) <= self.pool.num_free_after_touch(
                self.live(hits)
            )
        n = -(-num_tokens // self.block_size)
        for pool in (self.pool, self.state_pool):
            assert pool is not None
            mine = [g for g, p in enumerate(self.pools) if p is pool]
            need = sum(self._needed(g, tables[g] if tables else None, n) for g in mine)
            taken = [b for g in mine if hits for b in hits[g] if b != NULL_BLOCK]
            if need > pool.num_free_after_touch(taken):
                return False
        return True

    def touch(self, tables: BlockTables) -> None:
        """Take a reference on every block of ``tables`` (a prefix hit's), each in its pool."""
        for g, t in enumerate(tables):
            self.pools[g].touch([b for b in t if b != NULL_BLOCK])

    def _tables(self, tables: BlockTables) -> BlockTables:
        return tables or [[] for _ in self.groups]

    def blocks_needed(self, tables: BlockTables, num_tokens: int) -> int:
        """Blocks (and state pages) to allocate so that every group's table covers
        ``num_tokens`` positions (a state group's snapshots on the way not counted)."""
        n = -(-num_tokens // self.block_size)
        if len(tables) == 1:  # one group: every decode step asks, keep it cheap
            return max(0, n - len(tables[0]))
        return sum(
            self._needed(g, tables[g] if tables else None, n) for g in range(len(self.groups))
        )

    def allocate(self, tables: BlockTables, num_tokens: int, reserve: int = 0) -> BlockTables:
        """``tables`` extended with fresh blocks to cover ``num_tokens`` positions (in place
        where given; check :meth:`fits` first). A state group takes a page for its last block,
        and snapshot pages for the blocks before it, the latest first, only while ``reserve``
        state pages stay free (the pages the running sequences may need next); the others
        stay NULL."""
        tables = self._tables(tables)
        n = -(-num_tokens // self.block_size)
        for g, (t, p) in enumerate(zip(tables, self.pools, strict=True)):
            if n <= len(t):
                continue
            if g not in self.state_groups:
                t += p.allocate(n - len(t))
                continue
            gap = n - 1 - len(t)  # blocks filled on the way: the latest get snapshots if room
            spare = max(0, min(gap, p.num_free - 1 - reserve))
            last = p.allocate(1)
            t += [NULL_BLOCK] * (gap - spare) + p.allocate(spare) + last
        return tables

    def free(self, tables: BlockTables) -> None:
        """Give back every block of ``tables`` (a finished or preempted sequence)."""
        for t, p in zip(tables, self.pools, strict=False):  # no tables yet: nothing
            p.release([b for b in t if b != NULL_BLOCK])

    def drop_out_of_window(self, tables: BlockTables, next_pos: int, since: int = 0) -> None:
        """Release each windowed group's blocks no query at ``>= next_pos`` sees (their table
        entries become ``NULL_BLOCK``; the pool keeps their hashes for later prefix hits), and
        each state group's pages before the one holding position ``next_pos - 1``. ``since``:
        the first position of the step that just ran (a state group's entries before its page
        then are NULL already; its snapshots on the way may be NULL too)."""
        bs = self.block_size
        for g in self.windowed:
            t = tables[g]
            first = min(self.groups[g].first_live_block(next_pos, bs), len(t))
            dropped: list[int] = []
            state = g in self.state_groups
            lo = max(0, since - 1) // bs if state else 0
            for b in range(first - 1, lo - 1, -1):  # released entries: a prefix of the table
                if t[b] == NULL_BLOCK:
                    if state:  # a snapshot not taken
                        continue
                    break
                dropped.append(t[b])
                t[b] = NULL_BLOCK
            if dropped:
                self.pools[g].release(dropped)

    def lookup(self, chains: Sequence[Sequence[bytes]]) -> tuple[int, BlockTables]:
        """``(k, tables)``: the longest prefix of ``k`` blocks every group can serve, and the
        cached blocks each group takes (empty tables when nothing hits).

        ``chains[g]``: the chained hashes group ``g`` is keyed by (one list for all groups but
        those keyed as base blocks), over the prefix's full blocks that may hit. A full group
        takes its whole cached run from the start (possibly past ``k``: positions the sequence
        recomputes for the other groups, whose blocks it then shares); a windowed group takes
        the blocks a query at position ``k * block_size`` sees (vLLM's sliding-window manager:
        the rest of its first ``k`` entries are NULL) and its cached run on from ``k``.
        """
        pool, bs = self.pool, self.block_size
        if len(self.groups) == 1 and not self.windowed:
            hits = pool.lookup(chains[0])
            return len(hits), ([hits] if hits else [])
        if not pool.enable_prefix_caching:
            return 0, []
        k = len(chains[0])
        cached: dict[int, list[int | None]] = {}
        pools = self.pools
        for g in self.full:  # the longest run from the start every full group holds
            ids = pool.lookup([group_block_key(h, g) for h in chains[g]])
            cached[g], k = list(ids), min(k, len(ids))
        runs: dict[int, list[int]] = {}
        for g in self.windowed:  # run[b]: cached blocks ending at b, b included
            ids_w = [pools[g].cached.get(group_block_key(h, g)) for h in chains[g]]
            run, r = [], 0
            for b in ids_w:
                r = r + 1 if b is not None else 0
                run.append(r)
            cached[g], runs[g] = ids_w, run
        while k > 0 and not all(
            runs[g][k - 1] >= k - self.groups[g].first_live_block(k * bs, bs) for g in self.windowed
        ):
            k -= 1
        tables: BlockTables = []
        for g, grp in enumerate(self.groups):
            ids = cached[g]
            first = grp.first_live_block(k * bs, bs)
            end = k
            while not grp.state and end < len(ids) and ids[end] is not None:  # shared run
                end += 1
            tables.append([NULL_BLOCK] * first + [b for b in ids[first:end] if b is not None])
        return (k, tables) if any(tables) else (0, [])

    @staticmethod
    def live(tables: BlockTables) -> list[int]:
        """The blocks ``tables`` hold (not NULL)."""
        return [b for t in tables for b in t if b != NULL_BLOCK]

    def register(self, tables: BlockTables, block: int, chains: Sequence[Sequence[bytes]]) -> None:
        """Record that entry ``block`` of every group's table holds the KV of the prefix whose
        chained hash is ``chains[g][block]`` (under group ``g``'s key)."""
        for g, t in enumerate(tables):
            if t[block] != NULL_BLOCK:
                self.pools[g].register(t[block], group_block_key(chains[g][block], g))
