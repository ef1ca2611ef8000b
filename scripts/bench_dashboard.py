"""How fast the dashboards render a large fleet in the test browser (headless Chromium).

Serves the real pages (``loraplex.server`` and ``loraplex.router`` package data) from a small
app whose data routes answer with ``--adapters`` synthetic rows in the exact shape of
``/v1/adapters``, ``/v1/dashboard/stats`` (a full sample ring and event strip) and
``/v1/replicas`` (``--replicas`` replicas). Measures, per page and ``--repeats`` times: the
time from navigation start until every row is in the DOM (first render, scripts included),
and one full re-render of the table from data already fetched. Prints the best and the worst.

    .venv/bin/python scripts/bench_dashboard.py --adapters 1000 --replicas 4
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from loraplex.testing.server import serve_in_thread

ADMIN_VIEW = True
TIERS = ("device", "host", "disk", "absent")


def adapter_rows(n: int, slots: int, rng: random.Random) -> list[dict[str, Any]]:
    """``n`` rows as ``/v1/adapters`` gives them (``slots`` of them on the device)."""
    now = time.time()
    rows = []
    for i in range(n):
        tier = "device" if i < slots else rng.choice(TIERS[1:])
        rows.append(
            {
                "name": f"adapter-{i:04d}", "path": None, "registered": True, "tenant": None,
                "revision": 1, "sha256": f"{rng.getrandbits(64):016x}", "tier": tier,
                "rank": rng.choice((8, 16, 32)), "bytes": rng.randrange(1 << 20, 64 << 20),
                "hits": rng.randrange(1000), "loads": rng.randrange(10),
                "evictions": rng.randrange(10), "last_access": now - rng.random() * 3600,
                "pinned": i % 50 == 0, "warm_policy": "on-demand", "in_flight": rng.randrange(3),
                "slot": i if tier == "device" else None,
            }
        )  # fmt: skip
    return rows


def stats_body(n_samples: int, n_events: int, rng: random.Random) -> dict[str, Any]:
    """``/v1/dashboard/stats`` with a full ring and strip."""
    now = time.time()
    tiers = ("device", "host", "disk")

    def sample(i: int) -> dict[str, Any]:
        q = {"p50": rng.random() * 0.1, "p99": rng.random() * 0.5}
        return {
            "t": now - n_samples + i, "rps": rng.random() * 50,
            "ttft": {"warm": q, "cold": {k: 3 * v for k, v in q.items()}},
            "distinct_adapters": rng.random() * 8, "steps": 50,
            "hit_ratio": {t: rng.random() for t in tiers},
            "load_seconds": {s: rng.random() for s in ("disk_load", "h2d", "activation")},
            "evictions": {t: rng.randrange(5) for t in tiers},
            "thrash_ratio": {t: rng.random() for t in tiers},
            "kv_usage": rng.random(), "running": 4, "waiting": 1,
        }  # fmt: skip

    events = [
        {"t": now - i, "kind": rng.choice(("load", "evict", "pin")), "name": f"adapter-{i:04d}",
         "sha256": f"{rng.getrandbits(64):016x}", "detail": "host -> device"}
        for i in range(n_events)
    ]  # fmt: skip
    return {
        "now": now, "interval_s": 1.0, "lora": True, "admin": ADMIN_VIEW, "tenant": None,
        "policy": "hybrid",
        "occupancy": {
            "device": {"count": 8, "bytes": 1 << 28, "count_budget": 8, "bytes_budget": None},
            "host": {"count": 300, "bytes": 1 << 33, "count_budget": None, "bytes_budget": 1 << 34},
        },
        "events": events, "samples": [sample(i) for i in range(n_samples)],
    }  # fmt: skip


def replicas_body(names: list[str], n: int, rng: random.Random) -> dict[str, Any]:
    return {
        "object": "list", "policy": "residency",
        "decisions": {"affinity": 9000, "load": 700, "fallback": 40},
        "data": [
            {
                "url": f"http://10.0.0.{i + 1}:8000", "kind": "loraplex", "healthy": True,
                "in_flight": 3, "waiting": 1, "running": 4, "kv_usage": 0.4,
                "evictions_per_s": 0.1, "max_loras": 8, "max_cpu_loras": 64, "base_models": ["m"],
                "device": names[:8], "tiers": {a: rng.choice(TIERS) for a in names},
                "last_error": None,
            }
            for i in range(n)
        ],
    }  # fmt: skip


def page(package: str) -> str:
    return resources.files(package).joinpath("static/dashboard.html").read_text(encoding="utf-8")


def make_app(n_adapters: int, n_replicas: int) -> FastAPI:
    rng = random.Random(0)
    rows = adapter_rows(n_adapters, 8, rng)
    adapters = {"object": "list", "data": rows, "max_loras": 8, "policy": "hybrid"}
    stats = stats_body(300, 200, rng)
    replicas = replicas_body([r["name"] for r in rows], n_replicas, rng)
    app = FastAPI()
    app.get("/dashboard")(lambda: HTMLResponse(page("loraplex.server")))
    app.get("/fleet")(lambda: HTMLResponse(page("loraplex.router")))
    # bodies encoded once: the measure is the browser's, not this app's encoder
    for route, body in (("/v1/adapters", adapters), ("/v1/dashboard/stats", stats),
                        ("/v1/replicas", replicas)):  # fmt: skip
        data = json.dumps(body).encode()
        app.get(route)(lambda data=data: Response(data, media_type="application/json"))
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        print("no system chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    checks = {
        "replica /dashboard": ("/dashboard", "#adapters tbody tr", args.adapters),
        "router /dashboard": ("/fleet", "#matrix tbody tr", args.adapters),
    }
    rerender = {
        "replica /dashboard": "ui.lastSig = ''; renderTable()",
        "router /dashboard": "lastSig = ''; render()",
    }
    with serve_in_thread(make_app(args.adapters, args.replicas)) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        print(f"chromium {browser.version}, {args.adapters} adapters, {args.replicas} replicas")
        for label, (path, rows, n) in checks.items():
            first, again, fetches, dom = [], [], [], []
            for _ in range(args.repeats):
                pg = browser.new_context().new_page()
                # in the page: when the last row arrives, and when the frame after it is done
                # (style, layout and paint of the rows included)
                pg.add_init_script(
                    "window.__t = null; new MutationObserver(() => {"
                    f" if (window.__t === null && document.querySelectorAll('{rows}').length"
                    f" === {n}) {{ window.__t = [performance.now()];"
                    " requestAnimationFrame(() => setTimeout(() =>"
                    " window.__t.push(performance.now()))); }"
                    "}).observe(document, {childList: true, subtree: true});"
                )
                pg.goto(f"{url}{path}")
                pg.wait_for_function("window.__t && window.__t.length === 2")
                inserted, painted = pg.evaluate("window.__t")
                first.append(painted / 1000)
                dom.append(inserted / 1000)
                fetches.append(
                    pg.evaluate(
                        "Math.max(...performance.getEntriesByType('resource')"
                        ".filter(e => e.name.includes('/v1/')).map(e => e.responseEnd))"
                    )
                    / 1000
                )
                again.append(
                    pg.evaluate(
                        f"(() => {{ const t = performance.now(); {rerender[label]}; "
                        "return performance.now() - t; })()"
                    )
                    / 1000
                )
                pg.context.close()
            print(
                f"{label}: first render (navigation start -> {n} rows laid out and painted): "
                f"best {min(first):.3f} s, worst {max(first):.3f} s (data fetched by "
                f"{min(fetches):.3f}-{max(fetches):.3f} s, rows in the DOM by "
                f"{min(dom):.3f}-{max(dom):.3f} s); "
                f"re-render: best {min(again):.3f} s, worst {max(again):.3f} s"
            )
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
