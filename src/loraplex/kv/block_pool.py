"""KV block pool with chained-hash prefix caching.

A block's hash chains its parent's hash, the adapter namespace (the adapter's sha256, or the
base namespace) and its tokens, so the same prompt under two adapters — or two revisions of one
adapter name — never shares KV, while repeats under the same adapter do.

A request with a cache salt (vLLM's ``cache_salt``; the server salts every tenant's traffic
with its tenant) hashes under :func:`salted_namespace` of its adapter namespace: it shares KV
only with requests of the same salt, so a prefix-cache hit (``cached_tokens``) tells nobody
about another salt's prompts. Unsalted requests share among themselves, as before.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from loraplex.types import BASE_NAMESPACE


def salted_namespace(namespace: bytes, salt: str | None) -> bytes:
    """The prefix-cache namespace of a request under ``namespace`` (adapter digest or base)
    with cache salt ``salt``: ``namespace`` itself without one, else
    ``blake2b("loraplex-salt" || len(namespace) || namespace || salt)`` (never equal to an
    unsalted namespace: those are 32-byte digests or ``BASE_NAMESPACE``)."""
    if salt is None:
        return namespace
    h = hashlib.blake2b(digest_size=32, person=b"loraplex-salt")
    h.update(struct.pack("<I", len(namespace)))
    h.update(namespace)
    h.update(salt.encode("utf-8", "surrogatepass"))
    return b"salt:" + h.digest()


def composition_namespace(components: Iterable[tuple[str, float]]) -> bytes:
    """The prefix-cache namespace of a request composing adapters ``(sha256 hex, scale)``: the
    same set in any order gives the same key, a zero-scale component is left out, and what is
    left decides::

        nothing left                      -> BASE_NAMESPACE
        one adapter at scale 1.0          -> that adapter's own namespace (its digest)
        else  blake2b("loraplex-compose" || for (digest, scale) sorted: digest || float64 scale)

    (``-0.0`` and ``0.0`` alike are dropped; a scale is keyed by its exact float64 bits.)"""
    kept = sorted((d, float(s)) for d, s in components if float(s) != 0.0)
    if not kept:
        return BASE_NAMESPACE
    if len(kept) == 1 and kept[0][1] == 1.0:
        return bytes.fromhex(kept[0][0])
    h = hashlib.blake2b(digest_size=32, person=b"loraplex-compose")
    for digest, scale in kept:
        h.update(bytes.fromhex(digest))
        h.update(struct.pack("<d", scale))
    return b"compose:" + h.digest()


def alora_namespace(namespace: bytes, start: int) -> bytes:
    """The namespace of the blocks an activated LoRA shapes when it starts at prompt position
    ``start``: ``blake2b("loraplex-alora" || namespace || start)``. The KV of the block holding
    the activation point depends on where in it the adapter starts, which the block's tokens
    alone do not say (the last invocation may end in a later block)."""
    h = hashlib.blake2b(digest_size=32, person=b"loraplex-alora")
    h.update(namespace)
    h.update(struct.pack("<q", start))
    return b"alora:" + h.digest()


def hash_block(parent: bytes | None, namespace: bytes, tokens: Sequence[int]) -> bytes:
    """h = blake2b(parent || namespace || tokens) — chained so a hit implies the whole prefix."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(namespace or BASE_NAMESPACE)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def hash_prefix_blocks(
    namespace: bytes | Callable[[int], bytes],
    tokens: Sequence[int],
    block_size: int,
    known: Sequence[bytes] = (),
) -> list[bytes]:
    """Hashes of every *full* block of ``tokens``; ``namespace`` is one for all blocks or
    ``namespace(b)`` per block index ``b``. ``known``: the hashes of the first blocks, already
    computed (extended, not recomputed)."""
    out = list(known)
    parent = out[-1] if out else None
    for b in range(len(out), len(tokens) // block_size):
        ns = namespace if isinstance(namespace, bytes) else namespace(b)
        parent = hash_block(parent, ns, tokens[b * block_size : (b + 1) * block_size])
        out.append(parent)
    return out


class BlockPool:
    """Reference-counted KV blocks; free blocks keep their hash until reused (LRU order)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Longest run of cached blocks matching ``hashes`` from the start."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def num_free_after_touch(self, blocks: Sequence[int]) -> int:
        """Free blocks left once ``blocks`` (cache hits) are taken by a sequence."""
        return len(self.free) - sum(1 for b in blocks if self.ref_counts[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` fresh blocks, evicting the least recently freed cached blocks."""
        if n > len(self.free):
            raise RuntimeError(f"BlockPool: asked for {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; tail blocks first so they are evicted first."""
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] < 0:
                raise RuntimeError(f"BlockPool: block {b} released more often than taken")
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is None:
                    self.free[b] = None
                    self.free.move_to_end(b, last=False)  # unhashed: reuse first
                else:
                    self.free[b] = None

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that ``block`` holds the full KV of ``block_hash`` (first writer wins)."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens
