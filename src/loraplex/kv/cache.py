"""The paged KV cache as a module-like object: one flat slot space per layer."""

from __future__ import annotations

import torch


class PagedKVCache:
    """K and V storage for every layer, addressed by *slot* = block_id * block_size + offset.

    Layout: ``k[layer]``/``v[layer]`` are ``[num_blocks * block_size, num_kv_heads, head_dim]`` so
    writing a step's new tokens is one ``index_copy_`` and reading a sequence's context is one
    gather with precomputed slot indices.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """cache[layer][slots[t]] = k[t], v[t]  (k, v: [T, kv_heads, head_dim]; slots: [T])."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def gather_blocks(
        self, layer: int, block_table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of whole blocks: block_table [B, nblk] -> [B, nblk * block_size, kv_heads,
        head_dim] each; one contiguous row copy per block (cheaper than per-slot gathers)."""
        b, nblk = block_table.shape
        idx = block_table.reshape(-1)
        k, v = self.k[layer], self.v[layer]  # [slots, KVH, hd]
        shape = (b, nblk * self.block_size, *k.shape[1:])
        kb = k.view(self.num_blocks, -1).index_select(0, idx).view(shape)
        vb = v.view(self.num_blocks, -1).index_select(0, idx).view(shape)
        return kb, vb

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) at ``slots`` (any shape S) -> [*S, kv_heads, head_dim] each."""
        return self.k[layer][slots], self.v[layer][slots]
