"""OpenAI's routes: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (streamed or
not), with vLLM's extensions.

A call is authenticated, its body bounded (prompts per call and the per-field caps of
:mod:`~loraplex.server.protocol`: 400 naming the field), its model name resolved to the base
model or an adapter revision, or with ``lora_scale`` / ``merged_adapters`` / ``lora_requests``
to a composition of adapter revisions, each resolved like ``model``
(:func:`~loraplex.server.composition.resolve_served`, in the I/O pool), admitted
with its sequence count (:func:`~loraplex.server.admission.admit`), its prompts prepared in the
worker pools and run by the engine; the admission closes when the response (or the stream) is
done. Model entries never show server paths: ``root`` is the base model's served name or the
adapter's ``name@revision``.

Streams send one chunk per generated token (vLLM's shape; a token that ends inside a
character sends empty text). ``echo`` with ``logprobs`` returns the prompt tokens' logprobs
first (the first token's is null), and ``max_tokens=0`` with ``echo`` returns the prompt alone:
what lm-eval's ``local-completions`` loglikelihood requests send. Tool calls: ``tool_choice``
``auto`` reads them out of the text with the ``--tool-call-parser``; ``required`` and a named
tool are enforced by a JSON schema (:mod:`~loraplex.server.tools`).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from loraplex.outputs import CompletionOutput, RequestOutput
from loraplex.registry import Principal
from loraplex.requests import GenerationRequest, SamplingParams
from loraplex.server.admission import Admission, UsageRecord, admit, owned
from loraplex.server.auth import inference_principal
from loraplex.server.catalog import registration_order
from loraplex.server.composition import Served, engine_adapter, resolve_served
from loraplex.server.errors import APIError
from loraplex.server.generation import (
    Delta,
    collect,
    deltas,
    prefix_cache_salt,
    prepare_all,
    unless_disconnected,
)
from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from loraplex.server.responses import (
    LogprobStep,
    TokenText,
    adapter_header,
    chat_logprobs,
    completion_logprobs,
    ok_json,
    ok_stream,
    prompt_logprobs_json,
    prompt_steps,
    sse_events,
    usage_of,
)
from loraplex.server.state import ServerState, get_state
from loraplex.server.tools import ToolCall, ToolParser, parse_required, tool_call_id, tool_parser
from loraplex.types import InvalidRequestError

# the engine names a grammar that does not compile by its kind; the client sent another field
_STRUCTURED_KINDS = frozenset({"json_schema", "regex", "choice", "grammar"})


@contextlib.contextmanager
def _structured_errors_named(body: CompletionRequest | ChatCompletionRequest) -> Iterator[None]:
    """Name the request's own field (``guided_regex``, ``response_format``, ...) in the error
    of a structured-output constraint the engine could not compile."""
    try:
        yield
    except InvalidRequestError as e:
        if e.param in _STRUCTURED_KINDS:
            e.param = body.structured_field()
        raise


router = APIRouter()


@router.get("/v1/models")
def list_models(
    principal: Principal = Depends(inference_principal),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    """The base model's names, then every adapter the caller may use (registration order),
    as vLLM's model cards: the base with ``parent`` null and ``root`` the model path, each
    adapter with ``parent`` its base model's served name (``base_model_name`` of its
    ``--lora-modules`` entry when that is a served name, else the first) and ``root`` its
    path or URI. Tenant keys never see server paths: for them ``root`` is the base's served
    name and ``name@revision`` for adapters."""
    operator = principal.tenant is None
    max_len = state.client.max_model_len
    first = state.base_names[0]
    parents = {
        m.name: m.base_model_name
        for m in state.config.lora_modules
        if m.base_model_name in state.base_names
    }
    data = [
        {
            "id": name,
            "object": "model",
            "created": state.started,
            "owned_by": "loraplex",
            "root": state.config.engine.model if operator else first,
            "parent": None,
            "max_model_len": max_len,
            "permission": [_permission(state.started)],
        }
        for name in state.base_names
    ]
    for sv in sorted(state.catalog.visible(principal), key=registration_order):
        m = sv.active
        created = int(m.activated_at or m.created_at)
        data.append(
            {
                "id": sv.name,
                "object": "model",
                "created": created,
                "owned_by": m.tenant or "loraplex",
                "root": m.source_uri if operator else f"{sv.name}@{m.revision}",
                "parent": parents.get(sv.name, first),
                "max_model_len": max_len,
                "permission": [_permission(created)],
                "revision": m.revision,
                "sha256": m.sha256,
                # an activated LoRA applies from the last occurrence of these tokens on
                "alora_invocation_tokens": (
                    None if m.alora_invocation_tokens is None else list(m.alora_invocation_tokens)
                ),
            }
        )
    return {"object": "list", "data": data}


def _permission(created: int) -> dict[str, Any]:
    """vLLM's ``ModelPermission`` entry of a model card (its defaults)."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def _usage_chunk(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _continuous_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    so = body.stream_options
    return bool(so and so.include_usage and so.continuous_usage_stats)


def _response_id(prefix: str, body: CompletionRequest | ChatCompletionRequest) -> str:
    """vLLM's response id: the body's ``request_id`` if given (engine ids stay our own)."""
    return f"{prefix}-{body.request_id if body.request_id else uuid.uuid4().hex}"


def _engine_request(
    prefix: str,
    body: CompletionRequest | ChatCompletionRequest,
    principal: Principal,
    params: SamplingParams,
    lora: Served | None,
    arrival: float,
) -> GenerationRequest:
    """What one call asks the engine for, but its prompts: :func:`prepare_all` gives each prompt
    a copy with its own engine id ``{prefix}-{uuid}-{i}`` (ours, never the body's
    ``request_id``). A per-request field the body carries is read here, once for both routes."""
    return GenerationRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt="",  # each prompt's own (prepare_all)
        params=params,
        adapter=engine_adapter(lora),
        arrival=arrival,
        cache_salt=prefix_cache_salt(principal, body.cache_salt),
    )


async def _engine_prompts(
    state: ServerState, prompts: list[str | list[int]], add_special: bool, truncate: int | None
) -> list[str | list[int]]:
    """The prompts as the engine takes them: text tokenized here when special tokens are
    left out or the prompt is truncated (``truncate_prompt_tokens``: keep the last k)."""
    if add_special and truncate is None:
        return prompts
    out: list[str | list[int]] = []
    for p in prompts:
        ids = list(p) if isinstance(p, list) else await state.client.tokenize(p, add_special)
        out.append(ids[-truncate:] if truncate is not None else ids)
    return out


# -- completions -----------------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(
    body: CompletionRequest,
    request: Request,
    principal: Principal = Depends(inference_principal),
    state: ServerState = Depends(get_state),
) -> Response:
    arrival = time.monotonic()
    state.unknown_fields.note("/v1/completions", body)
    prompts = body.prompts()
    limit = state.config.max_prompts_per_request
    if len(prompts) > limit:
        raise APIError(
            400,
            f"prompt: {len(prompts)} prompts in one request; this server takes at most {limit}",
            param="prompt",
            code="too_many_prompts",
        )
    params = body.sampling_params(state.client.generation_defaults)
    lora = await state.run_io(resolve_served, state, body, principal)
    per_prompt = max(params.n, params.best_of or 1)
    param = ("best_of" if per_prompt > params.n else "n") if per_prompt > 1 else "prompt"
    admission = admit(
        state, len(prompts) * per_prompt, principal, requests=len(prompts), param=param, lora=lora
    )
    admission.usage = UsageRecord(body.model, principal, lora)
    template = _engine_request("cmpl", body, principal, params, lora, arrival)
    return await owned(
        admission, _completions(state, body, request, admission, lora, template, prompts)
    )


async def _completions(
    state: ServerState,
    body: CompletionRequest,
    request: Request,
    admission: Admission,
    lora: Served | None,
    template: GenerationRequest,
    prompts: list[str | list[int]],
) -> Response:
    rid = _response_id("cmpl", body)
    params = template.params
    engine_prompts = await _engine_prompts(
        state, prompts, body.special_tokens, body.truncate_prompt_tokens
    )
    with _structured_errors_named(body):
        prepared = await prepare_all(state.client, admission, engine_prompts, template)
    text_of = TokenText(state.client, as_ids=bool(body.return_tokens_as_token_ids))
    created = int(time.time())
    n = params.n
    whole = body.truncate_prompt_tokens is None  # a text prompt echoes as it was sent
    echo_text = [
        (p if isinstance(p, str) and whole else text_of.decode(q.prompt_token_ids))
        if body.echo and text_of.has_tokenizer
        else ""
        for p, q in zip(prompts, prepared, strict=True)
    ]
    num_top = body.logprobs or 0

    def prompt_part(out: RequestOutput) -> list[LogprobStep]:
        return prompt_steps(out.prompt_token_ids, out.prompt_logprobs)

    def extras(i: int, out: RequestOutput, o: CompletionOutput | None) -> dict[str, Any]:
        """prompt_logprobs and return_token_ids fields of a choice."""
        extra: dict[str, Any] = {}
        if params.prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs_json(
                out.prompt_token_ids, out.prompt_logprobs, params.prompt_logprobs, text_of
            )
        if body.return_token_ids:
            extra["prompt_token_ids"] = list(out.prompt_token_ids)
            if o is not None:
                extra["token_ids"] = [] if body.echo_only else list(o.token_ids)
        return extra

    headers = adapter_header(prepared, lora)
    if body.stream:
        continuous = _continuous_usage(body)

        async def chunks(finals: dict[int, RequestOutput]) -> AsyncIterator[dict[str, Any]]:
            started: set[tuple[int, int]] = set()
            async for d in deltas(state.metrics, admission, finals):
                i, o = d.prompt_index, d.output
                first = (i, o.index) not in started
                started.add((i, o.index))
                c: dict[str, Any] = {"index": i * n + o.index, "finish_reason": None,
                                     "stop_reason": None}  # fmt: skip
                if body.echo_only:
                    if not d.done:
                        continue
                    steps = prompt_part(d.source) if body.logprobs is not None else None
                    c["text"] = echo_text[i]
                    offset = 0
                else:
                    steps = None
                    if body.logprobs is not None:
                        steps = [LogprobStep.of(lp) for lp in d.logprobs or []]
                    offset = d.text_offset + len(echo_text[i])
                    c["text"] = d.text
                    if body.echo and first:  # the prompt comes with the first token
                        c["text"] = echo_text[i] + d.text
                        offset = 0
                        if steps is not None:
                            steps = prompt_part(d.source) + steps
                c["logprobs"] = (
                    completion_logprobs(steps, text_of, offset, num_top)
                    if steps is not None
                    else None
                )
                if d.done:
                    c["finish_reason"], c["stop_reason"] = o.finish_reason, o.stop_reason
                if body.return_token_ids:
                    c["token_ids"] = [] if body.echo_only else d.token_ids
                    if first:
                        c["prompt_token_ids"] = list(d.source.prompt_token_ids)
                chunk: dict[str, Any] = {"choices": [c]}
                if continuous:
                    k = 0 if body.echo_only else d.num_tokens
                    chunk["usage"] = _usage_chunk(len(d.source.prompt_token_ids), k)
                yield chunk

        base = {"id": rid, "object": "text_completion", "created": created,
                "model": body.model}  # fmt: skip
        events = sse_events(chunks, base, prepared, body.stream_options)
        return ok_stream(state.metrics, events, admission, headers)

    finals = await unless_disconnected(request, collect(state.metrics, admission))
    choices = []
    for i in sorted(finals):
        out = finals[i]
        for o in out.outputs:
            steps: list[LogprobStep] | None = None
            if body.echo_only:
                text = echo_text[i]
                if body.logprobs is not None:
                    steps = prompt_part(out)
            else:
                text = echo_text[i] + o.text
                if body.logprobs is not None:
                    steps = [LogprobStep.of(lp) for lp in o.logprobs or []]
                    if body.echo:
                        steps = prompt_part(out) + steps
            offset = 0 if body.echo else len(echo_text[i])
            choices.append(
                {
                    "index": i * n + o.index,
                    "text": text,
                    "logprobs": completion_logprobs(steps, text_of, offset, num_top)
                    if steps is not None
                    else None,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                    **extras(i, out, o),
                }
            )
    base = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
    return ok_json(state.metrics, base, choices, usage_of(prepared, finals), headers)


# -- chat ------------------------------------------------------------------------------------------
@dataclass
class _ToolMode:
    """How a chat call's output becomes tool calls: ``kind`` none | auto | required | named."""

    kind: str
    parser: ToolParser | None = None
    name: str | None = None  # the named tool
    parallel: bool = True  # parallel_tool_calls: False keeps the first call only

    def calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.parallel else calls[:1]


def _tool_mode(state: ServerState, body: ChatCompletionRequest) -> _ToolMode:
    choice = body.effective_tool_choice
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        return _ToolMode("named", name=choice.function.name, parallel=parallel)
    if choice == "required":
        return _ToolMode("required", parallel=parallel)
    if choice == "auto":
        cfg = state.config
        if not (cfg.enable_auto_tool_choice and cfg.tool_call_parser):
            raise APIError(
                400,
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                'and --tool-call-parser (or send tool_choice "none", "required" or a '
                "named tool)",
                param="tool_choice",
            )
        try:
            parser = tool_parser(cfg.tool_call_parser)
        except ValueError as e:
            raise APIError(500, str(e), "server_error") from e
        return _ToolMode("auto", parser=parser, parallel=parallel)
    return _ToolMode("none")


@dataclass
class _Message:
    """A finished choice's message: content, tool calls, and the finish reason to report."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None


def _message(mode: _ToolMode, o: CompletionOutput) -> _Message:
    """What a finished output says, under the call's tool mode (vLLM's finish reasons:
    ``tool_calls`` when calls were read out of auto text or required ones ended normally)."""
    if mode.kind == "named":
        assert mode.name is not None
        return _Message("", [ToolCall(mode.name, o.text, tool_call_id())], o.finish_reason)
    if mode.kind == "required":
        calls = parse_required(o.text)
        if calls is None:  # cut short (length): what came is content
            return _Message(o.text, [], o.finish_reason)
        finish = "tool_calls" if o.finish_reason == "stop" else o.finish_reason
        return _Message("", mode.calls(calls), finish)
    if mode.kind == "auto":
        assert mode.parser is not None
        ex = mode.parser.extract(o.text)
        if ex.calls:
            return _Message(ex.content, mode.calls(ex.calls), "tool_calls")
    return _Message(o.text, [], o.finish_reason)


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    principal: Principal = Depends(inference_principal),
    state: ServerState = Depends(get_state),
) -> Response:
    arrival = time.monotonic()
    state.unknown_fields.note("/v1/chat/completions", body)
    params = body.sampling_params(state.client.generation_defaults)
    mode = _tool_mode(state, body)
    messages = body.template_messages()
    lora = await state.run_io(resolve_served, state, body, principal)
    per_prompt = max(params.n, params.best_of or 1)
    param = "best_of" if per_prompt > params.n else "n"
    admission = admit(state, per_prompt, principal, requests=1, param=param, lora=lora)
    admission.usage = UsageRecord(body.model, principal, lora)
    template = _engine_request("chatcmpl", body, principal, params, lora, arrival)
    return await owned(
        admission,
        _chat_completions(state, body, request, admission, lora, template, messages, mode),
    )


async def _chat_completions(
    state: ServerState,
    body: ChatCompletionRequest,
    request: Request,
    admission: Admission,
    lora: Served | None,
    template: GenerationRequest,
    messages: list[dict[str, Any]],
    mode: _ToolMode,
) -> Response:
    params = template.params
    ids = await state.client.chat_template(
        messages,
        body.generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,  # None: the tokenizer's (or --chat-template)
        chat_template_kwargs=body.chat_template_kwargs,
        tools=body.template_tools(),
        documents=body.documents,
        add_special_tokens=body.special_tokens,
    )
    if body.truncate_prompt_tokens is not None:
        ids = ids[-body.truncate_prompt_tokens :]
    rid = _response_id("chatcmpl", body)
    with _structured_errors_named(body):
        prepared = await prepare_all(state.client, admission, [ids], template)
    text_of = TokenText(state.client, as_ids=bool(body.return_tokens_as_token_ids))
    created = int(time.time())
    headers = adapter_header(prepared, lora)
    role = body.response_role
    # vLLM's chat echo: the last message's content comes first when its role is the reply's
    last = messages[-1]
    echo = str(last.get("content") or "") if body.echo and last.get("role") == role else ""
    base = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": body.model,
    }

    if body.stream:
        continuous = _continuous_usage(body)
        num_prompt = len(ids)

        async def chunks(finals: dict[int, RequestOutput]) -> AsyncIterator[dict[str, Any]]:
            opening = {"role": role, "content": ""}
            first: dict[str, Any] = {
                "choices": [
                    {"index": j, "delta": dict(opening), "logprobs": None, "finish_reason": None}
                    for j in range(params.n)
                ]
            }  # fmt: skip
            if body.return_token_ids:
                first["prompt_token_ids"] = list(ids)
            yield first
            if echo:
                yield {
                    "choices": [
                        {"index": j, "delta": {"content": echo}, "logprobs": None,
                         "finish_reason": None}
                        for j in range(params.n)
                    ]
                }  # fmt: skip
            streamer = _ChatStreamer(mode)
            async for d in deltas(state.metrics, admission, finals):
                o = d.output
                delta, finish = streamer.step(d)
                lps = chat_logprobs(d.logprobs, text_of) if d.logprobs else None
                if delta is None and lps is None and not d.done:
                    continue  # held back (a possible tool call): nothing to send yet
                c: dict[str, Any] = {
                    "index": o.index,
                    "delta": delta or {},
                    "logprobs": lps,
                    "finish_reason": finish if d.done else None,
                }
                if d.done:
                    c["stop_reason"] = o.stop_reason
                if body.return_token_ids:
                    c["token_ids"] = d.token_ids
                chunk: dict[str, Any] = {"choices": [c]}
                if continuous:
                    chunk["usage"] = _usage_chunk(num_prompt, d.num_tokens)
                yield chunk

        events = sse_events(chunks, base, prepared, body.stream_options)
        return ok_stream(state.metrics, events, admission, headers)

    finals = await unless_disconnected(request, collect(state.metrics, admission))
    out = finals[0]
    choices = []
    for o in out.outputs:
        m = _message(mode, o)
        message: dict[str, Any] = {
            "role": role,
            "content": echo + m.content if m.content is not None else (echo or None),
        }
        if m.calls:
            message["tool_calls"] = [c.as_dict() for c in m.calls]
        choices.append(
            {
                "index": o.index,
                "message": message,
                "logprobs": chat_logprobs(o.logprobs, text_of) if o.logprobs is not None else None,
                "finish_reason": m.finish_reason,
                "stop_reason": o.stop_reason,
                **({"token_ids": list(o.token_ids)} if body.return_token_ids else {}),
            }
        )
    final = {**base, "object": "chat.completion"}
    if body.return_token_ids:
        final["prompt_token_ids"] = list(out.prompt_token_ids)
    if params.prompt_logprobs is not None:
        final["prompt_logprobs"] = prompt_logprobs_json(
            out.prompt_token_ids, out.prompt_logprobs, params.prompt_logprobs, text_of
        )
    return ok_json(state.metrics, final, choices, usage_of(prepared, finals), headers)


class _ChatStreamer:
    """Turns per-token deltas into chat ``delta`` objects under a tool mode: plain content
    token by token; a named tool's arguments token by token; ``required`` calls at the end;
    ``auto`` content as soon as it cannot be the start of a tool call, the calls at the end."""

    def __init__(self, mode: _ToolMode) -> None:
        self.mode = mode
        self.sent: dict[int, int] = {}  # choice -> content characters sent (auto)
        self.named_open: set[int] = set()

    def step(self, d: Delta) -> tuple[dict[str, Any] | None, str | None]:
        """The delta to send for ``d`` (None: nothing yet) and, when done, the finish reason."""
        o, kind = d.output, self.mode.kind
        if kind == "none":
            return {"content": d.text}, o.finish_reason
        if kind == "named":
            if o.index not in self.named_open:
                self.named_open.add(o.index)
                call = {"index": 0, "id": tool_call_id(), "type": "function",
                        "function": {"name": self.mode.name, "arguments": d.text}}  # fmt: skip
                return {"tool_calls": [call]}, o.finish_reason
            if not d.text:
                return None, o.finish_reason
            return {"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]}, (
                o.finish_reason
            )
        so_far = o.text[: d.text_offset + len(d.text)]
        if not d.done:
            if kind == "required":
                return None, None
            assert self.mode.parser is not None
            sent = self.sent.get(o.index, 0)
            cut = self.mode.parser.content_end(so_far)
            if cut <= sent:
                return None, None
            self.sent[o.index] = cut
            return {"content": so_far[sent:cut]}, None
        m = _message(self.mode, o)
        sent = self.sent.get(o.index, 0)
        delta: dict[str, Any] = {}
        rest = (m.content or "")[sent:]
        if rest:
            delta["content"] = rest
        if m.calls:
            delta["tool_calls"] = [{"index": j, **c.as_dict()} for j, c in enumerate(m.calls)]
        return (delta or None), m.finish_reason
