from loraplex.kv.block_pool import BlockPool, hash_block, hash_prefix_blocks
from loraplex.types import BASE_NAMESPACE

NS_A = bytes.fromhex("aa" * 32)
NS_B = bytes.fromhex("bb" * 32)


def test_hash_depends_on_namespace_parent_and_tokens() -> None:
    toks = list(range(16))
    assert hash_block(None, NS_A, toks) != hash_block(None, NS_B, toks)
    assert hash_block(None, NS_A, toks) != hash_block(None, BASE_NAMESPACE, toks)
    assert hash_block(None, NS_A, toks) != hash_block(b"x" * 16, NS_A, toks)
    assert hash_block(None, NS_A, toks) != hash_block(None, NS_A, toks[::-1])
    assert hash_block(None, NS_A, toks) == hash_block(None, NS_A, list(toks))


def test_prefix_hashes_only_full_blocks_and_chain() -> None:
    hs = hash_prefix_blocks(NS_A, list(range(40)), 16)
    assert len(hs) == 2
    assert hs[1] == hash_block(hs[0], NS_A, list(range(16, 32)))


def test_allocate_release_and_cached_reuse() -> None:
    pool = BlockPool(4, 16)
    blocks = pool.allocate(2)
    assert pool.num_free == 2
    hs = hash_prefix_blocks(NS_A, list(range(32)), 16)
    for b, h in zip(blocks, hs, strict=True):
        pool.register(b, h)
    pool.release(blocks)
    assert pool.num_free == 4
    assert pool.lookup(hs) == blocks  # still cached while free
    assert pool.num_free_after_touch(blocks) == 2
    pool.touch(blocks)
    assert pool.num_free == 2 and all(pool.ref_counts[b] == 1 for b in blocks)
    pool.release(blocks)
    fresh = pool.allocate(4)  # evicts the cached blocks, dropping their hashes
    assert sorted(fresh) == [0, 1, 2, 3]
    assert pool.lookup(hs) == []


def test_lookup_stops_at_first_miss_and_namespaces_isolated() -> None:
    pool = BlockPool(8, 4)
    toks = list(range(12))
    hs = hash_prefix_blocks(NS_A, toks, 4)
    b = pool.allocate(3)
    pool.register(b[0], hs[0])
    pool.register(b[2], hs[2])
    assert pool.lookup(hs) == [b[0]]
    assert pool.lookup(hash_prefix_blocks(NS_B, toks, 4)) == []


def test_disabled_prefix_caching_never_hits() -> None:
    pool = BlockPool(4, 4, enable_prefix_caching=False)
    hs = hash_prefix_blocks(NS_A, list(range(8)), 4)
    b = pool.allocate(2)
    pool.register(b[0], hs[0])
    assert pool.lookup(hs) == []


def test_double_release_is_an_error() -> None:
    pool = BlockPool(2, 4)
    b = pool.allocate(1)
    pool.release(b)
    try:
        pool.release(b)
    except RuntimeError as e:
        assert "released more often" in str(e)
    else:
        raise AssertionError("expected RuntimeError")


def test_block_gather_equals_slot_gather() -> None:
    """Gathering whole blocks gives each sequence's context in position order, as the
    per-slot gather does (padded past the context with whatever block 0 holds)."""
    import torch

    from loraplex.kv.cache import PagedKVCache

    cache = PagedKVCache(2, 6, 4, 3, 5, torch.float32, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    table = torch.tensor([[3, 1, 5], [2, 0, 0]])  # [B, nblk]
    pos = torch.arange(12)
    slots = table[:, pos // 4] * 4 + pos % 4  # [B, L]
    for layer in range(2):
        kb, vb = cache.gather_blocks(layer, table)
        ks, vs = cache.gather(layer, slots)
        assert kb.shape == (2, 12, 3, 5)
        assert torch.equal(kb, ks) and torch.equal(vb, vs)
