"""The OpenAI-compatible HTTP API over one engine: ``create_app(config)`` builds everything.

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streaming or not),
``/v1/adapters`` (residency), ``/health``, ``/version``, ``/metrics``, and the admin routes of
:mod:`loraplex.server.admin`. Callers are authenticated to a :class:`Principal` (tenant +
scopes) and see only their tenant's and shared adapters; each request is served by the registry
revision chosen at arrival (active, or canary by weight) and keyed by its sha256. Requests are
validated, tokenized and their adapter loaded in worker threads (:meth:`AsyncEngine.prepare`);
the engine loop only ever sees prepared requests. Every error leaves as OpenAI's JSON shape with
the right status code (:mod:`loraplex.server.errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import random
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import loraplex
from loraplex.cache.adapters import AdapterInUseError
from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.llm_engine import LLMEngine, PreparedRequest
from loraplex.outputs import CompletionOutput, RequestOutput, TokenLogprob
from loraplex.registry import (
    Manifest,
    Principal,
    Registry,
    RegistryPolicy,
    Tenant,
    base_model_info,
)
from loraplex.requests import SamplingParams
from loraplex.server.adapters import check_allowed_path, lexically_under
from loraplex.server.admin import add_admin_routes
from loraplex.server.catalog import (
    ADMIN_KEY,
    ANONYMOUS,
    STATIC_KEY,
    Catalog,
    Servable,
    digests_of,
    has_scope,
    local_source,
    retired_digests,
)
from loraplex.server.errors import APIError, as_api_error, validation_api_error
from loraplex.server.limits import TenantLimitExceeded, TenantLimits
from loraplex.server.metrics import CONTENT_TYPE, ServerMetrics
from loraplex.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from loraplex.types import AdapterError, AdapterSpec, LoraplexError

log = logging.getLogger(__name__)
usage_log = logging.getLogger("loraplex.usage")
"""One JSON line per finished call: tenant, key, adapter name, revision, sha256, tokens."""


@dataclass(frozen=True)
class ServedAdapter:
    """The adapter revision one call is served with, and how it was chosen: ``route`` is
    ``active`` or ``canary`` (the server's business: response header and usage log only)."""

    spec: AdapterSpec
    route: str


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

    def __init__(
        self, aengine: AsyncEngine, n: int, on_close: Callable[[], None] | None = None
    ) -> None:
        aengine.reserve(n)
        self.aengine = aengine
        self.left = n
        self.prepared: list[PreparedRequest] = []
        self._handed: set[str] = set()
        self._on_close = on_close
        self.usage: _UsageRecord | None = None
        self.finals: dict[int, RequestOutput] = {}  # finished outputs by prompt index

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
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()
        if self.usage is not None:
            usage, self.usage = self.usage, None
            usage.log(self.prepared, self.finals)


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


def open_registry(config: ServerConfig) -> Registry:
    """The registry a server with ``config`` uses: ``--registry-url`` (or
    ``$LORAPLEX_REGISTRY_URL``), else a private in-memory one; its policy from the flags."""
    keys = []
    for f in config.trusted_keys:
        try:
            keys.append(Path(f).read_text())
        except OSError as e:
            raise AdapterError(f"--trusted-key {f!r}: {e.strerror or e}") from e
    policy = RegistryPolicy(
        require_signatures=config.require_signatures,
        trusted_keys=tuple(keys),
        max_rank=config.engine.max_lora_rank,
        allowed_roots=tuple(config.allowed_lora_roots),
        allowed_prefixes=tuple(config.allowed_store_prefixes),
    )
    return Registry.open(config.registry_url or "sqlite://", policy=policy)


class ServerState:
    """Everything one app instance owns: engine, registry view, metrics, config."""

    def __init__(
        self, config: ServerConfig, engine: LLMEngine, registry: Registry | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self.aengine = AsyncEngine(engine)
        self.started = int(time.time())
        self.base_names = config.model_names
        self.owns_registry = registry is None
        self.registry = registry if registry is not None else open_registry(config)
        self.base = base_model_info(config.engine.model, name=self.base_names[0])
        self.catalog = Catalog(
            self.registry,
            self.base,
            poll_s=config.registry_poll_s,
            on_change=self._on_catalog_change,
        )
        self.metrics = ServerMetrics(self.aengine, self.catalog.names_of)
        self.limits = TenantLimits()
        self._retiring: dict[str, float] = {}  # digest -> when its cached copies go
        self._rng = random.Random()
        self._static_names = self._register_static_adapters()
        self.catalog.refresh(force=True)

    def _register_static_adapters(self) -> list[str]:
        """Register (validated) and activate every ``--lora-modules`` adapter; fail fast."""
        mgr = self.engine.adapters
        names = []
        for m in self.config.lora_modules:
            actor = "serve --lora-modules"
            with self._local_copy(m.name, m.path) as (local, uri):
                manifest = self.registry.register(
                    local,
                    m.name,
                    base=self.base,
                    source_uri=uri,
                    warm_policy=m.warm,
                    actor=actor,
                    allow_any_source=True,
                )
            if self.registry.release(m.name).active_revision != manifest.revision:
                self.registry.activate(m.name, manifest.revision, actor=actor)
            names.append(m.name)
        if names and mgr is None:  # config.validate() refuses this; keep the invariant loud
            raise AdapterError("--lora-modules needs --enable-lora")
        return names

    @contextlib.contextmanager
    def _local_copy(self, name: str, source: str) -> Iterator[tuple[str, str | None]]:
        """A readable local directory of an adapter source (object-store sources are fetched
        to a temporary directory) and the source URI to record (None: the local path)."""
        mgr = self.engine.adapters
        if "://" not in source or source.startswith("file://"):
            yield source.removeprefix("file://"), None
            return
        if mgr is None or mgr.store is None:
            raise AdapterError(
                f"adapter {name!r}: {source!r} is an object-store URI but no object store is "
                "configured (--adapter-store-url)"
            )
        uri = mgr.store.uri(source)
        with tempfile.TemporaryDirectory(prefix="loraplex-register-") as tmp:
            mgr.store.fetch(uri, Path(tmp) / "a")
            yield str(Path(tmp) / "a"), uri

    def preload_adapters(self) -> None:
        """Load and verify every ``--lora-modules`` adapter, and pre-warm registered ones whose
        warm policy asks for it (fail fast on anything unloadable)."""
        mgr = self.engine.adapters
        if mgr is None:
            return
        todo = []
        for s in self.catalog.servables().values():
            m = s.active
            if s.name in self._static_names or m.warm_policy != "on-demand":
                if self.catalog.compatible(m):
                    todo.append(self.adapter_spec(m))
        mgr.prewarm(todo)

    def close(self) -> None:
        if self.owns_registry:
            self.registry.close()

    # -- registry changes ------------------------------------------------------------------------
    def _on_catalog_change(
        self,
        old: dict[str, Servable],
        new: dict[str, Servable],
        tenants: dict[str, Tenant],
    ) -> None:
        """Schedule the replaced revisions' cached copies for eviction (after the swap delay,
        so a quick rollback is still warm), and apply tenants' host-memory budgets."""
        now = time.monotonic()
        serving = digests_of(new.values())
        for d in retired_digests(old, new):
            self._retiring.setdefault(d, now + self.config.swap_eviction_delay_s)
        for d in serving:
            self._retiring.pop(d, None)
        mgr = self.engine.adapters
        if mgr is not None:
            for t in tenants.values():
                mgr.set_tenant_budget(t.name, t.host_bytes_budget)

    def retire_due(self) -> list[str]:
        """Evict the cached copies of retired revisions whose delay is over; ones still in use
        are retried later. Returns the digests evicted (worker thread)."""
        mgr = self.engine.adapters
        self.catalog.refresh()
        now = time.monotonic()
        done = []
        for d, due in list(self._retiring.items()):
            if due > now:
                continue
            if mgr is None:
                self._retiring.pop(d, None)
                continue
            try:
                mgr.unpin(d)
                mgr.evict(d)
            except AdapterInUseError:
                self._retiring[d] = now + 1.0  # requests still run on it
                continue
            except AdapterError:
                pass  # never loaded here
            self._retiring.pop(d, None)
            done.append(d)
            log.info("evicted the cached copies of replaced adapter revision %s", d[:12])
        return done

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

    def _registry_key(self, key: str | None) -> Principal | None:
        return self.catalog.authenticate(key) if key is not None else None

    def check_inference_auth(self, request: Request) -> Principal:
        """The caller of an inference route; 401 when keys are configured and none matches."""
        key = self._bearer(request)
        if self._matches(key, self.config.api_keys):
            return STATIC_KEY
        if self.config.admin_api_key and self._matches(key, [self.config.admin_api_key]):
            return ADMIN_KEY
        p = self._registry_key(key)
        if p is not None and (p.allows("inference") or p.tenant is None):
            return p
        if not (self.config.api_keys or self.catalog.has_keys()):  # vLLM: open without keys
            return ANONYMOUS
        raise APIError(
            401,
            "missing API key" if key is None else "invalid API key",
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def check_admin_auth(self, request: Request, scope: str) -> Principal:
        """The caller of an admin route holding ``scope``: 404 while the admin API is off, 401
        for an unknown key, 403 for a key without the scope."""
        if not (self.config.admin_api_key or self.catalog.has_admin_keys()):
            raise APIError(
                404,
                "the admin API is disabled; start the server with --admin-api-key "
                "(or LORAPLEX_ADMIN_API_KEY), or create an admin key with "
                "`loraplex tenants keys create --admin`",
                "not_found_error",
                code="admin_api_disabled",
            )
        key = self._bearer(request)
        if self.config.admin_api_key and self._matches(key, [self.config.admin_api_key]):
            return ADMIN_KEY
        p = self._registry_key(key)
        if p is not None and has_scope(p, scope):
            return p
        if p is not None or self._matches(key, self.config.api_keys):
            raise APIError(
                403,
                f"this API key may not call this route (it needs the {scope!r} scope)",
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
    def admit(self, n: int, principal: Principal) -> _Admission:
        """Admit a call with ``n`` prompts: 429 (+ Retry-After) when the caller's tenant is over
        its rate or in-flight limit, 503 (+ Retry-After) when the shared queue is full.

        Its prompts count as waiting from now on; the caller must ``close()`` the admission."""
        if not self.aengine.is_running:
            raise APIError(503, "the engine is not running", "service_unavailable")
        on_close = None
        tenant = self.catalog.tenant(principal.tenant)
        if tenant is not None and (tenant.rate_limit_rps is not None or tenant.max_waiting):
            try:
                self.limits.acquire(
                    tenant.name,
                    n,
                    rate_rps=tenant.rate_limit_rps,
                    max_in_flight=tenant.max_waiting,
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
            on_close = lambda: self.limits.release(name, n)  # noqa: E731
        try:
            return self._admit_shared(n, on_close)
        except BaseException:
            if on_close is not None:
                on_close()
            raise

    def _admit_shared(self, n: int, on_close: Callable[[], None] | None) -> _Admission:
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
        return _Admission(self.aengine, n, on_close)

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

    def resolve_model(self, name: str, principal: Principal) -> ServedAdapter | None:
        """The base model (None) or the adapter revision that serves this request: the active
        one, or the canary with its traffic weight. 404 for names the caller may not see."""
        if name in self.base_names:
            return None
        s = self.catalog.lookup(name, principal)
        if s is None:
            raise APIError(
                404,
                f"The model `{name}` does not exist.",
                "NotFoundError",
                param="model",
                code="model_not_found",
            )
        manifest, via = s.choose(self._rng.random())
        if not self.catalog.compatible(manifest):
            raise APIError(
                409,
                f"adapter {name!r} revision {manifest.revision} was registered for base model "
                f"{manifest.base_model_name!r} (digest {manifest.base_model_digest[:12]}...), "
                f"not the one this server runs ({self.base.name!r}, {self.base.digest[:12]}...)",
                "conflict_error",
                param="model",
                code="adapter_incompatible_base",
            )
        local = local_source(manifest)
        roots = self.config.allowed_lora_roots
        if local is not None and roots and lexically_under(local, roots):
            try:  # its files may have been replaced by links out of the roots since
                check_allowed_path(str(local), roots)
            except AdapterError as e:
                raise APIError(
                    403, f"adapter {name!r}: {e}", "permission_error", code="adapter_path_refused"
                ) from e
        if self.engine.adapters is None:
            raise APIError(400, "LoRA is disabled on this server; start it with --enable-lora")
        return ServedAdapter(self.adapter_spec(manifest), via)

    @staticmethod
    def adapter_spec(m: Manifest) -> AdapterSpec:
        """What the engine serves for one registry revision: its digest is the cache key and is
        verified against the files read."""
        return AdapterSpec(m.ref, m.source_uri, m.tenant, m.priority, m.warm_policy)

    async def prepare(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora: ServedAdapter | None,
        arrival: float,
    ) -> PreparedRequest:
        spec = lora.spec if lora is not None else None
        return await self.aengine.prepare(request_id, prompt, params, spec, arrival)

    async def prepare_all(
        self,
        admission: _Admission,
        prompts: list[str | list[int]],
        params: SamplingParams,
        lora: ServedAdapter | None,
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
                    if item.finished:
                        admission.finals[i] = item
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

    def ok_json(
        self,
        base: dict[str, Any],
        choices: list[dict[str, Any]],
        usage: dict[str, Any],
        headers: dict[str, str],
    ) -> JSONResponse:
        """A finished (non-streamed) completion: ``base`` fields (id, object, created, model),
        its choices and usage."""
        self.metrics.requests.labels(status="200").inc()
        return JSONResponse({**base, "choices": choices, "usage": usage}, headers=headers)

    def ok_stream(
        self, events: AsyncIterator[bytes], admission: _Admission, headers: dict[str, str]
    ) -> _EngineStreamingResponse:
        """A streamed completion; the admission closes when the stream does."""
        self.metrics.requests.labels(status="200").inc()
        return _EngineStreamingResponse(
            events, on_close=admission.close, media_type="text/event-stream", headers=headers
        )

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
        yield _sse(as_api_error(e).body())
    yield _DONE


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


_DONE = b"data: [DONE]\n\n"


def _registration_order(sv: Servable) -> tuple[float, str]:
    """Adapters are listed in the order they were first registered (vLLM: the flag order)."""
    return (sv.active.created_at, sv.name)


def _adapter_header(outs: list[PreparedRequest], lora: ServedAdapter | None) -> dict[str, str]:
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


@dataclass
class _UsageRecord:
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
        usage_log.info(json.dumps(record, sort_keys=True))


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
    registry: Registry | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """Build the server: the engine (unless given), the registry view, metrics and routes.

    ``registry``: an open registry to share (default: :func:`open_registry` of the config,
    closed with the app). The engine loop starts with the app (lifespan) and stops with it;
    ``on_ready`` runs once the loop is up."""
    config.validate()
    if engine is None:
        engine = LLMEngine(config.engine)
    state = ServerState(config, engine, registry)
    state.preload_adapters()

    async def retire_loop() -> None:
        """Follow registry changes made elsewhere and evict replaced revisions when due."""
        tick = min(1.0, config.registry_poll_s, max(config.swap_eviction_delay_s, 0.05))
        while True:
            await asyncio.sleep(tick)
            try:
                await state.aengine.run_in_pool(state.retire_due)
            except Exception:  # a registry hiccup must not end the loop
                log.exception("registry refresh / eviction of replaced revisions failed")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.aengine.start()
        retire = asyncio.create_task(retire_loop())
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            retire.cancel()
            with contextlib.suppress(BaseException):
                await retire
            state.aengine.shutdown()
            state.close()

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
        err = validation_api_error(list(e.errors()))
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
        err = as_api_error(e)
        state.metrics.requests.labels(status=str(err.status)).inc()
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        err = as_api_error(e)
        state.metrics.requests.labels(status=str(err.status)).inc()
        return err.response()

    def inference_auth(request: Request) -> Principal:
        return state.check_inference_auth(request)

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

    @app.get("/v1/models")
    def list_models(principal: Principal = Depends(inference_auth)) -> dict[str, Any]:
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
        for sv in sorted(state.catalog.visible(principal), key=_registration_order):
            m = sv.active
            data.append(
                {
                    "id": sv.name,
                    "object": "model",
                    "created": int(m.activated_at or m.created_at),
                    "owned_by": m.tenant or "loraplex",
                    "root": m.source_uri,
                    "parent": state.base_names[0],
                    "max_model_len": max_len,
                    "revision": m.revision,
                    "sha256": m.sha256,
                }
            )
        return {"object": "list", "data": data}

    @app.get("/v1/adapters")
    def list_adapters(principal: Principal = Depends(inference_auth)) -> dict[str, Any]:
        return _residency(state, principal)

    # -- completions -----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(
        body: CompletionRequest,
        request: Request,
        principal: Principal = Depends(inference_auth),
    ) -> Response:
        arrival = time.monotonic()
        lora = state.resolve_model(body.model, principal)
        params = body.sampling_params()
        prompts = body.prompts()
        admission = state.admit(len(prompts), principal)
        admission.usage = _UsageRecord(body.model, principal, lora)
        return await state.owned(
            admission, _completions(body, request, admission, lora, params, prompts, arrival)
        )

    async def _completions(
        body: CompletionRequest,
        request: Request,
        admission: _Admission,
        lora: ServedAdapter | None,
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

        headers = _adapter_header(prepared, lora)
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
            return state.ok_stream(events, admission, headers)

        finals = await _unless_disconnected(request, state.collect(admission))
        choices = [
            choice(i, o, echo_text[i] + o.text, o.logprobs, len(echo_text[i]), True)
            for i in sorted(finals)
            for o in finals[i].outputs
        ]
        base = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
        return state.ok_json(base, choices, _usage(prepared, finals), headers)

    # -- chat ------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        principal: Principal = Depends(inference_auth),
    ) -> Response:
        arrival = time.monotonic()
        lora = state.resolve_model(body.model, principal)
        params = body.sampling_params()
        messages = body.template_messages()
        admission = state.admit(1, principal)
        admission.usage = _UsageRecord(body.model, principal, lora)
        return await state.owned(
            admission, _chat_completions(body, request, admission, lora, params, messages, arrival)
        )

    async def _chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        admission: _Admission,
        lora: ServedAdapter | None,
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
        headers = _adapter_header(prepared, lora)
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
            return state.ok_stream(events, admission, headers)

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
        final = {**base, "object": "chat.completion"}
        return state.ok_json(final, choices, _usage(prepared, finals), headers)

    add_admin_routes(app, state)
    return app


def _residency(state: ServerState, principal: Principal) -> dict[str, Any]:
    """``/v1/adapters``: every servable name the caller may see (its active revision's tiers,
    and its canary's), plus, for operators, every other adapter still in memory."""
    mgr = state.engine.adapters
    rows: list[dict[str, Any]] = []
    if mgr is None:
        return {"object": "list", "data": rows, "max_loras": 0}
    snapshot = {r.ref.sha256: r for r in mgr.residency()}
    seen: set[str] = set()

    def row_of(m: Manifest) -> dict[str, Any]:
        r = snapshot.get(m.sha256)
        seen.add(m.sha256)
        local = mgr.is_local_source(state.adapter_spec(m))
        if r is None:
            row: dict[str, Any] = {
                **_EMPTY_ROW,
                "sha256": m.sha256[:16],
                "tier": "disk" if local else "absent",
                "rank": m.rank,
                "bytes": None,
                "warm_policy": m.warm_policy,
            }
        else:
            row = _row(r)
            if r.tier == "absent" and local:
                row["tier"] = "disk"  # evicted from memory, its directory is on local disk
        row["revision"] = m.revision
        return row

    for sv in sorted(state.catalog.visible(principal), key=_registration_order):
        row = {"name": sv.name, "path": sv.active.source_uri, "registered": True,
               "tenant": sv.active.tenant, **row_of(sv.active)}  # fmt: skip
        if sv.canary is not None:
            row["canary"] = {**row_of(sv.canary), "weight": sv.canary_weight}
        rows.append(row)
    if principal.tenant is None:
        for d, r in snapshot.items():
            if d in seen or r.tier == "absent":
                continue
            names = state.catalog.names_of(d)
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


_EMPTY_ROW: dict[str, Any] = {
    "hits": 0, "loads": 0, "evictions": 0, "last_access": None, "pinned": False,
    "in_flight": 0, "slot": None,
}  # fmt: skip


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
