"""A live server on a shared adapter registry with two tenants, for the attack tests: ``acme``
owns ``a_only``, ``bravo`` owns ``b_only``, ``shared`` belongs to nobody; one inference key per
tenant."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loraplex.config import EngineConfig, ServerConfig
from loraplex.registry import Registry, RegistryPolicy, base_model_info
from loraplex.server.app import ServerState, create_app
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import wait_until

BASE = "tiny"
SOURCES = {"a_only": "all_r8", "b_only": "mlp_r16", "shared": "attn_r4_rslora"}


def tenant_adapters(adapters: dict[str, Path], root: Path) -> dict[str, Path]:
    """Copies of three of the shared test adapters under ``root``, by served name."""
    return {
        name: Path(shutil.copytree(adapters[src], root / name)) for name, src in SOURCES.items()
    }


@dataclass
class Live:
    url: str
    state: ServerState
    registry: Registry
    keys: dict[str, str]  # tenant -> its inference key

    def get(self, route: str, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{self.url}{route}", headers=headers, timeout=60)

    def complete(self, model: str, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        return httpx.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=60)

    def caught_up(self) -> None:
        """Wait until the server's catalog has seen every registry change made so far."""
        gen = self.registry.generation()
        wait_until(lambda: self.state.catalog.generation >= gen, what="the catalog refresh")


@contextlib.contextmanager
def live_server(
    url: str,
    tiny_model: Path,
    adapters: dict[str, Path],
    *,
    tenants: tuple[str, ...] = ("acme", "bravo"),
    with_keys: bool = True,
    **server: Any,
) -> Iterator[Live]:
    """A server on the registry at ``url`` with ``a_only`` (acme's), ``b_only`` (bravo's) and
    ``shared`` registered and active, and one inference key per tenant (``with_keys``).
    ``adapters``: name -> directory, for the three names (sources under one allowed root)."""
    root = adapters["a_only"].parent
    registry = Registry.open(url, policy=RegistryPolicy(allowed_roots=(str(root),)))
    base = base_model_info(tiny_model, name=BASE)
    keys = {}
    for t in tenants:
        registry.create_tenant(t, actor="test")
        if with_keys:
            keys[t] = registry.create_key(t, actor="test")[1]
    for name, tenant in (("a_only", "acme"), ("b_only", "bravo"), ("shared", None)):
        if tenant is not None and tenant not in tenants:
            continue
        m = registry.register(adapters[name], name, base=base, tenant=tenant, actor="test")
        registry.activate(name, m.revision, actor="test")
    config = ServerConfig(
        EngineConfig(model=str(tiny_model), max_loras=2, num_threads=1, dtype="float32"),
        served_model_name=[BASE],
        registry_poll_s=0.05,
        log_level="warning",
        **server,
    )
    app = create_app(config, registry=registry)
    try:
        with serve_in_thread(app) as base_url:
            yield Live(base_url, app.state.loraplex, registry, keys)
    finally:
        registry.close()
