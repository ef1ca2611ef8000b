"""``loraplex route`` fans an adapter push out to its replicas and answers 201 only when every
target took it with one digest; otherwise it names which replica did not and why.

The replicas here are :class:`~tests.router.push_double.PushReplicaDouble` (a test double of a
remote replica implementing the push route's contract) on loopback, behind the real router;
``test_push_reaches_real_replicas`` pushes through the router to two real loraplex servers.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.client import SHA256_HEADER, PushError, encode_adapter, push_adapter, push_headers
from loraplex.router.app import RouterConfig, create_router_app
from loraplex.router.replicas import Replica
from loraplex.testing import reference_greedy
from loraplex.testing.server import free_port, serve_in_thread
from loraplex.testing.sync import wait_until
from tests.router.push_double import (
    LORA_CONFIG,
    PROMPT,
    PushReplicaDouble,
    greedy_tokens,
    lora_tensors,
    peft_trainee,
    reseed,
    served_revision,
)

ADMIN = "sk-admin-push-5e1d"
STATUS = "sk-router-status-push"


def _view(router: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{router}/v1/replicas", headers={"Authorization": f"Bearer {STATUS}"})
    assert r.status_code == 200, r.text
    return {v["url"]: v for v in r.json()["data"]}


@contextlib.contextmanager
def _fleet(
    *doubles: PushReplicaDouble, extra: tuple[str, ...] = (), **kw: Any
) -> Iterator[tuple[str, list[str]]]:
    """The doubles on loopback behind a router that has polled them once: (router, urls)."""
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(d.app())) for d in doubles]
        kw.setdefault("push_api_key", ADMIN)
        config = RouterConfig(
            replicas=[*urls, *extra], poll_interval_s=3600.0, status_api_key=STATUS,
            read_timeout_s=60.0, **kw,
        )  # fmt: skip
        router = stack.enter_context(serve_in_thread(create_router_app(config)))
        wait_until(
            lambda: all(_view(router)[u]["kind"] == "loraplex" for u in urls),
            what="the router's first poll",
        )
        yield router, urls


def test_a_push_reaches_every_replica_and_the_view_knows_its_revision() -> None:
    a, b = PushReplicaDouble(ADMIN), PushReplicaDouble(ADMIN)
    with _fleet(a, b) as (router, urls):
        answer = push_adapter(
            router, "trainee", lora_tensors(1), config=LORA_CONFIG, api_key=ADMIN, revision="step-1",
            persist=True,
        )  # fmt: skip
        assert answer["object"] == "adapter.revision" and answer["revision"] == "step-1"
        assert [r["url"] for r in answer["replicas"]] == sorted(urls)
        assert {r["status"] for r in answer["replicas"]} == {201}
        assert {r["sha256"] for r in answer["replicas"]} == {answer["sha256"]}
        # every replica got the same bytes, the config, the label, the key and persist=disk
        body, _ = encode_adapter(lora_tensors(1), LORA_CONFIG)
        for d in (a, b):
            (p,) = d.pushes
            assert (p.name, p.revision, p.body, p.persist) == ("trainee", "step-1", body, True)
            assert p.config == LORA_CONFIG and p.authorization == f"Bearer {ADMIN}"
        view = _view(router)
        for u in urls:
            assert view[u]["revisions"]["trainee"] == "step-1"
            assert view[u]["tiers"]["trainee"] == "host"
        # the next revision replaces it on both
        push_adapter(
            router, "trainee", lora_tensors(2), config=LORA_CONFIG, api_key=ADMIN, revision="step-2"
        )
        assert [d.active["trainee"] for d in (a, b)] == ["step-2", "step-2"]
        assert {v["revisions"]["trainee"] for v in _view(router).values()} == {"step-2"}


def test_a_replica_that_refuses_is_named_and_the_push_is_502() -> None:
    good, bad = PushReplicaDouble(ADMIN), PushReplicaDouble(ADMIN, mode="refuse")
    with _fleet(good, bad) as (router, urls):
        with pytest.raises(PushError) as e:
            push_adapter(router, "trainee", lora_tensors(1), config=LORA_CONFIG, api_key=ADMIN)
        assert e.value.status == 502 and e.value.code == "push_incomplete"
        bad_url = urls[1]
        assert f"{bad_url}: 409" in e.value.message and "being rolled back" in e.value.message
        rows = {r["url"]: r for r in e.value.body["replicas"]}
        assert rows[urls[0]]["status"] == 201 and rows[bad_url]["status"] == 409
        view = _view(router)  # only the replica that took it has the revision in the view
        assert "trainee" in view[urls[0]]["revisions"]
        assert "trainee" not in view[bad_url]["revisions"]


def test_an_unreachable_replica_makes_the_push_incomplete() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with _fleet(PushReplicaDouble(ADMIN), extra=(dead,)) as (router, _):
        with pytest.raises(PushError) as e:
            push_adapter(router, "trainee", lora_tensors(1), config=LORA_CONFIG, api_key=ADMIN)
        assert e.value.status == 502
        assert f"{dead}: no answer ConnectError" in e.value.message


def test_different_digests_are_502_push_diverged() -> None:
    with _fleet(PushReplicaDouble(ADMIN), PushReplicaDouble(ADMIN, mode="diverge")) as (r, _):
        with pytest.raises(PushError) as e:
            push_adapter(r, "trainee", lora_tensors(1), config=LORA_CONFIG, api_key=ADMIN)
        assert e.value.status == 502 and e.value.code == "push_diverged"


def test_a_201_without_a_digest_is_not_success() -> None:
    with _fleet(PushReplicaDouble(ADMIN), PushReplicaDouble(ADMIN, mode="no_sha")) as (r, _):
        with pytest.raises(PushError) as e:
            push_adapter(r, "trainee", lora_tensors(1), config=LORA_CONFIG, api_key=ADMIN)
        assert e.value.status == 502 and "without a sha256" in e.value.message


def test_a_refusal_shared_by_every_replica_is_passed_through() -> None:
    """The router's push key is not the replicas' admin key: every replica refuses alike."""
    a, b = PushReplicaDouble("sk-replicas-only"), PushReplicaDouble("sk-replicas-only")
    with _fleet(a, b) as (router, _):
        with pytest.raises(PushError) as e:
            push_adapter(router, "trainee", lora_tensors(1), config=LORA_CONFIG, api_key=ADMIN)
        assert e.value.status == 401 and "invalid API key" in e.value.message
        assert a.pushes == b.pushes == []


def test_the_push_key_is_checked_before_the_body_is_read() -> None:
    """Fails closed: without --push-api-key the route is off (404); a missing or wrong key is
    the router's 401; neither reaches a replica, whatever the body's size."""
    a = PushReplicaDouble(ADMIN)
    with _fleet(a) as (router, _):
        url = f"{router}/v1/admin/adapters/trainee/push"
        for auth in ({}, {"Authorization": "Bearer sk-wrong"}):
            r = httpx.post(url, content=b"x" * 4096, headers=auth)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert a.pushes == []
    with _fleet(PushReplicaDouble(ADMIN), push_api_key=None) as (router, _):
        r = httpx.post(f"{router}/v1/admin/adapters/trainee/push", content=b"x",
                       headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
        assert r.status_code == 404 and r.json()["error"]["code"] == "push_api_disabled"


def test_a_digest_mismatch_or_an_oversized_body_never_leaves_the_router() -> None:
    a, b = PushReplicaDouble(ADMIN), PushReplicaDouble(ADMIN)
    body, config_json = encode_adapter(lora_tensors(1), LORA_CONFIG)
    with _fleet(a, b, max_push_bytes=len(body) + 16) as (router, _):
        url = f"{router}/v1/admin/adapters/trainee/push"
        headers = push_headers(body, config_json, api_key=ADMIN)
        tampered = body[:-1] + bytes([body[-1] ^ 1])
        r = httpx.post(url, content=tampered, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "digest_mismatch"
        assert hashlib.sha256(tampered).hexdigest() in r.json()["error"]["message"]
        r = httpx.post(url, content=body, headers={**headers, SHA256_HEADER: ""})
        assert r.status_code == 400 and SHA256_HEADER in r.json()["error"]["message"]
        big = body + b" " * 17
        r = httpx.post(url, content=big, headers=push_headers(big, config_json, api_key=ADMIN))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert a.pushes == b.pushes == []
        # the bound is inclusive: the body itself still goes through
        assert httpx.post(url, content=body, headers=headers).status_code == 201


def test_holders_targets_only_the_replicas_that_hold_the_name() -> None:
    holder, other = PushReplicaDouble(ADMIN, holds={"trainee"}), PushReplicaDouble(ADMIN)
    with _fleet(holder, other, push_targets="holders") as (router, urls):
        answer = push_adapter(router, "trainee", lora_tensors(1), config=LORA_CONFIG, api_key=ADMIN)
        assert [r["url"] for r in answer["replicas"]] == [urls[0]]
        assert len(holder.pushes) == 1 and other.pushes == []
        # a name no replica holds goes to every replica
        answer = push_adapter(router, "fresh", lora_tensors(2), config=LORA_CONFIG, api_key=ADMIN)
        assert len(answer["replicas"]) == 2 and len(other.pushes) == 1


def test_push_reaches_real_replicas(tiny_model: Path) -> None:
    """The fleet proof: two real loraplex servers behind the router; once a push returns, each
    replica serves the pushed revision (greedy tokens equal PEFT's with those weights), and a
    second push replaces it on both."""
    from loraplex.config import EngineConfig, ServerConfig
    from loraplex.server.app import create_app

    trainee = peft_trainee(tiny_model, seed=11)
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(2):
            config = ServerConfig(
                EngineConfig(model=str(tiny_model), enable_lora=True, max_loras=1,
                             max_cpu_loras=2, num_threads=1, max_num_seqs=4),
                served_model_name=["tiny"], admin_api_key=ADMIN, log_level="warning",
            )  # fmt: skip
            urls.append(stack.enter_context(serve_in_thread(create_app(config), timeout=120)))
        router_config = RouterConfig(replicas=urls, poll_interval_s=3600.0, read_timeout_s=120.0,
                                     status_api_key=STATUS, push_api_key=ADMIN)  # fmt: skip
        router = stack.enter_context(serve_in_thread(create_router_app(router_config)))
        for step in (1, 2):
            if step == 2:
                reseed(trainee, seed=12)
            answer = push_adapter(router, "trainee", trainee, api_key=ADMIN,
                                  revision=f"step-{step}")  # fmt: skip
            assert {r["status"] for r in answer["replicas"]} == {201}
            want, _ = reference_greedy(trainee, PROMPT, 6)
            for url in urls:
                tokens, headers = greedy_tokens(url, "trainee", ADMIN)
                assert tokens == want and served_revision(headers) == f"step-{step}", (url, step)
            assert {v["revisions"]["trainee"] for v in _view(router).values()} == {f"step-{step}"}


def test_a_push_outlives_a_poll_that_began_before_it() -> None:
    """A poll's answer older than a push does not undo it; a newer one replaces the view."""
    rep = Replica("http://r1", max_loras=1, max_cpu_loras=2)
    rep.apply_poll(0.0, {"trainee": "device", "other": "host"}, 1, None, 2, {"trainee": "step-1"})
    rep.note_pushed("trainee", "step-2", now=10.0)
    # the new revision is in host memory, not on the device the old one held
    assert (rep.tiers["trainee"], rep.revisions["trainee"]) == ("host", "step-2")
    assert "trainee" not in rep.device_lru
    rep.apply_poll(5.0, {"trainee": "device", "other": "host"}, 1, None, 2, {"trainee": "step-1"})
    assert (rep.tiers["trainee"], rep.revisions["trainee"]) == ("host", "step-2")
    rep.apply_poll(11.0, {"trainee": "device"}, 1, None, 2, {"trainee": "step-2"})
    assert (rep.tiers["trainee"], rep.revisions["trainee"]) == ("device", "step-2")
