"""Admission of one HTTP call: per-tenant limits (429), the shared ``--max-waiting`` queue (503),
the adapter's ``max_concurrent_requests`` and its canary's cap (wait, then 429; see
:mod:`~loraplex.server.adapter_limits`), and the :class:`Admission` that holds the call's engine
requests until it is done — for a stream, until the stream ends however it ends
(:class:`EngineStreamingResponse`) — and then writes its usage line and, for a call served by a
canary revision, reports its outcome to the canary's health (:mod:`~loraplex.server.canary`).

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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response, StreamingResponse

from loraplex.engine.client import (
    EngineClient,
    EngineDeadError,
    EngineStepError,
    PreparedRequest,
    PrepareTimeoutError,
    RequestStream,
    StreamStalledError,
)
from loraplex.logs import fields_of
from loraplex.outputs import RequestOutput
from loraplex.registry import CanaryPolicy, Principal
from loraplex.server.adapter_limits import AdapterBusy, Claim, ConcurrencyLimiter, claims_of
from loraplex.server.canary import CallOutcome, CanaryMonitor
from loraplex.server.composition import Served, ServedComposition, parts_of, served_name
from loraplex.server.errors import APIError, adapter_api_error
from loraplex.server.limits import TenantLimitExceeded
from loraplex.server.metrics import ServerMetrics
from loraplex.server.state import ServedAdapter, ServerState
from loraplex.types import AdapterError, InvalidRequestError, LoraplexError

log = logging.getLogger("loraplex.server.app")
usage_log = logging.getLogger("loraplex.usage")
"""One JSON line per finished call: tenant, key, adapter name, revision, sha256, tokens."""


@dataclass
class UsageRecord:
    """One line of the usage log: who ran which adapter revision, and how many tokens."""

    model: str
    principal: Principal
    lora: Served | None

    def log(self, prepared: list[PreparedRequest], finals: dict[int, RequestOutput]) -> None:
        if not usage_log.isEnabledFor(logging.INFO):
            return
        lora = self.lora
        ref = lora.spec.ref if isinstance(lora, ServedAdapter) else None
        record = {
            "model": self.model,
            "tenant": self.principal.tenant,
            "key_id": self.principal.key_id,
            "adapter": served_name(lora),
            "revision": ref.revision if ref else None,
            "sha256": ref.sha256 if ref else None,
            "route": lora.route if isinstance(lora, ServedAdapter) else None,
            "requests": len(prepared),
            "finished": len(finals),
            "prompt_tokens": sum(len(p.prompt_token_ids) for p in prepared),
            "completion_tokens": sum(len(o.token_ids) for r in finals.values() for o in r.outputs),
        }
        if isinstance(lora, ServedComposition):  # each component's revision, as for one adapter
            record["components"] = [
                {"adapter": p.spec.name, "revision": p.spec.ref.revision,
                 "sha256": p.spec.sha256, "route": p.route, "scale": scale}
                for p, scale in parts_of(lora)
            ]  # fmt: skip
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
        lora = usage.lora if usage is not None else None
        ref = lora.spec.ref if isinstance(lora, ServedAdapter) else None
        reasons = sorted(
            {o.finish_reason or "none" for r in finals.values() for o in r.outputs}
        ) or ["unfinished"]
        fields = {
            "request_id": call_id,
            "model": usage.model if usage is not None else None,
            "adapter": served_name(lora),
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
        adapter = ""
        if ref is not None:
            adapter = f" adapter={ref.name}@{ref.revision} ({ref.sha256[:12]})"
        elif parts := parts_of(lora):  # alpha@r1*1+style@r2*0.5 (digest,digest)
            names = "+".join(f"{p.spec.name}@{p.spec.ref.revision}*{k:g}" for p, k in parts)
            adapter = f" adapter={names} ({','.join(p.spec.sha256[:12] for p, _ in parts)})"
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
        self.slots: AdapterSlots | None = None  # the adapter's concurrency slots, if limited
        self.health: CanaryCall | None = None  # a call served by a canary revision

    def generate(self, prep: PreparedRequest) -> RequestStream | ObservedStream:
        """Hand ``prep`` to the engine now; its stream of outputs."""
        self._handed.add(prep.request_id)
        k = len(prep.request.seqs)
        reserved = self.left >= k
        self.left -= k if reserved else 0
        handed = time.monotonic()
        stream = self.client.generate(prep, reserved=reserved, on_stall=self.stalled.set)
        if self._on_generate is not None:  # after: a failed hand-over leaves nothing tracked
            self._on_generate(prep, handed)
        if self.health is not None:
            return ObservedStream(stream, self.health, prep.request.arrival)
        return stream

    def close(self) -> None:
        if self.slots is not None:
            slots, self.slots = self.slots, None
            slots.release()
        if self.health is not None:
            health, self.health = self.health, None
            health.report(self.finals)
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


class AdapterSlots:
    """A call's slots under its adapter's concurrency limits (:mod:`adapter_limits`): held at
    once, or waited for in the limiter's queue (:meth:`wait`); released when the call closes."""

    def __init__(
        self,
        limiter: ConcurrencyLimiter,
        name: str,
        claims: tuple[Claim, ...],
        *,
        timeout_s: float,
        retry_after: int,
        metrics: ServerMetrics,
    ) -> None:
        """Take the slots now, or a place in their queue; else raise the 429 :class:`APIError`
        (the queue is full, or ``timeout_s`` is 0)."""
        self.limiter, self.name, self.claims = limiter, name, claims
        self.timeout_s = timeout_s
        self._retry_after = retry_after
        self._metrics = metrics
        self._pending: asyncio.Future[None] | None = None
        self.held = limiter.try_acquire(claims)
        if not self.held:
            try:
                if timeout_s <= 0:
                    raise AdapterBusy(name, claims[0][1])
                self._pending = limiter.enqueue(name, claims)
            except AdapterBusy as e:
                raise self.refused(e) from e
            metrics.adapter_waits.inc()

    def refused(self, e: AdapterBusy) -> APIError:
        """The 429 of a call over its adapter's concurrency limit (OpenAI's rate-limit shape),
        counted."""
        self._metrics.adapter_rejections.inc()
        return APIError(
            429,
            str(e),
            "rate_limit_error",
            code="adapter_concurrency_limit",
            headers={"Retry-After": str(max(1, self._retry_after))},
        )

    async def wait(self) -> None:
        """Until the call holds its slots; the 429 :class:`APIError` after ``timeout_s``."""
        if self.held or self._pending is None:
            return
        fut, self._pending = self._pending, None
        try:
            await self.limiter.wait(self.name, self.claims, fut, self.timeout_s)
        except AdapterBusy as e:
            raise self.refused(e) from e
        self.held = True

    def release(self) -> None:
        if self._pending is not None:  # closed while queued (the client left): leave the queue
            fut, self._pending = self._pending, None
            if fut.done() and not fut.cancelled():
                self.limiter.release(self.claims)
            else:
                fut.cancel()
                self.limiter.forget(fut)
        if self.held:
            self.held = False
            self.limiter.release(self.claims)


class CanaryCall:
    """What one call served by a canary revision reports to its health: failed or not, the
    latency of its requests, its completions' texts for the policy's scorer."""

    def __init__(
        self,
        monitor: CanaryMonitor,
        name: str,
        revision: str,
        policy: CanaryPolicy,
        metrics: ServerMetrics,
    ) -> None:
        self.monitor, self.name, self.revision, self.policy = monitor, name, revision, policy
        self._metrics = metrics
        self.failed = False
        self.ttfts: list[float] = []
        self.tpots: list[float] = []

    def fail(self, e: BaseException) -> None:
        """Count ``e`` against the canary when it is the server's fault (see :func:`is_fault`)."""
        if is_fault(e):
            self.failed = True

    def report(self, finals: dict[int, RequestOutput]) -> None:
        """Hand the outcome to the canary's health: a call that failed by the server's fault or
        was served; one that ended otherwise (refused, the client gone) is not judged."""
        if not self.failed and not finals:
            return
        texts = [o.text for r in finals.values() for o in r.outputs]
        outcome = CallOutcome(
            failed=self.failed,
            ttft_s=max(self.ttfts) if self.ttfts else None,
            tpot_s=sum(self.tpots) / len(self.tpots) if self.tpots else None,
            score=None if self.failed else self.monitor.score(self.policy, texts),
        )
        self._metrics.canary_calls.labels(outcome="error" if self.failed else "ok").inc()
        self.monitor.observe(self.name, self.revision, self.policy, outcome)


def is_fault(e: BaseException) -> bool:
    """Whether ``e`` ending a call is the serving revision's fault: server errors (500, 502:
    an engine step that raised, adapter files that fail their digest, ...), not the client's
    (4xx, a disconnect, a stream it stopped reading) nor load (503: overload, capacity, a
    preparation time-out, the engine gone)."""
    if isinstance(e, APIError):
        return e.status >= 500 and e.status not in (503, 504)
    if isinstance(e, (asyncio.CancelledError, InvalidRequestError, StreamStalledError,
                      PrepareTimeoutError, EngineDeadError)):  # fmt: skip
        return False  # the client's doing, or load: not the revision's
    if isinstance(e, AdapterError):
        return adapter_api_error(e).status in (500, 502)
    return isinstance(e, (EngineStepError, LoraplexError, Exception))


class ObservedStream:
    """A request's stream of outputs as handed on, noting for its canary call when the first
    token came, the mean time per later token, and whether the engine raised."""

    def __init__(self, stream: RequestStream, call: CanaryCall, arrival: float) -> None:
        self._stream = stream
        self._call = call
        self._arrival = arrival
        self._first: float | None = None
        self.request_id = stream.request_id

    def __aiter__(self) -> ObservedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            out = await self._stream.__anext__()
        except StopAsyncIteration:
            raise
        except BaseException as e:
            self._call.fail(e)
            raise
        now = time.monotonic()
        first = out.outputs[0] if out.outputs else None
        if self._first is None and first is not None and first.token_ids:
            self._first = now
            self._call.ttfts.append(now - self._arrival)
        if out.finished and first is not None and self._first is not None:
            if len(first.token_ids) > 1:
                self._call.tpots.append((now - self._first) / (len(first.token_ids) - 1))
        return out

    async def aclose(self) -> None:
        await self._stream.aclose()


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
            if body.done() and not _stalled(body.exception()):
                body.result()
                return
            body.cancel()  # blocked in a send the client never drains (or ended by the stall)
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


def _stalled(e: BaseException | None) -> bool:
    """Whether ``e`` is (or groups) the abort of a stream whose client stopped reading."""
    if isinstance(e, StreamStalledError):
        return True
    group = getattr(e, "exceptions", None)  # an ExceptionGroup from the response's task group
    return isinstance(group, tuple) and any(_stalled(x) for x in group)


def admit(
    state: ServerState,
    n: int,
    principal: Principal,
    *,
    requests: int | None = None,
    param: str | None = None,
    lora: Served | None = None,
) -> Admission:
    """Admit a call of ``requests`` engine requests (prompts; default ``n``) holding ``n``
    sequences (prompts x n) served by ``lora``: 400 if ``n`` exceeds ``--max-waiting`` on its
    own (``param``: the field to name), 429 (+ Retry-After) when the caller's tenant is over its
    request rate or its sequences in flight, 503 (+ Retry-After) when the shared queue is full,
    429 (+ Retry-After) when the adapter is at its ``max_concurrent_requests`` and as many calls
    already wait for it (a call that may wait does so in :func:`owned`).

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
        admission = _admit_shared(state, n, on_close)
    except BaseException:
        if on_close is not None:
            on_close()
        raise
    if lora is not None:
        try:
            _admit_adapter(state, admission, lora, principal)
        except BaseException:
            admission.close()
            raise
    return admission


def _admit_adapter(
    state: ServerState, admission: Admission, lora: Served, principal: Principal
) -> None:
    """The concurrency slots of every adapter of the call (or a place in their queue: one
    call holds a slot of each of its components' limits at once) and, for a call served by a
    canary revision alone (one adapter, at scale 1), its health report: a composition's output
    is not the canary's own, so it is not judged against it."""
    claims: list[Claim] = []
    first = ""
    for part, _ in parts_of(lora):
        ref = part.spec.ref
        sv = state.catalog.lookup(ref.name, principal)
        if sv is None:  # removed since the revision was chosen: nothing left to limit or judge
            continue
        mine = claims_of(sv, ref.revision)
        if mine and not claims:
            first = ref.name
        claims.extend(mine)
        canary = sv.canary
        if (
            isinstance(lora, ServedAdapter)
            and canary is not None
            and canary.revision == ref.revision
            and sv.canary_policy is not None
        ):
            admission.health = CanaryCall(
                state.canary, ref.name, ref.revision, sv.canary_policy, state.metrics
            )
    if claims:
        admission.slots = AdapterSlots(
            state.adapter_limits,
            first,
            tuple(claims),
            timeout_s=state.config.adapter_queue_timeout_s,
            retry_after=state.config.retry_after_seconds,
            metrics=state.metrics,
        )
    if isinstance(lora, ServedComposition):
        state.metrics.count_composition(lora.name)


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


async def owned(admission: Admission, work: Coroutine[Any, Any, Response]) -> Response:
    """Await the response of an admitted call, once it holds its adapter's concurrency slots
    (waiting for them: 429 + Retry-After if the wait times out); the admission closes when the
    call is done, or, for a stream, when the stream is."""
    slots = admission.slots
    if slots is not None and not slots.held:
        try:
            await slots.wait()
        except BaseException:
            work.close()  # never started
            admission.close()
            raise
    try:
        response = await work
    except BaseException as e:
        if admission.health is not None:
            admission.health.fail(e)
        admission.close()
        raise
    if isinstance(response, EngineStreamingResponse):
        response.on_close = admission.close
    else:
        admission.close()
    return response
