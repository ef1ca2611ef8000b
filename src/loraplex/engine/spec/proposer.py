"""What every drafting method provides: drafts for running sequences, and hooks that tell it
when a sequence ends or an adapter leaves residency.

All calls come from the engine's loop thread. A proposer never changes a sequence; it reads
``seq.all_token_ids`` (prompt + outputs so far), ``seq.params``, ``seq.tenant``,
``seq.adapter`` / ``seq.adapters`` and ``seq.adapter_key``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from loraplex.engine.sequence import Sequence


@dataclass
class Draft:
    """Tokens proposed to continue one sequence, in order.

    ``probs``: ``[len(tokens), V]`` float32, the distribution each token was drawn from (a draft
    model that samples); None for a deterministic proposal (the draft distribution is one-hot
    on each token), which is what n-gram and suffix drafts and greedy draft models are."""

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


NO_DRAFT = Draft()


class Proposer(ABC):
    """One drafting method (``method`` names it as ``--speculative-config`` does)."""

    method: ClassVar[str]

    @abstractmethod
    def propose(self, seqs: Seq[Sequence], limits: Seq[int]) -> list[Draft]:
        """For each ``seqs[i]`` (running, its prompt computed, awaiting its next token) up to
        ``limits[i]`` tokens continuing ``seqs[i].all_token_ids``; fewer or none (``NO_DRAFT``)
        where the method has nothing worth proposing. ``limits[i]`` may be 0: no draft."""

    def finish(self, seq: Sequence) -> None:  # noqa: B027 (a hook: most methods keep nothing)
        """``seq`` ended (finished, aborted or failed; its tokens are final): drop what is kept
        for it, learn from its output where the method does."""

    def forget_adapter(self, digest: str) -> None:  # noqa: B027
        """The adapter ``digest`` left this engine's memory: drop everything learned from it
        (and from compositions that include it)."""

    def memory_bytes(self) -> int:
        """Bytes this proposer holds beyond what it was built with (for limits and stats)."""
        return 0

    def close(self) -> None:  # noqa: B027
        """Release what the proposer holds (a draft model's workers, caches)."""
