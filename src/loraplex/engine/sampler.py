"""Token sampling over float32 logits [S, V], one row per sequence, in vLLM's order:

    grammar mask (structured rows) → min_tokens mask → logprobs recorded (model's, pre-penalty)
    → logit_bias → penalties → greedy argmax | temperature → min_p → top-k / top-p → one draw

Penalties follow vLLM:

    seen = prompt tokens ∪ output tokens
    logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep     for t in seen
    logits[t] -= frequency_penalty * count_out[t] + presence_penalty * (count_out[t] > 0)
"""

from __future__ import annotations

import torch

from loraplex.engine.sequence import Sequence
from loraplex.engine.structured import GrammarState, apply_grammars
from loraplex.outputs import TokenLogprob
from loraplex.requests import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k and outside the top-p nucleus.  logits: [V]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (always keep the first)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False  # a top_p that rounds to 0 in float32 must not drop every token
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` [V] (non-negative, finite, not all zero) by inverse CDF: one
    uniform from ``generator`` against a float64 running sum, so a token is drawn with
    probability ``probs[t] / probs.sum()`` and a zero-probability token never.

    Not ``torch.multinomial``: for one sample it races V exponential variates, a large share of
    a CPU decode step for a 49k-token vocabulary (docs/benchmarks-history.md)."""
    cdf = probs.double().cumsum(0)  # [V], non-decreasing
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]  # [0, total)
    # the first token whose running sum exceeds u: a zero-probability token repeats its
    # predecessor's sum (or 0), so it is never the first to exceed
    i = int(torch.searchsorted(cdf, u, right=True))
    if i == cdf.shape[0]:  # u rounded up to the total: the last token with any mass
        i = int(torch.searchsorted(cdf, cdf[-1]))
    return i


def _filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` x the top token's.  logits: [V]."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[int],
    output_ids: list[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> torch.Tensor:
    """vLLM's penalties on one row (see the module docstring); returns a new row.  logits: [V]."""
    row = logits.clone()
    vocab = row.shape[0]
    if repetition != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(prompt_ids + output_ids, dtype=torch.long)] = True
        scaled = torch.where(row > 0, row / repetition, row * repetition)
        row = torch.where(seen, scaled, row)
    if output_ids and (presence != 0.0 or frequency != 0.0):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].to(row.dtype)  # [V]
        row = row - frequency * counts - presence * (counts > 0).to(row.dtype)
    return row


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """Add ``bias[t]`` to token ``t``'s logit; returns a new row.  logits: [V]."""
    row = logits.clone()
    ids = torch.tensor(list(bias), dtype=torch.long)
    row[ids] += torch.tensor(list(bias.values()), dtype=row.dtype)
    return row


def process_row(row: torch.Tensor, seq: Sequence, p: SamplingParams) -> torch.Tensor:
    """The row after logit_bias and penalties (the row itself when neither applies)."""
    if p.logit_bias:
        row = apply_logit_bias(row, p.logit_bias)
    if p.has_penalties:
        row = apply_penalties(
            row,
            seq.prompt_token_ids,
            seq.output_token_ids,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
    return row


def mask_min_tokens(logits: torch.Tensor, i: int, seq: Sequence) -> None:
    """No EOS and no stop id for row ``i`` of ``logits`` [S, V] (in place) while ``seq`` has
    fewer than ``min_tokens`` outputs, unless that leaves nothing (the grammar may allow only
    those)."""
    p = seq.params
    if p.min_tokens and len(seq.output_token_ids) < p.min_tokens:
        row = logits[i].clone()
        for t in (*seq.eos_token_ids, *(p.stop_token_ids or ())):
            row[t] = float("-inf")
        if bool(torch.isfinite(row).any()):
            logits[i] = row


def sampling_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor | None:
    """The distribution a non-greedy request draws from: ``row`` (processed logits [V]) over
    its temperature, min_p, top-k and top-p; None when it overflows (the limit is greedy)."""
    row = row / p.temperature
    if p.min_p > 0.0:
        row = _filter_min_p(row, p.min_p)
    row = _filter_top_k_top_p(row, p.top_k, p.top_p)
    probs = row.softmax(-1)
    return probs if bool(torch.isfinite(probs).all()) else None


def record_logprob(seq: Sequence, lp: torch.Tensor, token: int) -> None:
    """Record ``token``'s logprob (and the top-k asked for) on ``seq``. lp: [V], the log-softmax
    of the masked logits (the model's, before penalties and temperature, like vLLM's default)."""
    chosen = float(lp[token])
    seq.cumulative_logprob += chosen
    k = seq.params.logprobs
    if k is None:  # only ranked (best_of)
        return
    top: dict[int, float] = {}
    if k > 0:
        vals, idx = torch.topk(lp, k)
        top = dict(zip(idx.tolist(), vals.tolist(), strict=True))
    if seq.logprobs is None:
        seq.logprobs = []
    seq.logprobs.append(TokenLogprob(token, chosen, top))


class Sampler:
    """Samples one token per sequence from float32 logits [S, V]."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        logits = logits.float().cpu()  # [S, V]
        grammars: dict[int, GrammarState] = {
            i: s.grammar for i, s in enumerate(seqs) if s.grammar is not None
        }
        apply_grammars(logits, grammars)
        for i, seq in enumerate(seqs):
            mask_min_tokens(logits, i, seq)
        tokens = logits.argmax(dim=-1).tolist()
        lp = None
        if any(s.tracks_logprobs for s in seqs):
            lp = torch.log_softmax(logits, dim=-1)  # the model's, before penalties/temperature
        for i, seq in enumerate(seqs):
            p = seq.params
            raw = logits[i]  # [V]
            row = process_row(raw, seq, p)
            if row is not raw:
                tokens[i] = int(row.argmax())
            if not p.greedy:
                probs = sampling_probs(row, p)
                if probs is None:  # overflow: the limit is greedy
                    continue
                gen = seq.generator if seq.generator is not None else self.generator
                tokens[i] = draw(probs, gen)
        if lp is not None:  # lp: [S, V] log-softmax of the (masked) logits
            for i, seq in enumerate(seqs):
                if seq.tracks_logprobs:
                    record_logprob(seq, lp[i], tokens[i])
        return tokens
