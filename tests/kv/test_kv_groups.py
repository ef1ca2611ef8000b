"""KV-cache groups: how layers are grouped, per-group prefix-cache keys, windowed lookups
that need only what the window sees, and released blocks that stay hittable."""

from __future__ import annotations

import pytest

from loraplex.kv.block_pool import BlockPool, hash_prefix_blocks
from loraplex.kv.groups import (
    NULL_BLOCK,
    Chunked,
    KVCacheGroup,
    blocks_per_sequence,
    group_block_key,
    kv_cache_groups,
    layer_places,
    layers_per_group,
    max_tokens,
)
from loraplex.kv.manager import KVCacheManager
from loraplex.types import BASE_NAMESPACE

BS = 4


def test_one_kind_is_one_group_of_every_layer() -> None:
    assert kv_cache_groups([None] * 5) == [KVCacheGroup((0, 1, 2, 3, 4), None)]
    assert kv_cache_groups([8] * 3) == [KVCacheGroup((0, 1, 2), 8)]


def test_kinds_cut_into_groups_of_the_smallest_kind() -> None:
    """Gemma 3 1B's pattern (every 6th layer global, 26 layers): 4 full, 22 sliding -> groups
    of 4, the last sliding group padded; full groups first."""
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = kv_cache_groups(windows)
    assert groups[0] == KVCacheGroup((5, 11, 17, 23), None)
    assert [len(g.layers) for g in groups] == [4, 4, 4, 4, 4, 4, 2]
    assert all(g.window == 512 for g in groups[1:])
    assert layers_per_group(groups) == 4
    places = layer_places(groups)
    assert places[5] == (0, 0) and places[0] == (1, 0) and places[25] == (6, 1)
    assert sorted(layer for g in groups for layer in g.layers) == list(range(26))


def test_kinds_within_a_quarter_are_not_cut() -> None:
    """5 and 6 layers (within 25%): one group each, the smaller padded (vLLM's rule)."""
    groups = kv_cache_groups([None, 4] * 5 + [4])
    assert [(len(g.layers), g.window) for g in groups] == [(5, None), (6, 4)]


def test_live_blocks_and_capacity() -> None:
    full, win = KVCacheGroup((0,), None), KVCacheGroup((1,), 8)
    assert full.live_blocks(100, BS) == 25
    assert win.live_blocks(100, BS) == -(-7 // BS) + 1  # decode: a query sees 8 keys
    assert win.live_blocks(100, BS, chunk=6) == -(-13 // BS) + 1
    assert win.live_blocks(5, BS) == 2  # never more than the sequence has
    assert blocks_per_sequence([full, win], 100, BS) == 25 + 3
    # one group: num_blocks * block_size tokens, as a flat cache
    assert max_tokens([full], 10, BS, 6, limit=1000) == 40
    assert max_tokens([full, win], 10, BS, 6, limit=1000) == (10 - 5) * BS
    assert max_tokens([win], 5, BS, 6, limit=1000) == 1000  # windowed only: any length
    assert max_tokens([win], 4, BS, 6, limit=1000) < 1000


def test_group_keys_differ_by_group_and_group_0_is_the_chain() -> None:
    h = hash_prefix_blocks(BASE_NAMESPACE, list(range(8)), BS)[1]
    assert group_block_key(h, 0) == h
    keys = {group_block_key(h, g) for g in range(4)}
    assert len(keys) == 4


def _manager(num_blocks: int = 32) -> tuple[KVCacheManager, BlockPool]:
    pool = BlockPool(num_blocks, BS)
    return KVCacheManager(pool, [KVCacheGroup((0,), None), KVCacheGroup((1,), 8)]), pool


def _publish(kv: KVCacheManager, tables: list[list[int]], hashes: list[bytes]) -> None:
    for b in range(len(hashes)):
        kv.register(tables, b, [hashes] * len(tables))


def test_windowed_blocks_drop_out_of_the_window_and_stay_hittable() -> None:
    """A 24-token sequence with a window of 8: after computing it, the windowed group keeps
    only the blocks a query at position 24 sees (keys 17..23: blocks 4, 5); the dropped ones
    go back to the pool with their hashes, and a later lookup of the same prefix hits all of
    it with only the window's blocks in the windowed table."""
    kv, pool = _manager()
    tokens = list(range(100, 125))
    hashes = hash_prefix_blocks(BASE_NAMESPACE, tokens, BS)  # 6 full blocks
    tables = kv.allocate([], 24)
    assert [len(t) for t in tables] == [6, 6] and pool.num_free == 32 - 12
    _publish(kv, tables, hashes)
    kv.drop_out_of_window(tables, 24)
    assert tables[1][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in tables[1][4:]
    assert pool.num_free == 32 - 8
    kv.drop_out_of_window(tables, 24)  # idempotent
    assert pool.num_free == 32 - 8
    assert kv.blocks_needed(tables, 25) == 2  # one more block per group
    kv.free(tables)
    assert pool.num_free == 32
    k, hit = kv.lookup([hashes, hashes])
    assert k == len(hit[0]) == len(hit[1]) == 6
    assert hit[0] == tables[0] and hit[1][:4] == [NULL_BLOCK] * 4
    assert hit[1][4:] == tables[1][4:]


def test_a_hit_is_as_long_as_every_group_can_serve() -> None:
    """The windowed group lost block 5 (evicted): no hit of 6 blocks; the longest prefix
    whose window the windowed group still holds (blocks 3, 4 for 5 blocks: keys 13..19)
    is served."""
    kv, pool = _manager()
    hashes = hash_prefix_blocks(BASE_NAMESPACE, list(range(24)), BS)
    tables = kv.allocate([], 24)
    _publish(kv, tables, hashes)
    kv.free(tables)
    evicted = tables[1][5]
    del pool.cached[group_block_key(hashes[5], 1)]
    pool.block_hash[evicted] = None
    k, hit = kv.lookup([hashes, hashes])
    assert k == 5 and hit[0] == tables[0]  # the full group still takes all 6 of its blocks
    first = KVCacheGroup((1,), 8).first_live_block(5 * BS, BS)
    assert first == 3 and hit[1] == [NULL_BLOCK] * 3 + tables[1][3:5]
    # the windowed group also lost block 3: 5 blocks fail, 4 need blocks 3 -> none served
    del pool.cached[group_block_key(hashes[3], 1)]
    assert kv.lookup([hashes, hashes])[0] == 3  # 3 blocks: keys 5..11 in blocks 1, 2
    # full group without block 0: no hit; the windowed group still shares its run from 0
    del pool.cached[hashes[0]]
    assert kv.lookup([hashes, hashes]) == (0, [[], tables[1][:3]])
    del pool.cached[group_block_key(hashes[0], 1)]
    assert kv.lookup([hashes, hashes]) == (0, [])


@pytest.mark.parametrize("enabled", [True, False])
def test_one_group_is_the_pool_alone(enabled: bool) -> None:
    pool = BlockPool(16, BS, enable_prefix_caching=enabled)
    kv = KVCacheManager(pool)
    hashes = hash_prefix_blocks(BASE_NAMESPACE, list(range(12)), BS)
    tables = kv.allocate([], 12)
    _publish(kv, tables, hashes)
    assert kv.lookup([hashes]) == ((3, [tables[0]]) if enabled else (0, []))
    assert kv.lookup([hashes])[1] == ([pool.lookup(hashes)] if enabled else [])


def test_chunked_groups_keep_only_the_current_chunk() -> None:
    """Chunked attention (Llama 4, chunks of 8): a query at ``p`` sees keys from ``p // 8 * 8``
    on, so the group holds the blocks of the current chunk (what a chunk of tokens still being
    computed reads: at most the window-of-8 bound), and it sorts after full and windowed kinds."""
    ch = KVCacheGroup((1,), Chunked(8))
    assert [ch.first_live_block(p, BS) for p in (0, 7, 8, 15, 16, 23, 24)] == [0, 0, 2, 2, 4, 4, 6]
    assert ch.live_blocks(100, BS) == KVCacheGroup((1,), 8).live_blocks(100, BS)
    assert ch.live_blocks(100, BS, chunk=6) == -(-13 // BS) + 1
    groups = kv_cache_groups([Chunked(8), None, 4, Chunked(8), None, 4])
    assert [(g.window, g.layers) for g in groups] == [
        (None, (1, 4)),
        (4, (2, 5)),
        (Chunked(8), (0, 3)),
    ]
    pool = BlockPool(32, BS)
    kv = KVCacheManager(pool, [KVCacheGroup((0,), None), ch])
    tables = kv.allocate([], 22)  # 6 blocks each
    kv.drop_out_of_window(tables, 22)  # position 22 is in chunk 16..23: blocks 4, 5
    assert tables[1] == [NULL_BLOCK] * 4 + tables[1][4:] and NULL_BLOCK not in tables[0]
    assert pool.num_free == 32 - 8
