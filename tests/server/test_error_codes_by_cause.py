"""Error codes by cause (issue 14, item 8): a registry outage, and bad copies of an adapter.

A registry outage — the database goes away under a running server. Before the fix an admin call
answered 400 with the database driver's text, and a registry key looked up during the outage was
cached as invalid. Now a registry call answers 503
``registry_unavailable`` with ``Retry-After`` and no driver text, a key that cannot be checked is
a 503 (never a 401, never cached), and inference with a key the server holds goes on from the
catalog's snapshot. The outage is real: PostgreSQL stops accepting connections to the database
and drops the open ones.

One status per bad-copy cause: a bad copy of the registered bytes (from the object store, or
its L2 disk copy) is 502 ``adapter_copy_invalid`` whichever tier held it (before: 503 from the
disk tier, 502 from the store); changed local files are 500 ``adapter_integrity_error``. The
messages name the adapter, never the copy's path.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy.engine import make_url

from loraplex.config import EngineConfig, ServerConfig
from loraplex.registry import Registry, RegistryPolicy, base_model_info
from loraplex.server.app import create_app
from loraplex.server.errors import as_api_error
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import wait_until
from loraplex.types import AdapterCorruptError, AdapterIntegrityError
from tests.pg import pg_url_or_skip

BASE = "tiny"
KEY = "sk-outage-inference"
ADMIN = "sk-outage-admin"


def _set_reachable(url: str, reachable: bool) -> None:
    """Let the database of ``url`` take connections again, or refuse new ones and end the
    open ones (as a database that went away)."""
    u = make_url(url)
    with psycopg.connect(
        host=u.host, port=u.port, user=u.username, dbname="postgres", autocommit=True
    ) as conn:
        conn.execute(f'ALTER DATABASE "{u.database}" ALLOW_CONNECTIONS {str(reachable).lower()}')
        if not reachable:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (u.database,),
            )


def test_a_registry_outage_is_a_503_without_driver_text(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    url = pg_url_or_skip()
    root = adapters["all_r8"].parent
    registry = Registry.open(url, policy=RegistryPolicy(allowed_roots=(str(root),)))
    try:
        registry.create_tenant("acme", actor="test")
        _, acme = registry.create_key("acme", actor="test")
        _, unseen = registry.create_key("acme", actor="test")  # never used before the outage
        m = registry.register(adapters["all_r8"], "shared", base=base_model_info(tiny_model,
                              name=BASE), actor="test")  # fmt: skip
        registry.activate("shared", m.revision, actor="test")
        config = ServerConfig(
            EngineConfig(model=str(tiny_model), num_threads=1, max_loras=2, enable_lora=True),
            served_model_name=[BASE],
            api_keys=[KEY],
            admin_api_key=ADMIN,
            registry_poll_s=0.05,
            log_level="critical",
        )
        app = create_app(config, registry=registry)
        with serve_in_thread(app) as base_url, httpx.Client(base_url=base_url, timeout=60) as h:
            body = {"model": "shared", "prompt": "Hello", "max_tokens": 2}
            auth = {"Authorization": f"Bearer {acme}"}
            assert h.post("/v1/completions", json=body, headers=auth).status_code == 200
            _set_reachable(url, False)
            try:
                r = h.get("/v1/admin/adapters", headers={"Authorization": f"Bearer {ADMIN}"})
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert err["code"] == "registry_unavailable" and r.headers["retry-after"]
                for driver_text in ("psycopg", "connection", "postgres", "127.0.0.1", url):
                    assert driver_text not in err["message"].lower(), err
                r = h.post(
                    "/v1/completions", json=body, headers={"Authorization": f"Bearer {unseen}"}
                )
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "registry_unavailable"
                # keys the server holds still run inference from the catalog's snapshot
                for key in (KEY, acme):
                    r = h.post(
                        "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                    )
                    assert r.status_code == 200, r.text
            finally:
                _set_reachable(url, True)

            def recovered() -> bool:
                r = h.post(
                    "/v1/completions", json=body, headers={"Authorization": f"Bearer {unseen}"}
                )
                return r.status_code == 200

            wait_until(recovered, what="the key unseen before the outage to work")
    finally:
        registry.close()


@pytest.mark.parametrize(
    ("tier", "status", "code"),
    [
        ("object_store", 502, "adapter_copy_invalid"),
        ("disk", 502, "adapter_copy_invalid"),
        ("host", 502, "adapter_copy_invalid"),
        ("local", 500, "adapter_integrity_error"),
    ],
)
def test_one_status_per_bad_copy_cause(tier: str, status: int, code: str) -> None:
    path = "/srv/loraplex/cache/ab12/adapter_model.safetensors"
    for err in (
        AdapterIntegrityError(
            f"adapter 'sql': the {tier} tier copy at {path} has digest 1234",
            name="sql", tier=tier, path=path, expected="a" * 64, actual="b" * 64,
        ),
        AdapterCorruptError(f"adapter 'sql': the {tier} copy at {path} is unusable",
                            name="sql", tier=tier, path=path),
    ):  # fmt: skip
        api = as_api_error(err)
        assert (api.status, api.code) == (status, code), err
        assert "/srv" not in api.message and "sql" in api.message, api.message
