"""Paged attention over the flat KV slot space, plus the per-step metadata it reads.

Decode tokens (one new token per sequence) are batched into one call of the model's
``LayerOps.decode_attention`` (the C kernel reads each context from the cache's blocks; the
torch path gathers them into a padded copy); prefill chunks run one call each (causal, offset
by their cached prefix).

Sliding windows: a windowed layer reads its KV-cache group's block table (``loraplex.kv.groups``),
which keeps only the blocks some query still sees; it attends through masks that also hide the
keys ``window`` or more positions back (HF: key ``k`` is seen by query ``q`` iff ``k <= q and
q - k < window``), so the released blocks' table entries (pointing anywhere) are never seen.
Chunked layers (``loraplex.kv.groups.Chunked``, Llama 4: key ``k`` seen by query ``q`` iff ``k
<= q and k // size == q // size``) are windows of their own kind: the same groups, the same
masks (the C decode kernel reads a chunk as a negative window: ``WindowMasks.size``). The
runner builds each distinct window's masks once per step (``WindowMasks``); a layer picks its
set by index. Soft-capped scores (``tanh(s / cap) * cap`` before the mask, Gemma 2) cannot
go through SDPA: a block built with a cap attends with :func:`softcap_attend`, every other
block with :func:`sdpa_attend` (chosen once, at construction). A layer with attention sinks
(GPT-OSS) carries its own functions, bound to its sinks at load: :func:`sink_attend` for
prefill, and its ops' decode attention with the sinks for decode rows (the torch path:
:func:`gathered_decode` through :func:`sink_attend`, heads in place).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from loraplex.kv.cache import PagedKVCache
from loraplex.kv.groups import Chunked, Window

AttendFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float, bool], torch.Tensor
]
"""``attend(q, k, v, mask, scale, gqa)``: q ``[..., H, Lq, hd]``, k and v ``[..., KVH, Lk, hd]``,
``mask`` (True = attend, broadcast to ``[..., H, Lq, Lk]``) or None for causal with ``Lq ==
Lk``; ``gqa``: ``H > KVH``, head ``h`` reads KV head ``h // (H / KVH)``. Returns ``[..., H, Lq,
hd]``."""


DecodeAttendFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        int,
        PagedKVCache,
        "AttentionMetadata",
        float,
        "WindowMasks | None",
        AttendFn,
        "float | None",
    ],
    torch.Tensor,
]
"""``decode(q, out, layer, cache, meta, scale, masks, attend, softcap)``: the step's attention
output with its decode rows filled (``LayerOps.decode_attention`` states it)."""


def sdpa_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    gqa: bool,
) -> torch.Tensor:
    """``softmax(q k^T * scale, masked) v`` through SDPA (see ``AttendFn``)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )


def eager_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    gqa: bool,
    cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's eager attention up to the softmax: ``(s [..., H, Lq, Lk], v)`` with
    ``s = q k^T * scale`` (soft-capped: ``tanh(s / cap) * cap``), ``s[~mask] = -inf`` (mask
    None: causal), K and V repeated per query head under GQA (HF's ``repeat_kv``)."""
    if gqa:  # KV head j serves query heads j * G .. j * G + G - 1
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., H, Lq, Lk]
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    if mask is None:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return s.masked_fill(~mask, float("-inf")), v


def softcap_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    gqa: bool,
    *,
    cap: float,
) -> torch.Tensor:
    """HF's eager attention with soft-capped scores (see ``AttendFn``)::

    s = tanh((q k^T * scale) / cap) * cap;  s[~mask] = -inf
    out = softmax(s in float32).to(q.dtype) v
    """
    s, v = eager_scores(q, k, v, mask, scale, gqa, cap)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)  # [..., H, Lq, hd]


def sink_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    gqa: bool,
    *,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """HF's eager attention with attention sinks (GPT-OSS; see ``AttendFn``): one learned logit
    per query head (``sinks [H]``) joins each row's softmax and is dropped after it::

    s = q k^T * scale;  s[~mask] = -inf
    p = softmax([s, sinks[h]] - max)[..., :-1]        (in q's dtype, as HF)
    out = p.to(v.dtype) v

    The heads are ``q``'s dim -3, so GQA decode must keep them there (not fold the G query
    heads of a KV head into queries): :func:`gathered_decode` with ``fold_gqa=False``."""
    s, v = eager_scores(q, k, v, mask, scale, gqa)
    sink = sinks.to(s.dtype).view(-1, 1, 1).expand(*s.shape[:-1], 1)  # [..., H, Lq, 1]
    s = torch.cat((s, sink), dim=-1)
    s = s - s.max(dim=-1, keepdim=True).values
    p = torch.softmax(s, dim=-1, dtype=s.dtype)[..., :-1].to(v.dtype)
    return torch.matmul(p, v)  # [..., H, Lq, hd]


def gathered_decode(
    q: torch.Tensor,
    out: torch.Tensor,
    layer: int,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    masks: WindowMasks | None,
    attend: AttendFn,
    fold_gqa: bool = True,
) -> torch.Tensor:
    """Decode attention over each row's context gathered from the cache into a padded copy
    (the torch ``LayerOps.decode_attention``), under the layer's window ``masks`` (None:
    global). ``fold_gqa``: the G = H / KVH query heads sharing a KV head (HF's repeat_kv order)
    attend as G queries of one head (no K/V repeat; the fused CPU kernel takes it as is);
    else one query per head with the heads in place (``attend``'s GQA), for attention that
    reads per-head values (sinks). Fills ``out``'s decode rows, or returns its own tensor when
    every token is one."""
    qd = q if meta.decode_all else q[meta.decode_tokens]  # [Bd, H, hd]
    kc, vc = cache.gather_blocks(layer, meta.decode_block_table)  # [Bd, L, KVH, hd]
    bd, kvh, hd = qd.shape[0], kc.shape[2], qd.shape[-1]
    od = attend(
        qd.reshape(bd, kvh, -1, hd) if fold_gqa else qd[:, :, None],  # [Bd, KVH, G | H, 1, hd]
        kc.transpose(1, 2),  # [Bd, KVH, L, hd]
        vc.transpose(1, 2),
        meta.decode_mask if masks is None else masks.decode,  # [Bd, 1, 1, L]
        scale,
        not fold_gqa and qd.shape[1] != kvh,
    ).reshape(bd, -1, hd)  # [Bd, H, hd]
    if meta.decode_all:
        return od
    out[meta.decode_tokens] = od
    return out


def causal_mask(q_start: int, ctx: int, window: Window = None) -> torch.Tensor:
    """``[ctx - q_start, ctx]`` True = attend: the query at position ``p`` (``q_start <= p <
    ctx``) sees key ``k`` iff ``k <= p`` and, with a window, ``p - k < window`` (a chunk:
    ``k // size == p // size``)."""
    q = torch.arange(q_start, ctx)[:, None]
    k = torch.arange(ctx)[None, :]
    mask = k <= q
    if isinstance(window, Chunked):
        mask &= k // window.size == q // window.size
    elif window is not None:
        mask &= q - k < window
    return mask


def decode_mask(lens: torch.Tensor, width: int, window: Window = None) -> torch.Tensor:
    """``[Bd, 1, 1, width]`` True = attend for decode rows whose contexts are ``lens [Bd]``
    long (the new token at position ``len - 1``): keys ``k < len`` and, with a window,
    ``k >= len - window`` (a chunk: ``k >= (len - 1) // size * size``)."""
    pos = torch.arange(width)[None, :]
    mask = pos < lens[:, None]  # [Bd, width]
    if isinstance(window, Chunked):
        mask &= pos >= (lens[:, None] - 1) // window.size * window.size
    elif window is not None:
        mask &= pos >= lens[:, None] - window
    return mask[:, None, None, :]


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


NO_PAGE = -1
"""A state span's source page of a sequence that starts at position 0 (its state starts at zero)."""


@dataclass
class StateSpan:
    """One prefill chunk's state pages: rows ``[tok_start, tok_end)`` of the step at positions
    ``[start_pos, ...)``; it reads ``src`` (NO_PAGE: zeros) and writes the state after its
    first ``ends[j]`` tokens into ``pages[j]`` (the block ends it crosses that have a snapshot
    page, then its end)."""

    tok_start: int
    tok_end: int
    start_pos: int
    src: int
    ends: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)


@dataclass
class StateMetadata:
    """A state group's pages for one step: decode rows (``decode_tokens`` of the attention
    metadata, in order) read ``decode_src`` and write ``decode_dst`` ([Bd] page ids); prefill
    chunks as ``prefills``."""

    decode_src: torch.Tensor | None = None  # [Bd]
    decode_dst: torch.Tensor | None = None  # [Bd]
    prefills: list[StateSpan] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    decode_tokens: torch.Tensor | None = None  # [Bd] token indices of decode rows (None: none)
    decode_all: bool = False  # every token is a decode token, in order (skip the index gather)
    decode_block_table: torch.Tensor | None = None  # [Bd, nblk] block ids, padded with 0
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, nblk * block_size] True = attend
    decode_lens: torch.Tensor | None = None  # [Bd] int64 context lengths (the new token's too)
    prefills: list[PrefillSpan] = field(default_factory=list)
    windowed: list[WindowMasks] = field(default_factory=list)
    """The masks of each distinct sliding window of the model (``DecoderForCausalLM.windows``
    order); a windowed layer reads ``windowed[L.window]``."""
    states: dict[int, StateMetadata] = field(default_factory=dict)
    """Per state group of the cache (recurrent layers): its pages for the step."""
    kv_groups: list[AttentionMetadata] = field(default_factory=list)
    """With several KV-cache groups, each group's metadata (index: the cache's group of the
    layer): the same spans, masks and lengths, its own slots and block tables. Empty: one
    group, this metadata."""


@dataclass
class WindowMasks:
    """One sliding window's masks for the step (True = attend), beside the global ones."""

    decode: torch.Tensor | None = None  # [Bd, 1, 1, nblk * block_size], as decode_mask
    size: int | None = None
    """What the C decode attention reads: the sliding window, or minus a chunked layer's chunk
    size (a query at ``len - 1`` sees keys from ``(len - 1) // chunk * chunk``); None: the
    masks only."""
    prefill: list[torch.Tensor | None] = field(default_factory=list)
    """Per span of ``prefills``: its mask under the window (the span's own ``mask`` where the
    window does not bite; None: plain causal, a fresh chunk no longer than the window)."""


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    attend: AttendFn,
    decode: DecodeAttendFn,
    softcap: float | None = None,
    write: bool = True,
) -> torch.Tensor:
    """Write this step's K/V into the cache (unless ``write`` is False: a layer reading another
    layer's KV, which that layer wrote this step), then attend: decode rows through ``decode``
    (the model's ``LayerOps.decode_attention``), prefill chunks with ``attend``.

    q: [T, H, hd]; k, v: [T, KVH, hd]. ``window``: index of the layer's masks in
    ``meta.windowed`` (None: global attention); ``softcap``: the cap ``attend`` applies (the
    decode kernel applies it itself). Returns [T, H, hd].
    """
    if meta.kv_groups:
        meta = meta.kv_groups[cache.group_of[layer]]
    if write:
        cache.write(layer, k, v, meta.slot_mapping)
    masks = None if window is None else meta.windowed[window]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    gqa = q.shape[1] != k.shape[1]
    if meta.decode_block_table is not None:
        out = decode(q, out, layer, cache, meta, scale, masks, attend, softcap)
    for j, span in enumerate(meta.prefills):
        s, e = span.tok_start, span.tok_end
        qs = q[s:e].transpose(0, 1)  # [H, Lq, hd]
        mask = span.mask if masks is None else masks.prefill[j]  # [Lq, ctx] or None: causal
        if span.ctx_slots is None:
            ks, vs = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)  # [KVH, Lq, hd]
        else:
            kc, vc = cache.gather(layer, span.ctx_slots)  # [L, KVH, hd]
            ks, vs = kc.transpose(0, 1), vc.transpose(0, 1)  # [KVH, L, hd]
        o = attend(qs, ks, vs, mask, scale, gqa)  # [H, Lq, hd]
        out[s:e] = o.transpose(0, 1)
    return out
