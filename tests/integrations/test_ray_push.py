"""An adapter push through the Ray Serve ingress reaches every engine replica, on a real
two-node Ray cluster on loopback (one engine replica per node).

First against ``PushEngineDouble`` (a TEST DOUBLE of ``LoraplexEngine``: the real class, its
real ``push`` method, running the push route's contract from
:class:`~tests.router.push_double.PushReplicaDouble` instead of a whole loraplex server), then
the fleet proof against real engine replicas (xfail until the push route lands): once the push
returns, every replica serves the new revision.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray", reason="needs Ray Serve: pip install 'loraplex[ray]'")
serve = pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'loraplex[ray]'")

from loraplex.client import PushError, encode_adapter, push_adapter, push_headers  # noqa: E402
from loraplex.integrations.ray_serve import (  # noqa: E402
    IngressSettings,
    LoraplexEngine,
    LoraplexIngress,
    RayServeOptions,
    build_app,
)
from loraplex.integrations.ray_serve.asgi import InProcessASGI  # noqa: E402
from loraplex.integrations.ray_serve.local_cluster import (  # noqa: E402
    LocalRayCluster,
    connect,
    deploy,
    start_serve,
)
from loraplex.integrations.ray_serve.testbed import TinyFleet  # noqa: E402
from loraplex.testing import reference_greedy  # noqa: E402
from loraplex.testing.server import free_port  # noqa: E402
from tests.router.push_double import (  # noqa: E402
    LORA_CONFIG,
    PROMPT,
    PushReplicaDouble,
    greedy_tokens,
    lora_tensors,
    peft_trainee,
    reseed,
    served_revision,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ADMIN = "sk-admin-ray-push"
ROOT = Path(__file__).resolve().parents[2]
TENSORS = lora_tensors(1)


class _DoubleEngine(LoraplexEngine.func_or_class):  # type: ignore[misc,name-defined]
    """LoraplexEngine with the push contract's double as its app (see the module docstring).
    The first replica to claim ``refuse_dir/refuser`` (when given) refuses every push."""

    async def __init__(self, refuse_dir: str | None = None) -> None:
        mode = "ok"
        if refuse_dir is not None:
            try:
                os.close(os.open(Path(refuse_dir) / "refuser", os.O_CREAT | os.O_EXCL))
                mode = "refuse"
            except FileExistsError:
                pass
        self.double = PushReplicaDouble(ADMIN, mode=mode)
        self._asgi = InProcessASGI(self.double.app())
        await self._asgi.startup()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def taken(self) -> list[tuple[str, str, str]]:
        """(name, revision, sha256 of the body) of every push this replica took."""
        return [
            (p.name, p.revision, hashlib.sha256(p.body).hexdigest()) for p in self.double.pushes
        ]

    def check_health(self) -> None:
        pass

    def record_routing_stats(self) -> dict[str, Any]:
        return {"adapters": {}, "host_capacity": 4, "device_capacity": 1, "time": 0.0}


PushEngineDouble = serve.deployment(name="PushEngineDouble")(_DoubleEngine)


@dataclass
class Cluster:
    url: str
    cluster: LocalRayCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    old = os.environ.get("PYTHONPATH")
    # the workers import this module's double (``tests.``) by reference
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old) if p)
    c = LocalRayCluster()
    try:
        c.start_head(num_cpus=2, resources={"lp_ingress": 1, "lp_engine": 1})
        c.add_node(num_cpus=2, resources={"lp_engine": 1})
        connect(c)
        c.wait_for_nodes(2)
        yield Cluster(start_serve(free_port()), c)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            c.close()


def _deploy_doubles(refuse_dir: str | None) -> Any:
    engine = PushEngineDouble.options(
        num_replicas=2, ray_actor_options={"num_cpus": 0.5, "resources": {"lp_engine": 1}}
    ).bind(refuse_dir)
    ingress = LoraplexIngress.options(
        ray_actor_options={"num_cpus": 0, "resources": {"lp_ingress": 0.01}}
    ).bind(engine, IngressSettings(routing="default", max_push_bytes=1 << 20, push_api_key=ADMIN))
    deploy(ingress, name="doubles")
    return serve.get_deployment_handle("PushEngineDouble", app_name="doubles")


def test_a_push_reaches_both_engine_replicas_through_the_ingress(cluster: Cluster) -> None:
    handle = _deploy_doubles(None)
    try:
        answer = push_adapter(cluster.url, "trainee", TENSORS, config=LORA_CONFIG, api_key=ADMIN,
                              revision="step-1")  # fmt: skip
        assert answer["revision"] == "step-1" and len(answer["replicas"]) == 2
        assert {r["status"] for r in answer["replicas"]} == {201}
        body, _ = encode_adapter(TENSORS, LORA_CONFIG)
        want = [("trainee", "step-1", hashlib.sha256(body).hexdigest())]
        taken = handle.broadcast("taken").results(timeout_s=60)
        assert taken == [want, want]  # one push on each of the two replicas
        # a corrupt body and an oversized one stop at the ingress
        url = f"{cluster.url}/v1/admin/adapters/trainee/push"
        headers = push_headers(body, encode_adapter(TENSORS, LORA_CONFIG)[1], api_key=ADMIN)
        r = httpx.post(url, content=body[:-1] + b"!", headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "digest_mismatch"
        big = b"\0" * ((1 << 20) + 1)
        r = httpx.post(url, content=big, headers=headers, timeout=60)
        assert r.status_code == 413
        assert handle.broadcast("taken").results(timeout_s=60) == [want, want]
        # a wrong key stops at the ingress, before the body is read
        with pytest.raises(PushError) as e:
            push_adapter(cluster.url, "trainee", TENSORS, config=LORA_CONFIG, api_key="sk-bad")
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
        assert handle.broadcast("taken").results(timeout_s=60) == [want, want]
    finally:
        serve.delete("doubles")


def test_a_replica_that_refuses_makes_the_push_502_naming_it(cluster: Cluster) -> None:
    with tempfile.TemporaryDirectory() as refuse_dir:
        _deploy_doubles(refuse_dir)
        try:
            with pytest.raises(PushError) as e:
                push_adapter(cluster.url, "trainee", TENSORS, config=LORA_CONFIG, api_key=ADMIN)
            assert e.value.status == 502 and e.value.code == "push_incomplete"
            rows = e.value.body["replicas"]
            assert sorted(r["status"] for r in rows) == [201, 409]
            assert "being rolled back" in e.value.message
        finally:
            serve.delete("doubles")


def test_push_reaches_every_real_engine_replica(cluster: Cluster, testbed: TinyFleet) -> None:
    """The fleet proof: two real engine replicas (one per node); once each push returns, a
    burst of greedy requests (spread by Ray's default router) all equal PEFT's with it."""
    options = RayServeOptions(
        routing="default", num_replicas=2,
        engine_actor_options={"num_cpus": 1, "resources": {"lp_engine": 1}},
        ingress_actor_options={"num_cpus": 0, "resources": {"lp_ingress": 0.01}},
    )  # fmt: skip
    deploy(build_app(testbed.server_config(admin_api_key=ADMIN), options))
    try:
        trainee = peft_trainee(testbed.model, seed=21)
        for step in (1, 2):
            if step == 2:
                reseed(trainee, seed=22)
            answer = push_adapter(cluster.url, "trainee", trainee, api_key=ADMIN,
                                  revision=f"step-{step}")  # fmt: skip
            assert len(answer["replicas"]) == 2
            want, _ = reference_greedy(trainee, PROMPT, 5)
            seen: set[str | None] = set()
            for _ in range(8):  # bursts of 8 at once, until both replicas have answered
                with ThreadPoolExecutor(8) as pool:
                    got = list(pool.map(
                        lambda _: greedy_tokens(cluster.url, "trainee", ADMIN, 5), range(8)
                    ))  # fmt: skip
                for tokens, headers in got:
                    assert tokens == want and served_revision(headers) == f"step-{step}"
                    seen.add(headers.get("x-loraplex-replica"))
                if len(seen) == 2:
                    break
            assert len(seen) == 2  # both replicas answered with the new revision
    finally:
        serve.delete("loraplex")
