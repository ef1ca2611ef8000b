"""The server under concurrent load: many streams over more adapters than slots, clients that
disconnect mid-stream, unloading an adapter while it streams, and load shedding (503).

After each scenario every KV block, slot and adapter reference must be free again.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.app import ServerState, create_app
from loraplex.testing import ALL_PROJ, make_random_adapter, sync
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import EVENT_TIMEOUT_S, StepGate, wait_until

KEY = "sk-inference-test"
ADMIN = "sk-admin-test"
BASE = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Server:
    url: str
    state: ServerState
    root: Path
    names: dict[str, Path]


def _config(model: Path, names: dict[str, Path], root: Path, **engine: Any) -> ServerConfig:
    max_waiting = engine.pop("max_waiting", 256)
    return ServerConfig(
        EngineConfig(model=str(model), max_loras=4, num_threads=1, **engine),
        served_model_name=[BASE],
        lora_modules=[LoRAModule(n, str(p)) for n, p in names.items()],
        api_keys=[KEY],
        admin_api_key=ADMIN,
        allowed_lora_roots=[str(root)],
        max_waiting=max_waiting,
        log_level="warning",
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("allowed")


@pytest.fixture(scope="module")
def names(tiny_model: Path, adapters: dict[str, Path], root: Path) -> dict[str, Path]:
    extra = make_random_adapter(
        tiny_model, root / "extra_r8", r=8, lora_alpha=16, target_modules=ALL_PROJ, seed=11
    )
    return {**adapters, "extra_r8": extra}


@pytest.fixture(scope="module")
def server(tiny_model: Path, names: dict[str, Path], root: Path) -> Iterator[Server]:
    app = create_app(_config(tiny_model, names, root, max_num_seqs=64))
    with serve_in_thread(app) as url:
        yield Server(url, app.state.loraplex, root, names)


def engine_idle(state: ServerState) -> bool:
    eng = state.engine
    return (
        eng.is_idle()
        and eng.num_free_blocks == eng.pool.num_blocks
        and state.aengine.num_waiting == 0
        and not eng.requests
    )


def wait_idle(state: ServerState) -> None:
    sync.wait_idle(state.engine, state.aengine)


def sse_payloads(lines: list[str]) -> list[Any]:
    """The JSON payloads of an SSE body, checking it ends with ``data: [DONE]``."""
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def stream_text(payloads: list[Any]) -> str:
    assert not any("error" in p for p in payloads), payloads
    return "".join(c["text"] for p in payloads for c in p["choices"])


# -- 64 concurrent streams over 8 adapters, 4 slots -----------------------------------------------
def test_64_concurrent_streams_over_8_adapters(server: Server) -> None:
    models = sorted(server.names)
    assert len(models) == 8

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str | None]:
        model = models[i % len(models)]
        stream = await client.completions.create(
            model=model,
            prompt=f"Request {i}: the capital of France is",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        assert usage is not None
        return text, usage, finish

    async def main() -> list[tuple[str, int, str | None]]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120
        )
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    async def held_main(gate: StepGate) -> list[tuple[str, int, str | None]]:
        # every request is in the engine before the first step runs, so the first step has
        # more adapters waiting than slots (whatever the machine's speed)
        run = asyncio.ensure_future(main())
        eng = server.state.engine
        await asyncio.to_thread(wait_until, lambda: eng.num_waiting == 64, what="64 waiting")
        gate.open()
        return await run

    peak_distinct = []
    server.state.aengine.step_observers.append(lambda s: peak_distinct.append(s.distinct_adapters))
    try:
        with StepGate(server.state.engine) as gate:
            gate.hold()
            results = asyncio.run(held_main(gate))
    finally:
        server.state.aengine.step_observers.pop()
    assert len(results) == 64
    assert all(usage == 6 and finish == "length" for _, usage, finish in results), results
    # requests for the same adapter and prompt shape give the same greedy text
    assert max(peak_distinct) == 4  # all four slots used at once, never more
    wait_idle(server.state)
    mgr = server.state.engine.adapters
    assert mgr is not None and mgr.is_idle()
    assert all(u == 0 for u in mgr.slot_users)
    assert not mgr.request_refs


def test_concurrent_greedy_outputs_equal_sequential(server: Server) -> None:
    """Mixed concurrent batches give the same greedy text as one request at a time."""
    models = [*sorted(server.names)[:6], BASE]
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as h:
        solo = {
            m: h.post("/v1/completions", json={**body, "model": m}).json()["choices"][0]["text"]
            for m in models
        }

    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as h:
            rs = await asyncio.gather(
                *(h.post("/v1/completions", json={**body, "model": m}) for m in models * 3)
            )
        return [r.json()["choices"][0]["text"] for r in rs]

    together = asyncio.run(main())
    assert together == [solo[m] for m in models * 3]
    wait_idle(server.state)


# -- a client that goes away mid-stream -----------------------------------------------------------
def test_disconnect_mid_stream_aborts_and_frees(server: Server) -> None:
    eng = server.state.engine
    aborted: list[tuple[str, bool]] = []
    real_abort = eng.abort_request

    def spy(request_id: str) -> bool:
        ok = real_abort(request_id)
        aborted.append((request_id, ok))
        return ok

    eng.abort_request = spy  # type: ignore[method-assign]
    long_body = {
        "model": "all_r8",
        "prompt": "Tell me a long story",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    short_body = {"model": "mlp_r16", "prompt": "Hi", "max_tokens": 20, "ignore_eos": True}

    async def leave_early(h: httpx.AsyncClient, model: str) -> str:
        async with h.stream("POST", "/v1/completions", json={**long_body, "model": model}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return line  # leaving the block closes the connection
        raise AssertionError("no chunk")

    async def main(gate: StepGate) -> tuple[list[str], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as h:
            others = [
                asyncio.ensure_future(h.post("/v1/completions", json=short_body)) for _ in range(4)
            ]
            leaving = [
                asyncio.ensure_future(leave_early(h, m)) for m in ("all_r8", "patterns", BASE)
            ]
            # one step at a time until each long stream has its first chunk: none can reach
            # its 400 tokens, so each one is still running when its client leaves
            await asyncio.to_thread(wait_until, lambda: eng.num_waiting == 7, what="7 waiting")
            while not all(t.done() for t in leaving):
                gate.allow(1)
                await asyncio.to_thread(gate.wait_held)
                await asyncio.sleep(0.005)  # let that step's chunks reach the clients
            firsts = [t.result() for t in leaving]
            await asyncio.to_thread(
                wait_until,
                lambda: len([a for a in aborted if a[0].startswith("cmpl-")]) >= 3,
                what="the three abandoned streams to be aborted",
            )
            gate.open()
            return firsts, list(await asyncio.gather(*others))

    try:
        with StepGate(eng) as gate:
            gate.hold()
            firsts, others = asyncio.run(main(gate))
        wait_idle(server.state)
    finally:
        del eng.abort_request
    assert all(json.loads(f[len("data: ") :])["choices"] for f in firsts)
    assert [r.status_code for r in others] == [200] * 4
    assert all(r.json()["usage"]["completion_tokens"] == 20 for r in others)
    # each abandoned stream was aborted in the engine (not run to its 400 tokens)
    assert len([rid for rid, ok in aborted if ok and rid.startswith("cmpl-")]) == 3, aborted
    assert engine_idle(server.state)


def test_disconnect_during_non_streaming_request_aborts(server: Server) -> None:
    """The request runs three steps, then the engine is held while its client leaves: it is
    aborted (freed) while running, never run to its 450 tokens."""
    eng = server.state.engine
    aborted: list[tuple[str, bool]] = []
    real_abort = eng.abort_request

    def spy(request_id: str) -> bool:
        ok = real_abort(request_id)
        aborted.append((request_id, ok))
        return ok

    async def main(gate: StepGate) -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as h:
            task = asyncio.ensure_future(
                h.post(
                    "/v1/completions",
                    json={
                        "model": "extra_r8",
                        "prompt": "Count",
                        "max_tokens": 450,
                        "ignore_eos": True,
                    },
                )
            )
            await asyncio.to_thread(wait_until, lambda: eng.num_waiting == 1, what="1 waiting")
            gate.allow(3)
            await asyncio.to_thread(gate.wait_held)
            assert eng.num_running == 1 and not task.done()  # it is running, and held
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.to_thread(wait_until, lambda: aborted, what="the abort")

    eng.abort_request = spy  # type: ignore[method-assign]
    try:
        with StepGate(eng) as gate:
            gate.hold()
            asyncio.run(main(gate))
    finally:
        del eng.abort_request
    wait_idle(server.state)
    assert len(aborted) == 1 and aborted[0][1], aborted  # aborted while still in the engine


# -- unloading an adapter while it streams --------------------------------------------------------
def test_unload_is_drain_safe(server: Server) -> None:
    path = str(server.names["extra_r8"])
    admin = {"Authorization": f"Bearer {ADMIN}"}
    body = {
        "model": "drainee",
        "prompt": "The capital of France is",
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.url, timeout=60) as h:
        r = h.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "drainee", "lora_path": path},
            headers=admin,
        )
        assert r.status_code == 200, r.text
        with h.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            reference = stream_text(sse_payloads(list(r.iter_lines())))
        lines: list[str] = []
        unloaded = threading.Event()
        eng = server.state.engine
        with (
            StepGate(eng) as gate,
            h.stream("POST", "/v1/completions", json=body, headers=AUTH) as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: ") and not unloaded.is_set():
                    gate.hold()  # the stream cannot finish while the name is unloaded
                    gate.wait_held()
                    u = h.post(
                        "/v1/unload_lora_adapter", json={"lora_name": "drainee"}, headers=admin
                    )
                    assert u.status_code == 200, u.text
                    unloaded.set()
                    # while the stream is still running, new requests for the name are 404
                    again = h.post(
                        "/v1/completions",
                        json={**body, "stream": False, "max_tokens": 2},
                        headers=AUTH,
                    )
                    assert again.status_code == 404
                    assert again.json()["error"]["code"] == "model_not_found"
                    assert eng.num_running == 1
                    gate.open()
        payloads = sse_payloads(lines)
        assert unloaded.is_set()
        assert stream_text(payloads) == reference
        assert payloads[-1]["choices"][0]["finish_reason"] == "length"
        r = h.post("/v1/completions", json={**body, "stream": False}, headers=AUTH)
        assert r.status_code == 404
        models = h.get("/v1/models", headers=AUTH).json()["data"]
        assert "drainee" not in [m["id"] for m in models]
    wait_idle(server.state)


# -- load shedding --------------------------------------------------------------------------------
def test_overload_gets_503_with_retry_after(
    tiny_model: Path, names: dict[str, Path], root: Path
) -> None:
    config = _config(tiny_model, names, root, max_num_seqs=1, max_waiting=2)
    app = create_app(config)
    state: ServerState = app.state.loraplex
    body = {"prompt": "Hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    models = ["all_r8", "mlp_r16", BASE]

    async def main(url: str, gate: StepGate) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as h:
            calls = [
                asyncio.ensure_future(
                    h.post("/v1/completions", json={**body, "model": models[i % 3]})
                )
                for i in range(16)
            ]
            # nothing leaves the queue until every refused call has its answer
            while sum(c.done() for c in calls) < 14:
                await asyncio.sleep(0.01)
            gate.open()
            return list(await asyncio.gather(*calls))

    with serve_in_thread(app) as url:
        with StepGate(state.engine) as gate:
            gate.hold()
            responses = asyncio.run(main(url, gate))
        wait_idle(state)
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 503}, codes
        ok = [r for r in responses if r.status_code == 200]
        shed = [r for r in responses if r.status_code == 503]
        # while the queue cannot drain, exactly max_waiting calls are admitted (admission
        # counts requests still being prepared; without that, all 16 were admitted)
        assert len(ok) == 2, (len(ok), len(shed))
        for r in shed:
            assert r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "overloaded"
        for r in ok:
            assert r.json()["usage"]["completion_tokens"] == 40
        # once the queue drained, requests are admitted again
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as h:
            r = h.post("/v1/completions", json={**body, "model": "all_r8", "max_tokens": 2})
            assert r.status_code == 200
        wait_idle(state)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_preparing_leaks_nothing(server: Server, stream: bool) -> None:
    """A client that leaves while its request is still being prepared (a slow adapter load, say)
    must not leave the prepared request's adapter references behind."""
    eng = server.state.engine
    real_prepare = eng.prepare_request
    started, resume, prepared = threading.Event(), threading.Event(), threading.Event()

    def slow_prepare(*args: Any, **kw: Any) -> Any:
        started.set()
        resume.wait(EVENT_TIMEOUT_S)  # held until the client has gone
        try:
            return real_prepare(*args, **kw)
        finally:
            prepared.set()

    eng.prepare_request = slow_prepare  # type: ignore[method-assign]
    body = {
        "model": "qv_r32_regex",
        "prompt": "Hello",
        "max_tokens": 50,
        "ignore_eos": True,
        "stream": stream,
    }

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as h:
            task = asyncio.ensure_future(h.post("/v1/completions", json=body))
            await asyncio.to_thread(started.wait, EVENT_TIMEOUT_S)
            task.cancel()  # closes the connection while the server is preparing
            with pytest.raises(asyncio.CancelledError):
                await task
            resume.set()  # preparation finishes after the client is gone
            await asyncio.to_thread(prepared.wait, EVENT_TIMEOUT_S)

    try:
        asyncio.run(main())
    finally:
        del eng.prepare_request
    wait_idle(server.state)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as h:
        r = h.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert r.status_code == 200
    wait_idle(server.state)
