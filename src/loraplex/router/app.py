"""The router's HTTP API: the same OpenAI routes as a replica, proxied to the best replica.

``create_router_app(config)`` builds it. Per request::

    body = the request body (413 beyond max_request_bytes, counted while reading)
    adapter = body["model"], or a composition's adapters (route_adapters)
    for attempt in 1 .. 1 + max_retries:
        replica = Picker.pick(views of the replicas, adapter)   (loraplex.router.homes; the
                  home set, then scoring.choose)
        send (the client's headers, Authorization included, minus hop-by-hop ones)
        retry on the next replica only if no handler there can have run the request:
            connection refused (eject), connect or pool timeout, the request not fully
            written, or a 503 answer
        the whole request written and then no answer (dropped, reset): 502 replica_failed,
            never sent again (the replica may have begun generating); silence: 504
        otherwise: pass the response through (status, body, headers; SSE streamed event by
            event); a replica that dies mid-stream ends the stream with an OpenAI error event
            and ``[DONE]``, never a hang
        a 2xx answer with ``x-loraplex-adapter-state``: the adapter is on that replica's device
            in the router's view (the only update between polls; never what a client asked)

``POST /v1/admin/adapters/{name}/push`` (a training loop's new revision of an adapter, the
wire format of :mod:`loraplex.client`) is not routed but fanned out::

    the caller's bearer must be --push-api-key, checked before the body is read (none
           configured: 404 push_api_disabled, the route is off; a wrong or missing one: 401)
    body = the push body (413 beyond max_push_bytes), read once; its X-Loraplex-Body-SHA256
           checked here first (400: no replica is sent a body that does not match it)
    targets = every known replica (--push-targets all, the default), or the replicas whose
              residency lists the name (holders; every replica while none does)
    send the same bytes and the client's headers (Authorization included) to every target
        concurrently; never retried (a push that timed out may have been applied)
    every target 201 with one sha256: 201, the first replica's answer plus "replicas" (each
        one's url, status, revision, sha256); each replica's view: the name in host memory,
        at the revision it answered
    every target the same 4xx: that answer (the push was refused everywhere, nothing changed)
    otherwise: 502 push_incomplete (or push_diverged: different sha256s) naming in
        "replicas" which took it and which did not, and why

Also ``/v1/models`` (union over the replicas, with the client's Authorization),
``/v1/replicas`` (the router's view, every adapter name, its decisions by reason and, with the
``home`` policy, every answered adapter's home set: only with ``--status-api-key``, off
without one), ``/dashboard`` (the fleet page: adapters x
replicas; it holds no data and polls ``/v1/replicas`` with the key it asks for), ``/health`` (200 while one replica is healthy) and ``/metrics`` (decisions by
reason, per-replica latency, retries; no adapter names). Never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.client import SHA256_HEADER, push_path
from loraplex.pages import read_page
from loraplex.router.config import ENV_PUSH_API_KEY, ENV_STATUS_API_KEY, RouterConfig
from loraplex.router.homes import Picker
from loraplex.router.push import Answer, answer_of, bearer_refusal, check_digest, fan_in
from loraplex.router.relay import read_body, sse_error
from loraplex.router.replicas import Replica, ReplicaSet
from loraplex.types import MAX_COMPOSED_ADAPTERS

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length", "content-encoding",
    "accept-encoding",
}  # fmt: skip
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _check_key(
    request: Request, key: str | None, route: str, flag: str, env: str
) -> JSONResponse | None:
    """:func:`~loraplex.router.push.bearer_refusal` as the router's JSON error (401s say
    ``WWW-Authenticate: Bearer``)."""
    hint = f"start the router with {flag} (or {env})"
    refused = bearer_refusal(request.headers.get("authorization"), key, route, hint)
    if refused is None:
        return None
    status, message, type_, code = refused
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return _error(status, message, type_, code=code, headers=headers)


def _error(
    status: int,
    message: str,
    type_: str,
    *,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code or status}}
    return JSONResponse(body, status_code=status, headers=headers)


class RouterMetrics:
    """The router's own metrics, in its own registry."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.decisions = Counter(
            "loraplex_router_decisions",
            "Routing decisions by reason (affinity, home, spill, load, fallback, round_robin).",
            ["reason"],
            registry=r,
        )
        self.latency = Histogram(
            "loraplex_router_replica_latency_seconds",
            "Per replica: seconds to the response headers (first_byte) and to the end (total).",
            ["replica", "stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "loraplex_router_retries",
            "Requests sent again to another replica, by cause.",
            ["cause"],
            registry=r,
        )
        self.requests = Counter(
            "loraplex_router_requests", "Requests answered, by status.", ["status"], registry=r
        )
        self.stream_errors = Counter(
            "loraplex_router_stream_errors",
            "Streams cut by a replica failure after the first byte (client got an error event).",
            ["replica"],
            registry=r,
        )
        self.ejections = Counter(
            "loraplex_router_ejections", "Replicas ejected.", ["replica"], registry=r
        )
        self.arrivals = Counter(
            "loraplex_router_adapter_arrivals",
            "Responses by the adapter state the replica reported (warm, cold).",
            ["state"],
            registry=r,
        )
        self.healthy = Gauge(
            "loraplex_router_replica_healthy", "1 while a replica takes requests.", ["replica"],
            registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "loraplex_router_replica_in_flight", "Requests outstanding per replica.", ["replica"],
            registry=r,
        )  # fmt: skip

    def render(self, replicas: list[Replica]) -> bytes:
        self.healthy.clear()
        self.in_flight.clear()
        for rep in replicas:
            self.healthy.labels(replica=rep.url).set(1 if rep.healthy else 0)
            self.in_flight.labels(replica=rep.url).set(rep.in_flight)
        return generate_latest(self.registry)


class _ProxyStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends, even when its body never
    started (the client left first), so no upstream connection or in-flight count leaks."""

    def __init__(self, *args: Any, on_close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


class _Retry(Exception):
    """This attempt failed before any replica's handler can have run the request (and before
    any byte reached the client); try another replica."""

    def __init__(self, cause: str, message: str, body_503: bytes | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.body_503 = body_503  # the replica's own 503 answer, if that was the failure


def route_adapters(body: Any, is_base: Callable[[str], bool]) -> tuple[str | None, tuple[str, ...]]:
    """What a request body routes by: ``(adapter, components)``. One adapter (``model``, or
    the only one a composition names): ``(name, ())``; the base model: ``(None, ())``; a
    composition (``merged_adapters.ids`` or ``lora_requests[].lora_name``) of several:
    ``(primary, names)``, the primary being ``model`` when it is one of them, else the first.
    Reads at most :data:`MAX_COMPOSED_ADAPTERS` names (a replica refuses more); anything
    malformed routes as ``model`` alone (the replica answers the 400)."""
    if not isinstance(body, dict):
        return None, ()
    model = body.get("model")
    model = model if isinstance(model, str) and model and not is_base(model) else None
    listed: list[Any] = []
    merged, loras = body.get("merged_adapters"), body.get("lora_requests")
    if isinstance(merged, dict) and isinstance(merged.get("ids"), list):
        listed = merged["ids"][:MAX_COMPOSED_ADAPTERS]
    elif isinstance(loras, list):
        listed = [
            x.get("lora_name", x.get("name")) if isinstance(x, dict) else None
            for x in loras[:MAX_COMPOSED_ADAPTERS]
        ]
    names = list(dict.fromkeys(n for n in listed if isinstance(n, str) and n and not is_base(n)))
    if model in names:  # the primary first: its home set is the composition's
        names.remove(model)
        names.insert(0, model)
    if len(names) > 1:
        return names[0], tuple(names)
    return (names[0] if names else model), ()


class Router:
    """Replica set + policy + one HTTP client; ``forward`` proxies one request."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.replicas = ReplicaSet(
            static=config.replicas,
            replicas_file=config.replicas_file,
            dns=config.replicas_dns,
            poll_interval_s=config.poll_interval_s,
            poll_timeout_s=config.poll_timeout_s,
            readmit_after=config.readmit_after,
            eject_after=config.eject_after,
            api_key=config.replica_api_key,
            on_eject=lambda url: self.metrics.ejections.labels(replica=url).inc(),
        )
        self.picker = Picker(config.policy, config.weights, config.thresholds, config.homes)
        self.client: httpx.AsyncClient | None = None
        self.decisions: dict[str, int] = {}  # reason -> decisions (a handful of reasons)

    def pick(
        self, adapter: str | None, tried: set[str], components: tuple[str, ...] = ()
    ) -> Replica | None:
        reps = self.replicas.ordered()
        views = [r.view() for r in reps]
        exclude = frozenset(i for i, r in enumerate(reps) if r.url in tried)
        d = self.picker.pick(views, adapter, exclude=exclude, components=components)
        if d is None:
            return None
        self.metrics.decisions.labels(reason=d.reason).inc()
        self.decisions[d.reason] = self.decisions.get(d.reason, 0) + 1
        return reps[d.index]

    def _no_replica(self, tried: set[str], last: str | None) -> JSONResponse:
        self.metrics.requests.labels(status="503").inc()
        why = f" (last error: {last})" if last else ""
        msg = (
            f"no healthy replica is available; tried {len(tried)}{why}"
            if tried
            else "no healthy replica is available"
        )
        return _error(
            503,
            msg,
            "service_unavailable",
            code="no_healthy_replica",
            headers={"Retry-After": str(self.config.retry_after_s)},
        )

    def _observe_headers(
        self,
        rep: Replica,
        adapter: str | None,
        resp: httpx.Response,
        components: tuple[str, ...] = (),
    ) -> None:
        """A replica's answer: a success with its adapter state is the replica vouching that it
        served ``adapter`` (the name clients route by; a composition: each of its
        ``components``) from a device slot; nothing else (errors, answers without the header)
        changes the view."""
        state = resp.headers.get("x-loraplex-adapter-state")
        served = state in ("warm", "cold") and 200 <= resp.status_code < 300
        if adapter is not None and not served:
            self.picker.note_unanswered(adapter)  # a slot held for its first answer is free
        if state not in ("warm", "cold"):
            return
        self.metrics.arrivals.labels(state=state).inc()
        if adapter is not None and served:
            now = time.monotonic()
            for a in components or (adapter,):
                rep.note_served(a, now)
            self.picker.note_answered(adapter, rep.url)  # traffic for the home sets

    def check_status_key(self, request: Request) -> Response | None:
        """None if the caller holds the status key; else the error to answer (404 while no
        status key is configured: the route is off; 401 for a missing or wrong key)."""
        return _check_key(request, self.config.status_api_key, "status", "--status-api-key",
                          ENV_STATUS_API_KEY)  # fmt: skip

    def check_push_key(self, request: Request) -> Response | None:
        """As :meth:`check_status_key` for adapter pushes (``--push-api-key``): checked before
        a byte of the body is read, so nobody without it makes the router buffer and fan out
        up to ``--max-push-bytes`` a call."""
        return _check_key(request, self.config.push_api_key, "push", "--push-api-key",
                          ENV_PUSH_API_KEY)  # fmt: skip

    async def forward(self, request: Request, path: str) -> Response:
        raw = await read_body(request, self.config.max_request_bytes)
        if raw is None:
            self.metrics.requests.labels(status="413").inc()
            return _error(
                413,
                f"the request body is larger than {self.config.max_request_bytes} bytes",
                "invalid_request_error",
                code="request_too_large",
            )
        try:
            body = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self.metrics.requests.labels(status="400").inc()
            return _error(400, f"the request body is not valid JSON: {e}", "invalid_request_error")
        # the base model: no adapter to be near, route by load
        adapter, components = route_adapters(body, self.replicas.is_base_model)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        tried: set[str] = set()
        last: _Retry | None = None
        for attempt in range(self.config.max_retries + 1):
            rep = self.pick(adapter, tried, components)
            if rep is None:
                break
            tried.add(rep.url)
            try:
                return await self._attempt(rep, adapter, path, raw, headers, components)
            except _Retry as e:
                last = e
                if attempt < self.config.max_retries:
                    self.metrics.retries.labels(cause=e.cause).inc()
        if last is not None and last.body_503 is not None:  # every replica tried is overloaded
            self.metrics.requests.labels(status="503").inc()
            return Response(last.body_503, status_code=503, media_type="application/json",
                            headers={"Retry-After": str(self.config.retry_after_s)})  # fmt: skip
        return self._no_replica(tried, str(last) if last else None)

    async def _attempt(
        self,
        rep: Replica,
        adapter: str | None,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        components: tuple[str, ...] = (),
    ) -> Response:
        assert self.client is not None
        t0 = time.monotonic()
        pending = rep.note_dispatch(adapter)
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                rep.note_done(pending)

        # every byte of the request handed to the connection. Errs only towards True (asyncio
        # silently drops a write to a connection it has just lost): then a failure counts as
        # one the replica may have processed, a 502 and never a second generation
        sent = False

        async def body() -> AsyncIterator[bytes]:
            nonlocal sent
            if raw:
                yield raw
            sent = True  # resumed only after the write of the last chunk returned

        try:
            req = self.client.build_request(
                "POST", f"{rep.url}{path}", content=body(),
                headers={**headers, "content-length": str(len(raw))},
            )  # fmt: skip
            try:
                resp = await self.client.send(req, stream=True)
            except httpx.ConnectError as e:  # refused: the replica is down
                self.replicas.mark_failed(rep, f"connect: {e}")
                raise _Retry("connect", f"{rep.url}: cannot connect ({e})") from e
            except httpx.ConnectTimeout as e:  # nothing was sent
                raise _Retry("connect_timeout", f"{rep.url}: connect timed out ({e})") from e
            except httpx.PoolTimeout as e:  # no connection: nothing was sent
                raise _Retry("pool_timeout", f"{rep.url}: no free connection ({e})") from e
            except httpx.HTTPError as e:
                if not sent:  # cut before the request was whole: no handler can have run it
                    raise _Retry("write", f"{rep.url}: request not sent ({e!r})") from e
                finish()
                if isinstance(e, httpx.TimeoutException):  # it has the request, said nothing
                    self.metrics.requests.labels(status="504").inc()
                    return _error(504, f"replica {rep.url} timed out: {e!r}", "server_error",
                                  code="replica_timeout")  # fmt: skip
                # it had the whole request and hung up without a word: it may have begun
                # generating, so sending it elsewhere could generate twice
                self.replicas.mark_failed(rep, f"dropped a request: {e!r}")
                self.metrics.requests.labels(status="502").inc()
                return _error(
                    502,
                    f"replica {rep.url} closed the connection without answering "
                    f"({type(e).__name__}); not retried, as it may have processed the request",
                    "server_error",
                    code="replica_failed",
                )
            self.metrics.latency.labels(replica=rep.url, stage="first_byte").observe(
                time.monotonic() - t0
            )
            if resp.status_code == 503:  # overloaded / draining: nothing was generated
                content = await resp.aread()
                await resp.aclose()
                raise _Retry("status_503", f"{rep.url}: 503", content)
            self._observe_headers(rep, adapter, resp, components)
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            out_headers["x-loraplex-replica"] = rep.url
            self.metrics.requests.labels(status=str(resp.status_code)).inc()
            if resp.headers.get("content-type", "").startswith("text/event-stream"):

                async def close() -> None:
                    finish()
                    with contextlib.suppress(Exception):
                        await resp.aclose()

                return _ProxyStream(
                    self._stream(rep, resp, t0), status_code=resp.status_code,
                    headers=out_headers, media_type="text/event-stream", on_close=close,
                )  # fmt: skip
            try:
                content = await resp.aread()
            except httpx.HTTPError as e:
                self.replicas.mark_failed(rep, f"body: {e}")
                return _error(502, f"replica {rep.url} failed while answering: {e}",
                              "server_error", code="replica_failed")  # fmt: skip
            finally:
                await resp.aclose()
            self.metrics.latency.labels(replica=rep.url, stage="total").observe(
                time.monotonic() - t0
            )
            finish()
            return Response(content, status_code=resp.status_code, headers=out_headers)
        except BaseException:
            finish()
            raise

    async def _stream(self, rep: Replica, resp: httpx.Response, t0: float) -> AsyncIterator[bytes]:
        """Forward whole SSE events; on a replica failure, an error event and ``[DONE]``."""
        buf = b""
        try:
            async for chunk in resp.aiter_bytes():
                buf += chunk
                end = buf.rfind(b"\n\n")
                if end >= 0:
                    yield buf[: end + 2]
                    buf = buf[end + 2 :]
            if buf.strip():
                yield buf
            self.metrics.latency.labels(replica=rep.url, stage="total").observe(
                time.monotonic() - t0
            )
        except httpx.HTTPError as e:
            self.metrics.stream_errors.labels(replica=rep.url).inc()
            if not isinstance(e, httpx.TimeoutException):
                self.replicas.mark_failed(rep, f"stream: {e}")
            log.warning("stream from %s cut: %s", rep.url, e)
            yield sse_error(
                f"the replica serving this stream failed ({type(e).__name__}: {e}); "
                "the output above is incomplete",
                "replica_failed",
            )

    def push_targets(self, name: str) -> list[Replica]:
        """The replicas a push of ``name`` goes to (``--push-targets``), healthy or not: one
        that cannot take it is named in the answer, never skipped in silence."""
        reps = self.replicas.ordered()
        if self.config.push_targets == "holders":
            holders = [r for r in reps if r.tiers.get(name, "absent") != "absent"]
            return holders or reps
        return reps

    async def push(self, request: Request, name: str) -> Response:
        """Fan a push of ``name`` out to its target replicas (see the module docstring)."""
        refused = self.check_push_key(request)
        if refused is not None:
            self.metrics.requests.labels(status=str(refused.status_code)).inc()
            return refused
        limit = self.config.max_push_bytes
        raw = await read_body(request, limit)
        if raw is None:
            self.metrics.requests.labels(status="413").inc()
            return _error(413, f"the push body is larger than {limit} bytes (--max-push-bytes)",
                          "invalid_request_error", code="request_too_large")  # fmt: skip
        # hashed off the event loop: up to a GiB must not stall every other request
        bad = await asyncio.to_thread(check_digest, raw, request.headers.get(SHA256_HEADER))
        if bad is not None:
            self.metrics.requests.labels(status="400").inc()
            return _error(400, bad, "invalid_request_error", code="digest_mismatch")
        targets = self.push_targets(name)
        if not targets:
            return self._no_replica(set(), None)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["content-length"] = str(len(raw))
        path = push_path(name) + (f"?{request.url.query}" if request.url.query else "")
        answers = await asyncio.gather(*(self._push_one(r, path, raw, headers) for r in targets))
        now = time.monotonic()
        for rep, a in zip(targets, answers, strict=True):
            if a.took and isinstance(a.body.get("revision"), str):
                rep.note_pushed(name, a.body["revision"], now)
        status, body = fan_in(name, answers)
        self.metrics.requests.labels(status=str(status)).inc()
        return JSONResponse(body, status_code=status)

    async def _push_one(
        self, rep: Replica, path: str, raw: bytes, headers: dict[str, str]
    ) -> Answer:
        """One replica's answer to a push (the same bytes object for every replica: no copy).
        Never retried: a push that timed out may have been applied."""
        assert self.client is not None
        t0 = time.monotonic()
        rep.in_flight += 1
        try:
            resp = await self.client.post(f"{rep.url}{path}", content=raw, headers=headers)
        except httpx.HTTPError as e:
            if isinstance(e, httpx.ConnectError):
                self.replicas.mark_failed(rep, f"push: {e}")
            return Answer(rep.url, 0, error=f"{type(e).__name__}: {e}".rstrip(": "))
        finally:
            rep.in_flight -= 1
        self.metrics.latency.labels(replica=rep.url, stage="total").observe(time.monotonic() - t0)
        return answer_of(rep.url, resp.status_code, resp.content)

    async def models(self, request: Request) -> Response:
        """Union of every healthy replica's ``/v1/models`` (first replica's entry wins)."""
        assert self.client is not None
        auth = request.headers.get("authorization")
        headers = {"Authorization": auth} if auth else {}
        reps = [r for r in self.replicas.ordered() if r.healthy]
        if not reps:
            return self._no_replica(set(), None)

        async def one(r: Replica) -> httpx.Response | None:
            try:
                return await self.client.get(f"{r.url}/v1/models", headers=headers)  # type: ignore[union-attr]
            except httpx.HTTPError as e:
                if isinstance(e, httpx.ConnectError):
                    self.replicas.mark_failed(r, f"/v1/models: {e}")
                return None

        answers = await asyncio.gather(*(one(r) for r in reps))
        data: dict[str, Any] = {}
        for resp in answers:
            if resp is not None and resp.status_code == 200:
                for m in resp.json().get("data", []):
                    data.setdefault(m.get("id"), m)
        if not data:
            failed = next((a for a in answers if a is not None and a.status_code >= 400), None)
            if failed is not None:  # e.g. 401: the replicas' own answer
                return Response(failed.content, status_code=failed.status_code,
                                media_type="application/json")  # fmt: skip
            return self._no_replica({r.url for r in reps}, None)
        return JSONResponse({"object": "list", "data": list(data.values())})


def create_router_app(config: RouterConfig) -> FastAPI:
    """Build the router app; polling starts and stops with the app (lifespan)."""
    config.validate()
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        # an idle connection is never reused once near the replicas' keep-alive (uvicorn: 5 s)
        # so a replica cannot close it under a request: such a drop is not retried (it looks
        # like a replica that took the request and died), so it must not happen by accident
        limits = httpx.Limits(
            max_connections=None,
            max_keepalive_connections=64,
            keepalive_expiry=config.keepalive_expiry_s,
        )
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            router.client = client
            poller = asyncio.create_task(router.replicas.run())
            try:
                yield
            finally:
                poller.cancel()
                with contextlib.suppress(BaseException):
                    await poller
                router.client = None

    app = FastAPI(title="loraplex router", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("router error", exc_info=e)
        return _error(500, f"router error: {type(e).__name__}", "server_error")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions")

    @app.post("/v1/admin/adapters/{name}/push")
    async def push(name: str, request: Request) -> Response:
        return await router.push(request, name)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/v1/replicas")
    async def replicas(request: Request) -> Response:
        denied = router.check_status_key(request)
        if denied is not None:
            return denied
        return JSONResponse(
            {
                "object": "list",
                "policy": config.policy,
                "decisions": dict(sorted(router.decisions.items())),
                "data": router.replicas.status(),
                "homes": router.picker.home_sets(),
            }
        )

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        """The fleet page: it holds no data (open); it polls ``/v1/replicas`` (status key)."""
        page = read_page("loraplex.router", "static/dashboard.html")
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/health")
    async def health() -> Response:
        if any(r.healthy for r in router.replicas.ordered()):
            return Response(status_code=200)
        return _error(503, "no healthy replica", "service_unavailable",
                      headers={"Retry-After": str(config.retry_after_s)})  # fmt: skip

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(router.metrics.render(router.replicas.ordered()), media_type=CONTENT_TYPE)

    return app


def run_router(config: RouterConfig) -> None:
    """Serve the router with uvicorn until interrupted."""
    import uvicorn

    app = create_router_app(config)
    # h11: bounded header blocks (see loraplex.server.app.run_server); uvloop when installed
    uvicorn.run(
        app, host=config.host, port=config.port, log_level=config.log_level, http="h11", loop="auto"
    )
