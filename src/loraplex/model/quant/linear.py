"""What every quantized Linear shares (``kernels.py``, ``triton_gemm.py``): sizes, bytes, the
reference weight, the act-order gather and the bias."""

from __future__ import annotations

import torch

from loraplex.model.quant.weights import FP8Weight, QuantWeight


class QuantLinearBase:
    """What every quantized Linear shares: sizes, bytes, the act-order gather and the bias."""

    name = "unset"
    alt_name: str | None = None
    """A second path over the same stored weight (one copy of the weight for both), or None:
    inputs of at least :attr:`alt_rows` rows take it. The start-up timing sets ``alt_rows``
    where it measured the second path faster (``kernels.choose_kernel``)."""
    alt_rows: int | None = None

    def __init__(self, weight: QuantWeight | FP8Weight) -> None:
        self.out_features = weight.out_features
        self.in_features = weight.in_features
        self.quant = weight  # kept by every candidate for its reference (see dequantize)
        self.perm = getattr(weight, "perm", None)
        self.bias = weight.bias

    @property
    def nbytes(self) -> int:
        return self.quant.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[N, K]`` as the reference computes it (tests)."""
        return self.quant.dequantize(dtype)

    def alt(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` on the second path (``x`` gathered already)."""
        raise NotImplementedError(f"{self.name} has no second path")

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.perm is None else x[:, self.perm]  # act order: stored column order

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)
