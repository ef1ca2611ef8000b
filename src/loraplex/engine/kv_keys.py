"""Which chained hashes key each KV-cache group's blocks of a sequence.

Every group is keyed by the sequence's own chain (``Sequence.block_hashes``: its adapter's
namespace, salted by its tenant) except the groups whose layers all lie below the adapter's
first KV layer (``loraplex.lora.kv_reach.first_kv_layer``, with ``--kv-cache-layer-groups``
cutting groups at layer boundaries): their KV is the base model's, so they are keyed by the
chain under the base namespace with the same salt (``Sequence.base_block_hashes``), and share
blocks with the base model's requests of that tenant and with every adapter that leaves those
layers alone.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from loraplex.engine.sequence import Sequence
from loraplex.kv.block_pool import hash_prefix_blocks, salted_namespace
from loraplex.kv.groups import KVCacheGroup, base_groups
from loraplex.lora.kv_reach import first_kv_layer
from loraplex.types import BASE_NAMESPACE


class GroupKeys:
    """Per sequence, the chain each of ``groups`` is keyed by."""

    def __init__(self, groups: Seq[KVCacheGroup]) -> None:
        self.groups = list(groups)
        self.num_layers = sum(len(g.layers) for g in self.groups)
        self._base: dict[str, frozenset[int]] = {}  # adapter digest -> its base-keyed groups

    def base_groups(self, seq: Sequence) -> frozenset[int]:
        """The groups of ``seq`` keyed as base blocks (none for a base request, or with one
        group: its chain is the base's or the adapter's throughout)."""
        if seq.adapter is None or len(self.groups) == 1:
            return frozenset()
        d = seq.adapter_key  # a composition: its first KV layer is its adapters' first
        assert d is not None
        if d not in self._base:
            first = min(first_kv_layer(a.weights, self.num_layers) for a in seq.adapters)
            if len(self._base) >= 4096:  # compositions are many: keep the memo bounded
                self._base.clear()
            self._base[d] = base_groups(self.groups, first)
        return self._base[d]

    def extend_base(self, seq: Sequence, full: int, block_size: int) -> None:
        """Extend ``seq.base_block_hashes`` to its first ``full`` blocks when some group of
        ``seq`` is keyed as base blocks (else leave it empty)."""
        chain = seq.base_block_hashes
        if len(chain) >= full or not self.base_groups(seq):
            return
        ns = salted_namespace(BASE_NAMESPACE, seq.cache_salt)
        tokens = seq.all_token_ids[: full * block_size]
        seq.base_block_hashes = hash_prefix_blocks(ns, tokens, block_size, chain)

    def chains(self, seq: Sequence) -> list[list[bytes]]:
        """Per group, the chained hashes its blocks are keyed by."""
        own = seq.block_hashes
        if not seq.base_block_hashes:
            return [own] * len(self.groups)
        base = self.base_groups(seq)
        return [seq.base_block_hashes if g in base else own for g in range(len(self.groups))]
