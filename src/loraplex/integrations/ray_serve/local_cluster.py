"""A real multi-node Ray cluster on loopback, for tests and benchmarks.

Each node is its own ``ray start --block`` process (a head, then nodes joining it), all on a
loopback address (:data:`LOOPBACK_IP`) with free ports and one private temp dir, so two nodes
share a machine as two machines would share a network. ``kill_node`` SIGKILLs one node's
raylet and workers at once (a machine lost mid-traffic), ``kill_raylet`` its raylet alone;
``close`` ends every process this cluster started, by process id (never ``ray stop``, which
would end every Ray on the machine).

Starting and stopping nodes needs no Ray import (``subprocess`` and ``psutil``); waiting for
nodes to join, :func:`connect`, :func:`start_serve` and :func:`deploy` use this process's Ray
driver.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

__all__ = ["LocalRayCluster", "RayNode", "connect", "deploy", "local_ray_cluster", "start_serve"]

FAST_FAILURE_DETECTION = {
    # the GCS marks a node dead after 3 failed checks 0.5 s apart (default: 5 x 3 s)
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
"""Environment for a test cluster: node death detected in seconds, not tens of seconds."""


LOOPBACK_IP = "127.0.0.2"
"""The nodes' address: a loopback address Ray keeps (it replaces ``127.0.0.1`` and
``localhost`` by the machine's reachable address; the rest of ``127.0.0.0/8`` is loopback too)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _ray_cli() -> list[str]:
    """The ``ray`` command of this interpreter's environment (so workers run this Python)."""
    exe = Path(sys.executable).with_name("ray")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


@dataclass
class RayNode:
    """One ``ray start --block`` process and everything it started."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    resources: dict[str, float]
    seen: dict[int, float] = field(default_factory=dict)  # pid -> create_time

    def processes(self) -> list[psutil.Process]:
        """The node's live processes (the ``ray start`` process and its descendants), also
        remembered so :meth:`LocalRayCluster.close` finds them after they are re-parented."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                self.seen.setdefault(p.pid, p.create_time())
        return procs

    def raylet(self) -> psutil.Process | None:
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                if p.name() == "raylet" or Path(p.exe()).name == "raylet":
                    return p
        return None


class LocalRayCluster:
    """Ray nodes on a loopback address under one temp dir (see the module docstring)."""

    def __init__(
        self,
        *,
        root: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        object_store_bytes: int = 80 * 2**20,
        start_timeout_s: float = 120.0,
        node_ip: str = LOOPBACK_IP,
    ) -> None:
        # a short path: Ray's Unix sockets live under it (108-byte limit)
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="lpray"))
        self.root.mkdir(parents=True, exist_ok=True)
        self._own_root = root is None
        self.env = {
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_DEDUP_LOGS": "0",
            **FAST_FAILURE_DETECTION,
            **(env or {}),
        }
        self.object_store_bytes = object_store_bytes
        self.start_timeout_s = start_timeout_s
        self.node_ip = node_ip
        self.gcs_port = 0
        self.nodes: list[RayNode] = []

    @property
    def address(self) -> str:
        """The GCS address drivers and nodes join (``IP:PORT``)."""
        return f"{self.node_ip}:{self.gcs_port}"

    def _start(self, name: str, args: list[str], resources: Mapping[str, float]) -> RayNode:
        ports = _free_ports(5)
        # a private worker-port range per node, below Linux's ephemeral ports (32768-60999)
        # that the free ports above come from, so the two never meet
        base = 20000 + 250 * (len(self.nodes) % 8) + 2000 * random.randrange(6)
        cmd = [
            *_ray_cli(),
            "start",
            "--block",
            f"--node-ip-address={self.node_ip}",
            f"--object-store-memory={self.object_store_bytes}",
            f"--node-manager-port={ports[0]}",
            f"--object-manager-port={ports[1]}",
            f"--dashboard-agent-listen-port={ports[2]}",
            f"--dashboard-agent-grpc-port={ports[3]}",
            f"--metrics-export-port={ports[4]}",
            f"--runtime-env-agent-port={_free_port()}",
            f"--min-worker-port={base}",
            f"--max-worker-port={base + 199}",
            f"--resources={json.dumps(dict(resources))}",
            "--disable-usage-stats",
            *args,
        ]
        log = self.root / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        node = RayNode(name, proc, log, dict(resources))
        self.nodes.append(node)
        return node

    def start_head(
        self, *, num_cpus: int = 2, resources: Mapping[str, float] | None = None
    ) -> RayNode:
        """Start the head node (GCS, no dashboard) and wait until its GCS answers."""
        self.gcs_port = _free_port()
        node = self._start(
            "head",
            [
                "--head",
                f"--port={self.gcs_port}",
                f"--num-cpus={num_cpus}",
                "--include-dashboard=false",
                f"--ray-client-server-port={_free_port()}",
                f"--temp-dir={self.root}",
            ],
            resources or {},
        )
        self._wait_port(node, self.gcs_port)
        return node

    def add_node(
        self, *, num_cpus: int = 2, resources: Mapping[str, float] | None = None
    ) -> RayNode:
        """Start a node joining the head; :meth:`wait_for_nodes` waits until it is alive."""
        if not self.gcs_port:
            raise RuntimeError("start_head first")
        return self._start(
            f"node{len(self.nodes)}",
            [f"--address={self.address}", f"--num-cpus={num_cpus}"],
            resources or {},
        )

    def _wait_port(self, node: RayNode, port: int) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                raise RuntimeError(f"ray start ({node.name}) exited: {self.tail(node)}")
            with contextlib.suppress(OSError), socket.create_connection((self.node_ip, port), 0.5):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the {node.name} GCS did not listen in time: {self.tail(node)}")

    def wait_for_nodes(self, n: int, *, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Wait (through this process's Ray driver, ``ray.init(address=...)`` done) until ``n``
        nodes are alive; their ``ray.nodes()`` rows."""
        import ray

        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        while True:
            alive = [r for r in ray.nodes() if r.get("Alive")]
            if len(alive) >= n:
                return alive
            for node in self.nodes:
                if node.proc.poll() is not None:
                    raise RuntimeError(f"ray start ({node.name}) exited: {self.tail(node)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(alive)} of {n} Ray nodes alive after the timeout")
            time.sleep(0.2)

    def tail(self, node: RayNode, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return node.log.read_text(errors="replace")[-n:]
        return ""

    def kill_raylet(self, node: RayNode) -> int:
        """SIGKILL ``node``'s raylet alone (its workers notice and exit); the raylet's pid."""
        raylet = node.raylet()
        if raylet is None:
            raise RuntimeError(f"no raylet found for {node.name}")
        node.processes()  # remember the node's processes before they are re-parented
        raylet.kill()
        return raylet.pid

    def kill_node(self, node: RayNode) -> int:
        """SIGKILL every process of ``node`` at once, its raylet and the replicas' workers
        included (a machine lost, requests on it cut mid-generation); how many were killed."""
        procs = node.processes()
        if node.raylet() is None:
            raise RuntimeError(f"no raylet found for {node.name}")
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        return len(procs)

    def _ours(self) -> list[psutil.Process]:
        """Every live process this cluster started: the nodes' process trees as seen, plus any
        process whose command line names this cluster's private temp dir."""
        out: dict[int, psutil.Process] = {}
        for node in self.nodes:
            for p in node.processes():
                out[p.pid] = p
            for pid, created in node.seen.items():
                with contextlib.suppress(psutil.Error):
                    p = psutil.Process(pid)
                    if p.create_time() == created:
                        out[pid] = p
        root = str(self.root)
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(root in arg for arg in p.info["cmdline"] or ()):
                    out[p.pid] = p
        out.pop(os.getpid(), None)
        return list(out.values())

    def close(self, *, grace_s: float = 5.0) -> None:
        """End every process this cluster started (SIGTERM, then SIGKILL after ``grace_s``)
        and remove its temp dir when it made one."""
        procs = self._ours()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        for p in alive + self._ours():
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(self._ours(), timeout=grace_s)
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.proc.wait(timeout=1)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def local_ray_cluster(**options: Any) -> Iterator[LocalRayCluster]:
    """A :class:`LocalRayCluster` closed when the block ends, whatever happens inside."""
    cluster = LocalRayCluster(**options)
    try:
        yield cluster
    finally:
        cluster.close()


def connect(cluster: LocalRayCluster) -> None:
    """Make this process a Ray driver of ``cluster`` (quiet: worker logs stay in its dir)."""
    import ray

    ray.init(
        address=cluster.address,
        _node_ip_address=cluster.node_ip,
        log_to_driver=False,
        logging_level="warning",
        configure_logging=True,
    )


def start_serve(http_port: int, *, host: str = "127.0.0.1") -> str:
    """Start Ray Serve on the connected cluster, its HTTP proxy on the head node only at
    ``host:http_port`` (access logs off); the base URL."""
    from ray import serve

    serve.start(
        http_options={"host": host, "port": http_port},
        proxy_location="HeadOnly",
        logging_config={"log_level": "WARNING", "enable_access_log": False},
    )
    return f"http://{host}:{http_port}"


def deploy(app: Any, *, name: str = "loraplex", timeout_s: float = 300.0) -> None:
    """Deploy ``app`` at ``/`` and wait until it runs (raising with Serve's message if its
    deployment fails or the timeout passes)."""
    from ray import serve

    try:
        serve.run(
            app,
            name=name,
            route_prefix="/",
            blocking=False,
            logging_config={"log_level": "WARNING", "enable_access_log": False},
        )
    except RuntimeError as e:  # a failed deployment: say why, from each deployment's status
        status = serve.status().applications.get(name)
        details = [f"{d}: {s.message}" for d, s in (status.deployments if status else {}).items()]
        raise RuntimeError(f"{e} {' | '.join(details)}") from None
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not running after {timeout_s} s: {status}")
        time.sleep(0.2)
