"""Tenants see only themselves (issue 14, item 6, the server's side).

Before the fix a tenant's ``/v1/adapters`` totals counted every tenant's adapters, ``/v1/models``
showed each adapter's server path as ``root``, and error bodies carried server paths (a changed
adapter file, a file linked out of the allowed roots). Now a tenant's totals count only what it
sees, ``root`` is ``name@revision``, ``path`` is for operator keys only, and error messages
name the adapter instead of its path (the full text goes to the server log).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.server.registry_server import BASE, live_server, tenant_adapters

ADMIN = "sk-admin-leaks"


def test_tenant_totals_models_and_paths_show_only_what_the_tenant_sees(
    tmp_path: Path, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    served = tenant_adapters(adapters, tmp_path / "root")
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with live_server(url, tiny_model, served, admin_api_key=ADMIN) as live:
        acme, bravo = live.keys["acme"], live.keys["bravo"]
        assert live.complete("a_only", acme).status_code == 200
        assert live.complete("b_only", bravo).status_code == 200

        everything = live.get("/v1/adapters", ADMIN).json()
        assert everything["tiers"]["host"]["count"] == 2
        rows = {r["name"]: r for r in everything["data"]}
        assert rows["a_only"]["path"] == str(served["a_only"])  # operators see sources
        for key, own in ((acme, "a_only"), (bravo, "b_only")):
            view = live.get("/v1/adapters", key).json()
            names = {r["name"] for r in view["data"]}
            assert names == {own, "shared"}
            assert all(r["path"] is None for r in view["data"])
            host = view["tiers"]["host"]
            assert host["count"] == 1 and host["bytes"] == rows[own]["bytes"], view["tiers"]
            assert view["tiers"]["device"]["count"] <= 1

        for key in (acme, bravo):  # tenants never see a server path
            r = live.get("/v1/models", key)
            assert r.status_code == 200
            assert str(tmp_path) not in r.text and str(tiny_model) not in r.text
            for m in r.json()["data"]:
                want = BASE if m["parent"] is None else f"{m['id']}@{m['revision']}"
                assert m["root"] == want, m
        # operators get vLLM's model cards: root = the model path, the adapter's source
        cards = {m["id"]: m for m in live.get("/v1/models", ADMIN).json()["data"]}
        assert cards[BASE]["root"] == str(tiny_model)
        assert {n: cards[n]["root"] for n in served} == {n: str(p) for n, p in served.items()}


def test_error_bodies_carry_no_server_paths(
    tmp_path: Path, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """An adapter whose files changed after registration (500) and one whose file was replaced
    by a link out of the allowed roots (403): both answers name the adapter, never a path."""
    root = tmp_path / "root"
    served = tenant_adapters(adapters, root)
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with live_server(url, tiny_model, served, allowed_lora_roots=[str(root)]) as live:
        acme = live.keys["acme"]
        weights = served["a_only"] / "adapter_model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-64:] = bytes(64)  # same size and header, other weights
        weights.write_bytes(bytes(data))
        r = live.complete("a_only", acme)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "adapter_integrity_error"
        assert "a_only" in err["message"]
        assert str(tmp_path) not in r.text and "/" not in err["message"], err

        outside = tmp_path / "outside"
        outside.mkdir()
        target = served["shared"] / "adapter_model.safetensors"
        shutil.copy(target, outside / target.name)
        target.unlink()
        target.symlink_to(outside / target.name)
        r = live.complete("shared", acme)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "adapter_path_refused" and "shared" in err["message"]
        assert str(tmp_path) not in r.text and "/" not in err["message"], err
