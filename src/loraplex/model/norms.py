"""The RMSNorms of the decoders: Llama's (scale in the model dtype), Gemma's (``1 + w`` in
float32) and Gemma 4's and GPT-OSS's (``w`` in float32); each names its mode of the C layer ops
(``native/layer_ops.c``)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F


class RMSNorm:
    """HF-exact RMSNorm over the last dimension: statistics in float32, then the scale in the
    model dtype (one fused kernel in float32; low-precision inputs normalise in float32 first,
    as HF does).

    ``weight``: ``[dim]``, or one row per head (``[heads, dim]``, see :meth:`per_head`).
    Architectures with another norm (Gemma's ``x * (1 + w)`` computed in float32) subclass it
    and name the subclass in their decoder's ``norm_class``."""

    kernel_mode: ClassVar[int | None] = 0
    """The C layer ops' ``mode`` for this norm (``native/layer_ops.c``; None: torch only)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight
        self.eps = eps
        self.dim = (int(weight.shape[-1]),)
        self._fused = weight.dim() == 1  # F.rms_norm takes a weight of exactly ``dim``

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused and x.dtype == torch.float32:
            return F.rms_norm(x, self.dim, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.dim, None, self.eps).to(x.dtype)

    @classmethod
    def per_head(
        cls,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
    ) -> RMSNorm:
        """The per-head norms of q (``q_weight [hd]``) and k (``k_weight [hd]``) as one norm of
        the ``[T, H + KVH, hd]`` q/k heads: row ``h`` of its weight is q's for ``h < H``, else
        k's, so q and k normalise in one op (each head over its own ``hd`` values)."""
        rows = torch.cat((q_weight.expand(num_heads, -1), k_weight.expand(num_kv_heads, -1)))
        return cls(rows.contiguous(), eps)  # [H + KVH, hd]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, HF-exact: ``(x / rms(x)) * (1 + w)`` all in float32, then cast to the
    input dtype (Llama's scales in the model dtype instead)."""

    kernel_mode = 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), self.dim, None, self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)


class Float32ScaleRMSNorm(RMSNorm):
    """Gemma 4's and GPT-OSS's RMSNorm, HF-exact: ``(x / rms(x)) * w`` in float32, then cast
    to the input dtype (no ``1 +``; Llama's scales in the model dtype instead; the same in
    float32)."""

    kernel_mode = 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused and x.dtype == torch.float32:
            return F.rms_norm(x, self.dim, self.weight, self.eps)
        out = F.rms_norm(x.float(), self.dim, None, self.eps) * self.weight.float()
        return out.to(x.dtype)
