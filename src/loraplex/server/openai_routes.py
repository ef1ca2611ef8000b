"""OpenAI's routes: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (streamed or
not).

A call is authenticated, its body bounded (prompts per call and the per-field caps of
:mod:`~loraplex.server.protocol`: 400 naming the field), its model name resolved to the base
model or an adapter revision (:meth:`ServerState.resolve_model`, in the I/O pool), admitted
with its sequence count (:func:`~loraplex.server.admission.admit`), its prompts prepared in the
worker pools and run by the engine; the admission closes when the response (or the stream) is
done. Model entries never show server paths: ``root`` is the base model's served name or the
adapter's ``name@revision``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from loraplex.outputs import CompletionOutput, RequestOutput, TokenLogprob
from loraplex.registry import Principal
from loraplex.requests import SamplingParams
from loraplex.server.admission import Admission, UsageRecord, admit, owned
from loraplex.server.auth import inference_principal
from loraplex.server.catalog import registration_order
from loraplex.server.errors import APIError
from loraplex.server.generation import (
    collect,
    deltas,
    prefix_cache_salt,
    prepare_all,
    unless_disconnected,
)
from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.server.responses import (
    TokenText,
    adapter_header,
    chat_logprobs,
    completion_logprobs,
    ok_json,
    ok_stream,
    sse_events,
    usage_of,
)
from loraplex.server.state import ServedAdapter, ServerState, get_state

router = APIRouter()


@router.get("/v1/models")
def list_models(
    principal: Principal = Depends(inference_principal),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    """The base model's names, then every adapter the caller may use (registration order)."""
    max_len = state.client.max_model_len
    data = [
        {
            "id": name,
            "object": "model",
            "created": state.started,
            "owned_by": "loraplex",
            "root": state.base_names[0],
            "parent": None,
            "max_model_len": max_len,
        }
        for name in state.base_names
    ]
    for sv in sorted(state.catalog.visible(principal), key=registration_order):
        m = sv.active
        data.append(
            {
                "id": sv.name,
                "object": "model",
                "created": int(m.activated_at or m.created_at),
                "owned_by": m.tenant or "loraplex",
                "root": f"{sv.name}@{m.revision}",
                "parent": state.base_names[0],
                "max_model_len": max_len,
                "revision": m.revision,
                "sha256": m.sha256,
            }
        )
    return {"object": "list", "data": data}


# -- completions -----------------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(
    body: CompletionRequest,
    request: Request,
    principal: Principal = Depends(inference_principal),
    state: ServerState = Depends(get_state),
) -> Response:
    arrival = time.monotonic()
    prompts = body.prompts()
    limit = state.config.max_prompts_per_request
    if len(prompts) > limit:
        raise APIError(
            400,
            f"prompt: {len(prompts)} prompts in one request; this server takes at most {limit}",
            param="prompt",
            code="too_many_prompts",
        )
    params = body.sampling_params()
    lora = await state.run_io(state.resolve_model, body.model, principal)
    param = "n" if params.n > 1 else "prompt"
    admission = admit(state, len(prompts) * params.n, principal, requests=len(prompts), param=param)
    admission.usage = UsageRecord(body.model, principal, lora)
    salt = prefix_cache_salt(principal, body.cache_salt)
    return await owned(
        admission,
        _completions(state, body, request, admission, lora, params, prompts, arrival, salt),
    )


async def _completions(
    state: ServerState,
    body: CompletionRequest,
    request: Request,
    admission: Admission,
    lora: ServedAdapter | None,
    params: SamplingParams,
    prompts: list[str | list[int]],
    arrival: float,
    cache_salt: str | None,
) -> Response:
    rid = f"cmpl-{uuid.uuid4().hex}"
    prepared = await prepare_all(
        state.client, admission, prompts, params, lora, arrival, rid, cache_salt=cache_salt
    )
    text_of = TokenText(state.client)
    created = int(time.time())
    n = params.n
    echo_text = [
        (p.request.prompt if p.request.prompt is not None else text_of.decode(p.prompt_token_ids))
        if body.echo and text_of.has_tokenizer
        else ""
        for p in prepared
    ]

    def choice(
        i: int,
        o: CompletionOutput,
        text: str,
        lps: list[TokenLogprob] | None,
        offset: int,
        finish: bool,
    ) -> dict[str, Any]:
        return {
            "index": i * n + o.index,
            "text": text,
            "logprobs": completion_logprobs(lps, text_of, offset) if lps is not None else None,
            "finish_reason": o.finish_reason if finish else None,
            "stop_reason": o.stop_reason if finish else None,
        }

    headers = adapter_header(prepared, lora)
    if body.stream:

        async def chunks(finals: dict[int, RequestOutput]) -> AsyncIterator[dict[str, Any]]:
            if body.echo:
                for i in range(len(prepared)):
                    for j in range(n):
                        echo = {"index": i * n + j, "text": echo_text[i], "logprobs": None,
                                "finish_reason": None, "stop_reason": None}  # fmt: skip
                        yield {"choices": [echo]}
            async for d in deltas(state.metrics, admission, finals):
                offset = d.text_offset + len(echo_text[d.prompt_index])
                c = choice(d.prompt_index, d.output, d.text, d.logprobs, offset, d.done)
                yield {"choices": [c]}

        base = {"id": rid, "object": "text_completion", "created": created,
                "model": body.model}  # fmt: skip
        events = sse_events(chunks, base, prepared, body.stream_options)
        return ok_stream(state.metrics, events, admission, headers)

    finals = await unless_disconnected(request, collect(state.metrics, admission))
    choices = [
        choice(i, o, echo_text[i] + o.text, o.logprobs, len(echo_text[i]), True)
        for i in sorted(finals)
        for o in finals[i].outputs
    ]
    base = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
    return ok_json(state.metrics, base, choices, usage_of(prepared, finals), headers)


# -- chat ------------------------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    principal: Principal = Depends(inference_principal),
    state: ServerState = Depends(get_state),
) -> Response:
    arrival = time.monotonic()
    params = body.sampling_params()
    messages = body.template_messages()
    lora = await state.run_io(state.resolve_model, body.model, principal)
    admission = admit(state, params.n, principal, requests=1, param="n")
    admission.usage = UsageRecord(body.model, principal, lora)
    salt = prefix_cache_salt(principal, body.cache_salt)
    return await owned(
        admission,
        _chat_completions(state, body, request, admission, lora, params, messages, arrival, salt),
    )


async def _chat_completions(
    state: ServerState,
    body: ChatCompletionRequest,
    request: Request,
    admission: Admission,
    lora: ServedAdapter | None,
    params: SamplingParams,
    messages: list[dict[str, Any]],
    arrival: float,
    cache_salt: str | None,
) -> Response:
    ids = await state.client.chat_template(messages, body.add_generation_prompt)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    prepared = await prepare_all(
        state.client, admission, [ids], params, lora, arrival, rid, cache_salt=cache_salt
    )
    text_of = TokenText(state.client)
    created = int(time.time())
    headers = adapter_header(prepared, lora)
    base = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": body.model,
    }

    if body.stream:

        async def chunks(finals: dict[int, RequestOutput]) -> AsyncIterator[dict[str, Any]]:
            yield {
                "choices": [
                    {"index": j, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}
                    for j in range(params.n)
                ]
            }  # fmt: skip
            async for d in deltas(state.metrics, admission, finals):
                o = d.output
                c: dict[str, Any] = {
                    "index": o.index,
                    "delta": {"content": d.text} if d.text else {},
                    "logprobs": chat_logprobs(d.logprobs, text_of) if d.logprobs else None,
                    "finish_reason": o.finish_reason if d.done else None,
                }
                if d.done:
                    c["stop_reason"] = o.stop_reason
                yield {"choices": [c]}

        events = sse_events(chunks, base, prepared, body.stream_options)
        return ok_stream(state.metrics, events, admission, headers)

    finals = await unless_disconnected(request, collect(state.metrics, admission))
    out = finals[0]
    choices = [
        {
            "index": o.index,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": chat_logprobs(o.logprobs, text_of) if o.logprobs is not None else None,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
        }
        for o in out.outputs
    ]
    final = {**base, "object": "chat.completion"}
    return ok_json(state.metrics, final, choices, usage_of(prepared, finals), headers)
