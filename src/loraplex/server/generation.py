"""Running an admitted call's engine requests: prepare them all in the worker pool, run them
concurrently, and hand their progress on as outputs (:func:`collect`) or as per-completion
deltas for streaming (:func:`deltas`), observing latency metrics on the way. A client that
goes away cancels its work (:func:`unless_disconnected`), which aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from loraplex.engine.client import EngineClient, PreparedRequest
from loraplex.outputs import CompletionOutput, RequestOutput, TokenLogprob
from loraplex.registry import Principal
from loraplex.requests import GenerationRequest
from loraplex.server.admission import Admission
from loraplex.server.errors import APIError
from loraplex.server.metrics import ServerMetrics


@dataclass
class _Tracked:
    """Latency bookkeeping of one engine request."""

    arrival: float
    state: str  # warm | cold
    first_token: float | None = None


@dataclass
class Delta:
    """What one completion gained by one generated token (or, with no token, its finish)."""

    prompt_index: int
    output: CompletionOutput
    text: str  # the token's text (may be empty: part of a character, or held back)
    text_offset: int  # where ``text`` starts in the completion's text
    logprobs: list[TokenLogprob] | None  # the token's, when asked for
    done: bool
    token_ids: list[int]  # the token (empty for a finish without one)
    source: RequestOutput  # the request output this came from (prompt logprobs, usage)
    num_tokens: int  # tokens of the completion streamed up to and including this one


def prefix_cache_salt(principal: Principal, body_salt: str | None) -> str | None:
    """The prefix-cache salt of a call: for a tenant's key its tenant plus the body's
    ``cache_salt`` (so no tenant's cache hits reveal another's prompts), for operator traffic
    (no tenant) the body's ``cache_salt`` alone (None: shared, as in vLLM). The two forms
    never coincide."""
    if principal.tenant is not None:
        return "tenant:" + json.dumps([principal.tenant, body_salt])
    return None if body_salt is None else "salt:" + body_salt


async def prepare_all(
    client: EngineClient,
    admission: Admission,
    prompts: list[str | list[int]],
    template: GenerationRequest,
) -> list[PreparedRequest]:
    """Prepare ``template`` once per prompt concurrently (each with its prompt and the engine id
    ``{template.request_id}-{i}``; the template's own prompt is unused); if any fails, the others
    are discarded and its error raised. They become ``admission.prepared``."""
    results = await asyncio.gather(
        *(
            client.prepare(replace(template, request_id=f"{template.request_id}-{i}", prompt=p))
            for i, p in enumerate(prompts)
        ),
        return_exceptions=True,
    )
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        for r in results:
            if isinstance(r, PreparedRequest):
                client.discard(r)
        raise failed
    admission.prepared = results  # type: ignore[assignment]
    return results  # type: ignore[return-value]


async def stream_outputs(
    metrics: ServerMetrics, admission: Admission
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run an admission's prepared requests concurrently; yield (index, output) as they
    progress. Pull-based: a request's next output is taken from the engine only after the
    previous one was consumed, so a consumer that stops (a client that stops reading) leaves
    the outputs in the engine's per-request sinks, where they coalesce and the stream bounds
    apply. Closing the iterator aborts every request still running."""
    streams = [admission.generate(p) for p in admission.prepared]
    tracks = [
        _Tracked(p.request.arrival, "warm" if p.adapter_warm else "cold")
        for p in admission.prepared
    ]
    if len(streams) == 1:  # the common call: one prompt, n = 1; no future per output
        try:
            async for out in streams[0]:
                _observe(metrics, tracks[0], out)
                if out.finished:
                    admission.finals[0] = out
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    pending: dict[asyncio.Future[RequestOutput], int] = {}

    def arm(i: int) -> None:
        pending[asyncio.ensure_future(streams[i].__anext__())] = i

    try:
        for i in range(len(streams)):
            arm(i)
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: pending[f]):
                i = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                _observe(metrics, tracks[i], out)
                if out.finished:
                    admission.finals[i] = out
                yield i, out
                if not out.finished:
                    arm(i)
    finally:
        for fut in pending:
            fut.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def deltas(
    metrics: ServerMetrics, admission: Admission, finals: dict[int, RequestOutput]
) -> AsyncIterator[Delta]:
    """Each completion's progress as one delta per generated token (vLLM's stream shape: a
    reader that fell behind still gets every token as its own chunk), cut by the outputs'
    ``token_text_ends``; a completion's last delta carries its finish. Text held back by the
    engine (a possible stop string) comes with a later token. Finished request outputs are
    collected into ``finals``."""
    sent: dict[tuple[int, int], tuple[int, int]] = {}  # -> (chars, tokens) streamed
    finished: set[tuple[int, int]] = set()
    async for i, out in stream_outputs(metrics, admission):
        if out.finished:
            finals[i] = out
        for o in out.outputs:
            k = (i, o.index)
            if k in finished:
                continue
            t0, n0 = sent.get(k, (0, 0))
            done = o.finish_reason is not None
            n1 = len(o.token_ids)
            ends = o.token_text_ends
            for j in range(n0, n1):
                last = j == n1 - 1
                end = len(o.text) if last and done else min(ends[j], len(o.text))
                end = max(end, t0)
                lps = o.logprobs[j : j + 1] if o.logprobs is not None else None
                yield Delta(i, o, o.text[t0:end], t0, lps, done and last, o.token_ids[j : j + 1],
                            out, j + 1)  # fmt: skip
                t0 = end
            if n1 == n0 and (done or len(o.text) > t0):
                lps = [] if o.logprobs is not None else None
                yield Delta(i, o, o.text[t0:], t0, lps, done, [], out, n1)
                t0 = len(o.text)
            sent[k] = (t0, n1)
            if done:
                finished.add(k)


async def collect(metrics: ServerMetrics, admission: Admission) -> dict[int, RequestOutput]:
    """Run the admitted requests to the end; their final outputs by prompt index."""
    finals: dict[int, RequestOutput] = {}
    async for i, out in stream_outputs(metrics, admission):
        if out.finished:
            finals[i] = out
    return finals


def _observe(metrics: ServerMetrics, track: _Tracked, out: RequestOutput) -> None:
    now = time.monotonic()
    first = out.outputs[0] if out.outputs else None
    m = metrics
    if track.first_token is None and first is not None and first.token_ids:
        track.first_token = now
        m.ttft.labels(adapter_state=track.state).observe(now - track.arrival)
    if not out.finished:
        return
    m.e2e.labels(adapter_state=track.state).observe(now - track.arrival)
    for o in out.outputs:  # the token counters move per engine step (ServerMetrics._on_step)
        m.finished.labels(finished_reason=o.finish_reason or "unknown").inc()
    if first is not None and len(first.token_ids) > 1 and track.first_token is not None:
        tpot = (now - track.first_token) / (len(first.token_ids) - 1)
        m.tpot.labels(adapter_state=track.state).observe(tpot)


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise APIError(499, "client disconnected", "client_closed_request")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
