"""Exact verification of one sequence's draft against the target's logits.

The step ran the sequence's last token and its ``k`` draft tokens, so it has ``k + 1`` logits
rows: row ``j`` is the target's next-token distribution after the draft's first ``j`` tokens.
Position by position, in the order non-speculative decoding would take them::

    for j in 0..k:
        row = logits[j] masked (grammar, min_tokens) and processed (logit_bias, penalties)
              for the sequence as it is now (its outputs include the tokens accepted so far)
        greedy:   t = argmax(row); accepted = j < k and t == draft[j]
        sampling: p = the request's distribution of row (temperature, min_p, top-k, top-p)
                  j < k: q = the draft's distribution (one-hot on draft[j] when deterministic)
                         accept draft[j] with probability min(1, p[d] / q[d]);
                         else t ~ normalize(max(p - q, 0))          (rejection sampling)
                  j = k: t ~ p                                       (the bonus token)
        append t (text, stop strings, grammar, finish), record its logprob
        stop at the first rejection, the bonus token, or a finish

Greedy output is therefore token for token what the non-speculative sampler picks from the
same logits, and sampled output has the target distribution exactly (Leviathan et al., 2023;
Chen et al., 2023). The state every row depends on (penalties' counts, the grammar, min_tokens,
stop strings) is the sequence's own, advanced by :func:`append_token` between rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.engine.postprocess import append_token
from loraplex.engine.sampler import (
    draw,
    mask_min_tokens,
    process_row,
    record_logprob,
    sampling_probs,
)
from loraplex.engine.sequence import Sequence
from loraplex.engine.structured import apply_grammars


@dataclass(frozen=True)
class Verified:
    """What verification did for one sequence: tokens drafted and accepted (a prefix of the
    draft), tokens appended (accepted ones, then a correction or bonus token unless a finish
    came first) and the finish reason, if any."""

    drafted: int
    accepted: int
    appended: int
    finish: str | None

    @property
    def rejected(self) -> int:
        """Draft positions whose KV the step wrote but that are not the sequence's tokens."""
        return self.drafted - self.accepted


def _accepts(
    p: torch.Tensor, q: torch.Tensor | None, d: int, gen: torch.Generator
) -> tuple[bool, int]:
    """Rejection sampling at one position: (accepted, the token to append). p: [V] target
    distribution; q: [V] the draft's (None: one-hot on ``d``)."""
    pd = float(p[d])
    qd = 1.0 if q is None else float(q[d])
    u = float(torch.rand((), generator=gen, dtype=torch.float64))  # [0, 1)
    if qd > 0.0 and u * qd < pd:
        return True, d
    if q is None:
        residual = p.clone()
        residual[d] = 0.0  # max(p - onehot(d), 0)
    else:
        residual = (p - q).clamp_(min=0.0)
    if not bool(residual.sum() > 0):  # p == q up to rounding: nothing left to correct
        residual = p
    return False, draw(residual, gen)


def plain_greedy(seq: Sequence) -> bool:
    """Whether ``seq``'s next tokens are the raw logits' argmax whatever comes before them:
    greedy, no grammar, bias or penalty, no min_tokens still to reach, no logprobs to record
    (verification then needs only each row's argmax, taken for all rows at once)."""
    p = seq.params
    return (
        p.greedy
        and seq.grammar is None
        and not p.logit_bias
        and not p.has_penalties
        and not seq.tracks_logprobs
        and len(seq.output_token_ids) >= p.min_tokens
    )


def verify(
    seq: Sequence,
    logits: torch.Tensor,
    default_gen: torch.Generator,
    now: float,
    eos_token_ids: set[int],
    argmax: list[int] | None = None,
) -> Verified:
    """Verify ``seq.spec_tokens`` against ``logits`` [k + 1, V] (float32, CPU) and append the
    tokens the target keeps (see the module docstring). The draft is consumed (cleared).
    ``argmax``: each row's argmax, given when :func:`plain_greedy` holds (no row is
    processed then)."""
    draft, q = seq.spec_tokens, seq.spec_probs
    seq.spec_tokens, seq.spec_probs = [], None
    k = len(draft)
    if argmax is not None:  # plain greedy: the first disagreement ends it
        accepted = appended = 0
        for j in range(k + 1):
            tok = argmax[j]
            reason = append_token(seq, tok, now, eos_token_ids)
            appended += 1
            ok = j < k and tok == draft[j]
            accepted += ok
            if reason is not None or not ok:
                return Verified(drafted=k, accepted=accepted, appended=appended, finish=reason)
        raise AssertionError("unreachable: the bonus row always ends verification")
    p = seq.params
    gen = seq.generator if seq.generator is not None else default_gen
    accepted = appended = 0
    reason: str | None = None
    for j in range(k + 1):
        row = logits[j : j + 1].clone()  # [1, V]
        if seq.grammar is not None:
            apply_grammars(row, {0: seq.grammar})
        mask_min_tokens(row, 0, seq)
        raw = row[0]
        proc = process_row(raw, seq, p)
        probs = None if p.greedy else sampling_probs(proc, p)
        ok = False
        if probs is None:  # greedy (or an overflowing distribution, whose limit is greedy)
            tok = int(proc.argmax())
            ok = j < k and tok == draft[j]
        elif j < k:
            ok, tok = _accepts(probs, None if q is None else q[j], draft[j], gen)
        else:
            tok = draw(probs, gen)
        if seq.tracks_logprobs:
            record_logprob(seq, torch.log_softmax(raw, dim=-1), tok)
        reason = append_token(seq, tok, now, eos_token_ids)
        appended += 1
        accepted += ok
        if reason is not None or not ok:
            break
    return Verified(drafted=k, accepted=accepted, appended=appended, finish=reason)
