"""The paged KV cache as a module-like object: one flat slot space per layer of a page."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.kv.groups import KVCacheGroup, layer_places, layers_per_group, layers_per_state_group


@dataclass(frozen=True)
class StateShape:
    """One recurrent layer's state per sequence (Gated DeltaNet's): the last inputs of its
    causal convolution ``conv`` (model dtype) and its recurrent matrix ``recurrent`` (float32,
    as the recurrence accumulates)."""

    conv: tuple[int, ...]  # [channels, kernel - 1]
    recurrent: tuple[int, ...]  # [value heads, key dim, value dim]

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one layer's state with the convolution window in ``dtype``."""
        conv = torch.Size(self.conv).numel() * torch.empty((), dtype=dtype).element_size()
        return conv + torch.Size(self.recurrent).numel() * 4


class PagedKVCache:
    """K and V storage for every layer, addressed by *slot* = block_id * block_size + offset.

    Layout: ``k[i]``/``v[i]`` are ``[num_blocks * block_size, num_kv_heads, head_dim]``, ``i``
    a layer's index in its KV-cache group (``groups``; default one group of every layer, so
    ``i`` is the layer). One block id is one page: the KV of one group's layers for
    ``block_size`` positions, so a layer reads and writes slots of its group's block table.
    Writing a step's new tokens is one ``index_copy_`` and reading a sequence's context is one
    gather with precomputed slot indices.

    ``layer_shapes`` (one ``(kv_heads, head_dim)`` per layer; Gemma 4's full-attention layers
    have wider heads than its sliding ones): every slot is then as wide as the widest layer's
    K (or V) row, and a narrower layer uses the first ``kv_heads * head_dim`` values of each of
    its slots (a strided view: its blocks are read with one copy each all the same, and the C
    decode attention, which reads contiguous slots only, leaves such a layer to torch).

    With several groups the cache holds one more page than the pool's ``num_blocks``: block
    ``trash_block``, where a sequence writes the positions whose blocks it took from the prefix
    cache in some groups but recomputes for the others (never read).
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
        groups: Sequence[KVCacheGroup] | None = None,
        layer_shapes: Sequence[tuple[int, int]] | None = None,
        state: StateShape | None = None,
        num_state_pages: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.groups = list(groups or [KVCacheGroup(tuple(range(num_layers)))])
        self.trash_block = num_blocks if len(self.groups) > 1 else None
        self.num_pages = num_blocks + (self.trash_block is not None)
        places = layer_places(self.groups)
        assert len(places) == num_layers, "groups: every layer in exactly one group"
        self.group_of = [g for g, _ in places]  # layer -> its group
        self.index_of = [i for _, i in places]  # layer -> its index in the group's page
        self.layer_shapes = list(layer_shapes or [(num_kv_heads, head_dim)] * num_layers)
        self.width = max(kvh * hd for kvh, hd in self.layer_shapes)
        """Values of one slot's K (or V) row: the widest layer's ``kv_heads * head_dim``."""
        slots = self.num_pages * block_size
        alike = len(set(self.layer_shapes)) == 1  # [page layers, slots, kv_heads, head_dim]
        shape = (
            layers_per_group(self.groups),
            slots,
            *(self.layer_shapes[0] if alike else (self.width,)),
        )
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        stateful = {layer for g in self.groups if g.state for layer in g.layers}
        self._views = [  # per layer: (k, v) [slots, kv_heads, head_dim], views of its rows
            None
            if layer in stateful  # a recurrent layer keeps no KV
            else tuple(
                t[i] if alike else t[i, :, : kvh * hd].view(slots, kvh, hd)
                for t in (self.k, self.v)
            )
            for layer, (i, (kvh, hd)) in enumerate(
                zip(self.index_of, self.layer_shapes, strict=True)
            )
        ]
        self.num_state_pages = num_state_pages
        n = layers_per_state_group(self.groups)
        if n and state is None:
            raise ValueError("a KV cache with state groups needs the layers' StateShape")
        self.state_shape = state
        conv, rec = (state.conv, state.recurrent) if n and state else ((0,), (0,))
        self.conv = torch.zeros((n, num_state_pages, *conv), dtype=dtype, device=device)
        self.recurrent = torch.zeros((n, num_state_pages, *rec), dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of one page holding ``num_layers`` layers (a group's: ``layers_per_group``)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.conv.nbytes + self.recurrent.nbytes

    def layer_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent) state pages of recurrent ``layer``: ``[num_state_pages, *conv]``,
        ``[num_state_pages, *recurrent]``."""
        i = self.index_of[layer]
        return self.conv[i], self.recurrent[i]

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) slot spaces of ``layer``: [num_blocks * block_size, kv_heads, head_dim]."""
        k, v = self._views[layer]
        return k, v

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """cache[layer][slots[t]] = k[t], v[t]  (k, v: [T, kv_heads, head_dim]; slots: [T])."""
        kc, vc = self._views[layer]
        kc.index_copy_(0, slots, k)
        vc.index_copy_(0, slots, v)

    def gather_blocks(
        self, layer: int, block_table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of whole blocks: block_table [B, nblk] -> [B, nblk * block_size, kv_heads,
        head_dim] each; one contiguous row copy per block (cheaper than per-slot gathers)."""
        b, nblk = block_table.shape
        idx = block_table.reshape(-1)
        i, (kvh, hd) = self.index_of[layer], self.layer_shapes[layer]
        shape = (b, nblk * self.block_size, kvh, hd)
        out = []
        for t in (self.k[i], self.v[i]):  # whole pages, then the layer's part of each slot
            pages = t.view(self.num_pages, -1).index_select(0, idx)  # [B * nblk, bs * width]
            out.append(pages.view(-1, self.width)[:, : kvh * hd].reshape(shape))
        return out[0], out[1]

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) at ``slots`` (any shape S) -> [*S, kv_heads, head_dim] each."""
        k, v = self.layer_kv(layer)
        return k[slots], v[slots]
