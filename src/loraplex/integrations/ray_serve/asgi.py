"""Run an ASGI app inside this process without a server: its lifespan, and requests as data.

A Ray Serve engine replica holds a whole loraplex server (``create_app``) and answers requests
the ingress forwards as :class:`ForwardedRequest` values; each answer comes back as a
:class:`ResponseStart` (status, headers and, for a non-streamed response, its whole body)
followed, for a stream, by body chunks. Every route, middleware (body cap, keys), error shape
and metric of the app applies unchanged, since the app itself runs each request. No Ray import:
the driver is plain asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("loraplex.integrations.ray_serve")

Headers = list[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
"""Headers that describe one connection, never forwarded (RFC 9110 section 7.6.1)."""


def end_to_end(headers: Headers) -> Headers:
    """``headers`` without the hop-by-hop ones (names compared lower-case)."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request as the ingress read it (body complete, already size-checked)."""

    method: str
    path: str
    query: bytes = b""
    headers: Headers = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseStart:
    """Status and headers; ``body`` is the whole body unless ``streaming`` (then the chunks
    follow)."""

    status: int
    headers: Headers
    body: bytes = b""
    streaming: bool = False

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        for k, v in self.headers:
            if k.lower() == key:
                return v.decode("latin-1")
        return None


def error_start(status: int, message: str, type_: str, code: str) -> ResponseStart:
    """An OpenAI-shaped error answer (``{"error": {message, type, param, code}}``)."""
    body = json.dumps(
        {"error": {"message": message, "type": type_, "param": None, "code": code}}
    ).encode()
    return ResponseStart(status, [(b"content-type", b"application/json")], body)


class InProcessASGI:
    """Drives ``app``: :meth:`startup` / :meth:`shutdown` run its lifespan (ASGI lifespan
    protocol), :meth:`request` runs one HTTP request and yields its answer.

    A streamed response (``text/event-stream``) is yielded as it is sent, chunks that are ready
    together coalesced; any other response is gathered and yielded once. The app's ``send``
    blocks once ``max_buffered`` messages wait unread, so the app's own stream bounds still see
    a consumer that stopped reading."""

    def __init__(self, app: Any, *, max_buffered: int = 64) -> None:
        self.app = app
        self.max_buffered = max_buffered
        self.state: dict[str, Any] = {}
        self._lifespan: asyncio.Task[None] | None = None
        self._to_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._from_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def startup(self) -> None:
        """Run the app's lifespan start-up; raises if it fails."""
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}
        scope["state"] = self.state
        self._lifespan = asyncio.create_task(
            self.app(scope, self._to_app.get, self._from_app.put), name="asgi-lifespan"
        )
        await self._to_app.put({"type": "lifespan.startup"})
        msg = await self._lifespan_reply()
        if msg.get("type") != "lifespan.startup.complete":
            raise RuntimeError(f"the app's start-up failed: {msg.get('message', msg)}")

    async def shutdown(self) -> None:
        """Run the lifespan shut-down (once; a no-op when it never started)."""
        task, self._lifespan = self._lifespan, None
        if task is None or task.done():
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        msg = await self._lifespan_reply(task)
        if msg.get("type") != "lifespan.shutdown.complete":
            log.warning("the app's shut-down failed: %s", msg.get("message", msg))
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 10)

    async def _lifespan_reply(self, task: asyncio.Task[None] | None = None) -> dict[str, Any]:
        task = task or self._lifespan
        assert task is not None
        reply = asyncio.ensure_future(self._from_app.get())
        await asyncio.wait({reply, task}, return_when=asyncio.FIRST_COMPLETED)
        if reply.done():
            return reply.result()
        reply.cancel()
        exc = task.exception()
        return {"type": "lifespan.failed", "message": repr(exc) if exc else "lifespan ended"}

    async def request(self, req: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Run ``req`` through the app: a :class:`ResponseStart`, then (streaming) chunks.

        Closing the iterator early is the client going away: the app sees
        ``http.disconnect`` and its task is cancelled if it does not finish."""
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(self.max_buffered)
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if gone.is_set():
                raise OSError("the client went away")
            await out.put(message)

        async def run() -> None:
            try:
                await self.app(self._scope(req), receive, send)
            finally:
                await out.put(None)

        task = asyncio.create_task(run(), name=f"asgi {req.method} {req.path}")
        try:
            async for part in _answer(out):
                yield part
            try:
                await task
            except Exception:  # it raised after answering (the answer stands)
                log.exception("%s %s raised", req.method, req.path)
        finally:
            gone.set()
            if not task.done():
                # unblock a send waiting on a full queue, then give the app a moment
                with contextlib.suppress(asyncio.QueueEmpty):
                    while True:
                        out.get_nowait()
                try:
                    with contextlib.suppress(Exception):  # a timeout, or the app's own error
                        await asyncio.wait_for(asyncio.shield(task), 1.0)
                finally:
                    if not task.done():
                        task.cancel()

    def _scope(self, req: ForwardedRequest) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": req.method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.path.encode(),
            "query_string": req.query,
            "root_path": "",
            "headers": end_to_end(req.headers),
            "client": req.client,
            "server": None,
            "state": dict(self.state),
        }


async def _answer(
    out: asyncio.Queue[dict[str, Any] | None],
) -> AsyncIterator[ResponseStart | bytes]:
    """The app's messages as a :class:`ResponseStart` then chunks (see ``request``)."""
    start: dict[str, Any] | None = None
    body: list[bytes] = []
    streaming = started = False
    while True:
        msg = await out.get()
        if msg is None:  # the app returned
            break
        if msg["type"] == "http.response.start":
            start, streaming = msg, _is_stream(msg.get("headers", []))
            continue
        if msg["type"] != "http.response.body" or start is None:
            continue
        if not streaming:
            body.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
            continue
        if not started:
            started = True
            yield ResponseStart(start["status"], list(start.get("headers", [])), b"", True)
        parts = [msg.get("body", b"")]
        ended = not msg.get("more_body", False)
        while not ended and not out.empty():  # coalesce what is ready
            nxt = out.get_nowait()
            if nxt is None:
                ended = True
            elif nxt["type"] == "http.response.body":
                parts.append(nxt.get("body", b""))
                ended = not nxt.get("more_body", False)
        data = b"".join(parts)
        if data:
            yield data
        if ended:
            return
    if start is None:
        yield error_start(
            500, "the server ended the request without an answer", "server_error", "no_response"
        )
    elif not streaming:
        yield ResponseStart(start["status"], list(start.get("headers", [])), b"".join(body))
    elif not started:  # a stream that ended before its first body message
        yield ResponseStart(start["status"], list(start.get("headers", [])), b"", True)


def _is_stream(headers: Headers) -> bool:
    for k, v in headers:
        if k.lower() == b"content-type":
            return v.split(b";")[0].strip().lower() == b"text/event-stream"
    return False
