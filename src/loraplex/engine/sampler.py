"""Token sampling: greedy rows in one argmax, sampled rows with temperature / top-k / top-p."""

from __future__ import annotations

import torch

from loraplex.engine.sequence import Sequence
from loraplex.outputs import TokenLogprob


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


class Sampler:
    """Samples one token per sequence from float32 logits [S, V]."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        logits = logits.float().cpu()
        tokens = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.min_tokens and len(seq.output_token_ids) < p.min_tokens:
                row = logits[i].clone()  # no EOS and no stop id before min_tokens
                for t in (*seq.eos_token_ids, *(p.stop_token_ids or ())):
                    row[t] = float("-inf")
                logits[i] = row
                if p.greedy:
                    tokens[i] = int(row.argmax())
            if not p.greedy:
                row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
                probs = row.softmax(-1)
                if not bool(torch.isfinite(probs).all()):  # overflow: the limit is greedy
                    continue
                gen = seq.generator if seq.generator is not None else self.generator
                tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
        if any(s.params.logprobs is not None for s in seqs):
            self._logprobs(logits, seqs, tokens)
        return tokens

    @staticmethod
    def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> None:
        """Record the model's (pre-temperature) log-probabilities, like vLLM's default."""
        lp = torch.log_softmax(logits, dim=-1)
        for i, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None:
                continue
            top: dict[int, float] = {}
            if k > 0:
                vals, idx = torch.topk(lp[i], k)
                top = dict(zip(idx.tolist(), vals.tolist(), strict=True))
            chosen = float(lp[i, tokens[i]])
            seq.cumulative_logprob += chosen
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(TokenLogprob(tokens[i], chosen, top))
