"""The engine's side of speculative decoding: draft after a step, verify in the next.

After each step the engine asks :meth:`Speculator.propose` for drafts for the sequences that
decode next; the controller says how many tokens each may draft (adaptive k) and the proposer
drafts them into ``seq.spec_tokens``. The scheduler runs each such sequence's last token and
its draft in one row of ``1 + k`` tokens (or drops the draft when the step cannot hold it); the
runner returns ``1 + k`` logits rows for it, and :meth:`Speculator.verify` appends what the
target keeps and reports the draft positions whose KV must not count as computed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from loraplex.config.speculative import SpeculativeConfig
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.spec.control import SpecController
from loraplex.engine.spec.proposer import Proposer
from loraplex.engine.spec.stats import BASE_LABEL, SpecStepStats
from loraplex.engine.spec.verify import plain_greedy, verify

if TYPE_CHECKING:
    from loraplex.config import EngineConfig
    from loraplex.engine.builder import EngineParts

COMPOSED_LABEL = "composed"
KEPT_SUFFIX = "\x00kept"
"""Appended to the controller's key of a sequence whose last draft was kept whole: acceptance
comes in runs (a copy goes on), so such a sequence's next draft is judged apart."""


def control_key(seq: Sequence) -> str:
    """The key adaptive k tracks ``seq``'s acceptance under: its adapter (or composition),
    split by whether its last draft was kept whole."""
    key = seq.adapter_key or ""
    return key + KEPT_SUFFIX if seq.spec_kept else key


def adapter_label(seq: Sequence) -> str:
    """The per-adapter label of ``seq``'s drafts: its adapter's name, ``composed`` or ``base``."""
    if seq.adapter is None:
        return BASE_LABEL
    return COMPOSED_LABEL if seq.is_composed else seq.adapter.ref.name


class Speculator:
    """Owns the proposer and the controller of one engine."""

    def __init__(self, spec: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.spec = spec
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.control = SpecController(
            spec.num_speculative_tokens, spec.adaptive, spec.disable_by_batch_size
        )

    def propose(self, running: Seq[Sequence], max_batched_tokens: int) -> None:
        """Draft for every running sequence that decodes next (its prompt computed, one token
        to run), as many tokens as the controller gives it."""
        decoding: list[Sequence] = []
        caps: list[int] = []
        pending = 0  # the next step's tokens without drafts
        for s in running:
            left = s.num_tokens - s.num_computed_tokens
            pending += left
            if s.status is not SequenceStatus.RUNNING or left != 1 or s.spec_tokens:
                continue
            cap = min(
                self.spec.num_speculative_tokens,
                s.max_tokens - len(s.output_token_ids) - 1,  # the step appends up to k + 1
                self.max_model_len - s.num_tokens,  # positions up to num_tokens - 1 + k
            )
            decoding.append(s)
            caps.append(max(cap, 0))
        if not decoding:
            return
        keys = [control_key(s) for s in decoding]
        ks = self.control.limits(keys, caps, min(pending, max_batched_tokens))
        chosen = [(s, k, key) for s, k, key in zip(decoding, ks, keys, strict=True) if k > 0]
        if not chosen:
            return
        t0 = time.perf_counter()
        drafts = self.proposer.propose([s for s, _, _ in chosen], [k for _, k, _ in chosen])
        self.control.cost.observe_draft(max(k for _, k, _ in chosen), time.perf_counter() - t0)
        for (seq, k, key), draft in zip(chosen, drafts, strict=True):
            n = min(k, len(draft.tokens))
            self.control.observe_found(key, n > 0)
            if n == 0:
                continue
            seq.spec_tokens = list(draft.tokens[:n])
            seq.spec_probs = None if draft.probs is None else draft.probs[:n].float().cpu()

    def verify(
        self,
        logits: torch.Tensor,
        samplers: Seq[Sequence],
        generator: torch.Generator,
        eos_token_ids: set[int],
    ) -> tuple[list[tuple[Sequence, str]], dict[Sequence, int], int, SpecStepStats]:
        """Verify every sampling sequence's draft (none: a plain sample) against its rows of
        ``logits`` [sum(1 + k_i), V]. Returns the finishes, the rejected draft positions per
        sequence (for the scheduler), the tokens appended and the step's draft counts."""
        logits = logits.float().cpu()
        now = time.monotonic()
        finishes: list[tuple[Sequence, str]] = []
        rejected: dict[Sequence, int] = {}
        appended = drafts = drafted = accepted = 0
        per_pos: Counter[int] = Counter()
        by_label: dict[str, list[int]] = {}
        plain = [plain_greedy(s) for s in samplers]
        top = logits.argmax(dim=-1).tolist() if any(plain) else []  # [rows], one op
        r = 0
        for seq, fast in zip(samplers, plain, strict=True):
            k = len(seq.spec_tokens)
            rows = logits[r : r + k + 1]  # [k + 1, V]
            res = verify(
                seq, rows, generator, now, eos_token_ids, top[r : r + k + 1] if fast else None
            )
            r += k + 1
            appended += res.appended
            if res.finish is not None:
                finishes.append((seq, res.finish))
            if k == 0:
                continue
            if res.rejected:
                rejected[seq] = res.rejected
            self.control.observe(control_key(seq), k, res.accepted)
            seq.spec_kept = res.accepted == k
            drafts += 1
            drafted += k
            accepted += res.accepted
            per_pos.update(range(res.accepted))
            row = by_label.setdefault(adapter_label(seq), [0, 0, 0])
            row[0] += 1
            row[1] += k
            row[2] += res.accepted
        stats = SpecStepStats(
            num_drafts=drafts,
            num_draft_tokens=drafted,
            num_accepted_tokens=accepted,
            accepted_per_pos=tuple(per_pos[i] for i in range(self.spec.num_speculative_tokens)),
            by_adapter=tuple((lbl, *v) for lbl, v in sorted(by_label.items())),
        )
        return finishes, rejected, appended, stats

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The step that ran ``num_tokens`` tokens took ``seconds`` (model run and sampling)."""
        self.control.cost.observe(num_tokens, seconds)

    def finish(self, seq: Sequence) -> None:
        seq.spec_tokens, seq.spec_probs = [], None
        self.proposer.finish(seq)


def _ngram(spec: SpeculativeConfig, config: EngineConfig, parts: EngineParts) -> Proposer:
    from loraplex.engine.spec.ngram import NgramProposer

    return NgramProposer(spec)


def _suffix(spec: SpeculativeConfig, config: EngineConfig, parts: EngineParts) -> Proposer:
    from loraplex.engine.spec.suffix import SuffixProposer

    return SuffixProposer(spec)


def _draft_model(spec: SpeculativeConfig, config: EngineConfig, parts: EngineParts) -> Proposer:
    from loraplex.engine.spec.draft_model import DraftModelProposer

    return DraftModelProposer.build(config, spec, parts)


PROPOSERS: dict[str, Callable[[SpeculativeConfig, EngineConfig, EngineParts], Proposer]] = {
    "ngram": _ngram,
    "suffix": _suffix,
    "draft_model": _draft_model,
}
"""``method`` -> its proposer's builder (``loraplex.config.SPEC_METHODS`` names them)."""


def build_speculator(config: EngineConfig, parts: EngineParts) -> Speculator | None:
    """The engine's speculator for ``config.speculative_config`` (None without one). Raises
    ValueError for a model speculation cannot run exactly on."""
    spec = config.speculative()
    if spec is None:
        return None
    if parts.state_pool is not None:
        raise ValueError(
            "--speculative-config: this model has recurrent (linear-attention) layers, whose "
            "state cannot be rolled back to a rejected draft's position; serve it without "
            "speculative decoding"
        )
    return Speculator(spec, PROPOSERS[spec.method](spec, config, parts), parts.max_model_len)
