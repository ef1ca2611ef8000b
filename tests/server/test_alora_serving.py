"""An activated LoRA over HTTP: ``/v1/models`` shows its invocation sequence, each response
says whether the prompt held it (``x-loraplex-alora``), ``cached_tokens`` counts the base
blocks it shares, and ``/metrics`` counts invocations, per-adapter prefix-cache traffic and
base-aligned hits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.app import create_app
from loraplex.testing import ALL_PROJ, make_random_adapter
from loraplex.testing.server import serve_in_thread

BASE = "tiny"


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("alora-serving")
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    invocation = tok(" CHECK:", add_special_tokens=False).input_ids
    checker = make_random_adapter(
        tiny_model, root / "checker", r=8, target_modules=ALL_PROJ, seed=41,
        alora_invocation_tokens=invocation,
    )  # fmt: skip
    config = ServerConfig(
        EngineConfig(model=str(tiny_model), max_loras=2, num_threads=1),
        served_model_name=[BASE],
        lora_modules=[LoRAModule("checker", str(checker))],
        log_level="warning",
    )
    app = create_app(config)
    with serve_in_thread(app) as url:
        yield {"url": url, "invocation": invocation, "model": tiny_model}


def _complete(url: str, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_models_show_the_invocation(env: dict) -> None:
    cards = httpx.get(f"{env['url']}/v1/models", timeout=30).json()["data"]
    card = next(c for c in cards if c["id"] == "checker")
    assert card["alora_invocation_tokens"] == env["invocation"]
    assert "alora_invocation_tokens" not in next(c for c in cards if c["id"] == BASE)


def test_the_response_says_whether_it_was_invoked(env: dict) -> None:
    url = env["url"]
    context = "The quarterly report says revenue grew in every region we serve. " * 4
    base = _complete(url, BASE, context)
    assert "x-loraplex-alora" not in base.headers
    hit = _complete(url, "checker", context + " CHECK: is that supported?")
    assert hit.headers["x-loraplex-alora"] == "invoked"
    # the context's blocks wholly before the invocation came from the base request
    assert hit.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    miss = _complete(url, "checker", "No invocation in this one at all.")
    assert miss.headers["x-loraplex-alora"] == "not-invoked"
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in metrics.splitlines()
             if ln and not ln.startswith("#")}  # fmt: skip
    assert lines['loraplex_alora_requests_total{invocation="found"}'] >= 1
    assert lines['loraplex_alora_requests_total{invocation="absent"}'] >= 1
    assert lines["loraplex_prefix_cache_base_aligned_hits_total"] >= 16
    assert lines['loraplex_adapter_prefix_cache_hits_total{adapter="checker"}'] >= 16
    assert lines[f'loraplex_adapter_prefix_cache_queries_total{{adapter="{BASE}"}}'] > 0


def test_echo_logprobs_follow_the_activation_point(env: dict) -> None:
    """``echo`` with ``logprobs``: the prompt tokens before the invocation score as the base
    model's, the ones after it as the adapter's."""
    url = env["url"]
    head = "Revenue grew in the north and the south this quarter."
    prompt = head + " CHECK: which region?"

    def echoed(model: str) -> list[float | None]:
        body = {"model": model, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["token_logprobs"]

    base, adapted = echoed(BASE), echoed("checker")
    assert len(base) == len(adapted)
    tok = AutoTokenizer.from_pretrained(str(env["model"]))
    ids = tok(prompt).input_ids
    inv = env["invocation"]
    start = max(i for i in range(len(ids) - len(inv) + 1) if ids[i : i + len(inv)] == inv)
    assert base[1 : start + 1] == pytest.approx(adapted[1 : start + 1], abs=1e-4)
    assert (
        max(abs(a - b) for a, b in zip(base[start + 1 :], adapted[start + 1 :], strict=True)) > 1e-3
    )
