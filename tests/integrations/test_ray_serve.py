"""loraplex on a real Ray cluster: a head node and a second node (``ray start`` on loopback),
one engine replica on each, the OpenAI ingress on the head.

Repeat requests for an adapter go to the replica that holds it (each adapter is loaded once:
cold starts == distinct adapters); killing the second node mid-traffic (its raylet and its
workers, SIGKILL) loses no request: the ones cut on it fail over to the surviving replica;
``serve run`` deploys a Serve config file (the builder's arguments, Ray's autoscaling options).
The tests run in this order on one cluster.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

ray = pytest.importorskip("ray", reason="needs Ray Serve: pip install 'loraplex[ray]'")
serve = pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'loraplex[ray]'")

from loraplex.integrations.ray_serve import RayServeOptions, build_app  # noqa: E402
from loraplex.integrations.ray_serve.local_cluster import (  # noqa: E402
    LocalRayCluster,
    RayNode,
    connect,
    deploy,
    start_serve,
)
from loraplex.integrations.ray_serve.testbed import TinyFleet  # noqa: E402
from loraplex.testing.server import free_port  # noqa: E402
from loraplex.testing.sync import wait_until  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@dataclass
class Fleet:
    url: str
    cluster: LocalRayCluster
    second: RayNode
    adapters: list[str]


@pytest.fixture(scope="module")
def fleet(testbed: TinyFleet) -> Iterator[Fleet]:
    cluster = LocalRayCluster()
    try:
        # the ingress (and Serve's controller and proxy) on the head; one engine slot per node
        cluster.start_head(num_cpus=2, resources={"lp_ingress": 1, "lp_engine": 1})
        second = cluster.add_node(num_cpus=2, resources={"lp_engine": 1})
        connect(cluster)
        cluster.wait_for_nodes(2)
        url = start_serve(free_port())
        options = RayServeOptions(
            routing="residency",
            num_replicas=2,
            engine_actor_options={"num_cpus": 1, "resources": {"lp_engine": 1}},
            ingress_actor_options={"num_cpus": 0, "resources": {"lp_ingress": 0.01}},
            health_check_period_s=1.0,
            health_check_timeout_s=5.0,
        )
        deploy(build_app(testbed.server_config(max_loras=1, max_cpu_loras=2), options))
        yield Fleet(url, cluster, second, sorted(testbed.adapters))
    finally:
        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            cluster.close()


def _complete(client: httpx.Client, url: str, model: str, max_tokens: int = 4) -> httpx.Response:
    body = {
        "model": model,
        "prompt": "Hello",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return client.post(f"{url}/v1/completions", json=body)


def test_repeat_requests_go_to_the_replica_holding_the_adapter(fleet: Fleet) -> None:
    served: dict[str, set[str]] = defaultdict(set)
    states: Counter[str] = Counter()
    with httpx.Client(timeout=120) as client:
        for _ in range(3):
            for adapter in fleet.adapters:
                r = _complete(client, fleet.url, adapter)
                assert r.status_code == 200, r.text
                served[adapter].add(r.headers["x-loraplex-replica"])
                states[r.headers["x-loraplex-adapter-state"]] += 1
        # every OpenAI route passes through; per-replica admin calls are refused
        models = client.get(f"{fleet.url}/v1/models")
        assert models.status_code == 200
        assert {m["id"] for m in models.json()["data"]} >= {"tiny", *fleet.adapters}
        stream = client.post(
            f"{fleet.url}/v1/chat/completions",
            json={
                "model": "a0",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "stream": True,
            },
        )
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.text.rstrip().endswith("data: [DONE]")
        assert stream.headers["x-loraplex-replica"] in served["a0"]
        refused = client.post(
            f"{fleet.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "per_replica_route"
        missing = _complete(client, fleet.url, "no-such-adapter")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
    # each adapter was loaded once, on one replica, and both replicas took a share
    assert states["cold"] == len(fleet.adapters), states
    assert all(len(replicas) == 1 for replicas in served.values()), served
    assert len(set().union(*served.values())) == 2, served


def test_a_node_lost_mid_traffic_loses_no_request(fleet: Fleet) -> None:
    """One long request per adapter is generating and short ones keep coming when the second
    node dies: every request is answered in full, the long one cut on the lost node again on
    the survivor (the ingress's failover), the short ones sent to it meanwhile too."""
    short_done = threading.Semaphore(0)

    def one(adapter: str, max_tokens: int) -> httpx.Response:
        with httpx.Client(timeout=180) as client:
            r = _complete(client, fleet.url, adapter, max_tokens)
        if max_tokens < 100:
            short_done.release()
        return r

    with ThreadPoolExecutor(8) as pool, httpx.Client(timeout=60) as probe:
        longs = [pool.submit(one, a, 960) for a in fleet.adapters]  # seconds each
        busy: set[str] = set()  # replicas seen serving a long one (its adapter in flight)

        def both_busy() -> bool:
            r = probe.get(f"{fleet.url}/v1/adapters")
            if any(row["in_flight"] for row in r.json()["data"]):
                busy.add(r.headers["x-loraplex-replica"])
            return len(busy) == 2

        wait_until(both_busy, timeout=120, what="a long request generating on each replica")
        shorts = [pool.submit(one, fleet.adapters[i % 4], 16) for i in range(40)]
        assert short_done.acquire(timeout=120)  # short traffic under way too
        fleet.cluster.kill_node(fleet.second)
        results = [f.result(timeout=300) for f in longs + shorts]

    assert [r.status_code for r in results] == [200] * len(results), [
        r.text for r in results if r.is_error
    ]
    tokens = [r.json()["usage"]["completion_tokens"] for r in results]
    assert tokens == [960] * len(longs) + [16] * len(shorts)
    # the last requests started long after the kill: all on the survivor
    assert len({r.headers["x-loraplex-replica"] for r in results[-8:]}) == 1
    # the long requests on the lost node were cut mid-generation and retried elsewhere
    retried = [int(r.headers["x-loraplex-attempts"]) > 1 for r in results]
    print(
        f"failed over: {sum(retried[: len(longs)])} of {len(longs)} long requests, "
        f"{sum(retried[len(longs) :])} of {len(shorts)} short ones"
    )
    assert any(retried[: len(longs)])


def test_serve_run_deploys_a_config_file(fleet: Fleet, testbed: TinyFleet, tmp_path: Path) -> None:
    """The documented way in: ``serve run config.yaml`` with the builder's arguments and Ray's
    own deployment options (autoscaling) for ``LoraplexEngine``, on what is left of the
    cluster (the head node)."""
    port = int(fleet.url.rsplit(":", 1)[1])
    argv = (
        f"{testbed.model} --enable-lora --served-model-name tiny --max-loras 1 "
        f"--max-cpu-loras 2 --registry-url {testbed.registry_url} "
        f"--allowed-lora-roots {testbed.root / 'adapters'}"
    )
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "loraplex",
                "route_prefix": "/",
                "import_path": "loraplex.integrations.ray_serve:app",
                "args": {"serve_args": argv, "routing": "residency"},
                "deployments": [
                    {
                        "name": "LoraplexEngine",
                        "autoscaling_config": {
                            "min_replicas": 1,
                            "max_replicas": 1,
                            "target_ongoing_requests": 8,
                        },
                        "ray_actor_options": {"num_cpus": 1, "resources": {"lp_engine": 1}},
                    },
                    {
                        "name": "LoraplexIngress",
                        "ray_actor_options": {"num_cpus": 0, "resources": {"lp_ingress": 0.01}},
                    },
                ],
            }
        ],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).with_name("serve")
    before = serve.status().applications["loraplex"].last_deployed_time_s
    done = subprocess.run(
        [str(serve_cli), "run", "--address", fleet.cluster.address, "--non-blocking", str(path)],
        env=fleet.cluster.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    def running() -> bool:  # the new deployment, not the one before it
        app = serve.status().applications.get("loraplex")
        return bool(app and app.last_deployed_time_s > before and app.status == "RUNNING")

    wait_until(running, timeout=240, what="the serve run application")
    with httpx.Client(timeout=120) as client:
        states = []
        for adapter in ["a0", "a1", "a0", "a1"]:
            r = _complete(client, fleet.url, adapter)
            assert r.status_code == 200, r.text
            states.append(r.headers["x-loraplex-adapter-state"])
    assert states == ["cold", "cold", "warm", "warm"]  # two host slots, one replica
