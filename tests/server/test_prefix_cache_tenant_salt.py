"""Attack: learn another tenant's prompts from ``cached_tokens`` (issue 14).

A prefix-cache hit is visible to the caller (``usage.prompt_tokens_details.cached_tokens``), so
if two tenants' requests shared KV blocks, tenant B could send a guess of tenant A's prompt and
read from ``cached_tokens`` whether A sent it (on the base model and on shared adapters alike).
Tenant traffic is salted with the tenant (plus the body's ``cache_salt``, vLLM's field), so B's
probe never hits A's blocks while A's own repeats still do; different ``cache_salt`` values never
share either; unsalted operator traffic shares as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.config import EngineConfig, ServerConfig
from loraplex.registry import Registry, RegistryPolicy, base_model_info
from loraplex.server.app import create_app
from loraplex.testing import ALL_PROJ, make_random_adapter
from loraplex.testing.server import serve_in_thread

OPERATOR = "sk-operator-probe"
ADMIN = "sk-admin-probe"
_fresh = itertools.count()


def fresh_prompt() -> str:
    """A prompt no earlier request sent (several full 16-token prefix-cache blocks)."""
    return f"{next(_fresh)}: the secret plan of the quarter is to merge the two teams. " * 3


@dataclass
class Env:
    url: str
    keys: dict[str, str]  # tenant (or "operator") -> inference key

    def cached(self, who: str, model: str, prompt: str, **body: Any) -> int:
        """``cached_tokens`` of one completion by ``who``."""
        headers = {"Authorization": f"Bearer {self.keys[who]}"}
        payload = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **body}
        r = httpx.post(f"{self.url}/v1/completions", json=payload, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    def cached_chat(self, who: str, model: str, text: str, **body: Any) -> int:
        headers = {"Authorization": f"Bearer {self.keys[who]}"}
        payload = {"model": model, "messages": [{"role": "user", "content": text}],
                   "max_tokens": 1, "temperature": 0, **body}  # fmt: skip
        r = httpx.post(f"{self.url}/v1/chat/completions", json=payload, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("prefix-probe")
    root = tmp / "allowed"
    registry = Registry.open(
        f"sqlite:///{tmp / 'registry.db'}", policy=RegistryPolicy(allowed_roots=(str(root),))
    )
    shared = make_random_adapter(
        tiny_model, root / "shared", r=8, lora_alpha=16, target_modules=ALL_PROJ, seed=31
    )
    base = base_model_info(tiny_model, name="tiny")
    m = registry.register(shared, "shared", base=base, actor="test")
    registry.promote("shared", m.revision, actor="test")
    keys = {"operator": OPERATOR}
    for tenant in ("acme", "bravo"):
        registry.create_tenant(tenant, actor="test")
        keys[tenant] = registry.create_key(tenant, actor="test")[1]
    config = ServerConfig(
        EngineConfig(model=str(tiny_model), max_loras=2, max_num_seqs=4, num_threads=1),
        served_model_name=["tiny"],
        api_keys=[OPERATOR],
        admin_api_key=ADMIN,
        allowed_lora_roots=[str(root)],
        log_level="warning",
    )
    app = create_app(config, registry=registry)
    try:
        with serve_in_thread(app) as url:
            yield Env(url, keys)
    finally:
        registry.close()


@pytest.mark.parametrize("model", ["tiny", "shared"])
def test_a_tenant_cannot_probe_another_tenant_s_prompts(env: Env, model: str) -> None:
    secret = fresh_prompt()
    assert env.cached("acme", model, secret) == 0
    assert env.cached("bravo", model, secret) == 0  # B's exact guess: no hit, nothing learnt
    assert env.cached("acme", model, secret) > 0  # A's own repeat still hits
    assert env.cached("bravo", model, secret) > 0  # and so does B's, within B
    assert env.cached("operator", model, secret) == 0  # tenant blocks are not the operator's


def test_cache_salt_separates_requests_of_one_tenant(env: Env) -> None:
    prompt = fresh_prompt()
    assert env.cached("acme", "tiny", prompt) == 0
    assert env.cached("acme", "tiny", prompt, cache_salt="s1") == 0  # other salt, other blocks
    assert env.cached("acme", "tiny", prompt, cache_salt="s1") > 0
    assert env.cached("acme", "tiny", prompt, cache_salt="s2") == 0
    assert env.cached("bravo", "tiny", prompt, cache_salt="s1") == 0  # same salt, other tenant
    assert env.cached_chat("acme", "shared", prompt, cache_salt="c") == 0
    assert env.cached_chat("bravo", "shared", prompt, cache_salt="c") == 0
    assert env.cached_chat("acme", "shared", prompt, cache_salt="c") > 0


def test_operator_traffic_shares_unless_salted(env: Env) -> None:
    prompt = fresh_prompt()
    assert env.cached("operator", "tiny", prompt) == 0
    assert env.cached("operator", "tiny", prompt) > 0  # unsalted operator traffic shares
    assert env.cached("operator", "tiny", prompt, cache_salt="x") == 0
    assert env.cached("operator", "tiny", prompt, cache_salt="x") > 0
    assert env.cached("acme", "tiny", prompt, cache_salt="x") == 0  # never an operator's salt


def test_cache_salt_is_validated(env: Env) -> None:
    headers = {"Authorization": f"Bearer {OPERATOR}"}
    for bad in ("", 7, "x" * 5000):
        r = httpx.post(
            f"{env.url}/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 1, "cache_salt": bad},
            headers=headers,
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
