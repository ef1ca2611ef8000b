"""Hostile clients against the router (issue 14).

- **Residency poisoning**: a client flooding bogus model names (401s without a key, 404s with
  one) must not push a real adapter out of the router's view, nor change where that adapter is
  routed; the view changes only from the replicas' own successful answers and polls.
- **Status and metrics**: ``/v1/replicas`` shows every adapter name, so it needs the router's
  status key (401 without it, off without one configured); ``/metrics`` names no adapter.
- **Authorization** is forwarded on every proxied route and never logged.
- **No double generation**: a replica that reads a request and drops the connection is not
  sent the request again elsewhere (the client gets 502); a request that cannot have reached a
  replica's handler (the connection reset before its body was written) is retried.

Two real in-process replicas (tiny model, ``--max-loras 1 --max-cpu-loras 2``) and, for the
dropped connections, a raw-socket replica that answers the router's polls and does what it is
told with every POST.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.router.app import RouterConfig, create_router_app
from loraplex.router.scoring import rendezvous
from loraplex.server.app import create_app
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import wait_until

KEY = "sk-replica-inference-7f3a"  # the replicas' inference key (clients' and the router's)
STATUS = "sk-router-status-91c2"  # the router's status key
SERVED = ("mlp_r16", "all_r8", "attn_r4_rslora")
ROUTER_LOGGERS = ("loraplex.router", "httpx", "httpcore", "uvicorn")


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _completion(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "The sky is", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[list[str]]:
    """Two real replicas that need ``KEY``; one device slot and two host slots each."""
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(2):
            config = ServerConfig(
                EngineConfig(model=str(tiny_model), max_loras=1, max_cpu_loras=2,
                             num_threads=1, max_num_seqs=8),
                served_model_name=["tiny"],
                lora_modules=[LoRAModule(n, str(adapters[n])) for n in SERVED],
                api_keys=[KEY],
                log_level="warning",
            )  # fmt: skip
            urls.append(stack.enter_context(serve_in_thread(create_app(config), timeout=120)))
        yield urls


def _router_config(replicas: list[str], **kw: Any) -> RouterConfig:
    base: dict[str, Any] = dict(
        replicas=replicas,
        poll_timeout_s=60.0,
        read_timeout_s=60.0,
        replica_api_key=KEY,
        status_api_key=STATUS,
    )
    return RouterConfig(**{**base, **kw})


def _view(router: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{router}/v1/replicas", headers=_auth(STATUS))
    assert r.status_code == 200, r.text
    return {v["url"]: v for v in r.json()["data"]}


@contextlib.contextmanager
def _polled_once(config: RouterConfig) -> Iterator[str]:
    """The router, after its first poll of every replica. With ``poll_interval_s`` an hour
    that poll is its only one: every later change to its view comes from traffic."""
    with serve_in_thread(create_router_app(config)) as url:
        wait_until(
            lambda: all(v["kind"] == "loraplex" for v in _view(url).values()),
            what="the router's first poll of its replicas",
        )
        yield url


# --------------------------------------------------------------------------------- poisoning
def test_bogus_model_names_do_not_poison_residency(fleet: list[str]) -> None:
    adapter = "mlp_r16"
    home = max(fleet, key=lambda u: rendezvous(adapter, u))  # where a cold copy would go
    warm = next(u for u in fleet if u != home)
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{warm}/v1/completions", json=_completion(adapter), headers=_auth(KEY))
        assert r.status_code == 200, r.text  # now in `warm`'s only device slot, nowhere else
    # the residency policy follows the warm copy (the home policy: the next test)
    config = _router_config(fleet, poll_interval_s=3600.0, policy="residency")
    with _polled_once(config) as router, httpx.Client(base_url=router, timeout=60) as c:
        assert _view(router)[warm]["device"] == [adapter]
        r = c.post("/v1/completions", json=_completion(adapter), headers=_auth(KEY))
        assert r.status_code == 200, r.text
        assert (r.headers["x-loraplex-replica"], r.headers["x-loraplex-adapter-state"]) == (
            warm, "warm",
        )  # fmt: skip

        # the flood: names whose stable home is the replica holding the adapter (there a
        # dispatch-time guess would push it out of its one device slot and two host slots),
        # without a key (401) and with one (404); and real names without a key (401)
        bogus = [n for n in (f"bogus-{i}" for i in range(200)) if
                 max(fleet, key=lambda u, n=n: rendezvous(n, u)) == warm][:16]  # fmt: skip
        assert len(bogus) == 16
        for i, name in enumerate(bogus):
            key = KEY if i % 2 else None
            r = c.post("/v1/completions", json=_completion(name), headers=_auth(key))
            assert r.status_code == (404 if key else 401), r.text
        for name in ("all_r8", "attn_r4_rslora"):
            r = c.post("/v1/completions", json=_completion(name))
            assert r.status_code == 401, r.text

        r = c.post("/v1/completions", json=_completion(adapter), headers=_auth(KEY))
        assert r.status_code == 200, r.text
        assert (r.headers["x-loraplex-replica"], r.headers["x-loraplex-adapter-state"]) == (
            warm, "warm",
        )  # fmt: skip
        view = _view(router)
        assert view[warm]["device"] == [adapter] and view[warm]["tiers"][adapter] == "device"
        for v in view.values():
            assert not set(v["tiers"]) & set(bogus), v["tiers"]
            assert set(v["device"]) <= {adapter}, v["device"]  # nothing the flood asked for

        metrics = c.get("/metrics")
        assert metrics.status_code == 200
        for name in (*bogus, *SERVED):
            assert name not in metrics.text, name  # no adapter names in the router's metrics


def test_bogus_model_names_do_not_move_home_sets(fleet: list[str]) -> None:
    """The home policy counts only answered requests: a flood of bogus names (and of real
    names without a key) neither takes room in the home sets nor moves a real adapter's."""
    adapter = "all_r8"
    home = max(fleet, key=lambda u: rendezvous(adapter, u))  # its home in an empty map
    config = _router_config(fleet, poll_interval_s=3600.0)
    assert config.policy == "home"
    with _polled_once(config) as router, httpx.Client(base_url=router, timeout=60) as c:
        for _ in range(2):
            r = c.post("/v1/completions", json=_completion(adapter), headers=_auth(KEY))
            assert r.status_code == 200, r.text
            assert r.headers["x-loraplex-replica"] == home
        assert r.headers["x-loraplex-adapter-state"] == "warm"
        before = _homes(router)
        assert before == {adapter: [home]}
        bogus = [n for n in (f"bogus-{i}" for i in range(200)) if
                 max(fleet, key=lambda u, n=n: rendezvous(n, u)) == home][:16]  # fmt: skip
        for i, name in enumerate(bogus):
            key = KEY if i % 2 else None
            r = c.post("/v1/completions", json=_completion(name), headers=_auth(key))
            assert r.status_code == (404 if key else 401), r.text
        for name in ("mlp_r16", "attn_r4_rslora"):
            r = c.post("/v1/completions", json=_completion(name))
            assert r.status_code == 401, r.text
        assert _homes(router) == before  # nothing the flood asked for
        r = c.post("/v1/completions", json=_completion(adapter), headers=_auth(KEY))
        assert r.status_code == 200, r.text
        assert (r.headers["x-loraplex-replica"], r.headers["x-loraplex-adapter-state"]) == (
            home, "warm",
        )  # fmt: skip


def _homes(router: str) -> dict[str, list[str]]:
    r = httpx.get(f"{router}/v1/replicas", headers=_auth(STATUS))
    assert r.status_code == 200, r.text
    return r.json()["homes"]  # type: ignore[no-any-return]


def test_a_served_answer_is_what_updates_the_view(fleet: list[str]) -> None:
    """Between polls the view follows the replicas' successful answers: an adapter answered
    (2xx with the adapter-state header) on a replica is on its device in the view."""
    config = _router_config(fleet, poll_interval_s=3600.0)
    with _polled_once(config) as router, httpx.Client(base_url=router, timeout=60) as c:
        r = c.post("/v1/completions", json=_completion("attn_r4_rslora"), headers=_auth(KEY))
        assert r.status_code == 200, r.text
        where = r.headers["x-loraplex-replica"]
        assert _view(router)[where]["device"] == ["attn_r4_rslora"]
        again = c.post("/v1/completions", json=_completion("attn_r4_rslora"), headers=_auth(KEY))
        assert again.headers["x-loraplex-replica"] == where
        assert again.headers["x-loraplex-adapter-state"] == "warm"


# --------------------------------------------------------------------------------- status, auth
def test_replicas_route_needs_the_status_key(fleet: list[str]) -> None:
    with _polled_once(_router_config(fleet, poll_interval_s=0.5)) as router:
        for headers in ({}, _auth("wrong"), _auth(KEY), {"Authorization": STATUS}):
            r = httpx.get(f"{router}/v1/replicas", headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert not any(n in r.text for n in SERVED) and "127.0.0.1" not in r.text
        view = _view(router)  # the holder of the key sees every name
        assert all(set(SERVED) <= set(v["tiers"]) for v in view.values())
        assert httpx.get(f"{router}/health").status_code == 200  # /health stays open
    # no status key configured: the route is off, whatever the caller sends
    with serve_in_thread(create_router_app(_router_config(fleet, status_api_key=None))) as url:
        for headers in ({}, _auth(STATUS), _auth(KEY)):
            r = httpx.get(f"{url}/v1/replicas", headers=headers)
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "status_api_disabled"
            assert not any(n in r.text for n in SERVED)


def test_authorization_is_forwarded_on_every_route_and_never_logged(
    fleet: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    chat = {"model": "all_r8", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with _polled_once(_router_config(fleet)) as router, httpx.Client(base_url=router) as c:
        for key, status in ((KEY, 200), (None, 401), ("sk-not-a-key", 401)):
            answers = [
                c.post("/v1/completions", json=_completion("all_r8"), headers=_auth(key)),
                c.post("/v1/chat/completions", json=chat, headers=_auth(key)),
                c.get("/v1/models", headers=_auth(key)),
            ]
            for r in answers:
                assert r.status_code == status, (key, r.request.url, r.text)
                if status == 401:  # the replica's own answer, passed through
                    assert r.json()["error"]["code"] == "invalid_api_key"
        models = c.get("/v1/models", headers=_auth(KEY)).json()["data"]
        assert {m["id"] for m in models} == {"tiny", *SERVED}
    logged = [r for r in caplog.records if r.name.startswith(ROUTER_LOGGERS)]
    assert logged  # the loggers ran at DEBUG
    for rec in logged:
        text = rec.getMessage() + (rec.exc_text or "")
        assert KEY not in text and "sk-not-a-key" not in text, text


# --------------------------------------------------------------------------------- retries
class RawReplica:
    """A raw-socket HTTP/1.1 server that answers the router's polls like a loraplex replica
    (healthy, nothing resident, base model ``base``) and, for every POST, does ``mode``:
    ``drop`` reads the whole request and closes without answering; ``reset`` reads the head
    and the first MiB of the body (so the sender is mid-write) and resets the connection, the
    rest unread; ``answer`` answers 200."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.heads = 0  # POST heads received
        self.posts = 0  # POSTs received whole (a handler could have run them)
        self.authorization: list[str | None] = []
        self._lock = threading.Lock()
        self._sock = socket.socket()
        # a small fixed receive buffer (no autotuning, which may grow it to tcp_rmem's max of
        # tens of MiB): a body this server does not read cannot all fit into buffers
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="raw-replica", daemon=True).start()

    def close(self) -> None:
        self._sock.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with contextlib.suppress(OSError):
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in
                           (ln.split(":", 1) for ln in lines[1:])}  # fmt: skip
                if method == "POST":
                    with self._lock:
                        self.heads += 1
                        self.authorization.append(headers.get("authorization"))
                    if self.mode == "reset":  # close with the body unread: a reset
                        while len(buf) < 1 << 20:
                            data = conn.recv(1 << 16)
                            if not data:
                                return
                            buf += data
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))  # fmt: skip
                        conn.close()
                        return
                length = int(headers.get("content-length", "0"))
                while len(buf) < length:
                    data = conn.recv(1 << 20)
                    if not data:
                        return
                    buf += data
                buf = buf[length:]
                if method == "POST":
                    with self._lock:
                        self.posts += 1
                    if self.mode == "drop":
                        conn.close()
                        return
                conn.sendall(self._answer(method, path))

    def _answer(self, method: str, path: str) -> bytes:
        extra = ""
        if method == "POST":
            body: Any = {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}
        elif path == "/v1/adapters":
            body = {"object": "list", "data": [], "max_loras": 1}
        elif path == "/v1/models":
            body = {"object": "list", "data": [{"id": "base", "parent": None}]}
        elif path == "/metrics":
            body = None
            extra = "content-type: text/plain\r\n"
        else:
            body = {}
        data = b"" if body is None else json.dumps(body).encode()
        if body is not None:
            extra = "content-type: application/json\r\n"
        return (f"HTTP/1.1 200 OK\r\ncontent-length: {len(data)}\r\n{extra}\r\n").encode() + data


@pytest.fixture
def raw_replicas() -> Iterator[list[RawReplica]]:
    made: list[RawReplica] = []
    yield made
    for r in made:
        r.close()


def _retries(router: str) -> str:
    return "\n".join(
        ln for ln in httpx.get(f"{router}/metrics").text.splitlines()
        if ln.startswith("loraplex_router_retries_total")
    )  # fmt: skip


def test_a_dropped_request_is_not_sent_again(
    raw_replicas: list[RawReplica], caplog: pytest.LogCaptureFixture
) -> None:
    """Both replicas read the request and hang up: one of them may have started generating,
    so the router answers 502 instead of sending it to the other (a second generation)."""
    caplog.set_level(logging.DEBUG)
    raw_replicas += [RawReplica("drop"), RawReplica("drop")]
    config = _router_config([r.url for r in raw_replicas], poll_interval_s=0.5, max_retries=2)
    with _polled_once(config) as router:
        r = httpx.post(f"{router}/v1/completions", json=_completion("some-adapter"),
                       headers=_auth("sk-client-secret"), timeout=60)  # fmt: skip
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "replica_failed"
        assert sum(x.posts for x in raw_replicas) == 1  # exactly one replica saw it
        seen = [a for x in raw_replicas for a in x.authorization]
        assert seen == ["Bearer sk-client-secret"]  # forwarded, once
        assert _retries(router) == ""  # no retry of any cause
    for rec in caplog.records:
        assert "sk-client-secret" not in rec.getMessage() + (rec.exc_text or "")


def test_a_request_reset_before_its_body_was_sent_is_retried(
    raw_replicas: list[RawReplica],
) -> None:
    """The first replica resets the connection while the router is still writing the body
    (32 MiB: far more than the 1 MiB it reads, its 64 KiB receive buffer and the router's send
    buffer hold, so the write fails): no handler can have run it, so it goes to the other
    replica, once."""
    raw_replicas += [RawReplica("reset"), RawReplica("answer")]
    reset, answer = raw_replicas
    model = next(n for n in (f"m{i}" for i in range(100))
                 if rendezvous(n, reset.url) > rendezvous(n, answer.url))  # fmt: skip
    body = {**_completion(model), "prompt": "x" * (32 << 20)}
    config = _router_config([reset.url, answer.url], poll_interval_s=0.5, max_retries=2,
                            max_request_bytes=64 << 20)  # fmt: skip
    with _polled_once(config) as router:
        r = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-loraplex-replica"] == answer.url
        assert (reset.heads, reset.posts, answer.posts) == (1, 0, 1)
        assert 'loraplex_router_retries_total{cause="write"} 1.0' in _retries(router)


# --------------------------------------------------------------------------------- body cap
def _raw_exchange(url: str, head: str, body: bytes) -> str:
    """Send ``head`` and part of a body on a raw connection, stop writing, and read what the
    router answers (the status line)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head.encode() + body)
        answer = b""
        while b"\r\n" not in answer:
            data = s.recv(65536)
            if not data:
                break
            answer += data
    return answer.split(b"\r\n", 1)[0].decode()


def test_a_body_over_the_cap_is_413_and_never_forwarded(raw_replicas: list[RawReplica]) -> None:
    """The cap is checked while reading: a declared length over it is refused before any of
    the body is read, and an undeclared (chunked) body as soon as it passes the cap; neither
    reaches a replica."""
    raw_replicas.append(RawReplica("answer"))
    config = _router_config([raw_replicas[0].url], poll_interval_s=0.5,
                            max_request_bytes=1 << 20)  # fmt: skip
    with _polled_once(config) as router:
        prefix = b'{"model": "m", "prompt": "' + b"x" * (2 << 20)  # 2 MiB, never finished
        head = "POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        status = _raw_exchange(router, head + f"content-length: {8 << 30}\r\n\r\n", b"")
        assert status.startswith("HTTP/1.1 413"), status  # 8 GiB declared, nothing sent
        chunk = f"{len(prefix):x}\r\n".encode() + prefix + b"\r\n"
        status = _raw_exchange(router, head + "transfer-encoding: chunked\r\n\r\n", chunk)
        assert status.startswith("HTTP/1.1 413"), status  # 2 MiB of an endless body
        r = httpx.post(f"{router}/v1/completions", json=_completion("m"), timeout=60)
        assert r.status_code == 200, r.text  # under the cap: forwarded
        assert raw_replicas[0].heads == 1
