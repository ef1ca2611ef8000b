"""Screenshots of both dashboards over a small live fleet (headless Chromium, the system one).

Builds a tiny random Llama and ``--adapters`` random LoRA adapters in a temp dir, starts two
replicas (in this process, ``max_loras=2``) and a router over them, sends a Zipf mix of
requests through the router for ``--seconds``, pins one adapter and evicts another on replica
1, then writes ``replica.png`` and ``router.png`` into ``--out`` (default: the current
directory). The PNGs are not committed per run; ``docs/dashboard.png`` is one of them.

    .venv/bin/python scripts/dashboard_screenshot.py --out /tmp/shots
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.router.app import RouterConfig, create_router_app
from loraplex.server.app import create_app
from loraplex.testing import make_random_adapter, make_random_model
from loraplex.testing.server import serve_in_thread

ADMIN = "sk-screenshot-admin"
STATUS = "sk-screenshot-status"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".", help="directory for replica.png and router.png")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--seconds", type=float, default=20.0, help="traffic before the shots")
    args = p.parse_args(argv)
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        print("no system chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="loraplex-shots-") as tmp, contextlib.ExitStack() as st:
        root = Path(tmp)
        model = make_random_model(root / "model", num_layers=2, seed=0)
        names = [f"support-{i}" if i % 2 else f"sql-{i}" for i in range(args.adapters)]
        modules = [
            LoRAModule(n, str(make_random_adapter(model, root / n, r=8 * (1 + i % 3), seed=i)))
            for i, n in enumerate(names)
        ]

        def replica() -> str:
            app = create_app(
                ServerConfig(
                    EngineConfig(model=str(model), num_threads=1, max_loras=2, max_cpu_loras=4),
                    served_model_name=["tiny"],
                    lora_modules=modules,
                    admin_api_key=ADMIN,
                    allowed_lora_roots=[str(root)],
                    log_level="warning",
                )
            )
            return st.enter_context(serve_in_thread(app))

        replicas = [replica(), replica()]
        router = st.enter_context(
            serve_in_thread(
                create_router_app(
                    RouterConfig(replicas=replicas, poll_interval_s=0.5, status_api_key=STATUS)
                )
            )
        )
        rng = random.Random(0)
        weights = [1 / (i + 1) for i in range(len(names))]
        end = time.monotonic() + args.seconds
        with httpx.Client(base_url=router, timeout=60) as c:
            while time.monotonic() < end:
                name = rng.choices(names, weights)[0]
                body = {"model": name, "prompt": "Hello there", "max_tokens": 4}
                c.post("/v1/completions", json=body)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        httpx.post(f"{replicas[0]}/v1/pin_lora_adapter", json={"lora_name": names[1]},
                   headers=admin, timeout=60)  # fmt: skip
        httpx.post(f"{replicas[0]}/v1/evict_lora_adapter", json={"lora_name": names[2]},
                   headers=admin, timeout=60)  # fmt: skip
        time.sleep(2.5)  # a script, not a test: let the pages' next polls see it
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
            for url, key, rows, path in (
                (replicas[0], ADMIN, "#adapters tbody tr", out / "replica.png"),
                (router, STATUS, "#matrix tbody tr", out / "router.png"),
            ):
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(f"{url}/dashboard")
                page.evaluate("k => sessionStorage.setItem(document.title.includes('fleet')"
                              " ? 'loraplex.router.key' : 'loraplex.dashboard.key', k)", key)  # fmt: skip
                page.reload()
                page.wait_for_function(f"document.querySelectorAll('{rows}').length > 0")
                page.wait_for_timeout(1500)  # one more poll: charts with a few samples
                page.screenshot(path=str(path), full_page=True)
                print(f"wrote {path}")
            browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
