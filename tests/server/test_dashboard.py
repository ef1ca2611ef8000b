"""The replica's ``/dashboard`` in a real browser (headless Chromium): every adapter row shows
its true tier, the page follows an eviction, an admin pin from the page reaches the cache, the
filters work; a tenant key sees only its adapters, on the page and in every response the page
fetched. Plus the data route's own checks (scoping, bounds, the quantile estimate)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.app import ServerState, create_app
from loraplex.server.dashboard import DashboardSampler, quantile
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import wait_until
from tests.browser import chromium_page
from tests.server.registry_server import live_server, tenant_adapters

ADMIN = "sk-admin-dash"
USER = "sk-user-dash"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
NAMES = ("alpha", "bravo", "charlie")
Server = tuple[str, httpx.Client, ServerState]


def tier_label(row: dict[str, Any]) -> str:
    """The page's tier cell text for a ``/v1/adapters`` row."""
    if row["tier"] == "device" and row["slot"] is not None:
        return f"device #{row['slot']}"
    return str(row["tier"])


def page_tiers(page: Any) -> dict[str, str]:
    """name -> the tier cell's text, as rendered."""
    got: dict[str, str] = page.eval_on_selector_all(
        "#adapters tbody tr",
        "rows => Object.fromEntries(rows.map(r => "
        "[r.dataset.name, r.querySelector('td.tier').textContent]))",
    )
    return got


def wait_for_tiers(page: Any, want: dict[str, str]) -> None:
    """Wait (Playwright's wait, in the page) until the rendered tiers are exactly ``want``."""
    page.wait_for_function(
        """want => {
            const rows = [...document.querySelectorAll('#adapters tbody tr')];
            const got = Object.fromEntries(rows.map(r =>
                [r.dataset.name, r.querySelector('td.tier').textContent]));
            return JSON.stringify(got, Object.keys(got).sort()) ===
                   JSON.stringify(want, Object.keys(want).sort());
        }""",
        arg=want,
    )


def truth(c: httpx.Client) -> dict[str, str]:
    return {r["name"]: tier_label(r) for r in c.get("/v1/adapters", headers=ADMIN_H).json()["data"]}


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    sources = ("all_r8", "mlp_r16", "attn_r4_rslora")
    modules = [LoRAModule(n, str(adapters[s])) for n, s in zip(NAMES, sources, strict=True)]
    app = create_app(
        ServerConfig(
            EngineConfig(model=str(tiny_model), num_threads=1, max_loras=2),
            served_model_name=["tiny"],
            lora_modules=modules,
            api_keys=[USER],
            admin_api_key=ADMIN,
            allowed_lora_roots=[str(tmp_path_factory.mktemp("root"))],
            log_level="warning",
        )
    )
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        for name in NAMES:  # traffic: every adapter loaded and used once
            body = {"model": name, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
            r = c.post("/v1/completions", json=body, headers=ADMIN_H)
            assert r.status_code == 200, r.text
        yield url, c, app.state.loraplex


def test_page_shows_true_tiers_follows_eviction_and_pins(
    server: Server,
) -> None:
    url, c, _ = server
    with chromium_page() as page:
        page.goto(f"{url}/dashboard")
        page.wait_for_selector("#keybox", state="visible")  # 401: the page asks for a key
        assert page.locator("#adapters tbody tr").count() == 0
        page.fill("#key", ADMIN)
        page.click("#keysave")
        want = truth(c)
        assert set(want) == set(NAMES)
        wait_for_tiers(page, want)
        assert page.evaluate("sessionStorage.getItem('loraplex.dashboard.key')") == ADMIN
        assert page.locator("#policy").text_content() == "policy: hybrid"
        page.wait_for_selector("#occupancy .card[data-tier=device]")
        assert "/ 2 slots" in (page.text_content("#occupancy .card[data-tier=device]") or "")
        page.wait_for_selector("#chart-rps svg path")  # operator keys get the charts
        page.wait_for_selector("#chart-prefix svg")
        # no speculative decoding on this server: no section, no chart for it
        assert page.locator("#spec").is_hidden() and page.locator("#chart-spec").count() == 0

        # an eviction elsewhere: the page follows
        victim = "charlie"
        r = c.post("/v1/evict_lora_adapter", json={"lora_name": victim}, headers=ADMIN_H)
        assert r.status_code == 200 and r.json()["evicted_from"], r.text
        after = truth(c)
        assert after[victim] != want[victim]
        wait_for_tiers(page, after)
        # out of memory with a local source: "disk", in the strip as in the table
        page.wait_for_selector(
            f"#events li[data-kind=evict][data-name={victim}]:has-text('-> disk')"
        )

        # an admin pin from the page reaches the cache
        def pinned(name: str) -> bool:
            rows = c.get("/v1/adapters", headers=ADMIN_H).json()["data"]
            return next(r["pinned"] for r in rows if r["name"] == name)

        target = "bravo"
        assert not pinned(target)
        page.click(f"#adapters tbody tr[data-name={target}] [data-act=pin]")
        wait_until(lambda: pinned(target), what="the pin from the page")
        page.wait_for_selector(f"#adapters tbody tr[data-name={target}] [data-act=unpin]")
        page.click(f"#adapters tbody tr[data-name={target}] [data-act=unpin]")
        wait_until(lambda: not pinned(target), what="the unpin from the page")

        # filters: by name, then by tier
        page.fill("#filter-name", "char")
        page.wait_for_function(
            "document.querySelectorAll('#adapters tbody tr').length === 1"
            " && document.querySelector('#adapters tbody tr').dataset.name === 'charlie'"
        )
        page.fill("#filter-name", "")
        tier = truth(c)[victim].split(" ")[0]
        page.select_option("#filter-tier", tier)
        expect = sorted(
            r["name"]
            for r in c.get("/v1/adapters", headers=ADMIN_H).json()["data"]
            if r["tier"] == tier
        )
        page.wait_for_function(
            "want => JSON.stringify([...document.querySelectorAll('#adapters tbody tr')]"
            ".map(r => r.dataset.name).sort()) === JSON.stringify(want)",
            arg=expect,
        )
        # sorting by name, descending on the second click
        page.select_option("#filter-tier", "")
        page.click("th[data-sort=name]")
        page.wait_for_function(
            "want => JSON.stringify([...document.querySelectorAll('#adapters tbody tr')]"
            ".map(r => r.dataset.name)) === JSON.stringify(want)",
            arg=sorted(NAMES, reverse=True),
        )


def test_an_adapter_only_in_its_object_store_reads_object_store(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Out of every local tier with a store source: /v1/adapters says ``absent``, the page
    names where it will come from."""
    store_root = tmp_path / "store"
    shutil.copytree(adapters["all_r8"], store_root / "s")
    app = create_app(
        ServerConfig(
            EngineConfig(model=str(tiny_model), num_threads=1, max_loras=1,
                         adapter_store_url=str(store_root)),
            served_model_name=["tiny"],
            lora_modules=[LoRAModule("s", str(store_root / "s"))],
            admin_api_key=ADMIN,
            allowed_lora_roots=[str(tmp_path)],
            log_level="warning",
        )
    )  # fmt: skip
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        body = {"model": "s", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        assert c.post("/v1/completions", json=body, headers=ADMIN_H).status_code == 200
        r = c.post("/v1/evict_lora_adapter", json={"lora_name": "s"}, headers=ADMIN_H)
        assert r.status_code == 200, r.text
        assert truth(c) == {"s": "absent"}
        with chromium_page() as page:
            page.goto(f"{url}/dashboard")
            page.evaluate(f"sessionStorage.setItem('loraplex.dashboard.key', {ADMIN!r})")
            page.reload()
            wait_for_tiers(page, {"s": "object store"})
            page.select_option("#filter-tier", "absent")
            wait_for_tiers(page, {"s": "object store"})


def test_inference_key_sees_no_admin_buttons(server: Server) -> None:
    url, c, _ = server
    with chromium_page() as page:
        page.goto(f"{url}/dashboard")
        page.fill("#key", USER)
        page.click("#keysave")
        wait_for_tiers(page, truth(c))
        assert page.locator("#adapters .act").count() == 0
        assert (
            c.get("/v1/dashboard/stats", headers={"Authorization": f"Bearer {USER}"}).json()[
                "admin"
            ]
            is False
        )


def test_page_is_open_data_is_not(server: Server) -> None:
    """The page holds no data and needs no key; the data route needs one (fail closed)."""
    _, c, _ = server
    r = c.get("/dashboard")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "alpha" not in r.text and "http" not in r.text.replace("http-equiv", "")  # no CDN
    assert c.get("/v1/dashboard/stats").status_code == 401
    assert c.get("/v1/dashboard/stats", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_stats_shape_and_bounds(server: Server) -> None:
    _, c, _ = server
    body = c.get("/v1/dashboard/stats", headers=ADMIN_H).json()
    assert body["policy"] == "hybrid" and body["admin"] is True
    assert body["occupancy"]["device"]["count_budget"] == 2
    assert {"device", "host"} <= set(body["occupancy"])
    wait_until(
        lambda: c.get("/v1/dashboard/stats", headers=ADMIN_H).json()["samples"],
        what="a first sample",
    )
    s = c.get("/v1/dashboard/stats", headers=ADMIN_H).json()["samples"][-1]
    for key in ("rps", "ttft", "distinct_adapters", "hit_ratio", "load_seconds", "evictions",
                "thrash_ratio", "kv_usage", "prefix", "alora"):  # fmt: skip
        assert key in s, key
    assert set(s["ttft"]) == {"warm", "cold"}
    assert set(s["prefix"]) == {"hit ratio", "base-aligned"}
    assert set(s["alora"]) == {"invoked", "not invoked"}


def test_sampler_memory_is_bounded(server: Server) -> None:
    """The ring and the strip never grow past their bounds, however many ticks and events."""
    _, c, state = server
    sampler = DashboardSampler(state, max_samples=3, max_events=2)  # its own, small bounds
    sampler.sample()
    for _ in range(3):  # six events: pin + unpin, three times
        for route in ("pin", "unpin"):
            r = c.post(f"/v1/{route}_lora_adapter", json={"lora_name": "alpha"}, headers=ADMIN_H)
            assert r.status_code == 200, r.text
            sampler.sample()
    assert len(sampler.samples) == 3
    assert [e.kind for e in sampler.events] == ["pin", "unpin"]


def test_a_sample_is_the_interval_difference(server: Server) -> None:
    """Two hand-made ticks around three completions: the sample counts exactly them."""
    _, c, state = server
    sampler = DashboardSampler(state)
    sampler.sample()
    for _ in range(3):
        body = {"model": "alpha", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        assert c.post("/v1/completions", json=body, headers=ADMIN_H).status_code == 200
    sampler.sample()
    s = sampler.samples[-1]
    assert s["requests"] == 3 and s["rps"] > 0
    assert s["steps"] >= 3 and s["distinct_adapters"] == 1.0  # one adapter in every step
    ttft = [q["p50"] for q in s["ttft"].values() if q["p50"] is not None]
    assert ttft and all(v > 0 for v in ttft)
    assert s["hit_ratio"]["device"] is not None
    assert s["prefix"]["hit ratio"] is not None and s["alora"] == {"invoked": 0, "not invoked": 0}
    rows = c.get("/v1/dashboard/stats", headers=ADMIN_H).json()["prefix_by_adapter"]
    alpha = next(r for r in rows if r["name"] == "alpha")
    assert alpha["queries"] >= 3 and 0 <= alpha["hits"] <= alpha["queries"]


def test_quantile_matches_bucket_interpolation() -> None:
    bounds = [0.1, 0.5, 1.0, float("inf")]
    assert quantile(bounds, [0, 0, 0, 0], 0.5) is None
    # 10 observations, all in (0.1, 0.5]: the median is the bucket's middle
    assert quantile(bounds, [0, 10, 10, 10], 0.5) == pytest.approx(0.3)
    assert quantile(bounds, [5, 10, 10, 10], 0.5) == pytest.approx(0.1)
    assert quantile(bounds, [0, 0, 0, 4], 0.99) == 1.0  # +Inf bucket: its lower bound


def test_tenant_sees_only_its_adapters_on_the_page_and_in_its_data(
    tmp_path: Path, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    served = tenant_adapters(adapters, tmp_path / "root")
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with live_server(url, tiny_model, served, admin_api_key=ADMIN) as live:
        acme, bravo = live.keys["acme"], live.keys["bravo"]
        assert live.complete("a_only", acme).status_code == 200
        assert live.complete("b_only", bravo).status_code == 200
        fetched: list[str] = []
        with chromium_page() as page:

            def keep(response: Any) -> None:
                if "/v1/" in response.url:
                    fetched.append(response.text())

            page.on("response", keep)
            page.goto(f"{live.url}/dashboard")
            page.fill("#key", acme)
            page.click("#keysave")
            view = {r["name"]: tier_label(r) for r in live.get("/v1/adapters", acme).json()["data"]}
            assert set(view) == {"a_only", "shared"}
            wait_for_tiers(page, view)
            page.wait_for_selector("#who:has-text('tenant: acme')")
            assert page.locator("#adapters .act").count() == 0  # read-only
        assert fetched
        for text in fetched:
            assert "b_only" not in text, text
        stats = json.loads(live.get("/v1/dashboard/stats", acme).text)
        assert stats["samples"] is None and stats["tenant"] == "acme"
        assert stats["occupancy"]["host"]["count"] == 1  # its own adapter only
        assert all(e["name"] != "b_only" for e in stats["events"])


def test_canary_and_promotion_events_scoped_to_their_tenant(
    tmp_path: Path, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """A canary set and then promoted in the registry shows in the event strip, to the
    operator and to the adapter's tenant, never to another tenant."""
    served = tenant_adapters(adapters, tmp_path / "root")
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with live_server(url, tiny_model, served, admin_api_key=ADMIN) as live:
        state, registry = live.state, live.registry
        sampler = DashboardSampler(state)  # its own: ticked by hand, deterministic
        sampler.sample()
        base = state.catalog.servables()["a_only"].active
        # acme's new revision has the weights of bravo's b_only: one digest, two tenants' names
        m = registry.register(
            served["b_only"], "a_only", base=state.base, tenant="acme", actor="test"
        )
        registry.canary("a_only", m.revision, 0.25, actor="test")
        live.caught_up()
        sampler.sample()
        registry.promote("a_only", actor="test")
        live.caught_up()
        sampler.sample()
        kinds = [(e.kind, e.name) for e in sampler.events]
        assert ("canary", "a_only") in kinds and ("promote", "a_only") in kinds, kinds
        assert kinds.index(("canary", "a_only")) < kinds.index(("promote", "a_only"))
        acme = state.catalog.authenticate(live.keys["acme"])
        bravo = state.catalog.authenticate(live.keys["bravo"])
        assert acme is not None and bravo is not None
        seen = {e["kind"] for e in sampler.stats(acme)["events"] if e["name"] == "a_only"}
        assert {"canary", "promote"} <= seen
        assert all(e["name"] != "a_only" for e in sampler.stats(bravo)["events"])
        assert base.sha256 != state.catalog.servables()["a_only"].active.sha256
