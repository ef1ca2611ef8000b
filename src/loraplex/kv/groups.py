"""KV-cache groups: layers that share one block table (vLLM's hybrid KV-cache manager).

Layers with the same sliding window or attention chunk (:class:`Chunked`; None: full
attention) form a *kind*; each kind is cut into
groups of one common number of layers, so that every group's page (one block id) holds the
same bytes and all groups share one :class:`~loraplex.kv.block_pool.BlockPool`. A sequence
holds one block table per group. A windowed group needs only the blocks that hold a key some
future query still sees (HF: key ``k`` is seen by query ``q`` iff ``k <= q and q - k <
window``; a chunked group, Llama 4's: ``k <= q and k // size == q // size``, only the blocks of
the current chunk); the scheduler releases the others as the sequence advances, and their
entries in the table become :data:`NULL_BLOCK` (masked: no query reads them).

A model without windows has exactly one group of every layer: one table per sequence, one
page per block, the same bytes per block as a flat per-layer cache.

A *state group* (``state=True``) holds layers that keep a fixed-size recurrent state per
sequence instead of KV (Gated DeltaNet's convolution and recurrent state). Its pages come from a
pool of their own (a state page is not a KV page's size) and entry ``b`` of its table holds the
state after the last computed position of block ``b``: the running state while the block fills,
a snapshot at the block's end once it is full. Full blocks' snapshots are registered under the
block's key like KV blocks, so a prefix hit resumes the recurrence from the snapshot at the hit's
end; the table keeps live only the entry of the block holding the last computed token (the one
the next step reads), as a window would. A chunk that fills several blocks snapshots the ones
before its last only while the state pool has pages to spare (their entries are otherwise
NULL): snapshots serve later prefix hits, never correctness.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

NULL_BLOCK = -1
"""A block-table entry whose block was released (out of every future query's window)."""

_PAD_TOLERANCE = 1.25  # vLLM: pad every kind up to the largest one when it is this close


@dataclass(frozen=True)
class Chunked:
    """Chunked attention (Llama 4's local layers): the query at position ``q`` sees key ``k``
    iff ``k <= q and k // size == q // size`` (HF's ``chunked_overlay``). A layer's window is
    an ``int`` (sliding), a ``Chunked`` or None (full attention)."""

    size: int


Window = int | Chunked | None
"""A layer's local attention: a sliding window, an attention chunk, or None (full)."""


def window_span(window: int | Chunked) -> int:
    """The most keys one query sees (itself included): the window, or the chunk size."""
    return window.size if isinstance(window, Chunked) else window


def first_visible(pos: int, window: Window) -> int:
    """The first key position the query at ``pos`` sees under ``window``."""
    if window is None:
        return 0
    if isinstance(window, Chunked):
        return pos // window.size * window.size
    return max(0, pos - window + 1)


def kind_order(w: Window) -> tuple[int, int]:
    """Full attention first, then sliding windows ascending, then chunks ascending."""
    if w is None:
        return (0, 0)
    return (2, w.size) if isinstance(w, Chunked) else (1, w)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table, and their sliding window or attention chunk (None: full
    attention)."""

    layers: tuple[int, ...]
    window: Window = None
    state: bool = False
    """A state group: its layers keep a recurrent state (pages from the state pool), no KV."""

    def first_live_block(self, next_pos: int, block_size: int) -> int:
        """The first block a query at position ``>= next_pos`` may read: blocks before it hold
        only keys ``k < first_visible(next_pos)`` (0 for full attention). A state group's: the
        block holding position ``next_pos - 1``, whose page holds the state the next step reads."""
        if self.state:
            return max(0, next_pos - 1) // block_size
        return first_visible(next_pos, self.window) // block_size

    def live_blocks(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Blocks this group holds for a sequence of ``num_tokens`` tokens while it computes a
        chunk of ``chunk`` tokens (a decode: 1): every block of a full group; for a windowed
        (or chunked) group at most ``ceil((span - 1 + chunk) / block_size) + 1``; a state
        group two: the page it reads and the page of its last block (the snapshots of the
        blocks a chunk fills on the way are taken only where the state pool has room: see the
        manager)."""
        total = -(-num_tokens // block_size)
        if self.state:
            return min(total, 2)
        if self.window is None:
            return total
        return min(total, -(-(window_span(self.window) - 1 + chunk) // block_size) + 1)


def kv_cache_groups(
    windows: Sequence[Window], layer_groups: int = 1, state_layers: Sequence[int] = ()
) -> list[KVCacheGroup]:
    """Groups of the layers whose windows are ``windows`` (one per layer; None: full), the
    ``state_layers`` (recurrent: their windows are ignored) in state groups after them.

    One kind (every layer alike): one group of all layers. Else each kind is cut into groups of
    ``size`` layers, ``size`` the smallest kind's layer count (the largest kind's where that is
    within 25%, as vLLM does, so nothing is cut), the last group of a kind padded (its page
    slots for missing layers stay unused). Full-attention groups first, then windows ascending.
    ``layer_groups`` > 1 also caps ``size`` at ``ceil(layers / layer_groups)``: groups cut at
    layer boundaries, so an adapter that leaves the first layers alone shares their blocks
    with the base model (``loraplex.lora.kv_reach``). Chunked kinds come after the windows;
    the state layers are cut into ``layer_groups`` state groups alike.
    """
    stateful = set(state_layers)
    kinds: dict[Window, list[int]] = {}
    for layer, w in enumerate(windows):
        if layer not in stateful:
            kinds.setdefault(w, []).append(layer)
    order = sorted(kinds, key=kind_order)
    counts = [len(v) for v in kinds.values()]
    size = min(counts)
    if max(counts) < _PAD_TOLERANCE * size:
        size = max(counts)
    size = min(size, -(-len(windows) // max(1, layer_groups)))
    out = [
        KVCacheGroup(tuple(kinds[w][i : i + size]), w)
        for w in order
        for i in range(0, len(kinds[w]), size)
    ]
    states = sorted(stateful)
    step = -(-len(states) // max(1, layer_groups)) if states else 1
    out += [
        KVCacheGroup(tuple(states[i : i + step]), state=True) for i in range(0, len(states), step)
    ]
    return out


def layers_per_group(groups: Sequence[KVCacheGroup]) -> int:
    """The layers one KV page (block) holds: the largest attention group's."""
    return max((len(g.layers) for g in groups if not g.state), default=0)


def layers_per_state_group(groups: Sequence[KVCacheGroup]) -> int:
    """The layers one state page holds: the largest state group's (0: no state groups)."""
    return max((len(g.layers) for g in groups if g.state), default=0)


def layer_places(groups: Sequence[KVCacheGroup]) -> list[tuple[int, int]]:
    """Per layer: (its group, its index in the group's page)."""
    places = {layer: (g, i) for g, grp in enumerate(groups) for i, layer in enumerate(grp.layers)}
    return [places[layer] for layer in range(len(places))]


def base_groups(groups: Sequence[KVCacheGroup], first_kv_layer: int) -> frozenset[int]:
    """The groups whose layers all lie below ``first_kv_layer`` (an adapter's, see
    ``loraplex.lora.kv_reach``): their KV is the base model's, keyed as base blocks."""
    return frozenset(g for g, grp in enumerate(groups) if max(grp.layers) < first_kv_layer)


def group_block_key(chain_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of group ``group``'s block whose chained hash is ``chain_hash``:
    the chain hash itself for group 0 (one group: keys as before groups), else
    ``blake2b(chain_hash || group)`` (distinct per group)."""
    if group == 0:
        return chain_hash
    h = hashlib.blake2b(digest_size=16, person=b"loraplex-kvgrp")
    h.update(chain_hash)
    h.update(struct.pack("<I", group))
    return h.digest()


def blocks_per_sequence(
    groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int, chunk: int = 1
) -> int:
    """KV blocks one sequence of ``num_tokens`` tokens holds over all attention groups while
    it computes a chunk of ``chunk`` tokens (see :meth:`KVCacheGroup.live_blocks`; state
    pages come from their own pool: :func:`state_pages_per_sequence`)."""
    return sum(g.live_blocks(num_tokens, block_size, chunk) for g in groups if not g.state)


def state_pages_per_sequence(
    groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int, chunk: int = 1
) -> int:
    """State pages one sequence needs over all state groups (a fixed number, whatever its
    length: two per group)."""
    return sum(g.live_blocks(num_tokens, block_size, chunk) for g in groups if g.state)


def max_tokens(
    groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int, chunk: int, limit: int
) -> int:
    """The longest sequence (at most ``limit`` tokens) that fits in ``num_blocks`` blocks alone,
    computing chunks of up to ``chunk`` tokens."""
    lo, hi = 0, limit
    while lo < hi:  # the largest n with blocks_per_sequence(n) <= num_blocks (monotone in n)
        mid = (lo + hi + 1) // 2
        if blocks_per_sequence(groups, mid, block_size, min(chunk, mid)) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
