"""``ngram`` drafting (vLLM's prompt lookup): continue a sequence the way it continued the last
time its current ending appeared.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``: find an earlier occurrence
of the sequence's last ``n`` tokens (prompt and outputs so far) and propose the tokens that
followed it, up to the step's limit and never past the tokens that exist. The first ``n`` that
matches wins (the longest match), and among its occurrences the **most recent** one: a
sequence that repeats itself (code being edited, a list being continued, a quote being copied)
is most often repeating what it just wrote.

Cost per step and sequence: the tokens appended since the last step are copied into the
sequence's :class:`~loraplex.engine.spec.window.TokenWindow`; the search compares the last
``DEFAULT_WINDOW_TOKENS`` tokens once (numpy), then only positions that still match, among the
``MAX_CANDIDATES`` (1024; fewer when ``prompt_lookup_max`` exceeds 64) most recent
occurrences of the last token. The
window is the only per-sequence state, at most ``2 x window x 4`` bytes, dropped in
:meth:`NgramProposer.finish`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from loraplex.engine.spec.proposer import NO_DRAFT, Draft, Proposer
from loraplex.engine.spec.window import (
    DEFAULT_WINDOW_TOKENS,
    SequenceWindows,
    longest_suffix_match,
)

if TYPE_CHECKING:
    from loraplex.config.speculative import SpeculativeConfig
    from loraplex.engine.sequence import Sequence


class NgramProposer(Proposer):
    """Prompt-lookup drafts from each sequence's own tokens (see the module doc)."""

    method = "ngram"

    def __init__(self, spec: SpeculativeConfig, *, window: int = DEFAULT_WINDOW_TOKENS) -> None:
        if not 1 <= spec.prompt_lookup_min <= spec.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={spec.prompt_lookup_min} must be in "
                f"[1, prompt_lookup_max={spec.prompt_lookup_max}]"
            )
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max
        self._windows = SequenceWindows(window)

    def propose(self, seqs: Seq[Sequence], limits: Seq[int]) -> list[Draft]:
        return [self._one(seq, k) for seq, k in zip(seqs, limits, strict=True)]

    def _one(self, seq: Sequence, limit: int) -> Draft:
        if limit <= 0:
            return NO_DRAFT
        a = self._windows.tokens(seq)  # [n] int32
        m, ends = longest_suffix_match(a, self.max_n)
        if m < self.min_n:
            return NO_DRAFT
        start = int(ends[-1]) + 1  # the most recent occurrence; start < len(a)
        return Draft(a[start : start + limit].tolist())

    def finish(self, seq: Sequence) -> None:
        self._windows.drop(seq)

    def memory_bytes(self) -> int:
        return self._windows.nbytes
