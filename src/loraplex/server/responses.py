"""Building OpenAI responses: usage, logprobs (completion and chat shapes), the adapter headers,
SSE framing of streams, and the finished JSON or streamed response itself.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from loraplex.engine.client import EngineClient, PreparedRequest, StreamStalledError
from loraplex.outputs import RequestOutput, TokenLogprob
from loraplex.server.admission import Admission, EngineStreamingResponse
from loraplex.server.composition import Served, parts_of
from loraplex.server.errors import as_api_error
from loraplex.server.metrics import ServerMetrics
from loraplex.server.state import ServedAdapter


def usage_of(prepared: list[PreparedRequest], finals: dict[int, RequestOutput]) -> dict[str, Any]:
    """OpenAI's ``usage`` of a call: prompt, completion and cached prompt tokens."""
    prompt = sum(len(p.prompt_token_ids) for p in prepared)
    completion = sum(len(o.token_ids) for r in finals.values() for o in r.outputs)
    cached = sum(r.num_cached_tokens for r in finals.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class TokenText:
    """Token id -> its name in logprobs and its bytes (:class:`~loraplex.engine.vocab.TokenVocab`:
    byte tokens that are not whole characters keep their own piece, so none merge);
    ``token_id:<id>`` without a tokenizer or with vLLM's ``return_tokens_as_token_ids``."""

    def __init__(self, client: EngineClient, *, as_ids: bool = False) -> None:
        self.client = client
        self.as_ids = as_ids or not client.has_tokenizer

    @property
    def has_tokenizer(self) -> bool:
        return self.client.has_tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self.client.decode(token_ids)

    def __call__(self, tid: int) -> str:
        if self.as_ids:
            return f"token_id:{tid}"
        return self.client.vocab.text(tid)

    def bytes_of(self, tid: int) -> list[int]:
        if not self.client.has_tokenizer:
            return list(f"token_id:{tid}".encode())
        return list(self.client.vocab.token_bytes(tid))


@dataclass(frozen=True)
class LogprobStep:
    """One position of a logprobs list: its token, that token's logprob and the top
    alternatives (None for both at the first prompt token, which nothing predicts)."""

    token_id: int
    logprob: float | None
    top: dict[int, float] | None

    @classmethod
    def of(cls, lp: TokenLogprob) -> LogprobStep:
        return cls(lp.token_id, lp.logprob, lp.top)


def prompt_steps(
    prompt_ids: list[int], prompt_logprobs: list[dict[int, float] | None] | None
) -> list[LogprobStep]:
    """The prompt tokens as logprob steps (``prompt_logprobs``: the engine's, one entry per
    prompt token, each holding the token's own logprob and the top alternatives)."""
    if prompt_logprobs is None:
        raise RuntimeError("the engine returned no prompt logprobs")
    out = []
    for tid, d in zip(prompt_ids, prompt_logprobs, strict=True):
        if d is None:
            out.append(LogprobStep(tid, None, None))
        else:
            out.append(LogprobStep(tid, d[tid], {t: v for t, v in d.items() if t != tid}))
    return out


def _finite(v: float) -> float:
    """OpenAI's stand-in for -inf (JSON has no infinities)."""
    return max(v, -9999.0)


def completion_logprobs(
    steps: list[LogprobStep], text_of: TokenText, offset: int, num_top: int
) -> dict[str, Any]:
    """``/v1/completions`` logprobs: tokens, their logprobs, top alternatives, text offsets.
    Each ``top_logprobs`` entry holds the token itself and the ``num_top`` most likely
    (OpenAI: up to logprobs + 1 entries); keys are token names, so distinct tokens never
    share an entry."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for st in steps:
        piece = text_of(st.token_id)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
        if st.logprob is None or st.top is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(st.logprob))
        best = sorted(st.top.items(), key=lambda kv: -kv[1])[:num_top]
        top: dict[str, float] = {}
        owner: dict[str, int] = {}
        for t, v in [(st.token_id, st.logprob), *best]:
            name = text_of(t)
            if owner.get(name, t) != t:  # two ids with the same bytes: keep both entries
                name = f"token_id:{t}"
            owner[name] = t
            top[name] = _finite(v)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(lps: list[TokenLogprob], text_of: TokenText) -> dict[str, Any]:
    """``/v1/chat/completions`` logprobs: one entry per token with its bytes and the top
    alternatives, most likely first."""

    def entry(tid: int, v: float) -> dict[str, Any]:
        return {"token": text_of(tid), "logprob": _finite(v), "bytes": text_of.bytes_of(tid)}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [
                    entry(t, v) for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])
                ],
            }
            for lp in lps
        ]
    }


def prompt_logprobs_json(
    prompt_ids: list[int],
    prompt_logprobs: list[dict[int, float] | None] | None,
    num_top: int,
    text_of: TokenText,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or token id -> {logprob,
    rank, decoded_token}. Ranks of the ``num_top`` most likely are exact (1: the most
    likely); the prompt token's own entry, when it is not among them, has rank None (its
    place in the whole vocabulary is not computed)."""
    if prompt_logprobs is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, d in zip(prompt_ids, prompt_logprobs, strict=True):
        if d is None:
            out.append(None)
            continue
        ranked = sorted(d.items(), key=lambda kv: -kv[1])
        extra = len(d) > num_top  # the prompt token came on top of the num_top best
        entries: dict[str, dict[str, Any]] = {}
        rank = 0
        for t, v in ranked:
            own_extra = extra and t == tid
            if not own_extra:
                rank += 1
            entries[str(t)] = {
                "logprob": _finite(v),
                "rank": None if own_extra else rank,
                "decoded_token": text_of(t),
            }
        out.append(entries)
    return out


def adapter_header(outs: list[PreparedRequest], lora: Served | None) -> dict[str, str]:
    """Which adapter revision served the request, whether it was warm on arrival, whether
    it came through the active revision or a canary, and for an activated LoRA whether each
    prompt held its invocation (``x-loraplex-alora: invoked``, ``not-invoked``: the base model
    served it; a list in prompt order when the prompts differ). A composition lists each
    component (``alpha;revision=..;sha256=..;scale=0.5, style;...``) and each one's route."""
    parts = parts_of(lora)
    if not parts:
        return {}
    composed = not isinstance(lora, ServedAdapter)
    warm = all(p.adapter_warm for p in outs)
    headers = {
        "x-loraplex-adapter": ", ".join(
            f"{p.spec.name};revision={p.spec.ref.revision};sha256={p.spec.sha256[:16]}"
            + (f";scale={k:g}" if composed else "")
            for p, k in parts
        ),
        "x-loraplex-adapter-state": "warm" if warm else "cold",
        "x-loraplex-adapter-route": ", ".join(p.route for p, _ in parts),
    }
    invoked = ["invoked" if p.alora_invoked else "not-invoked" for p in outs]
    if outs and outs[0].alora_invoked is not None:  # an activated LoRA: one value per prompt
        headers["x-loraplex-alora"] = invoked[0] if len(set(invoked)) == 1 else ",".join(invoked)
    return headers


async def sse_events(
    chunks: Callable[[dict[int, RequestOutput]], AsyncIterator[dict[str, Any]]],
    base: dict[str, Any],
    prepared: list[PreparedRequest],
    stream_options: Any,
) -> AsyncIterator[bytes]:
    """SSE framing shared by both routes: ``base`` fields on every chunk, ``usage: null`` (or
    the chunk's own running usage, ``continuous_usage_stats``) then a final usage chunk when
    asked for, an error event instead of a hang, then ``[DONE]``. A stream aborted because its
    client stopped reading is not finished: its error propagates and the response is cut
    (:class:`EngineStreamingResponse`)."""
    include_usage = bool(stream_options and stream_options.include_usage)
    finals: dict[int, RequestOutput] = {}
    head = _json(base)[:-1].encode()  # '{"id": ..., "model": ...' (encoded once per stream)
    try:
        async for c in chunks(finals):
            if include_usage:
                c.setdefault("usage", None)
            if not c or not head[1:] or not base.keys().isdisjoint(c):
                yield _sse({**base, **c})
                continue
            # byte for byte _sse({**base, **c}): the base fields, then the chunk's own
            yield b"".join((b"data: ", head, b", ", _json(c)[1:].encode(), b"\n\n"))
        if include_usage:
            yield _sse({**base, "choices": [], "usage": usage_of(prepared, finals)})
    except StreamStalledError:
        raise
    except Exception as e:
        yield _sse(as_api_error(e).body())
    yield _DONE


def _json(obj: Any) -> str:
    """ASCII-only JSON: line-based clients split raw U+0085 / U+2028."""
    return json.dumps(obj, ensure_ascii=True)


def _sse(obj: Any) -> bytes:
    """One SSE event (ASCII-only JSON)."""
    return f"data: {_json(obj)}\n\n".encode()


_DONE = b"data: [DONE]\n\n"


def ok_json(
    metrics: ServerMetrics,
    base: dict[str, Any],
    choices: list[dict[str, Any]],
    usage: dict[str, Any],
    headers: dict[str, str],
) -> JSONResponse:
    """A finished (non-streamed) completion: ``base`` fields (id, object, created, model),
    its choices and usage."""
    metrics.requests.labels(status="200").inc()
    return JSONResponse({**base, "choices": choices, "usage": usage}, headers=headers)


def ok_stream(
    metrics: ServerMetrics,
    events: AsyncIterator[bytes],
    admission: Admission,
    headers: dict[str, str],
) -> EngineStreamingResponse:
    """A streamed completion; the admission closes when the stream does."""
    metrics.requests.labels(status="200").inc()
    return EngineStreamingResponse(
        events,
        on_close=admission.close,
        stalled=admission.stalled,
        media_type="text/event-stream",
        headers=headers,
    )
