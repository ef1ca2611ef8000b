"""Building OpenAI responses: usage, logprobs (completion and chat shapes), the adapter headers,
SSE framing of streams, and the finished JSON or streamed response itself.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse

from loraplex.engine.client import EngineClient, PreparedRequest
from loraplex.outputs import RequestOutput, TokenLogprob
from loraplex.server.admission import Admission, EngineStreamingResponse
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
    """Token id → text piece, for logprobs (``token_id:<id>`` without a tokenizer)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    @property
    def has_tokenizer(self) -> bool:
        return self.client.has_tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self.client.decode(token_ids)

    def __call__(self, tid: int) -> str:
        if not self.client.has_tokenizer:
            return f"token_id:{tid}"
        return self.client.decode([tid])


def completion_logprobs(lps: list[TokenLogprob], text_of: TokenText, offset: int) -> dict[str, Any]:
    """``/v1/completions`` logprobs: tokens, their logprobs, top alternatives, text offsets."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        piece = text_of(lp.token_id)
        tokens.append(piece)
        token_lps.append(lp.logprob)
        tops.append({text_of(t): v for t, v in lp.top.items()})
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(lps: list[TokenLogprob], text_of: TokenText) -> dict[str, Any]:
    """``/v1/chat/completions`` logprobs: one entry per token with its bytes and alternatives."""

    def entry(tid: int, v: float) -> dict[str, Any]:
        piece = text_of(tid)
        return {"token": piece, "logprob": v, "bytes": list(piece.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(t, v) for t, v in lp.top.items()],
            }
            for lp in lps
        ]
    }


def adapter_header(outs: list[PreparedRequest], lora: ServedAdapter | None) -> dict[str, str]:
    """Which adapter revision served the request, whether it was warm on arrival, and whether
    it came through the active revision or a canary."""
    if lora is None:
        return {}
    ref = lora.spec.ref
    warm = all(p.adapter_warm for p in outs)
    return {
        "x-loraplex-adapter": f"{ref.name};revision={ref.revision};sha256={ref.sha256[:16]}",
        "x-loraplex-adapter-state": "warm" if warm else "cold",
        "x-loraplex-adapter-route": lora.route,
    }


async def sse_events(
    chunks: Callable[[dict[int, RequestOutput]], AsyncIterator[dict[str, Any]]],
    base: dict[str, Any],
    prepared: list[PreparedRequest],
    stream_options: Any,
) -> AsyncIterator[bytes]:
    """SSE framing shared by both routes: ``base`` fields on every chunk, ``usage: null`` then a
    final usage chunk when asked for, an error event instead of a hang, then ``[DONE]``."""
    include_usage = bool(stream_options and stream_options.include_usage)
    finals: dict[int, RequestOutput] = {}
    try:
        async for c in chunks(finals):
            if include_usage:
                c["usage"] = None
            yield _sse({**base, **c})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": usage_of(prepared, finals)})
    except Exception as e:
        yield _sse(as_api_error(e).body())
    yield _DONE


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


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
