"""Admission of one HTTP call: per-tenant limits (429), the shared ``--max-waiting`` queue (503),
and the :class:`Admission` that holds the call's engine requests until it is done — for a
stream, until the stream ends however it ends (:class:`EngineStreamingResponse`) — and then
writes its usage line.

Admission counts sequences, not calls: a call with ``p`` prompts and ``n`` completions each
needs ``p x n`` places in the waiting count (and in its tenant's in-flight limit); a call that
needs more places than ``--max-waiting`` allows at all is a 400 (retrying cannot help).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response, StreamingResponse

from loraplex.engine.client import EngineClient, PreparedRequest, RequestStream
from loraplex.logs import fields_of
from loraplex.outputs import RequestOutput
from loraplex.registry import Principal
from loraplex.server.errors import APIError
from loraplex.server.limits import TenantLimitExceeded
from loraplex.server.state import ServedAdapter, ServerState

log = logging.getLogger("loraplex.server.app")
usage_log = logging.getLogger("loraplex.usage")
"""One JSON line per finished call: tenant, key, adapter name, revision, sha256, tokens."""


@dataclass
class UsageRecord:
    """One line of the usage log: who ran which adapter revision, and how many tokens."""

    model: str
    principal: Principal
    lora: ServedAdapter | None

    def log(self, prepared: list[PreparedRequest], finals: dict[int, RequestOutput]) -> None:
        if not usage_log.isEnabledFor(logging.INFO):
            return
        ref = self.lora.spec.ref if self.lora else None
        record = {
            "model": self.model,
            "tenant": self.principal.tenant,
            "key_id": self.principal.key_id,
            "adapter": ref.name if ref else None,
            "revision": ref.revision if ref else None,
            "sha256": ref.sha256 if ref else None,
            "route": self.lora.route if self.lora else None,
            "requests": len(prepared),
            "finished": len(finals),
            "prompt_tokens": sum(len(p.prompt_token_ids) for p in prepared),
            "completion_tokens": sum(len(o.token_ids) for r in finals.values() for o in r.outputs),
        }
        usage_log.info(json.dumps(record, sort_keys=True), extra=fields_of(record))


request_log = logging.getLogger("loraplex.requests")
"""One line per finished call (unless ``--disable-log-requests``); at debug level also its
prompts (``--max-log-len`` characters) and sampling parameters."""


@dataclass(frozen=True)
class RequestLog:
    """How calls are logged: ``max_log_len`` characters of each prompt at debug level."""

    max_log_len: int | None = None

    def log(
        self,
        usage: UsageRecord | None,
        prepared: list[PreparedRequest],
        finals: dict[int, RequestOutput],
        seconds: float,
    ) -> None:
        if not prepared or not request_log.isEnabledFor(logging.INFO):
            return
        call_id = prepared[0].request_id.rpartition("-")[0] or prepared[0].request_id
        ref = usage.lora.spec.ref if usage is not None and usage.lora else None
        reasons = sorted(
            {o.finish_reason or "none" for r in finals.values() for o in r.outputs}
        ) or ["unfinished"]
        fields = {
            "request_id": call_id,
            "model": usage.model if usage is not None else None,
            "adapter": ref.name if ref else None,
            "revision": ref.revision if ref else None,
            "tenant": usage.principal.tenant if usage is not None else None,
            "prompts": len(prepared),
            "finished": len(finals),
            "prompt_tokens": sum(len(p.prompt_token_ids) for p in prepared),
            "completion_tokens": sum(len(o.token_ids) for r in finals.values() for o in r.outputs),
            "cached_tokens": sum(r.num_cached_tokens for r in finals.values()),
            "finish_reasons": reasons,
            "seconds": round(seconds, 4),
        }
        adapter = f" adapter={ref.name}@{ref.revision} ({ref.sha256[:12]})" if ref else ""
        tenant = f" tenant={fields['tenant']}" if fields["tenant"] else ""
        request_log.info(
            "request %s model=%s%s%s prompts=%d prompt_tokens=%d completion_tokens=%d "
            "cached_tokens=%d finish=%s %.3fs",
            call_id,
            fields["model"],
            adapter,
            tenant,
            len(prepared),
            fields["prompt_tokens"],
            fields["completion_tokens"],
            fields["cached_tokens"],
            ",".join(reasons),
            seconds,
            extra=fields_of(fields),
        )
        if request_log.isEnabledFor(logging.DEBUG):
            for p in prepared:
                prompt = p.request.prompt
                if prompt is not None and self.max_log_len is not None:
                    prompt = prompt[: self.max_log_len]
                params = p.request.seqs[0].params if p.request.seqs else None
                request_log.debug(
                    "request %s: prompt %r (%d tokens), params %s",
                    p.request_id,
                    prompt,
                    len(p.prompt_token_ids),
                    params,
                )


class Admission:
    """The engine requests of one HTTP call, from admission until the engine has them.

    Admission reserves a place in the waiting count for each sequence (prompt x completion),
    so requests arriving together see each other before any is prepared and ``--max-waiting``
    holds; each prepared request uses its sequences' reservations when handed to the engine.
    :meth:`close` gives back unused reservations and discards prepared requests never handed
    over (a client gone before its stream began), so no adapter reference can leak.
    ``stalled`` is set if the engine aborted one of its requests because the client stopped
    reading. Event-loop thread only; idempotent.
    """

    def __init__(
        self,
        client: EngineClient,
        n: int,
        on_close: Callable[[], None] | None = None,
        *,
        on_generate: Callable[[PreparedRequest, float], None] | None = None,
        request_log: RequestLog | None = None,
    ) -> None:
        client.reserve(n)
        self.client = client
        self.started = time.monotonic()
        self._request_log = request_log  # None: --disable-log-requests
        self._on_generate = on_generate  # metrics: follow the sequences handed over
        self.left = n
        self.prepared: list[PreparedRequest] = []
        self._handed: set[str] = set()
        self._on_close = on_close
        self.usage: UsageRecord | None = None
        self.finals: dict[int, RequestOutput] = {}  # finished outputs by prompt index
        self.stalled = asyncio.Event()

    def generate(self, prep: PreparedRequest) -> RequestStream:
        """Hand ``prep`` to the engine now; its stream of outputs."""
        self._handed.add(prep.request_id)
        k = len(prep.request.seqs)
        reserved = self.left >= k
        self.left -= k if reserved else 0
        handed = time.monotonic()
        stream = self.client.generate(prep, reserved=reserved, on_stall=self.stalled.set)
        if self._on_generate is not None:  # after: a failed hand-over leaves nothing tracked
            self._on_generate(prep, handed)
        return stream

    def close(self) -> None:
        if self.left:
            self.client.unreserve(self.left)
            self.left = 0
        for p in self.prepared:
            if p.request_id not in self._handed:
                self._handed.add(p.request_id)
                self.client.discard(p)
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()
        usage, self.usage = self.usage, None
        if usage is not None:
            usage.log(self.prepared, self.finals)
        if self._request_log is not None:
            rlog, self._request_log = self._request_log, None
            rlog.log(usage, self.prepared, self.finals, time.monotonic() - self.started)


class EngineStreamingResponse(StreamingResponse):
    """A streaming response that closes its body iterator and runs ``on_close`` however the
    stream ends — including when the iterator never started (client gone before the first byte).

    When ``stalled`` is set (the engine aborted the request because the client stopped
    reading), the response stops where it is, even in the middle of a send the client never
    drains, and the connection is closed."""

    def __init__(
        self,
        *args: Any,
        on_close: Callable[[], None],
        stalled: asyncio.Event | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close
        self.stalled = stalled

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            if self.stalled is None:
                await super().__call__(scope, receive, send)
                return
            body = asyncio.ensure_future(super().__call__(scope, receive, send))
            stall = asyncio.ensure_future(self.stalled.wait())
            try:
                await asyncio.wait({body, stall}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                body.cancel()
                raise
            finally:
                stall.cancel()
            if body.done():
                body.result()
                return
            body.cancel()  # blocked in a send the client never drains
            with contextlib.suppress(BaseException):
                await body
            log.warning("closed a stream whose client stopped reading")
            # returning with the response unfinished makes the server close the connection
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self.on_close()


def admit(
    state: ServerState,
    n: int,
    principal: Principal,
    *,
    requests: int | None = None,
    param: str | None = None,
) -> Admission:
    """Admit a call of ``requests`` engine requests (prompts; default ``n``) holding ``n``
    sequences (prompts x n): 400 if ``n`` exceeds ``--max-waiting`` on its own (``param``: the
    field to name), 429 (+ Retry-After) when the caller's tenant is over its request rate or
    its sequences in flight, 503 (+ Retry-After) when the shared queue is full.

    Its sequences count as waiting from now on; the caller must ``close()`` the admission."""
    if not state.client.is_running:
        raise APIError(503, "the engine is not running", "service_unavailable")
    limit = state.config.max_waiting
    if limit and n > limit:
        raise APIError(
            400,
            f"this request needs {n} sequences (prompts x n), more than this server queues "
            f"({limit}); send fewer prompts or a smaller n",
            param=param,
            code="too_many_sequences",
        )
    on_close = None
    tenant = state.catalog.tenant(principal.tenant)
    if tenant is not None and (tenant.rate_limit_rps is not None or tenant.max_waiting):
        try:
            state.limits.acquire(
                tenant.name,
                n,
                rate_rps=tenant.rate_limit_rps,
                max_in_flight=tenant.max_waiting,
                requests=requests,
            )
        except TenantLimitExceeded as e:
            raise APIError(
                429,
                str(e),
                "rate_limit_error",
                code=e.code,
                headers={"Retry-After": str(e.retry_after)},
            ) from e
        name = tenant.name
        on_close = lambda: state.limits.release(name, n)  # noqa: E731
    try:
        return _admit_shared(state, n, on_close)
    except BaseException:
        if on_close is not None:
            on_close()
        raise


def _admit_shared(state: ServerState, n: int, on_close: Callable[[], None] | None) -> Admission:
    limit = state.config.max_waiting
    client = state.client
    waiting = client.num_waiting
    if limit and waiting + n > limit:
        retry = str(state.config.retry_after_seconds)
        raise APIError(
            503,
            f"the server is overloaded ({waiting} sequences waiting, this request needs {n}, "
            f"limit {limit}); retry later",
            "service_unavailable",
            code="overloaded",
            headers={"Retry-After": retry},
        )
    config = state.config
    return Admission(
        client,
        n,
        on_close,
        on_generate=state.metrics.sequences.track,
        request_log=None if config.disable_log_requests else RequestLog(config.max_log_len),
    )


async def owned(admission: Admission, work: Awaitable[Response]) -> Response:
    """Await the response of an admitted call; the admission closes when the call is done,
    or, for a stream, when the stream is."""
    try:
        response = await work
    except BaseException:
        admission.close()
        raise
    if isinstance(response, EngineStreamingResponse):
        response.on_close = admission.close
    else:
        admission.close()
    return response
