"""Fail closed (issue 14, item 1): a server whose registry has (or ever had) keys or tenants, or
that has ``--api-key``, answers every route but ``/health`` only to valid keys; revoking every
key never turns it anonymous. ``/metrics`` takes its own key (``--metrics-api-key``) or an
operator key, never a tenant key, and never shows adapter names without one. A key revoked
while its lookup is in flight is never cached as valid.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from loraplex.config import EngineConfig, ServerConfig
from loraplex.registry import Principal, Registry, base_model_info
from loraplex.server.app import create_app
from loraplex.server.catalog import Catalog
from loraplex.testing.server import serve_in_thread
from tests.server.registry_server import BASE, live_server, tenant_adapters

ADMIN = "sk-admin-auth"
METRICS = "sk-metrics-auth"


def _closed(r: httpx.Response) -> None:
    assert r.status_code == 401, (r.status_code, r.text)
    assert r.json()["error"]["type"] == "authentication_error"
    for name in ("a_only", "b_only", "shared"):
        assert name not in r.text


def test_revoking_every_key_never_turns_the_server_anonymous(
    db_url: str, tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """No ``--api-key``: the registry's tenant keys close the server. Revoke them all and it
    stays closed: no anonymous ``/v1/models``, completions, ``/v1/adapters``, ``/version`` or
    ``/metrics``, and a revoked key runs nothing — its own tenant's adapter or another's."""
    served = tenant_adapters(adapters, tmp_path)
    with live_server(db_url, tiny_model, served) as live:
        acme = live.keys["acme"]
        ids = [m["id"] for m in live.get("/v1/models", acme).json()["data"]]
        assert ids == [BASE, "a_only", "shared"]
        assert live.complete("a_only", acme).status_code == 200
        _closed(live.get("/v1/models"))

        for k in live.registry.list_keys():
            live.registry.revoke_key(k["key_id"], actor="test")
        live.caught_up()

        for route in ("/v1/models", "/v1/adapters", "/version", "/metrics", "/no/such/route"):
            _closed(live.get(route))
            _closed(live.get(route, acme))
        for model in ("a_only", "b_only", "shared", BASE):
            _closed(live.complete(model))
            _closed(live.complete(model, acme))
            _closed(live.complete(model, live.keys["bravo"]))
        assert live.get("/health").status_code == 200


def test_a_tenant_without_keys_closes_the_server(
    tmp_path: Path, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """A registry that holds a tenant but no key yet: nothing is open but ``/health``."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    served = tenant_adapters(adapters, tmp_path)
    with live_server(url, tiny_model, served, tenants=("acme",), with_keys=False) as live:
        _closed(live.get("/v1/models"))
        _closed(live.complete("a_only"))
        _closed(live.complete(BASE))
        assert live.get("/health").status_code == 200


def test_metrics_key_and_who_may_read_metrics(
    tmp_path: Path, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """``--metrics-api-key`` reads ``/metrics`` (with adapter names) and nothing else; an
    operator key reads it too; a tenant key gets 403 (the metrics name other tenants'
    adapters); no key gets 401 without a name in it."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    served = tenant_adapters(adapters, tmp_path)
    with live_server(url, tiny_model, served, admin_api_key=ADMIN, metrics_api_key=METRICS) as live:
        acme = live.keys["acme"]
        assert live.complete("b_only", ADMIN).status_code == 200  # b_only takes a device slot
        for key in (METRICS, ADMIN):
            r = live.get("/metrics", key)
            assert r.status_code == 200, r.text
            assert "b_only" in r.text  # vllm:lora_requests_info names it
        r = live.get("/metrics", acme)
        assert r.status_code == 403 and "b_only" not in r.text
        _closed(live.get("/metrics"))
        _closed(live.get("/metrics", "sk-wrong"))
        r = live.complete("shared", METRICS)  # a scrape key runs nothing
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert live.get("/v1/models", METRICS).status_code == 403
        assert live.get("/v1/admin/adapters", METRICS).status_code == 403


def test_an_open_server_with_a_metrics_key_guards_only_metrics(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """No keys anywhere but ``--metrics-api-key``: inference stays open (vLLM's default) while
    ``/metrics`` needs the scrape key."""
    config = ServerConfig(
        EngineConfig(model=str(tiny_model), num_threads=1),
        served_model_name=[BASE],
        metrics_api_key=METRICS,
        log_level="warning",
    )
    with serve_in_thread(create_app(config)) as url, httpx.Client(base_url=url, timeout=60) as h:
        assert h.get("/v1/models").status_code == 200
        assert h.get("/metrics").status_code == 401
        r = h.get("/metrics", headers={"Authorization": f"Bearer {METRICS}"})
        assert r.status_code == 200 and "vllm:num_requests_waiting" in r.text


def test_a_key_revoked_during_its_lookup_is_not_cached_as_valid(
    db_url: str, tiny_model: Path
) -> None:
    """The catalog looks a key up, the key is revoked and the cache cleared (a refresh) before
    the lookup's answer is stored: that stale "valid" must not be cached, so the next lookup
    sees the revocation at once (before the fix it stayed valid until the next registry
    change)."""
    registry = Registry.open(db_url)
    try:
        registry.create_tenant("acme", actor="test")
        key_id, secret = registry.create_key("acme", actor="test")
        catalog = Catalog(registry, base_model_info(tiny_model, name=BASE), poll_s=0.0)
        catalog.refresh(force=True)
        real = registry.authenticate
        revoked_midway: list[Principal | None] = []

        def authenticate_then_revoke(s: str) -> Principal | None:
            p = real(s)  # valid: looked up before the revocation
            if not revoked_midway:
                registry.revoke_key(key_id, actor="test")
                catalog.refresh(force=True)  # clears the key cache
                revoked_midway.append(p)
            return p

        registry.authenticate = authenticate_then_revoke  # type: ignore[method-assign]
        first = catalog.authenticate(secret)
        assert first is not None and first.tenant == "acme"  # the lookup that began earlier
        assert revoked_midway  # the revocation happened between its query and its store
        assert catalog.authenticate(secret) is None
        assert catalog.cached_principal(secret) == (True, None)
    finally:
        registry.close()


def test_adapter_labels_are_bounded() -> None:
    from loraplex.server.metrics import MAX_ADAPTER_LABELS, _bounded

    names = [f"adapter-{i}" for i in range(10 * MAX_ADAPTER_LABELS)]
    assert _bounded(names + names).split(",") == names[:MAX_ADAPTER_LABELS]
