"""The quantized weight layouts loraplex serves, one per family, whatever checkpoint they came from.

Every format reader (``formats.py``) unpacks its checkpoint tensors into one of these; the
kernels (``kernels.py``) read only these. Both are ``[N, K]`` weights of a Linear ``y = x W^T``:

- :class:`QuantWeight`: integer weights with per-group scales and integer zero points,
  ``W[n, k] = scales[n, k // gs] * (q[n, k] - zeros[n, k // gs])`` (GPTQ, AWQ, compressed-tensors
  W4A16/W8A16 and W8A8 int8, and ``--quantization int8/int4``). Act-order checkpoints (GPTQ's
  ``g_idx``) are stored with their columns sorted by group: ``perm`` says which input column each
  stored column is, and x is gathered by it before the product.
- :class:`FP8Weight`: float8 e4m3 weights with a per-tensor or per-channel scale.

Both may carry an activation scheme (``act``): how a W8A8 checkpoint quantizes the Linear's input
before its base product. The LoRA delta never sees that quantized input (``kernels.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

INT_BITS = (4, 8)


@dataclass(frozen=True)
class ActQuant:
    """How the base product quantizes its input x (a W8A8 checkpoint's ``input_activations``).

    ``kind``: ``int8`` (symmetric, per token, dynamic) or ``fp8`` (e4m3); for fp8 ``scale`` is the
    static per-tensor input scale, or None for a dynamic per-token one."""

    kind: str
    scale: float | None = None


@dataclass(frozen=True)
class QuantWeight:
    """``W[n, k] = scales[n, g] * (q[n, k] - zeros[n, g])``, ``g = k // group_size``: G =
    ceil(K / group_size) groups, the last one shorter where K is not a multiple (as GPTQ writes
    SmolLM2's 576 columns in groups of 128).

    q: bits 4: uint8 ``[N, K // 2]`` in blocks of 32 columns, column ``32 b + i`` the low
    nibble of byte ``16 b + i`` for i < 16, else the high nibble of byte ``16 b + i - 16``
    (0..15; K a multiple of 32: a block unpacks into two contiguous vectors); bits 8: int8 ``[N, K]`` (-128..127). scales: float32 ``[N, G]``. zeros: int8 ``[N, G]`` or
    None (symmetric). perm: int64 ``[K]`` or None: stored column k is input column ``perm[k]``.
    """

    q: torch.Tensor
    bits: int
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    perm: torch.Tensor | None = None
    act: ActQuant | None = None
    bias: torch.Tensor | None = field(default=None, compare=False)

    @property
    def out_features(self) -> int:
        return int(self.scales.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.q.shape[1] * (2 if self.bits == 4 else 1))

    @property
    def nbytes(self) -> int:
        """Resident bytes: packed values, scales, zero points, permutation, bias."""
        parts = (self.q, self.scales, self.zeros, self.perm, self.bias)
        return sum(t.nbytes for t in parts if t is not None)

    def to(self, device: torch.device) -> QuantWeight:
        """The same weight with every tensor on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(
            self, q=move(self.q), scales=move(self.scales), zeros=move(self.zeros),
            perm=move(self.perm), bias=move(self.bias),
        )  # fmt: skip

    def values(self) -> torch.Tensor:
        """The integer values ``q`` as int16 ``[N, K]`` (stored column order)."""
        if self.bits == 8:
            return self.q.to(torch.int16)
        n = self.q.shape[0]
        blocks = self.q.view(n, -1, 16)  # [N, K / 32, 16]
        lo = (blocks & 15).to(torch.int16)
        hi = (blocks >> 4).to(torch.int16)
        return torch.cat((lo, hi), dim=-1).reshape(n, -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` in input column order, computed in float32 (float64 if asked)
        and cast once to ``dtype``: the reference every kernel is checked against."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        q = self.values().to(work)  # [N, K]
        k = q.shape[1]
        z = self.zeros.to(work) if self.zeros is not None else torch.zeros_like(self.scales)
        per_col = functools.partial(torch.repeat_interleave, repeats=self.group_size, dim=1)
        w = (q - per_col(z.to(work))[:, :k]) * per_col(self.scales.to(work))[:, :k]
        if self.perm is not None:
            w = w[:, torch.argsort(self.perm)]
        return w.to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight in float32 (an embedding's lookup: only those rows are
        unpacked); an int8 weight with one scale per row (QuantizedEmbedding's)."""
        if self.bits != 8 or self.zeros is not None or self.perm is not None:
            raise ValueError("rows() reads a symmetric int8 weight in its stored order")
        return self.q[ids].float() * self.scales[ids, 0, None]

    @staticmethod
    def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
        """int values ``[N, K]`` (0..15 for 4 bits, -128..127 for 8) -> the ``q`` layout."""
        if bits == 8:
            return values.to(torch.int8).contiguous()
        n, k = values.shape
        if k % 32:
            raise ValueError(f"4-bit weights need in_features a multiple of 32, got {k}")
        v = values.to(torch.uint8).view(n, k // 32, 32)
        return (v[..., :16] | (v[..., 16:] << 4)).reshape(n, k // 2).contiguous()

    @classmethod
    def quantize(
        cls,
        w: torch.Tensor,
        bits: int,
        group_size: int | None,
        *,
        asymmetric: bool = False,
        bias: torch.Tensor | None = None,
    ) -> QuantWeight:
        """Round-to-nearest quantization of a float weight ``[N, K]`` (``--quantization``):
        ``group_size`` None is one group per output channel. Symmetric int4 stores ``q + 8``
        (0..15) with zero point 8, as GPTQ does."""
        n, k = w.shape
        gs = k if group_size is None else group_size
        groups = -(-k // gs)
        # a short last group: padded with zeros for its statistics (the range always holds 0)
        padded = torch.nn.functional.pad(w.float(), (0, groups * gs - k))
        g = padded.reshape(n, groups, gs)
        if asymmetric:
            levels = (1 << bits) - 1
            lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
            scales = ((hi - lo) / levels).clamp(min=1e-10)
            zp = torch.round(-lo / scales).clamp(0, levels)  # [N, G], in q's range
            q = torch.round(g / scales[..., None]) + zp[..., None]
            q = q.clamp(0, levels)
            if bits == 8:  # int8 storage is signed: shift values and zero points together
                q, zp = q - 128, zp - 128
            zeros = zp.to(torch.int8)
        else:
            qmax = (1 << (bits - 1)) - 1
            scales = (g.abs().amax(-1) / qmax).clamp(min=1e-10)
            q = torch.round(g / scales[..., None]).clamp(-qmax - 1, qmax)
            zeros = None
            if bits == 4:
                q = q + 8
                zeros = torch.full(scales.shape, 8, dtype=torch.int8)
        values = q.reshape(n, groups * gs)[:, :k].to(torch.int16)
        return cls(cls.pack(values, bits), bits, scales.float().contiguous(), zeros, gs, bias=bias)

    @classmethod
    def random(
        cls,
        n: int,
        k: int,
        bits: int,
        group_size: int,
        *,
        asymmetric: bool = True,
        generator: torch.Generator | None = None,
    ) -> QuantWeight:
        """A random quantized weight (kernel self-checks and tests)."""
        w = torch.randn(n, k, generator=generator)
        return cls.quantize(w, bits, group_size, asymmetric=asymmetric)

    @staticmethod
    def cat(parts: Sequence[QuantWeight]) -> QuantWeight:
        """The parts of a fused Linear (q, k, v) stacked along the output rows; they must agree
        on bits, group size, zero points, permutation and activation scheme."""
        first = parts[0]
        for p in parts[1:]:
            if (p.bits, p.group_size, p.in_features) != (
                first.bits,
                first.group_size,
                first.in_features,
            ):
                raise ValueError("fused projections quantized differently (bits or group size)")
            if (p.zeros is None) != (first.zeros is None) or p.act != first.act:
                raise ValueError("fused projections quantized differently (zero points)")
            if (p.perm is None) != (first.perm is None) or (
                p.perm is not None and not torch.equal(p.perm, first.perm)
            ):
                raise ValueError("fused projections have different act-order g_idx")
        bias = _cat_bias(parts)
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])  # type: ignore[misc]
        return replace(
            first,
            q=torch.cat([p.q for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            zeros=zeros,
            bias=bias,
        )


@dataclass(frozen=True)
class FP8Weight:
    """``W = w.float() * scale``: w float8_e4m3fn ``[N, K]``, scale float32 ``[N, 1]``
    (per channel) or ``[1, 1]`` (per tensor)."""

    w: torch.Tensor
    scale: torch.Tensor
    act: ActQuant | None = None
    bias: torch.Tensor | None = field(default=None, compare=False)

    @property
    def out_features(self) -> int:
        return int(self.w.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.w.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.w, self.scale, self.bias) if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        work = torch.float64 if dtype == torch.float64 else torch.float32
        return (self.w.to(work) * self.scale.to(work)).to(dtype)

    def to(self, device: torch.device) -> FP8Weight:
        bias = None if self.bias is None else self.bias.to(device)
        return replace(self, w=self.w.to(device), scale=self.scale.to(device), bias=bias)

    @staticmethod
    def cat(parts: Sequence[FP8Weight]) -> FP8Weight:
        """Fused parts; per-tensor scales become per-channel rows (exact: each row keeps its
        own scale). The parts read one input, quantized once: with static input scales that
        is the largest part's (as vLLM fuses them), so no part's input saturates."""
        acts = {p.act.kind if p.act else None for p in parts}
        if len(acts) > 1:
            raise ValueError("fused projections quantize their input differently")
        act = parts[0].act
        if act is not None and act.scale is not None:
            act = ActQuant(act.kind, max(p.act.scale for p in parts if p.act and p.act.scale))
        scales = [p.scale.expand(p.out_features, 1) for p in parts]
        bias = _cat_bias(parts)
        return replace(
            parts[0],
            act=act,
            w=torch.cat([p.w for p in parts]),
            scale=torch.cat(scales).contiguous(),
            bias=bias,
        )


def _cat_bias(parts: Sequence[QuantWeight | FP8Weight]) -> torch.Tensor | None:
    """The fused parts' biases, zeros for a part without one; None when none has a bias."""
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts])


class QuantizedEmbedding:
    """An embedding matrix stored as a per-row int8 weight (``--quantization int8/int4`` with
    its LM head, tied or not): a lookup dequantizes only the gathered rows. ``source`` holds
    the values: the :class:`QuantWeight`, or the tied head's Linear where its kernel keeps the
    matrix only in its own layout (``rows(ids)`` reads them back there), so a tied pair is one
    matrix in memory either way."""

    def __init__(self, source: QuantWeight | Any, dtype: torch.dtype) -> None:
        bits, gs = getattr(source, "bits", None), getattr(source, "group_size", None)
        if bits != 8 or gs != source.in_features or getattr(source, "zeros", None) is not None:
            raise ValueError("a quantized embedding is int8 with one scale per row")
        self.source, self.dtype = source, dtype
        self.shape = (source.out_features, source.in_features)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.source.rows(ids).to(self.dtype)  # [T, D]

    @property
    def nbytes(self) -> int:
        return self.source.nbytes
