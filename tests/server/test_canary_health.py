"""Issue 19 items 3-4 on a live server: an adapter's ``max_concurrent_requests`` (excess calls
wait, are admitted as slots free, then get 429 + Retry-After), a canary's concurrency cap (calls
past it are served by the active revision), and canary health: a healthy canary keeps serving; a
canary with injected failures (its weights changed on disk after registration: every call it
serves is a 500) or bad quality (user feedback) is rolled back within its window, audited as
``system:canary-health``, counted in ``/metrics`` and shown in ``/v1/adapters``."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.config import EngineConfig, ServerConfig
from loraplex.registry import Registry, RegistryPolicy
from loraplex.server.adapter_limits import name_key
from loraplex.server.app import ServerState, create_app
from loraplex.server.canary import HEALTH_ACTOR
from loraplex.testing import ALL_PROJ, make_random_adapter
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import StepGate, wait_idle, wait_until

ADMIN = "sk-admin-canary"
BASE = "tiny"


@dataclass
class Env:
    url: str
    state: ServerState
    registry: Registry
    root: Path
    model: Path
    keys: dict[str, str]  # tenant -> inference key

    def http(self, key: str | None = ADMIN) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        )

    def admin(self, route: str, **body: Any) -> httpx.Response:
        with self.http() as h:
            return h.post(route, json=body)

    def complete(self, model: str, key: str = ADMIN, **kw: Any) -> httpx.Response:
        body = {"model": model, "prompt": "Hello there", "max_tokens": 3, "temperature": 0,
                "ignore_eos": True, **kw}  # fmt: skip
        with self.http(key) as h:
            return h.post("/v1/completions", json=body)

    def adapters(self, key: str = ADMIN) -> dict[str, dict[str, Any]]:
        with self.http(key) as h:
            r = h.get("/v1/adapters")
        assert r.status_code == 200, r.text
        return {row["name"]: row for row in r.json()["data"] if row.get("registered")}

    def metric(self, sample: str) -> float:
        with self.http() as h:
            text = h.get("/metrics").text
        for line in text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("canary")
    root = tmp / "allowed"
    root.mkdir()
    make_random_adapter(tiny_model, root / "good1", r=8, lora_alpha=16, target_modules=ALL_PROJ,
                        seed=31)  # fmt: skip
    registry = Registry.open(
        f"sqlite:///{tmp / 'registry.db'}", policy=RegistryPolicy(allowed_roots=(str(root),))
    )
    keys = {}
    for tenant in ("acme", "bravo"):
        registry.create_tenant(tenant, actor="test")
        keys[tenant] = registry.create_key(tenant, actor="test")[1]
    config = ServerConfig(
        EngineConfig(
            model=str(tiny_model), max_loras=2, max_cpu_loras=4, max_num_seqs=4, num_threads=1
        ),
        served_model_name=[BASE],
        admin_api_key=ADMIN,
        allowed_lora_roots=[str(root)],
        registry_poll_s=0.1,
        log_level="warning",
    )
    app = create_app(config, registry=registry)
    try:
        with serve_in_thread(app) as url:
            yield Env(url, app.state.loraplex, registry, root, tiny_model, keys)
    finally:
        registry.close()


def release(
    env: Env, name: str, *, tenant: str | None = None, limit: int | None = None
) -> tuple[str, str]:
    """``name`` with r1 (good1's weights) active and r2 (weights of its own: no other name's
    cached copy can serve it) registered; ``limit``: r1's max_concurrent_requests."""
    src1, src2 = env.root / f"{name}-1", env.root / f"{name}-2"
    shutil.copytree(env.root / "good1", src1)
    seed = 100 + sum(name.encode())
    make_random_adapter(env.model, src2, r=8, lora_alpha=16, target_modules=ALL_PROJ, seed=seed)
    revs = []
    for src, kw in ((src1, {"activate": True, "max_concurrent_requests": limit}), (src2, {})):
        body = {"name": name, "path": str(src), "tenant": tenant, **kw}
        r = env.admin("/v1/admin/adapters", **{k: v for k, v in body.items() if v is not None})
        assert r.status_code == 200, r.text
        revs.append(r.json()["revision"])
    return revs[0], revs[1]


def start_canary(env: Env, name: str, rev: str, weight: float, **policy: Any) -> None:
    r = env.admin(f"/v1/admin/adapters/{name}/canary", revision=rev, weight=weight, policy=policy)
    assert r.status_code == 200, r.text


def route_of(r: httpx.Response) -> str:
    return r.headers["x-loraplex-adapter-route"]


def break_weights(env: Env, name: str) -> None:
    """Change r2's weights on disk after registration: every call r2 serves fails (500)."""
    weights = env.root / f"{name}-2" / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0xFF
    weights.write_bytes(bytes(raw))


def test_healthy_canary_keeps_serving_and_its_window_is_shown(env: Env) -> None:
    _, rev2 = release(env, "calm")
    start_canary(env, "calm", rev2, 0.5, window_s=600, min_requests=3, max_error_rate=0.0)
    canary_calls = 0
    for _ in range(24):
        r = env.complete("calm")
        assert r.status_code == 200, r.text
        canary_calls += route_of(r) == "canary"
    assert canary_calls >= 3  # P(fewer than 3 of 24 at 0.5) < 2e-5
    rel = env.registry.release("calm")
    assert rel.canary_revision == rev2 and rel.last_rollback is None
    row = env.adapters()["calm"]
    assert row["canary_health"]["requests"] == canary_calls
    assert row["canary_health"]["errors"] == 0 and row["canary_health"]["ttft_p95_s"] > 0
    assert row["canary_policy"]["min_requests"] == 3 and row["last_rollback"] is None
    assert env.metric('loraplex_canary_requests_total{outcome="ok"}') >= canary_calls
    wait_idle(env.state.engine)


def test_canary_with_injected_failures_is_rolled_back_within_its_window(env: Env) -> None:
    rev1, rev2 = release(env, "flaky")
    break_weights(env, "flaky")
    before = env.metric('loraplex_canary_rollbacks_total{reason="error_rate"}')
    start_canary(env, "flaky", rev2, 0.5, window_s=600, min_requests=4, max_error_rate=0.25)
    failed = 0
    while failed < 4:  # the 4th failed canary call breaches the bound
        r = env.complete("flaky")
        if r.status_code == 500:
            assert r.json()["error"]["code"] == "adapter_integrity_error"
            failed += 1
        else:
            assert r.status_code == 200 and route_of(r) == "active", r.text
    wait_until(lambda: env.registry.release("flaky").canary_revision is None,
               what="the automatic rollback")  # fmt: skip
    rel = env.registry.release("flaky")
    assert rel.active_revision == rev1 and env.registry.get("flaky", rev2).status == "disabled"
    assert rel.last_rollback is not None and rel.last_rollback.actor == HEALTH_ACTOR
    (entry,) = [e for e in env.registry.audit_log(target="flaky") if e.action == "rollback"]
    assert entry.actor == HEALTH_ACTOR
    assert "error rate 1.000 > 0.25 over 4 calls" in entry.after["reason"]  # type: ignore[index]
    assert env.metric('loraplex_canary_rollbacks_total{reason="error_rate"}') == before + 1
    assert env.metric('loraplex_canary_requests_total{outcome="error"}') >= 4
    # this replica serves only the active revision from now on
    for _ in range(10):
        r = env.complete("flaky")
        assert r.status_code == 200 and route_of(r) == "active"
    row = env.adapters()["flaky"]
    assert "canary" not in row and row["last_rollback"]["actor"] == HEALTH_ACTOR
    assert row["last_rollback"]["revision"] == rev2
    assert "error rate" in row["last_rollback"]["reason"]
    wait_idle(env.state.engine)


def test_feedback_is_tenant_scoped_and_bad_feedback_rolls_the_canary_back(env: Env) -> None:
    rev1, rev2 = release(env, "acme-bot", tenant="acme")
    start_canary(env, "acme-bot", rev2, 0.5, window_s=600, min_requests=3, max_error_rate=None,
                 min_quality=0.5)  # fmt: skip
    acme, bravo = env.keys["acme"], env.keys["bravo"]
    with env.http(bravo) as h:  # another tenant cannot tell the name exists
        r = h.post("/v1/adapters/acme-bot/feedback", json={"revision": rev2, "score": 0.0})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        missing = h.post("/v1/adapters/nope/feedback", json={"revision": rev2, "score": 0.0})
        assert missing.status_code == 404
        hidden, unknown = r.json()["error"], missing.json()["error"]
        assert hidden["message"].replace("acme-bot", "nope") == unknown["message"]
        assert {**hidden, "message": ""} == {**unknown, "message": ""}
    with env.http(None) as h:
        r = h.post("/v1/adapters/acme-bot/feedback", json={"revision": rev2, "score": 0.0})
        assert r.status_code == 401
    with env.http(acme) as h:
        r = h.post("/v1/adapters/acme-bot/feedback", json={"revision": rev2, "score": 1.5})
        assert r.status_code == 400
        r = h.post("/v1/adapters/acme-bot/feedback", json={"revision": rev1, "score": 0.0})
        assert r.status_code == 200 and r.json()["recorded"] is False  # not the canary
        for score in (0.0, 0.5, 0.0):  # mean 0.17 < 0.5 over 3 scores
            r = h.post("/v1/adapters/acme-bot/feedback", json={"revision": rev2, "score": score})
            assert r.status_code == 200 and r.json()["recorded"] is True
    wait_until(lambda: env.registry.release("acme-bot").canary_revision is None,
               what="the rollback on feedback")  # fmt: skip
    ev = env.registry.release("acme-bot").last_rollback
    assert ev is not None and ev.actor == HEALTH_ACTOR and "quality 0.167 < 0.5" in ev.reason
    shown = env.adapters(acme)["acme-bot"]["last_rollback"]
    assert shown["actor"] == HEALTH_ACTOR and "quality" in shown["reason"]
    assert "acme-bot" not in env.adapters(bravo)


def test_max_concurrent_requests_waits_then_429_and_admits_waiters_as_slots_free(
    env: Env,
) -> None:
    """Limit 1: call A runs (the engine is held), B waits in the adapter's queue (one place),
    C gets 429 + Retry-After at once; when A finishes, B is admitted and finishes too."""
    release(env, "narrow", limit=1)
    state, eng = env.state, env.state.engine
    results: dict[str, httpx.Response] = {}

    def run(name: str) -> None:
        results[name] = env.complete("narrow")

    key = name_key("narrow")
    rejected = env.metric("loraplex_adapter_concurrency_rejections_total")
    with StepGate(eng) as gate:
        gate.hold()
        a = threading.Thread(target=run, args=("a",))
        a.start()
        wait_until(lambda: eng.num_waiting == 1, what="call A in the engine")
        b = threading.Thread(target=run, args=("b",))
        b.start()
        wait_until(lambda: state.adapter_limits.waiting(key) == 1, what="call B queued")
        assert state.adapter_limits.in_flight(key) == 1 and eng.num_waiting == 1
        c = env.complete("narrow")
        assert c.status_code == 429 and c.headers["retry-after"] == "1"
        err = c.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["code"]) == ("rate_limit_error", "adapter_concurrency_limit")
        assert "narrow" in err["message"] and "limit 1" in err["message"]
        gate.open()
        a.join()
        b.join()
    assert results["a"].status_code == 200 and results["b"].status_code == 200, results
    assert env.metric("loraplex_adapter_concurrency_rejections_total") == rejected + 1
    assert state.adapter_limits.in_flight(key) == 0 and state.adapter_limits.waiting(key) == 0
    wait_idle(eng, state.aengine)


def test_canary_cap_sends_calls_past_it_to_the_active_revision(env: Env) -> None:
    """Canary weight 1.0 with a cap of 1: while one canary call is in flight, the next call is
    served by the active revision; once it is done, the canary takes calls again."""
    _, rev2 = release(env, "capped")
    start_canary(env, "capped", rev2, 1.0, max_error_rate=None, max_concurrent_requests=1)
    state, eng = env.state, env.state.engine
    results: dict[str, httpx.Response] = {}

    def run(name: str) -> None:
        results[name] = env.complete("capped")

    with StepGate(eng) as gate:
        gate.hold()
        first = threading.Thread(target=run, args=("first",))
        first.start()
        wait_until(lambda: eng.num_waiting == 1, what="the canary call in the engine")
        second = threading.Thread(target=run, args=("second",))
        second.start()
        wait_until(lambda: eng.num_waiting == 2, what="the second call in the engine")
        gate.open()
        first.join()
        second.join()
    assert route_of(results["first"]) == "canary" and route_of(results["second"]) == "active"
    assert route_of(env.complete("capped")) == "canary"
    wait_idle(eng, state.aengine)


def test_two_replicas_judging_one_canary_roll_it_back_once(env: Env, tmp_path: Path) -> None:
    """A second replica on the same registry: both judge the canary on their own feedback; the
    breach on each replica (the last scores sent to both at once) stops the canary exactly once
    (one audit entry, one rollback counted over both replicas), the active revision untouched,
    and neither replica serves the canary afterwards."""
    rev1, rev2 = release(env, "twin")
    start_canary(env, "twin", rev2, 0.5, window_s=600, min_requests=3, max_error_rate=None,
                 min_quality=0.5)  # fmt: skip
    config = dataclasses.replace(env.state.config, log_level="warning")
    other = create_app(config, registry=env.registry)
    with serve_in_thread(other) as url2:
        replicas = [env.url, url2]
        sample = 'loraplex_canary_rollbacks_total{reason="quality"}'
        before = [metric_at(u, sample) for u in replicas]

        def score(url: str) -> httpx.Response:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"},
                              timeout=120) as h:  # fmt: skip
                return h.post("/v1/adapters/twin/feedback", json={"revision": rev2, "score": 0.0})

        for url in replicas:
            wait_until(lambda url=url: score_ok(score(url)), what=f"{url} sees the canary")
            assert score(url).json()["recorded"] is True  # two scores each: below min_requests
        last: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=lambda u=u: last.update({u: score(u)}))
                   for u in replicas]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r.status_code == 200 for r in last.values())
        wait_until(lambda: env.registry.release("twin").canary_revision is None,
                   what="the rollback")  # fmt: skip
        for state in (env.state, other.state.loraplex):
            wait_until(lambda state=state: "twin" in state.catalog.servables()
                       and state.catalog.servables()["twin"].canary is None,
                       what="each replica's catalog without the canary")  # fmt: skip
        rollbacks = [e for e in env.registry.audit_log(target="twin") if e.action == "rollback"]
        assert len(rollbacks) == 1 and rollbacks[0].actor == HEALTH_ACTOR
        rel = env.registry.release("twin")
        assert rel.active_revision == rev1 and env.registry.get("twin", rev1).status == "active"
        after = [metric_at(u, sample) for u in replicas]
        assert sum(after) - sum(before) == 1
        for url in replicas:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"},
                              timeout=120) as h:  # fmt: skip
                for _ in range(6):
                    r = h.post("/v1/completions", json={"model": "twin", "prompt": "Hi",
                                                        "max_tokens": 1})  # fmt: skip
                    assert r.status_code == 200 and route_of(r) == "active"


def score_ok(r: httpx.Response) -> bool:
    """A feedback answer that was counted (the replica's catalog has the canary)."""
    assert r.status_code == 200, r.text
    return bool(r.json()["recorded"])


def metric_at(url: str, sample: str) -> float:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as h:
        text = h.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0
