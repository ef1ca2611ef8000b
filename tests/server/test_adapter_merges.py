"""``POST /v1/admin/adapters/merge``: registered adapters merged into a new revision that the
server then serves like any other, equal to transformers + PEFT with the merged adapter; admin
auth fails closed (the ``admin:register`` scope), a merge for a tenant reads only that tenant's
and shared adapters, and every bad input is an OpenAI-style 400/403/404."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from loraplex.config import EngineConfig, ServerConfig
from loraplex.lora.adapter import read_adapter
from loraplex.registry import Registry, RegistryPolicy, base_model_info
from loraplex.server.app import ServerState, create_app
from loraplex.testing import (
    ATTN_PROJ,
    MLP_PROJ,
    load_merged_reference,
    make_random_adapter,
    make_random_model,
    reference_greedy,
)
from loraplex.testing.server import serve_in_thread

ADMIN = "sk-admin-merges"
BASE = "tiny"
PROMPT = "Merged adapters are registered like any other adapter, and served the same way."


@dataclass
class Env:
    url: str
    state: ServerState
    registry: Registry
    model: Path
    keys: dict[str, str]  # "acme" / "bravo": inference keys; "register" / "promote": admin scopes

    def post(self, route: str, body: Any, key: str | None = ADMIN) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}{route}", json=body, headers=headers, timeout=120)

    def merge(self, key: str | None = ADMIN, **body: Any) -> httpx.Response:
        return self.post("/v1/admin/adapters/merge", body, key)


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("merges")
    root = tmp / "allowed"
    registry = Registry.open(f"sqlite:///{tmp / 'registry.db'}",
                             policy=RegistryPolicy(allowed_roots=(str(root),)))  # fmt: skip
    base = base_model_info(tiny_model, name=BASE)
    twin = make_random_model(tmp / "twin", num_layers=3, seed=77, with_tokenizer=False)
    adapters = {  # ranks 8 and 4 on different modules, one rsLoRA, non-zero B
        "attn8": dict(r=8, lora_alpha=16, target_modules=ATTN_PROJ, seed=31),
        "mlp4": dict(r=4, lora_alpha=4, target_modules=MLP_PROJ, use_rslora=True, seed=32),
        "bravo8": dict(r=8, lora_alpha=8, target_modules=ATTN_PROJ, seed=33),
        "twin8": dict(r=8, lora_alpha=8, target_modules=ATTN_PROJ, seed=34),
    }
    paths = {n: make_random_adapter(tiny_model, root / n, **kw) for n, kw in adapters.items()}
    keys = {}
    for tenant in ("acme", "bravo"):
        registry.create_tenant(tenant, actor="test")
        keys[tenant] = registry.create_key(tenant, actor="test")[1]
    for scope in ("register", "promote"):
        keys[scope] = registry.create_key(None, scopes=(f"admin:{scope}",), actor="test")[1]
    for name, tenant, b in [("attn8", None, base), ("mlp4", "acme", base),
                            ("bravo8", "bravo", base),
                            ("twin8", None, base_model_info(twin, name="twin"))]:  # fmt: skip
        m = registry.register(paths[name], name, base=b, tenant=tenant, actor="test")
        registry.activate(name, m.revision, actor="test")
    config = ServerConfig(
        EngineConfig(
            model=str(tiny_model), max_loras=2, max_num_seqs=4, num_threads=1, dtype="float32"
        ),
        served_model_name=[BASE],
        admin_api_key=ADMIN,
        registry_poll_s=0.05,
        log_level="warning",
    )
    app = create_app(config, registry=registry)
    try:
        with serve_in_thread(app) as url:
            yield Env(url, app.state.loraplex, registry, tiny_model, keys)
    finally:
        registry.close()


def test_merged_adapter_is_registered_and_served_as_peft_serves_it(env: Env) -> None:
    r = env.merge(
        name="acme_mix",
        adapters=["attn8", "mlp4@r1"],
        weights=[0.8, -1.5],
        combination_type="cat",
        tenant="acme",
        activate=True,
        key=env.keys["register"],
    )
    assert r.status_code == 201, r.text
    got = r.json()
    assert (got["name"], got["revision"], got["tenant"], got["status"], got["rank"]) == (
        "acme_mix", "r1", "acme", "active", 12,
    )  # fmt: skip
    assert "path" not in got and "source_uri" not in got  # no server paths to a client
    m = env.registry.get("acme_mix", "r1")
    assert m.sha256 == got["sha256"] and read_adapter(m.path).digest == m.sha256
    # served to acme (its tenant), unknown to bravo; equal to PEFT with the merged adapter
    tok = AutoTokenizer.from_pretrained(str(env.model))
    ref = load_merged_reference(env.model, m.path)
    want, _ = reference_greedy(ref, tok(PROMPT).input_ids, 6)
    base_ids, _ = reference_greedy(load_merged_reference(env.model, None), tok(PROMPT).input_ids, 6)
    assert want != base_ids  # the merge changes what is generated: a real comparison
    body = {"model": "acme_mix", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    for _ in range(100):  # the catalog follows the registry within registry_poll_s
        resp = env.post("/v1/completions", body, env.keys["acme"])
        if resp.status_code != 404:
            break
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
    assert env.post("/v1/completions", body, env.keys["bravo"]).status_code == 404


def _error(r: httpx.Response, status: int, match: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert match in err["message"], err
    assert err["type"] and "/allowed/" not in err["message"]  # no server paths
    return err


def test_merge_auth_fails_closed(env: Env) -> None:
    body = dict(name="m", adapters=["attn8"], combination_type="linear")
    assert env.merge(None, **body).status_code == 401
    assert env.merge("sk-wrong", **body).status_code == 401
    _error(env.merge(env.keys["acme"], **body), 403, "")  # an inference key
    _error(env.merge(env.keys["promote"], **body), 403, "")  # an admin key without the scope
    # a merge for a tenant reads only its own and shared adapters: another's is unknown
    _error(env.merge(env.keys["register"], name="m", adapters=["attn8", "bravo8"],
                     combination_type="cat", tenant="acme"), 404, "unknown adapter 'bravo8'")  # fmt: skip
    assert not [m for m in env.registry.list() if m.name == "m"]


@pytest.mark.parametrize(
    ("body", "status", "match", "code"),
    [
        (dict(adapters=["attn8", "nope"], combination_type="cat"), 404, "unknown adapter 'nope'",
         "not_found"),
        (dict(adapters=["attn8", "attn8@r7"], combination_type="cat"), 404, "r7", "not_found"),
        (dict(adapters=["attn8", "twin8"], combination_type="cat"), 400, "registered for base "
         "model twin", "base_model_mismatch"),
        (dict(adapters=["attn8", "mlp4"], combination_type="ties", density=0.5), 400,
         "needs adapters of one rank", "invalid_merge"),
        (dict(adapters=["attn8", "mlp4"], combination_type="mean"), 400,
         "combination_type must be one of", "invalid_merge"),
        (dict(adapters=["attn8", "mlp4"], combination_type="cat", weights=[1.0]), 400,
         "2 adapters but 1 weights", "invalid_merge"),
        (dict(adapters=["attn8", "mlp4"], combination_type="cat", density=0.5), 400,
         "density is not used", "invalid_merge"),
        (dict(adapters=["attn8", "mlp4"], combination_type="dare_ties_svd"), 400,
         "needs density", "invalid_merge"),
        (dict(adapters=["attn8", "mlp4"], combination_type="svd", svd_rank=1000), 400,
         "rank 1000, above", "rank_too_large"),
        (dict(adapters=["attn8"] * 9, combination_type="cat"), 400, "adapters", None),
        (dict(adapters=[], combination_type="cat"), 400, "adapters", None),
        (dict(adapters=["attn8"], combination_type="cat", colour="red"), 400, "colour", None),
        (dict(adapters=["attn8", "attn8@r1"], combination_type="cat"), 400, "named twice",
         "invalid_merge"),
        (dict(name=BASE, adapters=["attn8"], combination_type="cat"), 400, "base model's name",
         None),
        (dict(name="../x", adapters=["attn8"], combination_type="cat"), 400,
         "invalid adapter name", "registry_error"),
    ],
)  # fmt: skip
def test_merge_bad_inputs(
    env: Env, body: dict[str, Any], status: int, match: str, code: str | None
) -> None:
    err = _error(env.merge(**{"name": "bad", **body}), status, match)
    if code is not None:
        assert err["code"] == code, err
    assert not [m for m in env.registry.list() if m.name in ("bad", "../x")]


def test_dry_run_names_the_payload_to_sign(env: Env) -> None:
    body = dict(name="dry", adapters=["attn8", "bravo8"], combination_type="dare_linear",
                density=0.5, seed=9, weights=[1, 1])  # fmt: skip
    r = env.merge(**body, dry_run=True)
    assert r.status_code == 200, r.text
    draft = r.json()
    assert draft["revision"] == "" and '"sha256":"' + draft["sha256"] in draft["signed_payload"]
    assert not [m for m in env.registry.list() if m.name == "dry"]
    r = env.merge(**body)
    assert r.status_code == 201 and r.json()["sha256"] == draft["sha256"]  # seeded: the same


def test_the_bad_parameter_is_named(env: Env) -> None:
    r = env.merge(name="bad", adapters=["attn8", "mlp4"], combination_type="svd", svd_clamp=3.0)
    assert _error(r, 400, "svd_clamp must be a quantile")["param"] == "svd_clamp"
    r = env.merge(name="bad", adapters=["attn8", "mlp4"], combination_type="cat", seed=1)
    assert _error(r, 400, "seed is not used")["param"] == "seed"


def test_one_merge_at_a_time(env: Env) -> None:
    """A merge while another runs is a 429 to retry, not a second copy of the work in memory."""
    assert env.state.merge_lock.acquire(blocking=False)
    try:
        r = env.merge(name="busy", adapters=["attn8", "mlp4"], combination_type="cat")
        assert _error(r, 429, "another adapter merge is running")["code"] == "merge_in_progress"
    finally:
        env.state.merge_lock.release()
    assert (
        env.merge(name="busy", adapters=["attn8", "mlp4"], combination_type="cat").status_code
        == 201
    )
