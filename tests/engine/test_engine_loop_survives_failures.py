"""The engine loop survives anything (issue 14, code reading): an exception from a step
observer, a load observer or the delivery of outputs.

Before the fix such an exception left the engine thread: every stream in flight hung and no
request was served again. Now observers are isolated (one that raises is logged and counted;
the requests it observed finish normally), and any other failure in the loop fails the requests
in flight cleanly (their clients get an error, their KV blocks are freed) while the loop goes on
serving new ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.app import ServerState, create_app
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import EVENT_TIMEOUT_S, wait_idle

BASE = "tiny"


@pytest.fixture
def live(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[tuple[str, ServerState]]:
    config = ServerConfig(
        EngineConfig(model=str(tiny_model), num_threads=1, max_loras=2, enable_lora=True),
        served_model_name=[BASE],
        lora_modules=[LoRAModule("a", str(adapters["all_r8"]))],
        log_level="warning",
    )
    app = create_app(config)
    with serve_in_thread(app) as url:
        yield url, app.state.loraplex


def _complete(url: str, model: str = BASE, **kw: Any) -> httpx.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=EVENT_TIMEOUT_S)


def _sse(r: httpx.Response) -> list[Any]:
    data = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def test_a_raising_step_observer_harms_no_request(live: tuple[str, ServerState]) -> None:
    url, state = live

    def broken(stats: Any) -> None:
        raise RuntimeError("a broken metrics hook")

    state.client.add_step_observer(broken)
    try:
        for _ in range(2):
            r = _complete(url)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert state.aengine.num_observer_errors >= 2
        assert state.aengine.num_step_errors == 0
    finally:
        state.aengine.step_observers.remove(broken)
    wait_idle(state.engine, state.aengine)


def test_a_raising_load_observer_harms_no_request(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    config = ServerConfig(
        EngineConfig(model=str(tiny_model), num_threads=1, max_loras=2, enable_lora=True),
        served_model_name=[BASE],
        log_level="warning",
        allowed_lora_roots=[str(adapters["mlp_r16"].parent)],
        admin_api_key="sk-admin-loop",
    )
    app = create_app(config)
    state: ServerState = app.state.loraplex

    def broken(stage: str, seconds: float) -> None:
        raise RuntimeError("a broken load hook")

    state.client.add_load_observer(broken)
    with serve_in_thread(app) as url:
        r = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "m", "lora_path": str(adapters["mlp_r16"])},
            headers={"Authorization": "Bearer sk-admin-loop"},
            timeout=EVENT_TIMEOUT_S,
        )
        assert r.status_code == 200, r.text
        state.client.evict(state.registry.get("m").sha256)  # the next request loads it again
        r = _complete(url, "m")
        assert r.status_code == 200, r.text
        assert r.headers["x-loraplex-adapter-state"] == "cold"
        assert state.client.num_observer_errors > 0
        assert _complete(url).status_code == 200
        wait_idle(state.engine, state.aengine)


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_delivery_fails_the_requests_in_flight_and_the_loop_goes_on(
    live: tuple[str, ServerState], stream: bool
) -> None:
    url, state = live
    aengine = state.aengine
    real = aengine._deliver
    failed: list[str] = []

    def deliver_once_broken(out: Any, now: float) -> None:
        if not failed:
            failed.append(out.request_id)
            raise RuntimeError("delivery broke")
        real(out, now)

    aengine._deliver = deliver_once_broken  # type: ignore[method-assign]
    try:
        r = _complete(url, "a", max_tokens=8, stream=stream)
        if stream:
            assert r.status_code == 200
            payloads = _sse(r)
            assert "error" in payloads[-1], payloads[-1]
            assert payloads[-1]["error"]["type"] == "server_error"
        else:
            assert r.status_code == 500, r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert failed and aengine.num_step_errors == 1
        wait_idle(state.engine, aengine)  # its KV blocks and adapter reference are free
        for model in (BASE, "a"):  # and the loop serves new requests
            assert _complete(url, model, stream=stream).status_code == 200
    finally:
        del aengine._deliver
    wait_idle(state.engine, aengine)
