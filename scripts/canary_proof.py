#!/usr/bin/env python
"""The canary proof (issue 19): a canary with an injected failure rate is rolled back within its
window; a healthy one is not.

It builds a tiny random Llama and adapters in a temp dir (no downloads), serves them from a
SQLite registry in this process (``create_app`` + uvicorn on a free port, an admin key), and for
each scenario registers a fresh name (r1 active, r2 as a canary with weight ``--weight`` and a
health policy over ``--window`` seconds with ``--min-requests``), then sends up to
``--requests`` sequential completions and prints, per scenario, whether and when the canary was
rolled back: canary calls seen, failures among them, seconds from the canary's start, the audit
entry's actor and reason.

Scenarios:

- ``healthy``: r2 is a sound adapter; bound ``max_error_rate`` (default 0.05). Must not roll back.
- ``errors``: r2's weights are changed on disk after registration, so every call it serves
  fails (500 ``adapter_integrity_error``): an injected failure rate of 100% of the canary's
  calls (``--weight`` of the name's traffic). Must roll back after ``--min-requests`` canary
  calls, well within the window.
- ``quality-P`` for each ``--bad-rate`` P: r2 is sound but users report a fraction P of its
  responses as bad (feedback score 0, else 1, in a fixed interleaving); bound
  ``min_quality = 1 - --max-bad``. Rolls back exactly when P > ``--max-bad``.

Exit status 0 when every scenario ended as it must.

    python scripts/canary_proof.py
    python scripts/canary_proof.py --requests 400 --window 30 --min-requests 20 --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loraplex.config import EngineConfig, ServerConfig
from loraplex.registry import Registry, RegistryPolicy
from loraplex.server.app import create_app
from loraplex.testing import ALL_PROJ, make_random_adapter, make_random_model
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import wait_until

ADMIN = "sk-canary-proof"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200, help="calls per scenario (at most)")
    p.add_argument("--weight", type=float, default=0.5, help="canary traffic share")
    p.add_argument("--window", type=float, default=60.0, help="health window, seconds")
    p.add_argument("--min-requests", type=int, default=20)
    p.add_argument("--max-error-rate", type=float, default=0.05)
    p.add_argument("--max-bad", type=float, default=0.1, help="bad-feedback share tolerated")
    p.add_argument("--bad-rate", type=float, nargs="*", default=[0.02, 0.3])
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def _bad(i: int, rate: float) -> bool:
    """The i-th feedback is bad: a fixed interleaving with ``rate`` bad ones in every prefix."""
    return int((i + 1) * rate) > int(i * rate)


def run_scenario(
    h: httpx.Client, reg: Registry, root: Path, model: Path, kind: str, args: argparse.Namespace,
    seed: int, bad_rate: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    name = f"proof-{kind}".replace(".", "_")
    src1, src2 = root / f"{name}-1", root / f"{name}-2"
    make_random_adapter(model, src1, r=8, lora_alpha=16, target_modules=ALL_PROJ, seed=seed)
    make_random_adapter(model, src2, r=8, lora_alpha=16, target_modules=ALL_PROJ, seed=seed + 1)
    revs = []
    for src, extra in ((src1, {"activate": True}), (src2, {})):
        r = h.post("/v1/admin/adapters", json={"name": name, "path": str(src), **extra})
        r.raise_for_status()
        revs.append(r.json()["revision"])
    policy: dict[str, Any] = {"window_s": args.window, "min_requests": args.min_requests}
    if kind.startswith("quality"):
        policy |= {"max_error_rate": None, "min_quality": 1.0 - args.max_bad}
    else:
        policy |= {"max_error_rate": args.max_error_rate}
    if kind == "errors":
        weights = src2 / "adapter_model.safetensors"
        raw = bytearray(weights.read_bytes())
        raw[-3] ^= 0xFF  # r2's files no longer match their registered digest
        weights.write_bytes(bytes(raw))
    r = h.post(f"/v1/admin/adapters/{name}/canary",
               json={"revision": revs[1], "weight": args.weight, "policy": policy})  # fmt: skip
    r.raise_for_status()
    start = time.monotonic()
    canary_calls = failures = feedback = 0
    rolled_at = None
    for _ in range(args.requests):
        r = h.post("/v1/completions", json={"model": name, "prompt": "Hello there",
                                            "max_tokens": 4, "ignore_eos": True})  # fmt: skip
        if r.status_code != 200:
            canary_calls += 1  # only the canary's calls fail here
            failures += 1
        elif r.headers["x-loraplex-adapter-route"] == "canary":
            canary_calls += 1
            if kind.startswith("quality"):
                score = 0.0 if _bad(feedback, bad_rate) else 1.0
                feedback += 1
                h.post(f"/v1/adapters/{name}/feedback",
                       json={"revision": revs[1], "score": score}).raise_for_status()  # fmt: skip
        due = failures if kind == "errors" else feedback  # calls the policy has judged
        if _breaches(kind, bad_rate, args) and due >= args.min_requests:
            try:  # the breaching call was answered; its rollback runs in the server's I/O pool
                wait_until(lambda: reg.release(name).canary_revision is None, timeout=30,
                           what="the rollback")  # fmt: skip
            except AssertionError:
                pass  # reported as not rolled back
        if reg.release(name).canary_revision is None:
            rolled_at = time.monotonic() - start
            break
    rel = reg.release(name)
    entry = next((e for e in reg.audit_log(target=name) if e.action == "rollback"), None)
    return {
        "scenario": kind,
        "rolled_back": rel.canary_revision is None,
        "canary_calls": canary_calls,
        "failures": failures,
        "bad_feedback": sum(_bad(i, bad_rate) for i in range(feedback)) if feedback else 0,
        "feedback": feedback,
        "seconds": None if rolled_at is None else round(rolled_at, 2),
        "window_s": args.window,
        "actor": entry.actor if entry else None,
        "reason": entry.after.get("reason") if entry and entry.after else None,
        "expected": _breaches(kind, bad_rate, args),
    }


def _breaches(kind: str, bad_rate: float, args: argparse.Namespace) -> bool:
    if kind == "healthy":
        return False
    if kind == "errors":
        return True
    return bad_rate > args.max_bad


def main() -> int:
    args = _args()
    with tempfile.TemporaryDirectory(prefix="canary-proof-") as tmp_s:
        tmp = Path(tmp_s)
        model = make_random_model(tmp / "tiny", num_layers=2, seed=0)
        root = tmp / "adapters"
        root.mkdir()
        reg = Registry.open(f"sqlite:///{tmp / 'registry.db'}",
                            policy=RegistryPolicy(allowed_roots=(str(root),)))  # fmt: skip
        config = ServerConfig(
            EngineConfig(model=str(model), max_loras=4, max_cpu_loras=8, num_threads=1),
            served_model_name=["tiny"],
            admin_api_key=ADMIN,
            allowed_lora_roots=[str(root)],
            registry_poll_s=0.1,
            log_level="error",
        )
        app = create_app(config, registry=reg)
        rows = []
        with (
            serve_in_thread(app) as url,
            httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120
            ) as h,
        ):
            scenarios = [("healthy", 0.0), ("errors", 0.0)]
            scenarios += [(f"quality-{p:g}", p) for p in args.bad_rate]
            for i, (kind, p) in enumerate(scenarios):
                rows.append(run_scenario(h, reg, root, model, kind, args, 10 * i + 1, p))
            metrics = h.get("/metrics").text
        reg.close()
        shutil.rmtree(root, ignore_errors=True)
    counted = [
        ln for ln in metrics.splitlines() if ln.startswith("loraplex_canary_rollbacks_total")
    ]
    ok = all(r["rolled_back"] == r["expected"] for r in rows)
    if args.json:
        print(json.dumps({"rows": rows, "metrics": counted, "ok": ok}, indent=2))
        return 0 if ok else 1
    print(f"weight {args.weight:g}, window {args.window:g}s, min_requests {args.min_requests}, "
          f"max_error_rate {args.max_error_rate:g}, min_quality {1 - args.max_bad:g}")  # fmt: skip
    head = ("scenario", "canary calls", "failed", "bad fb", "rolled back", "after s", "as expected")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        fb = f"{r['bad_feedback']}/{r['feedback']}" if r["feedback"] else "-"
        after = "-" if r["seconds"] is None else f"{r['seconds']:.2f}"
        print(f"| {r['scenario']} | {r['canary_calls']} | {r['failures']} | {fb} | "
              f"{'yes' if r['rolled_back'] else 'no'} | {after} | "
              f"{'yes' if r['rolled_back'] == r['expected'] else 'NO'} |")  # fmt: skip
    for r in rows:
        if r["reason"]:
            print(f"  {r['scenario']}: {r['actor']}: {r['reason']}")
    print("\n".join(counted))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
