"""One request must not bypass admission (issue 14, item 4).

With ``--max-waiting 4``, one call with 2000 prompts x n=4 was admitted (8000 sequences
queued); stop lists and stop token ids were unbounded and scanned every token. Now admission
counts sequences (prompts x n) against ``--max-waiting``, and each request's prompts, ``n``,
``best_of``, stop strings, stop token ids and logprobs are capped: a 400 naming the field,
before anything is queued or prepared.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loraplex.config import EngineConfig, ServerConfig
from loraplex.server.app import ServerState, create_app
from loraplex.server.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
)
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import EVENT_TIMEOUT_S, StepGate, wait_idle, wait_until

BASE = "tiny"


@pytest.fixture(scope="module")
def live(tiny_model: Any) -> Iterator[tuple[str, ServerState]]:
    config = ServerConfig(
        EngineConfig(model=str(tiny_model), num_threads=1, max_num_seqs=4),
        served_model_name=[BASE],
        max_waiting=4,
        max_prompts_per_request=4096,
        log_level="warning",
    )
    app = create_app(config)
    with serve_in_thread(app) as url:
        yield url, app.state.loraplex


def _post(url: str, route: str = "/v1/completions", **body: Any) -> httpx.Response:
    return httpx.post(f"{url}{route}", json={"model": BASE, **body}, timeout=120)


def _refused(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    return err


def test_one_call_with_many_sequences_is_refused_and_one_that_fits_is_served(
    live: tuple[str, ServerState],
) -> None:
    url, state = live
    eng = state.engine
    prepared_before = eng.num_steps
    r = _post(url, prompt=["Hello"] * 2000, n=4, max_tokens=1)
    err = _refused(r, 400, "n")
    assert err["code"] == "too_many_sequences"
    r = _post(url, prompt=["Hello", "Hi", "Hey"], max_tokens=1, n=2)  # 6 sequences > 4
    assert _refused(r, 400, "n")["code"] == "too_many_sequences"
    r = _post(url, prompt=["a", "b", "c", "d", "e"], max_tokens=1)  # 5 > 4
    assert _refused(r, 400, "prompt")["code"] == "too_many_sequences"
    r = _post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], n=5)
    assert _refused(r, 400, "n")["code"] == "too_many_sequences"
    assert eng.num_steps == prepared_before and state.aengine.num_waiting == 0  # nothing ran

    r = _post(url, prompt=["Hello", "Hi"], n=2, max_tokens=3, ignore_eos=True)  # 4: fits
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    wait_idle(eng, state.aengine)


def test_waiting_sequences_count_against_the_limit(live: tuple[str, ServerState]) -> None:
    """While one call's 3 sequences wait (the engine is held), a call with 2 more is a 503
    (3 + 2 > 4; before the fix only the 3 < 4 calls were compared) and one with 1 more fits."""
    url, state = live
    eng = state.engine
    results: dict[str, httpx.Response] = {}

    def run(name: str, **body: Any) -> None:
        results[name] = _post(url, max_tokens=2, ignore_eos=True, **body)

    with StepGate(eng) as gate:
        gate.hold()
        first = threading.Thread(target=run, args=("first",), kwargs={"prompt": ["a"], "n": 3})
        first.start()
        wait_until(lambda: eng.num_waiting == 3, what="3 sequences waiting")
        r = _post(url, prompt=["b", "c"], max_tokens=2)
        err = _refused(r, 503, None)
        assert err["code"] == "overloaded" and r.headers["retry-after"] == "1"
        fits = threading.Thread(target=run, args=("fits",), kwargs={"prompt": "d"})
        fits.start()
        wait_until(lambda: eng.num_waiting == 4, what="4 sequences waiting")
        gate.open()
        first.join()
        fits.join()
    assert results["first"].status_code == 200 and len(results["first"].json()["choices"]) == 3
    assert results["fits"].status_code == 200
    wait_idle(eng, state.aengine)


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "n": MAX_N + 1}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 10**9}, "best_of"),
        ("/v1/completions", {"prompt": "x", "stop": ["s"] * (MAX_STOP + 1)}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": "s" * (MAX_STOP_CHARS + 1)}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)},
         "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ("/v1/completions", {"prompt": ["x"] * 4097}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "stop": ["s"] * (MAX_STOP + 1)}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
         "top_logprobs"),
    ],
)  # fmt: skip
def test_per_request_caps_are_400s_naming_the_field(
    live: tuple[str, ServerState], route: str, body: dict[str, Any], param: str
) -> None:
    url, state = live
    steps = state.engine.num_steps
    _refused(_post(url, route, max_tokens=1, **body), 400, param)
    assert state.engine.num_steps == steps and state.aengine.num_waiting == 0


def test_many_concurrent_callers_never_exceed_the_limit(live: tuple[str, ServerState]) -> None:
    """Eight calls of 2 sequences at once while the engine is held: exactly two are admitted
    (2 x 2 = 4), the others get 503."""
    url, state = live
    eng = state.engine

    async def main(gate: StepGate) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as h:
            body = {"model": BASE, "prompt": "x", "n": 2, "max_tokens": 2}
            calls = [asyncio.ensure_future(h.post("/v1/completions", json=body)) for _ in range(8)]
            deadline = time.monotonic() + EVENT_TIMEOUT_S  # a bound, not a race
            while sum(c.done() for c in calls) < 6:
                assert time.monotonic() < deadline, "six calls were not refused"
                await asyncio.sleep(0.01)
            gate.open()
            return list(await asyncio.gather(*calls))

    with StepGate(eng) as gate:
        gate.hold()
        responses = asyncio.run(main(gate))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200] + [503] * 6, codes
    wait_idle(eng, state.aengine)
