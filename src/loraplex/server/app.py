"""The OpenAI-compatible HTTP API over one engine: ``create_app(config)`` builds everything.

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streaming or not),
``/v1/adapters`` (residency), admin ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``,
``/health``, ``/version``, ``/metrics``. Requests are validated, tokenized and their adapter
loaded in worker threads (:meth:`AsyncEngine.prepare`); the engine loop only ever sees prepared
requests. Every error leaves as OpenAI's JSON shape with the right status code.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import loraplex
from loraplex.cache.adapters import AdapterCapacityError, AdapterInUseError
from loraplex.cache.store import StoreNotFoundError, StorePermissionError, StoreUnavailableError
from loraplex.cache.verify import AdapterCopyError
from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from loraplex.engine.llm_engine import LLMEngine, PreparedRequest
from loraplex.outputs import CompletionOutput, RequestOutput, TokenLogprob
from loraplex.requests import LoRARequest, SamplingParams
from loraplex.server.adapters import AdapterDirectory, ServedAdapter, check_allowed_path
from loraplex.server.metrics import CONTENT_TYPE, ServerMetrics
from loraplex.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EvictLoRAAdapterRequest,
    LoadLoRAAdapterRequest,
    PinLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from loraplex.types import AdapterError, InvalidRequestError, LoraplexError

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error that leaves the server as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _as_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e))
    if isinstance(e, AdapterError):
        return _adapter_api_error(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "service_unavailable")
    if isinstance(e, EngineStepError | LoraplexError):
        return APIError(500, str(e), "server_error")
    log.exception("unexpected error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}", "server_error")


def _adapter_api_error(e: AdapterError) -> APIError:
    """Adapter failures by cause: capacity and unreachable stores are retryable (503), a bad
    copy in the object store is an upstream fault (502), anything else a server error."""
    msg = str(e)
    retry = {"Retry-After": "1"}
    if isinstance(e, AdapterCapacityError):
        return APIError(503, msg, "service_unavailable", code="adapter_capacity", headers=retry)
    if isinstance(e, StoreUnavailableError):
        return APIError(
            503, msg, "service_unavailable", code="adapter_store_unavailable", headers=retry
        )
    if isinstance(e, StoreNotFoundError):
        return APIError(404, msg, "NotFoundError", code="adapter_not_found")
    if isinstance(e, StorePermissionError):
        return APIError(403, msg, "permission_error", code="adapter_source_refused")
    if isinstance(e, AdapterCopyError):
        if e.tier == "object_store":
            return APIError(502, msg, "server_error", code="adapter_copy_invalid")
        return APIError(503, msg, "service_unavailable", code="adapter_copy_invalid", headers=retry)
    if isinstance(e, AdapterInUseError):
        return APIError(409, msg, "conflict_error", code="adapter_in_use")
    return APIError(500, msg, "server_error", code="adapter_load_failed")


def _validation_api_error(errs: list[Any]) -> APIError:
    """One 400 for pydantic's errors, naming the first bad field as ``param``.

    A value matching no member of a union gets one error per member, located at
    ``field.<member type>``; those are one problem, so ``param`` is the location they share
    (``prompt``, not ``prompt.str``)."""
    locs = [[x for x in err.get("loc", ()) if x != "body"] for err in errs]
    if not locs:
        return APIError(400, "invalid request")
    group = [i for i, loc in enumerate(locs) if loc[:1] == locs[0][:1]]
    shared = locs[0]
    if len(group) > 1:
        n = 0
        while all(len(locs[i]) > n and locs[i][n] == shared[n] for i in group):
            n += 1
        shared = shared[:n]
    param = ".".join(str(x) for x in shared) or None
    msgs = list(dict.fromkeys(str(errs[i].get("msg", "invalid value")) for i in group))
    others = len(errs) - len(group)
    more = f" (and {others} more problems)" if others else ""
    msg = "; or ".join(msgs[:3])
    return APIError(400, f"{param + ': ' if param else ''}{msg}{more}", param=param)


@dataclass
class _Tracked:
    """Latency bookkeeping of one engine request."""

    arrival: float
    state: str  # warm | cold
    first_token: float | None = None


class _Admission:
    """The engine requests of one HTTP call, from admission until the engine has them.

    Admission reserves a place in the waiting count for each prompt, so requests arriving
    together see each other before any is prepared and ``--max-waiting`` holds; each prepared
    request uses its reservation when handed to the engine. :meth:`close` gives back unused
    reservations and discards prepared requests never handed over (a client gone before its
    stream began), so no adapter reference can leak. Event-loop thread only; idempotent.
    """

    def __init__(self, aengine: AsyncEngine, n: int) -> None:
        aengine.reserve(n)
        self.aengine = aengine
        self.left = n
        self.prepared: list[PreparedRequest] = []
        self._handed: set[str] = set()

    def generate(self, prep: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """Hand ``prep`` to the engine; iterate the result at once (its first step queues it)."""
        self._handed.add(prep.request_id)
        reserved = self.left > 0
        self.left -= int(reserved)
        return self.aengine.generate(prep, reserved=reserved)

    def close(self) -> None:
        if self.left:
            self.aengine.unreserve(self.left)
            self.left = 0
        for p in self.prepared:
            if p.request_id not in self._handed:
                self._handed.add(p.request_id)
                self.aengine.discard(p)


class _EngineStreamingResponse(StreamingResponse):
    """A streaming response that closes its body iterator and runs ``on_close`` however the
    stream ends — including when the iterator never started (client gone before the first byte).
    """

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self.on_close()


class ServerState:
    """Everything one app instance owns: engine, adapter names, metrics, config."""

    def __init__(self, config: ServerConfig, engine: LLMEngine) -> None:
        self.config = config
        self.engine = engine
        self.aengine = AsyncEngine(engine)
        self.adapters = AdapterDirectory()
        self.metrics = ServerMetrics(self.aengine, self.adapters.names_of)
        self.started = int(time.time())
        self.base_names = config.model_names
        for m in config.lora_modules:
            self.adapters.add(ServedAdapter(m.name, m.path, m.base_model_name, "cli"))

    def preload_static_adapters(self) -> None:
        """Load and validate every ``--lora-modules`` adapter at start-up (fail fast)."""
        mgr = self.engine.adapters
        if mgr is None:
            return
        adapters = self.adapters.list()
        warm = {m.name: m.warm for m in self.config.lora_modules}
        refs = mgr.prewarm([(a.lora_request(), warm.get(a.name, "on-demand")) for a in adapters])
        for a, ref in zip(adapters, refs, strict=True):
            self.adapters.learn(a.name, ref.sha256)

    # -- auth ------------------------------------------------------------------------------------
    @staticmethod
    def _bearer(request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        return key.strip() if scheme.lower() == "bearer" and key.strip() else None

    @staticmethod
    def _matches(key: str | None, keys: list[str]) -> bool:
        ok = False
        for k in keys:  # constant time per key, and no early exit
            ok |= key is not None and hmac.compare_digest(key.encode(), k.encode())
        return ok

    def check_inference_auth(self, request: Request) -> None:
        keys = self.config.api_keys
        if not keys:
            return
        key = self._bearer(request)
        admin = [self.config.admin_api_key] if self.config.admin_api_key else []
        if not self._matches(key, keys + admin):
            raise APIError(
                401,
                "missing API key" if key is None else "invalid API key",
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def check_admin_auth(self, request: Request) -> None:
        admin = self.config.admin_api_key
        if not admin:
            raise APIError(
                404,
                "the admin API is disabled; start the server with --admin-api-key "
                "(or LORAPLEX_ADMIN_API_KEY)",
                "not_found_error",
                code="admin_api_disabled",
            )
        key = self._bearer(request)
        if self._matches(key, [admin]):
            return
        if self._matches(key, self.config.api_keys):
            raise APIError(
                403,
                "this API key may not call admin routes; use the admin key",
                "permission_error",
                code="insufficient_permissions",
            )
        raise APIError(
            401,
            "missing admin API key" if key is None else "invalid admin API key",
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    # -- requests --------------------------------------------------------------------------------
    def admit(self, n: int) -> _Admission:
        """Admit a call with ``n`` prompts, or 503 (+ Retry-After) when the queue is full.

        Its prompts count as waiting from now on; the caller must ``close()`` the admission."""
        if not self.aengine.is_running:
            raise APIError(503, "the engine is not running", "service_unavailable")
        limit = self.config.max_waiting
        if limit and self.aengine.num_waiting >= limit:
            retry = str(self.config.retry_after_seconds)
            raise APIError(
                503,
                f"the server is overloaded ({self.aengine.num_waiting} requests waiting, "
                f"limit {limit}); retry later",
                "service_unavailable",
                code="overloaded",
                headers={"Retry-After": retry},
            )
        return _Admission(self.aengine, n)

    @staticmethod
    async def owned(admission: _Admission, work: Awaitable[Response]) -> Response:
        """Await the response of an admitted call; the admission closes when the call is done,
        or, for a stream, when the stream is."""
        try:
            response = await work
        except BaseException:
            admission.close()
            raise
        if isinstance(response, _EngineStreamingResponse):
            response.on_close = admission.close
        else:
            admission.close()
        return response

    def resolve_model(self, name: str) -> LoRARequest | None:
        if name in self.base_names:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise APIError(
                404,
                f"The model `{name}` does not exist.",
                "NotFoundError",
                param="model",
                code="model_not_found",
            )
        if adapter.source == "admin":  # its files may have been replaced since it was loaded
            try:
                check_allowed_path(adapter.path, self.config.allowed_lora_roots)
            except AdapterError as e:
                raise APIError(
                    403, f"adapter {name!r}: {e}", "permission_error", code="adapter_path_refused"
                ) from e
        return adapter.lora_request()

    async def prepare(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora: LoRARequest | None,
        arrival: float,
    ) -> PreparedRequest:
        prep = await self.aengine.prepare(request_id, prompt, params, lora, arrival)
        n_prompt, limit = len(prep.prompt_token_ids), self.engine.max_model_len
        if params.max_tokens is not None and n_prompt + params.max_tokens > limit:
            self.aengine.discard(prep)
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n_prompt + params.max_tokens} tokens ({n_prompt} in the prompt, "
                f"{params.max_tokens} in the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        if lora is not None and prep.adapter is not None:
            self.adapters.learn(lora.name, prep.adapter.sha256)
        return prep

    async def prepare_all(
        self,
        admission: _Admission,
        prompts: list[str | list[int]],
        params: SamplingParams,
        lora: LoRARequest | None,
        arrival: float,
        base_id: str,
    ) -> list[PreparedRequest]:
        results = await asyncio.gather(
            *(
                self.prepare(f"{base_id}-{i}", p, params, lora, arrival)
                for i, p in enumerate(prompts)
            ),
            return_exceptions=True,
        )
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            for r in results:
                if isinstance(r, PreparedRequest):
                    self.aengine.discard(r)
            raise failed
        admission.prepared = results  # type: ignore[assignment]
        return results  # type: ignore[return-value]

    async def stream_outputs(
        self, admission: _Admission
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run an admission's prepared requests concurrently; yield (index, output) as they
        progress. Closing the iterator aborts every request still running."""
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, prep: PreparedRequest) -> None:
            track = _Tracked(prep.request.arrival, "warm" if prep.adapter_warm else "cold")
            try:
                async for out in admission.generate(prep):
                    self._observe(track, out)
                    await queue.put((i, out))
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(admission.prepared)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def deltas(
        self, admission: _Admission, finals: dict[int, RequestOutput]
    ) -> AsyncIterator[_Delta]:
        """Each completion's progress as deltas (text, logprobs, finish), one per change;
        finished request outputs are collected into ``finals``."""
        sent: dict[tuple[int, int], tuple[int, int]] = {}  # -> (chars, tokens) streamed
        finished: set[tuple[int, int]] = set()
        async for i, out in self.stream_outputs(admission):
            if out.finished:
                finals[i] = out
            for o in out.outputs:
                k = (i, o.index)
                if k in finished:
                    continue
                t0, n0 = sent.get(k, (0, 0))
                done = o.finish_reason is not None
                new_lps = o.logprobs is not None and len(o.token_ids) > n0
                if not (len(o.text) > t0 or new_lps or done):
                    continue
                sent[k] = (len(o.text), len(o.token_ids))
                if done:
                    finished.add(k)
                lps = o.logprobs[n0:] if o.logprobs is not None else None
                yield _Delta(i, o, o.text[t0:], t0, lps, done)

    async def collect(self, admission: _Admission) -> dict[int, RequestOutput]:
        """Run the admitted requests to the end; their final outputs by prompt index."""
        finals: dict[int, RequestOutput] = {}
        async for i, out in self.stream_outputs(admission):
            if out.finished:
                finals[i] = out
        return finals

    def _observe(self, track: _Tracked, out: RequestOutput) -> None:
        now = time.monotonic()
        first = out.outputs[0] if out.outputs else None
        if track.first_token is None and first is not None and first.token_ids:
            track.first_token = now
            self.metrics.ttft.labels(adapter_state=track.state).observe(now - track.arrival)
        if not out.finished:
            return
        m = self.metrics
        m.e2e.labels(adapter_state=track.state).observe(now - track.arrival)
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        for o in out.outputs:
            m.generation_tokens.inc(len(o.token_ids))
            m.finished.labels(finished_reason=o.finish_reason or "unknown").inc()
        if first is not None and len(first.token_ids) > 1 and track.first_token is not None:
            tpot = (now - track.first_token) / (len(first.token_ids) - 1)
            m.tpot.labels(adapter_state=track.state).observe(tpot)


# -- response building -----------------------------------------------------------------------------
def _usage(prepared: list[PreparedRequest], finals: dict[int, RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(p.prompt_token_ids) for p in prepared)
    completion = sum(len(o.token_ids) for r in finals.values() for o in r.outputs)
    cached = sum(r.num_cached_tokens for r in finals.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class _TokenText:
    """Token id → text piece, for logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def __call__(self, tid: int) -> str:
        if self.tok is None:
            return f"token_id:{tid}"
        return self.tok.decode([tid])


def _completion_logprobs(
    lps: list[TokenLogprob], text_of: _TokenText, offset: int
) -> dict[str, Any]:
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


def _chat_logprobs(lps: list[TokenLogprob], text_of: _TokenText) -> dict[str, Any]:
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


@dataclass
class _Delta:
    """What one completion gained since it was last streamed."""

    prompt_index: int
    output: CompletionOutput
    text: str  # new text
    text_offset: int  # where ``text`` starts in the completion's text
    logprobs: list[TokenLogprob] | None  # for the new tokens, when asked for
    done: bool


async def _sse_events(
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
            yield _sse({**base, "choices": [], "usage": _usage(prepared, finals)})
    except Exception as e:
        yield _sse(_as_api_error(e).body())
    yield _DONE


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


_DONE = b"data: [DONE]\n\n"


def _adapter_header(outs: list[PreparedRequest]) -> dict[str, str]:
    """Which adapter weights served the request, and whether they were warm on arrival."""
    ref = outs[0].adapter if outs else None
    if ref is None:
        return {}
    rev = f";revision={ref.revision}" if ref.revision else ""
    warm = all(p.adapter_warm for p in outs)
    return {
        "x-loraplex-adapter": f"{ref.name}{rev};sha256={ref.sha256[:16]}",
        "x-loraplex-adapter-state": "warm" if warm else "cold",
    }


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
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


# -- the app --------------------------------------------------------------------------------------
def create_app(
    config: ServerConfig,
    *,
    engine: LLMEngine | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """Build the server: the engine (unless given), adapter names, metrics and routes.

    The engine loop starts with the app (lifespan) and stops with it; ``on_ready`` runs once
    the loop is up."""
    config.validate()
    if engine is None:
        engine = LLMEngine(config.engine)
    state = ServerState(config, engine)
    state.preload_static_adapters()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.aengine.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            state.aengine.shutdown()

    app = FastAPI(
        title="loraplex",
        version=loraplex.__version__,
        description="OpenAI-compatible multi-LoRA inference server",
        lifespan=lifespan,
    )
    app.state.loraplex = state

    # -- errors ----------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        state.metrics.requests.labels(status=str(e.status)).inc()
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = _validation_api_error(list(e.errors()))
        state.metrics.requests.labels(status="400").inc()
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        status = e.status_code
        kind = (
            "NotFoundError"
            if status == 404
            else "invalid_request_error"
            if 400 <= status < 500
            else "server_error"
        )
        state.metrics.requests.labels(status=str(e.status_code)).inc()
        return APIError(e.status_code, str(e.detail), kind, headers=e.headers).response()

    @app.exception_handler(LoraplexError)
    async def _domain_error(request: Request, e: LoraplexError) -> JSONResponse:
        err = _as_api_error(e)
        state.metrics.requests.labels(status=str(err.status)).inc()
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        err = _as_api_error(e)
        state.metrics.requests.labels(status=str(err.status)).inc()
        return err.response()

    def inference_auth(request: Request) -> None:
        state.check_inference_auth(request)

    def admin_auth(request: Request) -> None:
        state.check_admin_auth(request)

    # -- plain routes ----------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not state.aengine.is_running:
            return APIError(503, "the engine is not running", "service_unavailable").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": loraplex.__version__}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(inference_auth)])
    async def list_models() -> dict[str, Any]:
        max_len = engine.max_model_len
        data = [
            {
                "id": name,
                "object": "model",
                "created": state.started,
                "owned_by": "loraplex",
                "root": config.engine.model,
                "parent": None,
                "max_model_len": max_len,
            }
            for name in state.base_names
        ]
        for a in state.adapters.list():
            data.append(
                {
                    "id": a.name,
                    "object": "model",
                    "created": a.created,
                    "owned_by": "loraplex",
                    "root": a.path,
                    "parent": a.base_model_name or state.base_names[0],
                    "max_model_len": max_len,
                }
            )
        return {"object": "list", "data": data}

    @app.get("/v1/adapters", dependencies=[Depends(inference_auth)])
    async def list_adapters() -> dict[str, Any]:
        return _residency(state)

    # -- completions -----------------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=[Depends(inference_auth)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        lora = state.resolve_model(body.model)
        params = body.sampling_params()
        prompts = body.prompts()
        admission = state.admit(len(prompts))
        return await state.owned(
            admission, _completions(body, request, admission, lora, params, prompts, arrival)
        )

    async def _completions(
        body: CompletionRequest,
        request: Request,
        admission: _Admission,
        lora: LoRARequest | None,
        params: SamplingParams,
        prompts: list[str | list[int]],
        arrival: float,
    ) -> Response:
        rid = f"cmpl-{uuid.uuid4().hex}"
        prepared = await state.prepare_all(admission, prompts, params, lora, arrival, rid)
        text_of = _TokenText(engine.tokenizer)
        created = int(time.time())
        n = params.n
        echo_text = [
            (
                p.request.prompt
                if p.request.prompt is not None
                else text_of.tok.decode(p.prompt_token_ids)
            )
            if body.echo and text_of.tok is not None
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
                "logprobs": _completion_logprobs(lps, text_of, offset) if lps is not None else None,
                "finish_reason": o.finish_reason if finish else None,
                "stop_reason": o.stop_reason if finish else None,
            }

        headers = _adapter_header(prepared)
        if body.stream:

            async def chunks(finals: dict[int, RequestOutput]) -> AsyncIterator[dict[str, Any]]:
                if body.echo:
                    for i in range(len(prepared)):
                        for j in range(n):
                            echo = {"index": i * n + j, "text": echo_text[i], "logprobs": None,
                                    "finish_reason": None, "stop_reason": None}  # fmt: skip
                            yield {"choices": [echo]}
                async for d in state.deltas(admission, finals):
                    offset = d.text_offset + len(echo_text[d.prompt_index])
                    c = choice(d.prompt_index, d.output, d.text, d.logprobs, offset, d.done)
                    yield {"choices": [c]}

            base = {"id": rid, "object": "text_completion", "created": created,
                    "model": body.model}  # fmt: skip
            events = _sse_events(chunks, base, prepared, body.stream_options)
            state.metrics.requests.labels(status="200").inc()
            return _EngineStreamingResponse(
                events, on_close=admission.close, media_type="text/event-stream", headers=headers
            )

        finals = await _unless_disconnected(request, state.collect(admission))
        choices = [
            choice(i, o, echo_text[i] + o.text, o.logprobs, len(echo_text[i]), True)
            for i in sorted(finals)
            for o in finals[i].outputs
        ]
        state.metrics.requests.labels(status="200").inc()
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": choices,
                "usage": _usage(prepared, finals),
            },
            headers=headers,
        )

    # -- chat ------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=[Depends(inference_auth)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        lora = state.resolve_model(body.model)
        params = body.sampling_params()
        messages = body.template_messages()
        admission = state.admit(1)
        return await state.owned(
            admission, _chat_completions(body, request, admission, lora, params, messages, arrival)
        )

    async def _chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        admission: _Admission,
        lora: LoRARequest | None,
        params: SamplingParams,
        messages: list[dict[str, Any]],
        arrival: float,
    ) -> Response:
        ids = await state.aengine.run_in_pool(
            engine.apply_chat_template, messages, body.add_generation_prompt
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prepared = await state.prepare_all(admission, [ids], params, lora, arrival, rid)
        text_of = _TokenText(engine.tokenizer)
        created = int(time.time())
        headers = _adapter_header(prepared)
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
                async for d in state.deltas(admission, finals):
                    o = d.output
                    c: dict[str, Any] = {
                        "index": o.index,
                        "delta": {"content": d.text} if d.text else {},
                        "logprobs": _chat_logprobs(d.logprobs, text_of) if d.logprobs else None,
                        "finish_reason": o.finish_reason if d.done else None,
                    }
                    if d.done:
                        c["stop_reason"] = o.stop_reason
                    yield {"choices": [c]}

            events = _sse_events(chunks, base, prepared, body.stream_options)
            state.metrics.requests.labels(status="200").inc()
            return _EngineStreamingResponse(
                events, on_close=admission.close, media_type="text/event-stream", headers=headers
            )

        finals = await _unless_disconnected(request, state.collect(admission))
        out = finals[0]
        choices = [
            {
                "index": o.index,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": _chat_logprobs(o.logprobs, text_of) if o.logprobs is not None else None,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            }
            for o in out.outputs
        ]
        state.metrics.requests.labels(status="200").inc()
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": body.model,
                "choices": choices,
                "usage": _usage(prepared, finals),
            },
            headers=headers,
        )

    # -- admin -----------------------------------------------------------------------------------
    @app.post("/v1/load_lora_adapter", dependencies=[Depends(admin_auth)])
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        mgr = engine.adapters
        if mgr is None:
            raise APIError(400, "LoRA is disabled on this server; start it with --enable-lora")
        name = body.lora_name
        if name in state.base_names:
            raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
        if state.adapters.get(name) is not None and not body.load_inplace:
            raise APIError(
                400,
                f"The lora adapter '{name}' has already been loaded. "
                "Unload it first or pass load_inplace=true.",
                param="lora_name",
            )
        try:
            path = check_allowed_path(body.lora_path, config.allowed_lora_roots)
        except AdapterError as e:
            raise APIError(400, str(e), param="lora_path") from e
        request = LoRARequest(name, str(path))
        try:
            adapter, _ = await state.aengine.run_in_pool(
                lambda: mgr.resolve_with_state(request, count=False)
            )
        except AdapterError as e:
            raise APIError(400, str(e), param="lora_path") from e
        mgr.release(adapter)
        state.adapters.add(ServedAdapter(name, str(path), None, "admin"), replace=True)
        state.adapters.learn(name, adapter.ref.sha256)
        log.info("loaded adapter %s from %s (%s)", name, path, adapter.ref.short)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(admin_auth)])
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        removed = state.adapters.remove(body.lora_name)
        if removed is None:
            raise APIError(
                404,
                f"The lora adapter '{body.lora_name}' cannot be found.",
                "NotFoundError",
                param="lora_name",
                code="model_not_found",
            )
        log.info("unloaded adapter %s (in-flight requests finish on it)", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def _served(name: str) -> ServedAdapter:
        a = state.adapters.get(name)
        if a is None:
            raise APIError(
                404,
                f"The lora adapter '{name}' cannot be found.",
                "NotFoundError",
                param="lora_name",
                code="model_not_found",
            )
        if engine.adapters is None:
            raise APIError(400, "LoRA is disabled on this server; start it with --enable-lora")
        return a

    @app.post("/v1/pin_lora_adapter", dependencies=[Depends(admin_auth)])
    async def pin_lora_adapter(body: PinLoRAAdapterRequest) -> dict[str, Any]:
        """Load the adapter if needed and pin it in host memory and disk (and its device slot
        with ``device``): pinned adapters are never evicted."""
        a, mgr = _served(body.lora_name), engine.adapters
        assert mgr is not None

        def pin() -> str:
            adapter, _ = mgr.resolve_with_state(a.lora_request(), count=False)
            try:
                return mgr.pin(adapter.ref.sha256, device=body.device)
            finally:
                mgr.release(adapter)

        digest = await state.aengine.run_in_pool(pin)
        state.adapters.learn(a.name, digest)
        log.info("pinned adapter %s (%s, device=%s)", a.name, digest[:12], body.device)
        return {"lora_name": a.name, "sha256": digest[:16], "pinned": True, "device": body.device}

    @app.post("/v1/unpin_lora_adapter", dependencies=[Depends(admin_auth)])
    async def unpin_lora_adapter(body: UnloadLoRAAdapterRequest) -> dict[str, Any]:
        a, mgr = _served(body.lora_name), engine.adapters
        assert mgr is not None
        d = state.adapters.digest_of(a.name)
        if d is None:
            raise APIError(400, f"adapter {a.name!r} has never been loaded", param="lora_name")
        mgr.unpin(d)
        return {"lora_name": a.name, "sha256": d[:16], "pinned": False}

    @app.post("/v1/evict_lora_adapter", dependencies=[Depends(admin_auth)])
    async def evict_lora_adapter(body: EvictLoRAAdapterRequest) -> dict[str, Any]:
        """Drop the adapter's copies from the given tiers (default: device, host, disk).
        Refused with 409 while requests use it or it is pinned."""
        a, mgr = _served(body.lora_name), engine.adapters
        assert mgr is not None
        d = state.adapters.digest_of(a.name)
        if d is None:
            return {"lora_name": a.name, "evicted_from": []}
        tiers = body.tiers or ["device", "host", "disk"]
        left = mgr.evict(d, tiers=tiers)
        log.info("evicted adapter %s (%s) from %s", a.name, d[:12], left)
        return {"lora_name": a.name, "sha256": d[:16], "evicted_from": left}

    return app


def _residency(state: ServerState) -> dict[str, Any]:
    """``/v1/adapters``: every served adapter and every adapter still in memory."""
    mgr = state.engine.adapters
    rows: list[dict[str, Any]] = []
    if mgr is None:
        return {"object": "list", "data": rows, "max_loras": 0}
    snapshot = {r.ref.sha256: r for r in mgr.residency()}
    seen: set[str] = set()
    for a in state.adapters.list():
        d = state.adapters.digest_of(a.name)
        r = snapshot.get(d) if d else None
        row: dict[str, Any] = {"name": a.name, "path": a.path, "registered": True}
        if r is None:
            row.update(
                revision=None,
                sha256=d[:16] if d else None,
                tier="disk" if mgr.is_local_source(a.lora_request()) else "absent",
                rank=None,
                bytes=None,
                hits=0,
                loads=0,
                evictions=0,
                last_access=None,
                pinned=False,
                warm_policy=None,
                in_flight=0,
                slot=None,
            )
        else:
            seen.add(r.ref.sha256)
            row.update(_row(r))
            if r.tier == "absent" and mgr.is_local_source(a.lora_request()):
                row["tier"] = "disk"  # evicted from memory, its directory is on local disk
        rows.append(row)
    for d, r in snapshot.items():
        if d in seen or r.tier == "absent":
            continue
        names = state.adapters.names_of(d)
        rows.append(
            {
                "name": names[0] if names else r.ref.name,
                "path": None,
                "registered": False,
                **_row(r),
            }
        )
    counts = mgr.resident_bytes()
    return {
        "object": "list",
        "data": rows,
        "max_loras": mgr.max_loras,
        "max_cpu_loras": mgr.max_cpu_loras,
        "tiers": {t: {"count": n, "bytes": b} for t, (n, b) in counts.items()},
        "policy": mgr.policy.name,
    }


def _row(r: Any) -> dict[str, Any]:
    return {
        "revision": r.ref.revision,
        "sha256": r.ref.sha256[:16],
        "tier": r.tier,
        "rank": r.rank,
        "bytes": r.nbytes,
        "hits": r.hits,
        "loads": r.loads,
        "evictions": r.evictions,
        "last_access": r.last_access or None,
        "pinned": r.pinned,
        "warm_policy": r.warm_policy,
        "in_flight": r.in_flight,
        "slot": r.slot,
    }


def run_server(config: ServerConfig, *, on_ready: Callable[[], None] | None = None) -> None:
    """Build the app and serve it with uvicorn until interrupted."""
    import uvicorn

    app = create_app(config, on_ready=on_ready)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
