"""The router's ``/dashboard`` in a real browser (headless Chromium) over two real replicas:
the fleet matrix shows, for every adapter and replica, the tier the router's view holds (which
equals each replica's own ``/v1/adapters``), follows an eviction on one replica, and shows each
replica's health and the decisions by reason; the data needs the status key."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.router.app import RouterConfig, create_router_app
from loraplex.router.scoring import Weights
from loraplex.server.app import create_app
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import wait_until
from tests.browser import chromium_page

STATUS = "sk-router-dash"
STATUS_H = {"Authorization": f"Bearer {STATUS}"}
ADMIN = "sk-admin-router-dash"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
NAMES = {"alpha": "all_r8", "bravo": "mlp_r16", "charlie": "attn_r4_rslora"}


def _replica(tiny_model: Path, adapters: dict[str, Path], root: Path) -> Any:
    return create_app(
        ServerConfig(
            EngineConfig(model=str(tiny_model), num_threads=1, max_loras=2),
            served_model_name=["tiny"],
            lora_modules=[LoRAModule(n, str(adapters[s])) for n, s in NAMES.items()],
            admin_api_key=ADMIN,
            allowed_lora_roots=[str(root)],
            log_level="warning",
        )
    )


@pytest.fixture(scope="module")
def fleet(
    tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, list[str]]]:
    root = tmp_path_factory.mktemp("root")
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(serve_in_thread(_replica(tiny_model, adapters, root)))
            for _ in range(2)
        ]
        config = RouterConfig(
            replicas=urls, poll_interval_s=0.2, weights=Weights(evictions=0.0),
            status_api_key=STATUS,
        )  # fmt: skip
        router = stack.enter_context(serve_in_thread(create_router_app(config)))
        yield router, urls


def router_view(router: str) -> dict[str, dict[str, str]]:
    """replica url -> {adapter: tier} as the router sees it."""
    r = httpx.get(f"{router}/v1/replicas", headers=STATUS_H)
    assert r.status_code == 200, r.text
    return {rep["url"]: rep["tiers"] for rep in r.json()["data"]}


def replica_truth(url: str) -> dict[str, str]:
    rows = httpx.get(f"{url}/v1/adapters", timeout=60).json()["data"]
    return {r["name"]: r["tier"] for r in rows}


def converged(router: str, urls: list[str]) -> dict[str, dict[str, str]]:
    """Wait until the router's view equals every replica's own; that view."""
    want: dict[str, dict[str, str]] = {}

    def same() -> bool:
        nonlocal want
        want = {u: replica_truth(u) for u in urls}
        return router_view(router) == want

    wait_until(same, what="the router's view of the replicas")
    return want


def wait_for_matrix(page: Any, want: dict[str, dict[str, str]]) -> None:
    """Wait (in the page) until every matrix cell shows ``want[replica][adapter]``."""
    page.wait_for_function(
        """want => {
            const cells = [...document.querySelectorAll('#matrix td.cell')];
            const got = {};
            for (const c of cells) (got[c.dataset.replica] ??= {})[c.dataset.adapter] = c.dataset.tier;
            const norm = o => JSON.stringify(Object.keys(o).sort().map(k =>
                [k, Object.keys(o[k]).sort().map(a => [a, o[k][a]])]));
            return cells.length > 0 && norm(got) === norm(want);
        }""",
        arg=want,
    )


def test_fleet_matrix_follows_the_replicas(fleet: tuple[str, list[str]]) -> None:
    router, urls = fleet
    with httpx.Client(base_url=router, timeout=60) as c:
        for name in NAMES:
            for _ in range(2):
                body = {"model": name, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
                assert c.post("/v1/completions", json=body).status_code == 200
    assert httpx.get(f"{router}/v1/replicas").status_code == 401  # the status key rules
    want = converged(router, urls)
    with chromium_page() as page:
        page.goto(f"{router}/dashboard")
        page.wait_for_selector("#keybox", state="visible")
        page.fill("#key", STATUS)
        page.click("#keysave")
        wait_for_matrix(page, want)
        for u in urls:
            card = page.locator(f".card[data-replica='{u}']")
            assert card.get_attribute("data-healthy") == "true"
        decisions = httpx.get(f"{router}/v1/replicas", headers=STATUS_H).json()["decisions"]
        assert sum(decisions.values()) == 2 * len(NAMES)
        for reason, n in decisions.items():
            page.wait_for_selector(
                f"#decisions [data-reason={reason}] .count:text-is('{n}')", state="attached"
            )

        # evict one adapter from the replica that holds it in memory: the matrix follows
        url, name = next(
            (u, n) for u in urls for n, t in want[u].items() if t in ("device", "host")
        )
        r = httpx.post(f"{url}/v1/evict_lora_adapter", json={"lora_name": name}, headers=ADMIN_H)
        assert r.status_code == 200 and r.json()["evicted_from"], r.text
        after = converged(router, urls)
        assert after[url][name] != want[url][name]
        wait_for_matrix(page, after)
        page.wait_for_selector(
            f"#matrix td.cell[data-replica='{url}'][data-adapter={name}][data-tier=disk]"
        )
