"""Property-based API tests: schemathesis generates requests from the live server's
``/openapi.json`` for the public routes, valid and invalid; none may get a 5xx, and the engine
must end idle with every KV block and slot free.

The server runs with ``max_model_len=64`` so no generated request can ask for a long generation
(anything larger is a 400). Request bodies naming a model are steered, half of the time, to the
base model or a served adapter so that generation itself is exercised, not only the 404 path.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.app import ServerState, create_app
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import wait_idle

KEY = "sk-inference-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = "tiny"
SERVED = ["all_r8", "mlp_r16", "qv_r32_regex"]
OPERATIONS = [
    ("/v1/models", "GET"),
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/adapters", "GET"),
    ("/health", "GET"),
    ("/version", "GET"),
]
MAX_EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "40"))
STATUSES: list[int] = []  # every status the fuzzing got, for the final check


@dataclass
class Live:
    url: str
    state: ServerState


@pytest.fixture(scope="module")
def live(
    tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    config = ServerConfig(
        EngineConfig(
            model=str(tiny_model), max_loras=2, num_threads=1, max_model_len=64, max_num_seqs=64
        ),
        served_model_name=[BASE],
        lora_modules=[LoRAModule(n, str(adapters[n])) for n in SERVED],
        api_keys=[KEY],
        admin_api_key="sk-admin-test",
        allowed_lora_roots=[str(tmp_path_factory.mktemp("allowed"))],
        log_level="warning",
    )
    app = create_app(config)
    with serve_in_thread(app) as url:
        yield Live(url, app.state.loraplex)


@pytest.fixture(scope="module")
def api_schema(live: Live) -> Any:
    # the server has keys: every route but /health needs one, the schema too
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json", headers=AUTH)


def _steer(case: Any) -> None:
    """Point half of the bodies that name a model at a model that exists."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        rng = random.Random(repr(body))
        if rng.random() < 0.5:
            case.body = {**body, "model": rng.choice([BASE, *SERVED])}


def test_schema_lists_the_public_routes(live: Live) -> None:
    with httpx.Client(base_url=live.url) as h:
        assert h.get("/openapi.json").status_code == 401  # fail closed: the schema too
        paths = h.get("/openapi.json", headers=AUTH).json()["paths"]
    assert {path for path, _ in OPERATIONS} <= set(paths)
    for path, method in OPERATIONS:
        assert method.lower() in paths[path]


# schemathesis' pytest integration (``from_fixture``) does not run under pytest 9, so each
# operation's hypothesis strategy is driven directly: valid bodies, and for bodies invalid ones.
@pytest.mark.parametrize(
    ("path", "method", "mode"),
    [(p, m, GenerationMode.POSITIVE) for p, m in OPERATIONS]
    + [(p, m, GenerationMode.NEGATIVE) for p, m in OPERATIONS if m == "POST"],
    ids=lambda x: getattr(x, "value", x),
)
def test_no_server_errors(
    api_schema: Any, live: Live, path: str, method: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]
    calls: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES if method == "POST" else 5,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        _steer(case)
        response = case.call_and_validate(headers=AUTH, checks=[not_a_server_error], timeout=60)
        calls.append(response.status_code)

    run()
    assert calls and all(code < 500 for code in calls)
    STATUSES.extend(calls)


def test_engine_idle_after_fuzzing(live: Live) -> None:
    """Runs after the fuzzing above (same module, same server)."""
    state, eng = live.state, live.state.engine
    assert STATUSES.count(200) >= 5  # generation itself was exercised, not only validation
    assert eng.num_steps > 0
    wait_idle(eng, state.aengine)
    assert eng.num_free_blocks == eng.pool.num_blocks
    assert state.aengine.num_step_errors == 0
    assert state.aengine.is_running
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as h:
        assert h.get("/health").status_code == 200
        r = h.post(
            "/v1/completions",
            json={"model": "all_r8", "prompt": "hi", "max_tokens": 2, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
