"""The in-process ASGI driver an engine replica runs loraplex's app with (no Ray cluster):
lifespan, plain and streamed answers, errors in OpenAI's shape, a consumer that goes away."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'loraplex[ray]'")

import asyncio
import json
from typing import Any

from loraplex.integrations.ray_serve.asgi import ForwardedRequest, InProcessASGI, ResponseStart
from loraplex.integrations.ray_serve.testbed import TinyFleet
from loraplex.server.app import create_app


def _post(path: str, body: dict[str, Any]) -> ForwardedRequest:
    return ForwardedRequest(
        "POST",
        path,
        headers=[(b"content-type", b"application/json")],
        body=json.dumps(body).encode(),
    )


async def _collect(asgi: InProcessASGI, req: ForwardedRequest) -> tuple[ResponseStart, bytes]:
    parts = [p async for p in asgi.request(req)]
    start = parts[0]
    assert isinstance(start, ResponseStart)
    rest = b"".join(p for p in parts[1:] if isinstance(p, bytes))
    return start, start.body + rest


def test_the_app_runs_in_process(testbed: TinyFleet) -> None:
    app = create_app(testbed.server_config())
    asgi = InProcessASGI(app)

    async def main() -> None:
        await asgi.startup()
        try:
            start, body = await _collect(asgi, ForwardedRequest("GET", "/v1/models"))
            assert start.status == 200 and not start.streaming
            assert {m["id"] for m in json.loads(body)["data"]} >= {"tiny", "a0", "a3"}

            req = {"model": "a1", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
            start, body = await _collect(asgi, _post("/v1/completions", req))
            assert start.status == 200, body
            assert start.header("x-loraplex-adapter-state") == "cold"  # first use: a real load
            assert json.loads(body)["usage"]["completion_tokens"] == 3
            start, _ = await _collect(asgi, _post("/v1/completions", req))
            assert start.header("x-loraplex-adapter-state") == "warm"

            start, body = await _collect(asgi, _post("/v1/completions", {**req, "stream": True}))
            assert start.status == 200 and start.streaming
            events = [e for e in body.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and len(events) >= 2

            start, body = await _collect(asgi, _post("/v1/completions", {**req, "model": "nope"}))
            assert start.status == 404
            assert json.loads(body)["error"]["code"] == "model_not_found"

            # a consumer that stops after the first part: the stream ends, the engine goes on
            gen = asgi.request(_post("/v1/completions", {**req, "stream": True, "max_tokens": 50}))
            first = await gen.__anext__()
            assert isinstance(first, ResponseStart) and first.streaming
            await gen.aclose()
            start, _ = await _collect(asgi, _post("/v1/completions", req))
            assert start.status == 200
        finally:
            await asgi.shutdown()
        assert not app.state.loraplex.client.is_running

    asyncio.run(main())
