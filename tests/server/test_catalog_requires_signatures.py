"""Signatures checked where a replica builds its catalog (issue 14, item 8).

Two registries on one database: a lax one (no signature policy) registers and activates an
unsigned revision, and a badly signed canary. A server started with ``--require-signatures`` and
``--trusted-key`` serves only what verifies against its trusted keys, whoever registered the
rest: the unsigned name is a 404 (as if unknown), the bad canary takes no traffic, a signed
adapter is served. Before the fix signatures were checked only at registration.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from loraplex.config import EngineConfig, ServerConfig
from loraplex.registry import Registry, RegistryPolicy, base_model_info
from loraplex.registry.signing import generate_keypair, sign
from loraplex.server.app import create_app
from loraplex.testing.server import serve_in_thread

BASE = "tiny"


def test_a_strict_server_serves_only_verified_revisions(
    db_url: str, tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    private, public = generate_keypair()
    other_private, other_public = generate_keypair()
    key_file = tmp_path / "trusted.pem"
    key_file.write_text(public)
    root = adapters["all_r8"].parent
    # signatures optional; it trusts a key the server does not
    lax_policy = RegistryPolicy(trusted_keys=(public, other_public), allowed_roots=(str(root),))
    lax = Registry.open(db_url, policy=lax_policy)
    base = base_model_info(tiny_model, name=BASE)
    try:
        draft, _ = lax.prepare(adapters["all_r8"], "signed", base=base)
        m = lax.register(adapters["all_r8"], "signed", base=base, actor="test",
                         signature=sign(draft.signed_payload(), private))  # fmt: skip
        lax.activate("signed", m.revision, actor="test")
        m = lax.register(adapters["mlp_r16"], "unsigned", base=base, actor="test")
        lax.activate("unsigned", m.revision, actor="test")
        # a canary signed by a key the server does not trust
        draft, _ = lax.prepare(adapters["attn_r4_rslora"], "signed", base=base)
        canary = lax.register(adapters["attn_r4_rslora"], "signed", base=base, actor="test",
                              signature=sign(draft.signed_payload(), other_private))  # fmt: skip
        lax.canary("signed", canary.revision, 1.0, actor="test")
        active = lax.release("signed").active_revision

        config = ServerConfig(
            EngineConfig(model=str(tiny_model), num_threads=1, max_loras=2, enable_lora=True),
            served_model_name=[BASE],
            registry_url=db_url,
            require_signatures=True,
            trusted_keys=[str(key_file)],
            log_level="warning",
        )
        app = create_app(config)
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as h:
            ids = [m["id"] for m in h.get("/v1/models").json()["data"]]
            assert ids == [BASE, "signed"]
            body = {"prompt": "Hello", "max_tokens": 2}
            r = h.post("/v1/completions", json={**body, "model": "unsigned"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            for _ in range(3):  # canary weight 1.0, but the canary does not verify
                r = h.post("/v1/completions", json={**body, "model": "signed"})
                assert r.status_code == 200, r.text
                assert f"revision={active};" in r.headers["x-loraplex-adapter"]
                assert r.headers["x-loraplex-adapter-route"] == "active"
    finally:
        lax.close()
