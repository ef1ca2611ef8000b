"""``POST /v1/admin/adapters/{name}/push``: a pushed adapter is served exactly (PEFT with the
revision the response names), swaps atomically, persists to disk when asked, is pruned past
``--max-pushed-revisions``, is audited, and every bad push is refused with the right status
and changes nothing."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save
from transformers import AutoTokenizer

from loraplex.config import EngineConfig, ServerConfig
from loraplex.registry import Registry
from loraplex.server.app import ServerState, create_app
from loraplex.testing import ALL_PROJ, make_random_adapter, reference_greedy
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import StepGate, wait_idle, wait_until
from tests.engine.push_cases import PeftReference, read_peft_dir, revision_tensors

ADMIN = "sk-admin-push"
BASE = "tiny"
PROMPT = "The trainer pushes a new revision every few seconds."
CAP = 1 << 20  # --max-adapter-push-bytes of this server


@dataclass
class Env:
    url: str
    state: ServerState
    registry: Registry
    base: dict[str, torch.Tensor]
    config: dict[str, Any]
    ref: PeftReference
    tok: Any
    inference_key: str

    def client(self, key: str | None = ADMIN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def push(
        self,
        name: str,
        tensors: dict[str, torch.Tensor],
        config: dict[str, Any] | None = None,
        *,
        revision: str | None = None,
        persist: str | None = None,
        key: str | None = ADMIN,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> httpx.Response:
        data = save(tensors) if body is None else body
        cfg = json.dumps(config if config is not None else self.config).encode()
        h = {
            "Content-Type": "application/octet-stream",
            "X-Loraplex-Adapter-Config": base64.b64encode(cfg).decode(),
            "X-Loraplex-Body-SHA256": hashlib.sha256(data).hexdigest(),
        }
        if revision is not None:
            h["X-Loraplex-Revision"] = revision
        h.update(headers or {})
        params = {"persist": persist} if persist else None
        with self.client(key) as c:
            return c.post(f"/v1/admin/adapters/{name}/push", content=data, headers=h,
                          params=params)  # fmt: skip

    def complete(self, model: str) -> httpx.Response:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        with self.client() as c:
            return c.post("/v1/completions", json=body)

    def active(self, name: str) -> str | None:
        with self.client() as c:
            r = c.get(f"/v1/admin/adapters/{name}")
        return r.json()["release"]["active_revision"] if r.status_code == 200 else None

    def expected_text(self, tensors: dict[str, torch.Tensor]) -> str:
        ids, _ = reference_greedy(self.ref.use(tensors), self.tok(PROMPT).input_ids, 5)
        return self.tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("push-server")
    adapter = make_random_adapter(tiny_model, tmp / "a", r=8, target_modules=ALL_PROJ, seed=7)
    registry = Registry.open(f"sqlite:///{tmp / 'registry.db'}")
    inference_key = registry.create_key(None, actor="test")[1]
    config = ServerConfig(
        EngineConfig(
            model=str(tiny_model),
            max_loras=2,
            max_cpu_loras=4,
            max_num_seqs=4,
            num_threads=1,
            disk_cache_dir=str(tmp / "disk"),
            disk_cache_bytes=1 << 26,
        ),
        served_model_name=[BASE],
        admin_api_key=ADMIN,
        registry_poll_s=0.1,
        max_adapter_push_bytes=CAP,
        max_pushed_revisions=3,
        log_level="warning",
    )
    app = create_app(config, registry=registry)
    base, cfg = read_peft_dir(adapter)
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    try:
        with serve_in_thread(app) as url:
            yield Env(url, app.state.loraplex, registry, base, cfg,
                      PeftReference(tiny_model, adapter), tok, inference_key)  # fmt: skip
    finally:
        registry.close()


def served_revision(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    fields = dict(f.split("=", 1) for f in r.headers["x-loraplex-adapter"].split(";")[1:])
    return fields["revision"]


def test_push_serves_each_revision_exactly_and_swaps(env: Env) -> None:
    t1, t2 = revision_tensors(env.base, 1), revision_tensors(env.base, 2)
    r = env.push("live", t1, revision="step-1")
    assert r.status_code == 201, r.text
    first = r.json()
    assert first["object"] == "adapter.revision" and first["revision"] == "step-1"
    assert first["previous_revision"] is None and first["persisted"] == ["host"]
    out = env.complete("live")
    assert served_revision(out) == "step-1"
    assert out.json()["choices"][0]["text"] == env.expected_text(t1)
    r = env.push("live", t2, revision="step-2", persist="disk")
    assert r.status_code == 201, r.text
    second = r.json()
    assert second["previous_revision"] == "step-1" and second["persisted"] == ["host", "disk"]
    assert second["sha256"] != first["sha256"]
    out = env.complete("live")
    assert served_revision(out) == "step-2"
    assert out.json()["choices"][0]["text"] == env.expected_text(t2)
    assert env.state.client.has_copy(second["sha256"])
    # the same bytes under the same label again: idempotent, still step-2
    again = env.push("live", t2, revision="step-2")
    assert again.status_code == 201 and again.json()["sha256"] == second["sha256"]
    # the replaced revision leaves host memory once no request holds it (no swap delay)
    state = env.state
    wait_until(lambda: state.client.tier_of(first["sha256"]) is None, what="step-1 retired")
    with env.client() as c:
        audit = c.get("/v1/admin/audit", params={"target": "live"}).json()["data"]
    assert {"live@step-1", "live@step-2"} <= {e["target"] for e in audit if e["action"] == "push"}


def test_pushes_are_pruned_past_the_bound(env: Env) -> None:
    for step in range(10, 15):
        r = env.push("pruned", revision_tensors(env.base, step), revision=f"s{step}")
        assert r.status_code == 201, r.text
    revs = [m.revision for m in env.registry.list() if m.name == "pruned"]
    assert revs == ["s12", "s13", "s14"]
    assert env.active("pruned") == "s14"
    with env.client() as c:
        audit = c.get("/v1/admin/audit", params={"target": "pruned@s10"}).json()["data"]
    assert [e["action"] for e in audit if e["action"] == "prune"] == ["prune"]


def _bad_cases(env: Env) -> list[tuple[str, dict[str, Any], int, str]]:
    t = revision_tensors(env.base, 3)
    a_key = next(k for k in t if "lora_A" in k)
    b_key = next(k for k in t if "lora_B" in k)
    cfg_b64 = {"X-Loraplex-Adapter-Config": "not base64!"}
    return [
        ("bad base64", {"tensors": t, "headers": cfg_b64}, 400, "base64"),
        ("not JSON", {"tensors": t, "headers": {
            "X-Loraplex-Adapter-Config": base64.b64encode(b"{nope").decode()}}, 400, "JSON"),
        ("digest mismatch", {"tensors": t, "headers": {"X-Loraplex-Body-SHA256": "0" * 64}},
         400, "sha256"),
        ("no digest", {"tensors": t, "headers": {"X-Loraplex-Body-SHA256": "xyz"}}, 400,
         "sha256"),
        ("wrong shape", {"tensors": {**t, a_key: torch.zeros(8, 65)}}, 400, "shape|65"),
        ("wrong dtype", {"tensors": {**t, b_key: t[b_key].to(torch.int32)}}, 400, "float|dtype"),
        ("non-PEFT key", {"tensors": {**t, "model.embed.weight": torch.zeros(2, 2)}}, 400,
         "not a LoRA A/B weight"),
        ("bad config", {"tensors": t, "config": {**env.config, "r": -1}}, 400, "r"),
        ("corrupt body", {"tensors": t, "body": b"\x10\x00\x00\x00\x00\x00\x00\x00{"}, 400,
         "corrupt safetensors"),
        ("label taken", {"tensors": t, "revision": "step-1"}, 409, "already has a revision"),
        ("too large", {"tensors": t, "body": b"\0" * (CAP + 1)}, 413, "max-adapter-push-bytes"),
        ("no key", {"tensors": t, "key": None}, 401, "API key"),
        ("inference key", {"tensors": t, "key": env.inference_key}, 403, "admin:load"),
        ("persist elsewhere", {"tensors": t, "persist": "s3"}, 400, "persist"),
    ]  # fmt: skip


def test_bad_pushes_are_refused_and_change_nothing(env: Env) -> None:
    r = env.push("live", revision_tensors(env.base, 1), revision="step-1")
    assert r.status_code == 201, r.text
    before = (env.active("live"), len(env.registry.list()))
    for what, kw, status, needle in _bad_cases(env):
        r = env.push("live", **kw)
        assert r.status_code == status, (what, r.text)
        err = r.json()["error"]
        assert re.search(needle, err["message"]), (what, err)
        assert (env.active("live"), len(env.registry.list())) == before, what
    # a chunked body (no Content-Length) is cut off at the bound while it streams in
    with env.client() as c:
        chunks = (b"\0" * (64 << 10) for _ in range(CAP // (64 << 10) + 1))
        r = c.post("/v1/admin/adapters/live/push", content=chunks, headers={
            "Content-Type": "application/octet-stream", "X-Loraplex-Body-SHA256": "0" * 64,
            "X-Loraplex-Adapter-Config": base64.b64encode(b"{}").decode()})  # fmt: skip
    assert r.status_code == 413 and "max-adapter-push-bytes" in r.text, r.text
    # a config header over 64 KiB decoded is refused before it is decoded
    big = {"X-Loraplex-Adapter-Config": "A" * (90 << 10)}
    r = env.push("live", revision_tensors(env.base, 4), headers=big)
    assert r.status_code == 400 and "65536 bytes" in r.text, r.text
    assert env.active("live") == before[0]


def test_admitted_requests_finish_on_their_revision(env: Env) -> None:
    """A request admitted on revision A waits in the held engine while B is pushed: it ends on
    A (A's text, A named), A's host copy stays until it ends and then goes; the next request
    gets B with no KV of A reused."""
    ta, tb = revision_tensors(env.base, 30), revision_tensors(env.base, 31)
    a = env.push("held", ta, revision="A").json()
    assert served_revision(env.complete("held")) == "A"  # A's prompt blocks now cached
    results: dict[str, httpx.Response] = {}
    engine = env.state.engine
    with StepGate(engine) as gate:
        gate.hold()
        queued = threading.Thread(target=lambda: results.update(q=env.complete("held")))
        queued.start()
        gate.wait_held()
        wait_until(lambda: engine.num_waiting == 1, what="the A request queued")
        b = env.push("held", tb, revision="B")
        assert b.status_code == 201 and b.json()["previous_revision"] == "A"
        assert a["sha256"] not in env.state.retire_due()  # due now, but a request holds it
        assert env.state.client.tier_of(a["sha256"]) is not None
        gate.open()
        queued.join()
    assert served_revision(results["q"]) == "A"
    assert results["q"].json()["choices"][0]["text"] == env.expected_text(ta)
    r = env.complete("held")
    assert served_revision(r) == "B"
    assert r.json()["choices"][0]["text"] == env.expected_text(tb)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no KV of A
    wait_until(lambda: env.state.client.tier_of(a["sha256"]) is None, what="A retired")
    wait_idle(engine)
