"""What sharing KV across adapters saves in a pipeline of adapters over one context.

The pipeline: the base model answers over a ``context``-token prompt, then each adapter in turn
adds ``question`` tokens (an aLoRA's invocation and a question) over that same context. A
standard LoRA shapes every block from the first token, so each step prefills the whole prompt
again and keeps its own copy of the context's KV. An activated LoRA applies from its invocation
on: the blocks wholly before it are base blocks, found in the prefix cache (the base answer
computed them), so the step prefills only the block the context ends in and its own tokens::

    standard step: context + question tokens computed
    aLoRA step:    context + question - (context // block_size) * block_size

Prefill compute is ``2 x active parameters`` FLOPs a token; KV bytes per token are the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loraplex.tools.plan.adapter_shape import AdapterShape


def pipeline_estimate(
    adapters: Sequence[AdapterShape],
    *,
    context: int,
    question: int,
    block_size: int,
    kv_bytes_per_token: int,
    flops_per_token: int,
) -> dict[str, Any]:
    """Prefill tokens, FLOPs and KV bytes of the pipeline's adapter steps, as standard LoRAs and
    as the adapters are (aLoRA steps sharing the base blocks), and the ratios."""
    shared_prefix = context // block_size * block_size
    steps = []
    for a in adapters:
        standard = context + question
        actual = standard - shared_prefix if a.alora else standard
        steps.append({"name": a.name, "alora": a.alora, "standard_tokens": standard,
                      "tokens": actual})  # fmt: skip
    std = sum(s["standard_tokens"] for s in steps)
    got = sum(s["tokens"] for s in steps)
    return {
        "context": context,
        "question": question,
        "block_size": block_size,
        "steps": steps,
        "standard_prefill_tokens": std,
        "prefill_tokens": got,
        "prefill_ratio": got / std if std else 1.0,
        "standard_prefill_flops": std * flops_per_token,
        "prefill_flops": got * flops_per_token,
        # KV the steps hold beside the base answer's: a copy of the context per standard step
        "standard_kv_bytes": std * kv_bytes_per_token,
        "kv_bytes": got * kv_bytes_per_token,
    }
