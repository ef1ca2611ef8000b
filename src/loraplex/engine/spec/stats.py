"""What speculation did in one step (for ``/metrics`` and the dashboard)."""

from __future__ import annotations

from dataclasses import dataclass

BASE_LABEL = "base"
"""``by_adapter``'s label for sequences that run the base model."""


@dataclass(frozen=True)
class SpecStepStats:
    """Drafts verified in one step, counted as vLLM's ``vllm:spec_decode_*`` counters count
    them, plus the same counts per adapter.

    - ``num_drafts``: sequences that carried a draft (>= 1 token) into the step;
    - ``num_draft_tokens`` / ``num_accepted_tokens``: tokens drafted / accepted;
    - ``accepted_per_pos[i]``: drafts whose token ``i`` was accepted (so the tokens before it
      were too);
    - ``by_adapter``: ``(label, drafts, draft tokens, accepted tokens)`` per adapter label: the
      adapter's name, ``"composed"`` for a composition, :data:`BASE_LABEL` for the base model
      (unbounded names: the metrics layer bounds the series it keeps)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    by_adapter: tuple[tuple[str, int, int, int], ...] = ()
