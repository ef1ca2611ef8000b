"""What a draft model (``speculative_config`` method ``draft_model``) takes from the device
memory the target's KV cache is sized from.

On CUDA the target's KV cache gets what ``--gpu-memory-utilization`` leaves after its weights;
the draft model is loaded after it, with its own weights and a KV cache of at most
:data:`DRAFT_KV_SHARE` of the target's bytes. So the target sizes its cache from what is left
once the draft's weights are set aside, and gives the draft its share of that::

    rest   = budget - draft weight bytes (its checkpoint's tensors at the serving dtype)
    target = rest / (1 + DRAFT_KV_SHARE)        # draft KV <= DRAFT_KV_SHARE * target

(on CPU the KV budget is a fixed share of host memory, and ``--kv-cache-memory`` is the
target's own, as given).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from loraplex.checkpoint.safetensors import FLOAT_DTYPES, safetensors_header

DRAFT_KV_SHARE = 0.25
"""The draft's KV-cache bytes, at most this share of the target's (but at least one
full-length sequence's worth): a draft model is small, its KV per token usually a fraction of
the target's, so this bound bites only for an unusually wide draft."""


def draft_weight_bytes(model_dir: str | Path, dtype: torch.dtype) -> int:
    """Bytes of a checkpoint's tensors once loaded: floating tensors at ``dtype``, the others
    (quantized payloads, integer buffers) as stored. Reads the safetensors headers only."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for t in safetensors_header(path).values():
            floating = t.dtype in FLOAT_DTYPES
            total += math.prod(t.shape) * dtype.itemsize if floating else t.nbytes
    return total


def target_kv_budget(budget: int, draft_bytes: int) -> int:
    """The target's KV bytes out of ``budget`` when a draft of ``draft_bytes`` of weights and
    its KV share must fit in it too. Raises ValueError naming the flags when nothing is left."""
    rest = budget - draft_bytes
    if rest <= 0:
        gib = 1 << 30
        raise ValueError(
            f"speculative_config: the draft model's weights ({draft_bytes / gib:.2f} GiB) do "
            f"not fit in the {max(budget, 0) / gib:.2f} GiB --gpu-memory-utilization leaves "
            "after the target's weights (raise it, or set --kv-cache-memory)"
        )
    return int(rest / (1.0 + DRAFT_KV_SHARE))
