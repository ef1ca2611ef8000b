"""After sampling: each new token joins its sequence (text, stop strings, grammar, the finish
decision), and a request's state becomes the :class:`RequestOutput` snapshot its caller sees.
Loop thread only; the engine applies the finishes (scheduler, adapter references)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from loraplex.engine.intake import EngineRequest
from loraplex.engine.sequence import Sequence
from loraplex.outputs import CompletionOutput, RequestOutput
from loraplex.types import FinishReason

log = logging.getLogger(__name__)


def append_token(seq: Sequence, tok: int, now: float, eos_token_ids: set[int]) -> str | None:
    """Add the sampled ``tok`` to ``seq`` (its output ids, text and grammar); the finish reason
    when this token ends the sequence (its ``stop_reason`` set), else None."""
    if seq.first_token_time is None:
        seq.first_token_time = now
    seq.output_token_ids.append(tok)
    p = seq.params
    n_out = len(seq.output_token_ids)
    reason: str | None = None
    if tok in (p.stop_token_ids or ()) and n_out >= p.min_tokens:
        reason, seq.stop_reason = FinishReason.STOP.value, tok
    elif not p.ignore_eos and tok in eos_token_ids and n_out >= p.min_tokens:
        reason = FinishReason.STOP.value
    if seq.grammar is not None and reason is None:
        if not seq.grammar.accept(tok):  # the mask allows only accepted tokens
            log.warning("request %s: token %d rejected by its grammar", seq.request_id, tok)
            reason = FinishReason.STOP.value
        elif seq.grammar.terminated:  # complete, and its stop token came
            reason = FinishReason.STOP.value
    if reason is None and n_out >= seq.max_tokens:
        reason = FinishReason.LENGTH.value
    if seq.detokenizer is not None:
        before = len(seq.text)  # text of the first n_out - 1 tokens
        seq.detokenizer.add([tok])
        if reason is not None:
            seq.detokenizer.flush()
        seq.text = seq.detokenizer.text
        if p.stop and n_out == p.min_tokens:  # stop strings must end after this offset
            seq.stop_search_from = before
        if p.stop and n_out >= p.min_tokens and (reason is None or reason == "length"):
            for s in p.stop:  # type: ignore[union-attr]
                at = seq.text.find(s, max(0, max(before, seq.stop_search_from) - len(s) + 1))
                if at >= 0:
                    seq.text = seq.text[: at + (len(s) if p.include_stop_str_in_output else 0)]
                    reason, seq.stop_reason = FinishReason.STOP.value, s
                    break
    seq.token_text_ends.append(len(seq.text))
    return reason


def has_output(req: EngineRequest) -> bool:
    """Whether the request has an output to report now: a best_of request (which picks its n
    completions when all are done) only once finished."""
    p = req.seqs[0].params
    return p.num_seqs == p.n or all(s.is_finished for s in req.seqs)


def request_output(req: EngineRequest) -> RequestOutput:
    """The request's snapshot: its completions so far (best_of: the n best), text that may
    start a stop string held back until it is known not to."""
    seqs = req.seqs
    p = seqs[0].params
    if p.num_seqs > p.n:  # best_of: the n with the highest cumulative logprob, as vLLM
        seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: p.n]
    outs = []
    for i, s in enumerate(seqs):
        text = s.text
        if s.params.stop and not s.is_finished:  # hold back what may start a stop string
            hold = max(len(x) for x in s.params.stop) - 1  # type: ignore[union-attr]
            text = text[: max(0, len(text) - hold)]
        outs.append(
            CompletionOutput(
                index=i,
                text=text,
                token_ids=list(s.output_token_ids),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob if s.tracks_logprobs else None,
                token_text_ends=[min(e, len(text)) for e in s.token_text_ends],
            )
        )
    first = req.seqs[0]
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=outs,
        finished=all(s.is_finished for s in req.seqs),
        adapter=req.adapter_ref,
        num_cached_tokens=first.num_cached_tokens,
        # a copy (the dicts are never changed once made)
        prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
    )


def take_outputs(
    requests: dict[str, EngineRequest], request_ids: Iterable[str]
) -> list[RequestOutput]:
    """The outputs of the requests ``request_ids`` that have one now; a finished request leaves
    ``requests`` with its last output."""
    outputs = []
    for rid in request_ids:
        req = requests.get(rid)
        if req is None or not has_output(req):
            continue
        out = request_output(req)
        if out.finished:
            del requests[rid]
        outputs.append(out)
    return outputs
