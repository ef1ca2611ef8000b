"""Paged attention over the flat KV slot space, plus the per-step metadata it reads.

Decode tokens (one new token per sequence) are batched into one SDPA call over their gathered,
padded contexts; prefill chunks run one SDPA call each (causal, offset by their cached prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from loraplex.kv.cache import PagedKVCache


@dataclass
class PrefillSpan:
    """One sequence's chunk of new tokens ``[tok_start, tok_end)`` in the flattened batch.

    ``ctx_slots`` is None when the chunk is the whole context (nothing cached before it); else
    it lists the cache slots of the full context (cached prefix + this chunk) and ``mask``
    ([q_len, ctx_len], True = attend) encodes the causal offset.
    """

    tok_start: int
    tok_end: int
    ctx_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    decode_tokens: torch.Tensor | None = None  # [Bd] token indices of decode rows (None: none)
    decode_all: bool = False  # every token is a decode token, in order (skip the index gather)
    decode_block_table: torch.Tensor | None = None  # [Bd, nblk] block ids, padded with 0
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, nblk * block_size] True = attend
    prefills: list[PrefillSpan] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend.

    q: [T, H, hd]; k, v: [T, KVH, hd]. Returns [T, H, hd].
    """
    cache.write(layer, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    if meta.decode_block_table is not None:
        qd = q if meta.decode_all else q[meta.decode_tokens]  # [Bd, H, hd]
        kc, vc = cache.gather_blocks(layer, meta.decode_block_table)  # [Bd, L, KVH, hd]
        bd, kvh = qd.shape[0], kc.shape[2]
        # The G = H / KVH query heads sharing a KV head (HF's repeat_kv order) attend as G
        # queries of one head: no K/V repeat, and the fused CPU kernel takes it as is.
        od = F.scaled_dot_product_attention(
            qd.reshape(bd, kvh, -1, qd.shape[-1]),  # [Bd, KVH, G, hd]
            kc.transpose(1, 2),  # [Bd, KVH, L, hd]
            vc.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=scale,
        ).reshape(bd, -1, qd.shape[-1])  # [Bd, H, hd]
        if meta.decode_all:
            out = od
        else:
            out[meta.decode_tokens] = od
    for span in meta.prefills:
        s, e = span.tok_start, span.tok_end
        qs = q[s:e].transpose(0, 1)  # [H, Lq, hd]
        if span.ctx_slots is None:
            ks, vs = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)  # [KVH, Lq, hd]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            kc, vc = cache.gather(layer, span.ctx_slots)  # [L, KVH, hd]
            o = F.scaled_dot_product_attention(
                qs,
                kc.transpose(0, 1),
                vc.transpose(0, 1),
                attn_mask=span.mask,
                scale=scale,
                enable_gqa=gqa,
            )
        out[s:e] = o.transpose(0, 1)
    return out
