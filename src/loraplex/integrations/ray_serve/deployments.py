"""The two Ray Serve deployments: ``LoraplexEngine`` replicas and the ``LoraplexIngress``.

``LoraplexEngine``: one replica is one whole loraplex server, ``create_app(config)`` in the
replica's process: its engine, tiered adapter cache, registry view, auth, metrics, every route.
It answers :class:`~.asgi.ForwardedRequest` values (``forward``, a streaming method) by running
them through that app, and reports its adapter residency to Ray (``record_routing_stats``: the
adapters in its device slots and host memory, read through the engine client) for the
residency router. With ``routing="multiplex"`` it also tells Ray's multiplexing which adapters
it holds: after each successful adapter answer it calls its ``@serve.multiplexed`` function for
that adapter, whose whole job is to have loraplex's cache load (or keep) it, never to load
weights itself (``max_num_models_per_replica`` = the host tier's adapter count).

``LoraplexIngress``: the OpenAI-compatible HTTP front (every path and method passes through).
It reads the body (up to the server's ``--max-request-bytes``), takes the adapter from the JSON
body's ``model`` (the base model's names route by load alone), and forwards the request to an
engine replica through a handle whose multiplexed model id is that adapter, so the deployment's
request router sees it. A replica lost before its answer began (actor or node death, a replica
going away, back-pressure, loraplex's own 503) is retried on another replica with backoff, up
to ``max_attempts`` within ``failover_timeout_s``; a stream cut after its first chunk ends with
an OpenAI error event instead (its tokens were already sent). Per-replica admin calls (runtime
load/unload, pins, evictions) are refused: behind a load balancer they would reach one replica
at random; adapters come from ``--lora-modules`` or a shared ``--registry-url``.

An adapter push (``POST /v1/admin/adapters/{name}/push``, a training loop's new revision) is
the one admin call that reaches every replica: the ingress reads its body once (up to
``max_push_bytes``), checks its ``X-Loraplex-Body-SHA256`` (400 before any replica sees it),
calls ``LoraplexEngine.push`` on every running replica (``DeploymentHandle.broadcast``) and
answers as ``loraplex route`` does (:func:`loraplex.router.push.fan_in`): 201 once every
replica took it with one sha256, else the replicas' shared refusal or a 502 naming the
replicas that did not take it. Each replica reports the new revision's residency to the
request router with its next routing stats, as for any adapter it holds.
"""

import asyncio
import json
import logging
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import (
    LocalRayletDiedError,
    NodeDiedError,
    ObjectLostError,
    OwnerDiedError,
    RayActorError,
    WorkerCrashedError,
)
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from loraplex.client import SHA256_HEADER
from loraplex.config import ServerConfig
from loraplex.integrations.ray_serve.asgi import (
    ForwardedRequest,
    InProcessASGI,
    ResponseStart,
    end_to_end,
    error_start,
)
from loraplex.router.app import route_adapters
from loraplex.router.push import Answer, answer_of, bearer_refusal, check_digest, fan_in
from loraplex.router.relay import read_body, sse_error

__all__ = ["IngressSettings", "LoraplexEngine", "LoraplexIngress"]

log = logging.getLogger("loraplex.integrations.ray_serve")

ROUTINGS = ("residency", "multiplex", "default")
"""``residency``: :class:`~.router.ResidencyRequestRouter`; ``multiplex``: Ray's default router
with its model multiplexing; ``default``: Ray's default router, no adapter information."""

RETRYABLE: tuple[type[BaseException], ...] = (
    RayActorError,  # ActorDiedError, ActorUnavailableError
    WorkerCrashedError,
    NodeDiedError,
    LocalRayletDiedError,
    ObjectLostError,
    OwnerDiedError,
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
"""Failures that mean no replica produced an answer: the request may go to another one."""

PER_REPLICA_ROUTES = frozenset(
    {
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/v1/pin_lora_adapter",
        "/v1/unpin_lora_adapter",
        "/v1/evict_lora_adapter",
    }
)
"""Admin calls that change one replica's cache: refused behind the ingress."""

PUSH_ROUTE = re.compile(r"/v1/admin/adapters/([^/]+)/push")
"""The push route: fanned out to every replica (``LoraplexEngine.push``)."""

ADAPTER_HEADER = "x-loraplex-adapter"
REPLICA_HEADER = b"x-loraplex-replica"
ATTEMPTS_HEADER = b"x-loraplex-attempts"


@dataclass(frozen=True)
class _Held:
    """What the multiplexed function returns: the adapter's name (loraplex's cache holds the
    weights and decides their eviction; Ray dropping this drops nothing)."""

    name: str


@serve.deployment(name="LoraplexEngine", max_ongoing_requests=64)
class LoraplexEngine:
    """One loraplex server per replica (see the module docstring)."""

    async def __init__(self, config: ServerConfig, routing: str = "residency") -> None:
        from loraplex.server.app import create_app

        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        self.routing = routing
        app = await asyncio.to_thread(create_app, config)
        self._state = app.state.loraplex
        self._asgi = InProcessASGI(app)
        await self._asgi.startup()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._mark: Any = None
        self._marking: set[asyncio.Task[Any]] = set()
        self._serving: Counter[str] = Counter()  # adapter name -> requests in flight here
        if routing == "multiplex":
            client = self._state.client
            n = max(1, client.max_cpu_loras) if client.lora_enabled else 1

            async def _loraplex_adapter_loader(name: str) -> _Held:
                return await self._have_loaded(name)

            self._mark = serve.multiplexed(max_num_models_per_replica=n)(_loraplex_adapter_loader)

    async def forward(self, req: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Run ``req`` through this replica's app: a :class:`ResponseStart`, then chunks."""
        adapter = serve.get_multiplexed_model_id()
        if adapter:
            self._serving[adapter] += 1
        try:
            async for part in self._asgi.request(req):
                if isinstance(part, ResponseStart):
                    part = replace(
                        part, headers=[*part.headers, (REPLICA_HEADER, self.replica_id.encode())]
                    )
                    if self._mark is not None and part.status < 300 and part.header(ADAPTER_HEADER):
                        self._note_served(adapter)
                yield part
        finally:
            if adapter:
                self._serving[adapter] -= 1
                if self._serving[adapter] <= 0:
                    del self._serving[adapter]

    async def push(self, req: ForwardedRequest) -> dict[str, Any]:
        """An adapter push (one of a broadcast to every replica) through this replica's app:
        ``{"replica": its id, "status", "body": the whole answer}``."""
        status, chunks = 0, []
        async for part in self._asgi.request(req):
            if isinstance(part, ResponseStart):
                status = part.status
                chunks.append(part.body)
            else:
                chunks.append(part)
        return {"replica": self.replica_id, "status": status, "body": b"".join(chunks)}

    def _note_served(self, name: str) -> None:
        """Tell Ray's multiplexing this replica holds ``name`` (in the background)."""
        if not name:
            return
        task = asyncio.ensure_future(self._mark(name))
        self._marking.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._marking.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("multiplexed load of %r failed: %s", name, t.exception())

        task.add_done_callback(done)

    async def _have_loaded(self, name: str) -> _Held:
        """The ``@serve.multiplexed`` function: loraplex's cache loads (or keeps) ``name``'s
        active revision through the engine client, the same verified load a request makes."""
        state = self._state

        def load() -> None:
            s = state.catalog.servables().get(name)
            if s is None:
                raise LookupError(f"no adapter {name!r}")
            state.client.check_loadable(state.adapter_spec(s.active))

        await asyncio.to_thread(load)
        return _Held(name)

    def record_routing_stats(self) -> dict[str, Any]:
        """Residency for the router: adapter name -> ``device`` | ``host`` for every adapter
        this replica holds (``serving`` for one only a request in flight here holds so far: it
        is being loaded), its host tier's adapter capacity, and when this was read."""
        client, catalog = self._state.client, self._state.catalog
        adapters: dict[str, str] = {}
        if client.lora_enabled:
            for a in client.loaded_adapters():  # device rows first
                for name in catalog.names_of(a.digest):
                    adapters.setdefault(name, a.tier)
            for name in list(self._serving):
                adapters.setdefault(name, "serving")
        return {
            "adapters": adapters,
            "host_capacity": client.max_cpu_loras if client.lora_enabled else 0,
            "device_capacity": client.max_loras if client.lora_enabled else 0,
            "time": time.time(),
        }

    def check_health(self) -> None:
        """Ray's health check: the engine loop must be running."""
        if not self._state.client.is_running:
            raise RuntimeError("the loraplex engine loop is not running")

    async def __del__(self) -> None:
        for task in list(getattr(self, "_marking", ())):
            task.cancel()
        asgi = getattr(self, "_asgi", None)
        if asgi is not None:
            await asgi.shutdown()


@dataclass(frozen=True)
class IngressSettings:
    """How the ingress forwards (see :func:`~.builder.build_app` for where each comes from)."""

    routing: str = "residency"
    base_names: tuple[str, ...] = ()
    max_request_bytes: int = 8 << 20
    max_attempts: int = 5
    failover_timeout_s: float = 60.0
    overload_retries: int = 2  # loraplex 503s retried elsewhere before one is passed on
    max_push_bytes: int = 1 << 30  # an adapter push body, read once for every replica
    push_api_key: str | None = None  # the replicas' admin key; None: pushes are off (404)
    push_timeout_s: float = 300.0  # every replica's answer to a push, at most


def routed_adapter(req: ForwardedRequest, base_names: tuple[str, ...]) -> str:
    """The adapter a request routes by, or ``""`` (the base model): its JSON body's ``model``,
    or for a composition (``merged_adapters``, ``lora_requests``) its primary adapter, as
    ``loraplex route`` picks it (:func:`~loraplex.router.app.route_adapters`), so a composed
    request goes where its primary's weights are."""
    if req.method != "POST" or not req.body.lstrip().startswith(b"{"):
        return ""
    try:
        body = json.loads(req.body)
    except ValueError:
        return ""  # the replica answers the malformed body
    adapter, _ = route_adapters(body, lambda name: name in base_names)
    return adapter or ""


async def _relay(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The rest of a streamed answer; a replica lost mid-stream ends it with an error event."""
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    except RETRYABLE as e:
        finished = True
        log.warning("a stream's replica was lost mid-stream (%s)", type(e).__name__)
        yield sse_error("the replica serving this stream was lost", "replica_failed")
    finally:
        if not finished:
            stream.cancel()


def _too_large(limit: int) -> ResponseStart:
    return error_start(
        413,
        f"the request body is larger than this server accepts ({limit} bytes, --max-request-bytes)",
        "invalid_request_error",
        "request_too_large",
    )


def _response(
    start: ResponseStart, attempts: int, stream: AsyncIterator[bytes] | None = None
) -> Response:
    """The HTTP answer for ``start`` (its headers end to end, plus the attempts made)."""
    headers = end_to_end(start.headers)
    if stream is not None:
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        resp: Response = StreamingResponse(stream, status_code=start.status)
    else:
        resp = Response(content=start.body, status_code=start.status)
        if not any(k.lower() == b"content-length" for k, _ in headers):
            headers.append((b"content-length", str(len(start.body)).encode()))
    headers.append((ATTEMPTS_HEADER, str(attempts).encode()))
    resp.raw_headers = headers
    return resp


# The ingress's FastAPI app is frozen (pickled by value) when ``@serve.ingress`` runs, so
# everything its route uses must be defined above it.
ingress_api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@serve.deployment(name="LoraplexIngress", max_ongoing_requests=1024)
@serve.ingress(ingress_api)
class LoraplexIngress:
    """The OpenAI-compatible front (see the module docstring)."""

    def __init__(self, engine: DeploymentHandle, settings: IngressSettings) -> None:
        self.engine = engine
        self.settings = settings

    @ingress_api.api_route("/{path:path}", methods=_METHODS)
    async def proxy(self, path: str, request: Request) -> Response:
        route = "/" + path
        if route in PER_REPLICA_ROUTES:
            return _response(
                error_start(
                    400,
                    f"{route} changes one replica's adapter cache; behind Ray Serve adapters come "
                    "from --lora-modules or a shared --registry-url (every replica serves them)",
                    "invalid_request_error",
                    "per_replica_route",
                ),
                0,
            )
        pushed = PUSH_ROUTE.fullmatch(route)
        if pushed is not None and request.method == "POST":
            return await self._push(request, route, pushed.group(1))
        body = await read_body(request, self.settings.max_request_bytes)
        if body is None:
            return _response(_too_large(self.settings.max_request_bytes), 0)
        req = ForwardedRequest(
            method=request.method,
            path=route,
            query=request.url.query.encode(),
            headers=list(request.headers.raw),
            body=body,
            client=(request.client.host, request.client.port) if request.client else None,
        )
        start, stream, attempts = await self._send(req, self._adapter_of(req))
        if stream is None:
            return _response(start, attempts)
        return _response(start, attempts, _relay(stream))

    async def _push(self, request: Request, route: str, name: str) -> Response:
        """Fan a push out to every engine replica (see the module docstring)."""
        s = self.settings
        refused = bearer_refusal(  # before a byte of the body: nobody else makes it buffer one
            request.headers.get("authorization"), s.push_api_key, "push",
            "serve with an admin key (--admin-api-key) for the ingress to check",
        )  # fmt: skip
        if refused is not None:
            return _response(error_start(*refused), 0)
        body = await read_body(request, s.max_push_bytes)
        if body is None:
            return _response(_too_large(s.max_push_bytes), 0)
        bad = await asyncio.to_thread(check_digest, body, request.headers.get(SHA256_HEADER))
        if bad is not None:
            return _response(error_start(400, bad, "invalid_request_error", "digest_mismatch"), 0)
        req = ForwardedRequest(
            method="POST",
            path=route,
            query=request.url.query.encode(),
            headers=list(request.headers.raw),
            body=body,
            client=(request.client.host, request.client.port) if request.client else None,
        )
        try:
            results = await self.engine.broadcast("push", req).results_async(
                timeout_s=s.push_timeout_s, return_exceptions=True
            )
        except TimeoutError:
            msg = (f"not every engine replica answered the push of {name!r} within "
                   f"{s.push_timeout_s:g} s; some may have taken it (push again)")  # fmt: skip
            return _response(error_start(504, msg, "server_error", "push_timeout"), 1)
        except RETRYABLE as e:
            msg = f"the push of {name!r} could not reach the engine replicas ({type(e).__name__})"
            return _response(error_start(503, msg, "server_error", "replicas_unavailable"), 1)
        answers = []
        for i, r in enumerate(results):
            if isinstance(r, dict):
                answers.append(answer_of(str(r["replica"]), int(r["status"]), r["body"]))
            else:  # the replica died or raised: it did not take the push
                err = f"{type(r).__name__}: {str(r).splitlines()[0] if str(r) else ''}"
                answers.append(Answer(f"replica #{i}", 0, error=err[:300]))
        status, out = fan_in(name, answers)
        start = ResponseStart(status, [(b"content-type", b"application/json")],
                              json.dumps(out).encode())  # fmt: skip
        return _response(start, len(results))

    def _adapter_of(self, req: ForwardedRequest) -> str:
        return routed_adapter(req, self.settings.base_names)

    async def _send(
        self, req: ForwardedRequest, adapter: str
    ) -> tuple[ResponseStart, DeploymentResponseGenerator | None, int]:
        """Forward ``req``, failing over until an answer starts: (its start, the rest of a
        stream or None, attempts made)."""
        s = self.settings
        handle = self.engine.options(stream=True)
        if adapter and s.routing != "default":
            handle = handle.options(multiplexed_model_id=adapter)
        deadline = time.monotonic() + s.failover_timeout_s
        delay, attempt, overloaded = 0.05, 0, 0
        last = ""
        while True:
            attempt += 1
            gen: DeploymentResponseGenerator = handle.forward.remote(req)
            try:
                first = await gen.__anext__()
            except StopAsyncIteration:
                first = error_start(
                    502, "the replica ended without an answer", "server_error", "replica_failed"
                )
                return first, None, attempt
            except RETRYABLE as e:
                gen.cancel()
                last = type(e).__name__
                log.warning(
                    "attempt %d of %s %s failed (%s); retrying", attempt, req.method, req.path, last
                )
            except asyncio.CancelledError:
                gen.cancel()
                raise
            except Exception as e:  # the replica's own code raised: another try would too
                log.exception("%s %s failed on its replica", req.method, req.path)
                return (
                    error_start(
                        500,
                        f"the engine replica failed ({type(e).__name__})",
                        "server_error",
                        "replica_error",
                    ),
                    None,
                    attempt,
                )
            else:
                if first.status != 503 or overloaded >= s.overload_retries:
                    return first, (gen if first.streaming else None), attempt
                overloaded += 1  # loraplex refused it for load: try another replica first
                gen.cancel()
                last = "503"
            if attempt >= s.max_attempts or time.monotonic() + delay > deadline:
                return (
                    error_start(
                        503,
                        f"no engine replica could answer after {attempt} attempts (last: {last})",
                        "server_error",
                        "replicas_unavailable",
                    ),
                    None,
                    attempt,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
