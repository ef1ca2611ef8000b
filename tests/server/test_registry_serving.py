"""The server on the adapter registry, against SQLite and PostgreSQL: hot swaps never serve old
weights or old KV, canary splits and instant rollback, tenant isolation (404, not 403), scoped
admin keys, refused sources, tampered files and bad signatures, per-tenant limits, delayed
eviction of replaced revisions, and the audit trail of every action."""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from loraplex.config import EngineConfig, ServerConfig
from loraplex.registry import Registry, RegistryPolicy, base_model_info
from loraplex.registry.signing import generate_keypair, sign
from loraplex.server.app import ServerState, create_app
from loraplex.server.limits import TenantLimits
from loraplex.testing import ALL_PROJ, load_merged_reference, make_random_adapter, reference_greedy
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import StepGate, wait_idle, wait_until
from tests.pg import pg_url_or_skip

ADMIN = "sk-admin-registry"
BASE = "tiny"
# long enough to fill prefix-cache blocks (16 tokens each)
PROMPT = "The quick brown fox jumps over the lazy dog while the registry swaps revisions. " * 2


@dataclass
class Env:
    url: str
    state: ServerState
    registry: Registry
    root: Path
    model: Path
    keys: dict[str, str]  # tenant -> inference key

    def http(self, key: str | None = ADMIN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def admin(self, method: str, route: str, **body: Any) -> httpx.Response:
        with self.http() as h:
            return h.request(method, route, json=body if method == "POST" else None)

    def complete(self, model: str, key: str | None = ADMIN, **kw: Any) -> httpx.Response:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, **kw}  # fmt: skip
        with self.http(key) as h:
            return h.post("/v1/completions", json=body)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def env(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp(f"registry-{request.param}")
    url = f"sqlite:///{tmp / 'registry.db'}" if request.param == "sqlite" else pg_url_or_skip()
    root = tmp / "allowed"
    root.mkdir()
    registry = Registry.open(url, policy=RegistryPolicy(allowed_roots=(str(root),)))
    base = base_model_info(tiny_model, name=BASE)
    adapters = {
        name: make_random_adapter(
            tiny_model, root / name, r=8, lora_alpha=16, target_modules=ALL_PROJ, seed=seed
        )
        for name, seed in [("x1", 21), ("x2", 22), ("a_only", 23), ("b_only", 24), ("shared", 25)]
    }
    keys = {}
    for tenant, limits in [("acme", {}), ("bravo", {"rate_limit_rps": 1.0})]:
        registry.create_tenant(tenant, actor="test", **limits)
        keys[tenant] = registry.create_key(tenant, actor="test")[1]
    for name, tenant in [("a_only", "acme"), ("b_only", "bravo"), ("shared", None)]:
        m = registry.register(adapters[name], name, base=base, tenant=tenant, actor="test")
        registry.promote(name, m.revision, actor="test")
    config = ServerConfig(
        EngineConfig(
            model=str(tiny_model), max_loras=2, max_cpu_loras=4, max_num_seqs=4, num_threads=1
        ),
        served_model_name=[BASE],
        admin_api_key=ADMIN,
        allowed_lora_roots=[str(root)],
        registry_poll_s=0.1,
        swap_eviction_delay_s=0.3,
        log_level="warning",
    )
    app = create_app(config, registry=registry)
    try:
        with serve_in_thread(app) as server_url:
            yield Env(server_url, app.state.loraplex, registry, root, tiny_model, keys)
    finally:
        registry.close()


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model))


def reference_text(env: Env, tok: Any, adapter: Path, n: int = 6) -> str:
    ref = load_merged_reference(env.model, adapter)
    ids, _ = reference_greedy(ref, tok(PROMPT).input_ids, n)
    return tok.decode(ids, skip_special_tokens=True)


def revision_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    fields = dict(f.split("=", 1) for f in r.headers["x-loraplex-adapter"].split(";")[1:])
    return fields["revision"]


def register(env: Env, name: str, path: Path, **kw: Any) -> dict[str, Any]:
    r = env.admin("POST", "/v1/admin/adapters", name=name, path=str(path), **kw)
    assert r.status_code == 200, r.text
    return r.json()


def test_hot_swap_serves_new_weights_and_queued_requests_finish_on_old(env: Env, tok: Any) -> None:
    """x rev 1 fills the prefix cache for PROMPT; rev 2 (other weights) is promoted while a
    rev-1 request waits in the queue: that request ends on rev 1, the next one on rev 2 — equal
    to rev 2's merged reference, with no KV reused from rev 1."""
    x1, x2 = env.root / "x1", env.root / "x2"
    want1, want2 = reference_text(env, tok, x1), reference_text(env, tok, x2)
    assert want1 != want2
    rev1 = register(env, "swap", x1, activate=True)["revision"]
    r = env.complete("swap")
    assert revision_of(r) == rev1 and r.json()["choices"][0]["text"] == want1
    r = env.complete("swap")  # the prefix cache now holds PROMPT's blocks under rev 1
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    # queue a rev-1 request and hold the engine loop before it can run: it has resolved rev 1
    # and waits in the scheduler's queue while rev 2 is promoted
    results: dict[str, httpx.Response] = {}

    def run(key: str, model: str, **kw: Any) -> None:
        results[key] = env.complete(model, **kw)

    with StepGate(env.state.engine) as gate:
        gate.hold()
        queued = threading.Thread(target=run, args=("queued", "swap"))
        queued.start()
        gate.wait_held()
        assert env.state.engine.num_waiting == 1
        rev2 = register(env, "swap", x2, activate=True)["revision"]
        assert rev2 != rev1
        gate.open()
        queued.join()
    assert revision_of(results["queued"]) == rev1
    assert results["queued"].json()["choices"][0]["text"] == want1

    r = env.complete("swap")
    assert revision_of(r) == rev2
    assert r.json()["choices"][0]["text"] == want2
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no rev-1 KV
    assert r.headers["x-loraplex-adapter"].endswith(
        f"sha256={env.registry.get('swap').sha256[:16]}"
    )
    wait_idle(env.state.engine)


def test_replaced_revision_is_evicted_after_the_delay(env: Env) -> None:
    """After a promote, the old revision's copies leave memory once the swap delay is over."""
    mgr = env.state.engine.adapters
    own = make_random_adapter(  # weights no other test serves, so no other name keeps them
        env.model, env.root / "evictme-v1", r=4, lora_alpha=8, target_modules=ALL_PROJ, seed=31
    )
    old = register(env, "evictme", own, activate=True)
    assert env.complete("evictme").status_code == 200
    assert mgr.tier_of(old["sha256"]) is not None
    register(env, "evictme", env.root / "a_only", activate=True)
    wait_until(lambda: mgr.tier_of(old["sha256"]) is None, what="the replaced revision's eviction")
    mgr.check_invariants()


def test_canary_split_and_instant_rollback(env: Env) -> None:
    """10% canary: the split over many requests is within 4 sigma; rollback sends every
    following request to rev 1 at once."""
    rev1 = register(env, "canary", env.root / "x1", activate=True)["revision"]
    rev2 = register(env, "canary", env.root / "x2")["revision"]
    r = env.admin("POST", "/v1/admin/adapters/canary/canary", revision=rev2, weight=0.1)
    assert r.status_code == 200, r.text
    n = 300
    routes: Counter[str] = Counter()
    with env.http() as h:
        for _ in range(n):
            r = h.post("/v1/completions", json={"model": "canary", "prompt": "a", "max_tokens": 1})
            rev = revision_of(r)
            routes[rev] += 1
            assert r.headers["x-loraplex-adapter-route"] == ("canary" if rev == rev2 else "active")
    sigma = (n * 0.1 * 0.9) ** 0.5
    assert abs(routes[rev2] - n * 0.1) <= 4 * sigma, routes
    r = env.admin("POST", "/v1/admin/adapters/canary/rollback")
    assert r.status_code == 200, r.text
    with env.http() as h:
        for _ in range(20):
            r = h.post("/v1/completions", json={"model": "canary", "prompt": "a", "max_tokens": 1})
            assert revision_of(r) == rev1


def test_promote_then_rollback_restores_rev1(env: Env, tok: Any) -> None:
    rev1 = register(env, "rb", env.root / "x1", activate=True)["revision"]
    register(env, "rb", env.root / "x2", activate=True)
    r = env.admin("POST", "/v1/admin/adapters/rb/rollback")
    assert r.status_code == 200 and r.json()["active_revision"] == rev1
    r = env.complete("rb")
    assert revision_of(r) == rev1
    assert r.json()["choices"][0]["text"] == reference_text(env, tok, env.root / "x1")


def test_tenant_sees_and_runs_only_its_own_and_shared_adapters(env: Env) -> None:
    ka, kb = env.keys["acme"], env.keys["bravo"]
    with env.http(ka) as h:
        ids = {m["id"] for m in h.get("/v1/models").json()["data"]}
        assert {"a_only", "shared", BASE} <= ids and "b_only" not in ids
        names = {row["name"] for row in h.get("/v1/adapters").json()["data"]}
        assert "b_only" not in names and "a_only" in names
    other = env.complete("b_only", key=ka)
    missing = env.complete("no_such_adapter", key=ka)
    assert other.status_code == missing.status_code == 404
    assert other.json()["error"]["code"] == missing.json()["error"]["code"] == "model_not_found"
    assert env.complete("a_only", key=ka).status_code == 200
    assert env.complete("shared", key=ka).status_code == 200
    assert env.complete("a_only", key=kb).status_code == 404
    assert env.complete("a_only", key="lpx-not-a-key").status_code == 401
    assert env.complete("a_only", key=None).status_code == 401
    with env.http(ka) as h:  # an inference key is not an admin key
        r = h.post("/v1/admin/adapters/a_only/rollback")
        assert r.status_code == 403


def test_tenant_rate_limit_is_429_with_retry_after(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 req/s tenant: the second request in the same instant is refused, one second later
    the bucket has refilled (the limiter runs on a test clock, not on the machine's speed)."""
    now = [1000.0]
    monkeypatch.setattr(env.state, "limits", TenantLimits(clock=lambda: now[0]))
    kb = env.keys["bravo"]
    assert env.complete("b_only", key=kb, max_tokens=1).status_code == 200
    r = env.complete("b_only", key=kb, max_tokens=1)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    now[0] += 1.0
    assert env.complete("b_only", key=kb, max_tokens=1).status_code == 200
    assert env.complete("b_only", key=kb, max_tokens=1).status_code == 429


def test_scoped_admin_keys(env: Env) -> None:
    _, pin_only = env.registry.create_key(None, scopes=("admin:pin",), actor="test")
    with env.http(pin_only) as h:
        assert h.post("/v1/pin_lora_adapter", json={"lora_name": "shared"}).status_code == 200
        assert h.post("/v1/unpin_lora_adapter", json={"lora_name": "shared"}).status_code == 200
        r = h.post("/v1/admin/adapters/shared/rollback")
        assert r.status_code == 403 and "admin:promote" in r.json()["error"]["message"]
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "q", "lora_path": str(env.root)})
        assert r.status_code == 403
    audit = env.admin("GET", "/v1/admin/audit?target=shared").json()["data"]
    assert [e["action"] for e in audit[:2]] == ["unpin", "pin"]
    key_ids = {e["actor"] for e in audit[:2]}
    assert len(key_ids) == 1 and key_ids != {"admin-api-key"}


def test_sources_outside_the_roots_are_refused(env: Env, tmp_path: Path) -> None:
    outside = make_random_adapter(env.model, tmp_path / "outside", r=4, seed=31)
    link = env.root / "link_out"
    link.symlink_to(outside, target_is_directory=True)
    cases = [
        (str(outside), "source_not_allowed"),
        (str(env.root / ".." / "outside"), None),
        (str(link), "source_not_allowed"),
    ]
    for path, code in cases:
        r = env.admin("POST", "/v1/admin/adapters", name="evil", path=path)
        assert r.status_code == 400, (path, r.text)
        if code is not None:
            assert r.json()["error"]["code"] == code
    r = env.admin("POST", "/v1/load_lora_adapter", lora_name="evil", lora_path=str(outside))
    assert r.status_code == 400
    assert env.complete("evil").status_code == 404
    # a request can never name a path
    assert env.complete(str(env.root / "x1")).status_code == 404


def test_tampered_files_are_refused_and_the_server_keeps_serving(env: Env) -> None:
    src = env.root / "tamper"
    shutil.copytree(env.root / "x1", src)
    m = register(env, "tamper", src, activate=True)
    assert env.complete("tamper").status_code == 200
    wait_idle(env.state.engine)
    env.state.engine.adapters.evict(m["sha256"])
    weights = src / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0xFF  # one flipped byte in the last tensor
    weights.write_bytes(bytes(raw))
    r = env.complete("tamper")
    assert r.status_code == 500 and r.json()["error"]["code"] == "adapter_integrity_error"
    assert "not the registered" in r.json()["error"]["message"]
    assert env.complete(BASE).status_code == 200
    assert env.complete("shared").status_code == 200
    wait_idle(env.state.engine)


def test_bad_and_missing_signatures_are_refused(env: Env, tiny_model: Path) -> None:
    """A registry that requires signatures takes only manifests signed by a trusted key."""
    private, public = generate_keypair()
    other_private, _ = generate_keypair()
    strict = Registry.open(
        env.registry.url,
        policy=RegistryPolicy(
            require_signatures=True, trusted_keys=(public,), allowed_roots=(str(env.root),)
        ),
    )
    try:
        base = env.state.base
        draft, _ = strict.prepare(env.root / "x2", "signed", base=base)
        payload = draft.signed_payload()
        for signature, reason in [
            (None, "unsigned"),
            (sign(payload, other_private), "bad_signature"),
            (sign(payload + b" ", private), "bad_signature"),
        ]:
            with pytest.raises(Exception) as e:
                strict.register(env.root / "x2", "signed", base=base, signature=signature,
                                actor="test")  # fmt: skip
            assert getattr(e.value, "reason", None) == reason
        m = strict.register(env.root / "x2", "signed", base=base, signature=sign(payload, private),
                            actor="test")  # fmt: skip
        assert m.signed_by
        strict.promote("signed", m.revision, actor="test")
    finally:
        strict.close()
    # the server sees the change within its poll interval
    wait_until(lambda: env.complete("signed").status_code == 200, what="'signed' to be served")


def test_audit_records_every_registry_and_admin_action(env: Env) -> None:
    register(env, "audited", env.root / "x1", activate=True)
    env.admin("POST", "/v1/pin_lora_adapter", lora_name="audited")
    env.admin("POST", "/v1/unpin_lora_adapter", lora_name="audited")
    env.admin("POST", "/v1/admin/adapters/audited/disable")
    r = env.admin("GET", "/v1/admin/audit?target=audited&limit=50")
    entries = r.json()["data"]
    actions = [e["action"] for e in reversed(entries)]
    for want in ["register", "promote", "pin", "unpin"]:
        assert want in actions, actions
    assert any(e.action == "disable" for e in env.registry.audit_log(limit=50))
    promote = next(e for e in entries if e["action"] == "promote")
    assert promote["actor"] == "admin-api-key" and promote["after"]["active_revision"]
    assert env.complete("audited").status_code == 404  # disabled: no longer served


def test_usage_log_records_the_revision(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    import json

    m = register(env, "usage", env.root / "x1", activate=True)
    with caplog.at_level("INFO", logger="loraplex.usage"):
        assert env.complete("usage", key=env.keys["acme"]).status_code == 200
        wait_until(
            lambda: any(r.name == "loraplex.usage" for r in caplog.records), what="a usage line"
        )
    rec = json.loads(next(r for r in caplog.records if r.name == "loraplex.usage").getMessage())
    assert rec["adapter"] == "usage" and rec["revision"] == m["revision"]
    assert rec["sha256"] == m["sha256"] and rec["tenant"] == "acme" and rec["route"] == "active"
    assert rec["completion_tokens"] == 6 and rec["prompt_tokens"] > 0


def test_cli_registered_adapters_and_keys_are_served(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The operator's flow: ``loraplex adapters register --activate`` and ``loraplex tenants``
    into a registry file, then a server on ``--registry-url`` serves them to the tenant's key."""
    import contextlib
    import io
    import json

    from loraplex.cli import main

    url = f"sqlite:///{tmp_path / 'reg.db'}"
    adapter = make_random_adapter(tiny_model, tmp_path / "roots" / "sql", r=4, seed=41)

    def cli(*args: str) -> Any:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([*args, "--registry-url", url, "--json"]) == 0
        return json.loads(out.getvalue())

    cli("tenants", "create", "acme")
    cli("adapters", "register", "sql", str(adapter), "--base-model", str(tiny_model),
        "--tenant", "acme", "--allowed-root", str(tmp_path / "roots"), "--activate")  # fmt: skip
    key = cli("tenants", "keys", "create", "--tenant", "acme")["secret"]
    config = ServerConfig(
        EngineConfig(model=str(tiny_model), max_loras=2, num_threads=1),
        served_model_name=[BASE],
        registry_url=url,
        log_level="warning",
    )
    with serve_in_thread(create_app(config)) as server_url:
        with httpx.Client(base_url=server_url, timeout=60) as h:
            auth = {"Authorization": f"Bearer {key}"}
            assert h.get("/v1/models").status_code == 401  # tenant keys exist: auth is on
            ids = [m["id"] for m in h.get("/v1/models", headers=auth).json()["data"]]
            assert ids == [BASE, "sql"]
            body = {"model": "sql", "prompt": "hi", "max_tokens": 3}
            r = h.post("/v1/completions", json=body, headers=auth)
            assert r.status_code == 200 and revision_of(r) == "r1"
            # a revision registered by the CLI while the server runs is picked up
            cli("adapters", "register", "sql", str(adapters["all_r8"]),
                "--base-model", str(tiny_model), "--tenant", "acme", "--allow-any-source",
                "--activate")  # fmt: skip
            wait_until(
                lambda: revision_of(h.post("/v1/completions", json=body, headers=auth)) == "r2",
                interval=0.1,
                what="revision r2 to be served",
            )


def test_vllm_load_unload_load_again(env: Env) -> None:
    """vLLM's load, unload, then load of the same files re-enables the same revision."""
    path = str(env.root / "x2")
    for _ in range(2):
        r = env.admin("POST", "/v1/load_lora_adapter", lora_name="again", lora_path=path)
        assert r.status_code == 200, r.text
        assert env.complete("again").status_code == 200
        r = env.admin("POST", "/v1/unload_lora_adapter", lora_name="again")
        assert r.status_code == 200, r.text
        assert env.complete("again").status_code == 404
    revisions = {m.revision for m in env.registry.list() if m.name == "again"}
    assert revisions == {"r1"}
