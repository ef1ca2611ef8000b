"""Memory before auth (issue 14, item 3): huge request bodies without a key, or over the cap.

Against a real ``loraplex serve`` in a subprocess (so its RSS is its own): 12 concurrent
200 MiB JSON bodies without a key, more with a key but over ``--max-request-bytes`` (declared
and chunked). Before the fix each body was read and parsed before the 401 (the server grew by
gigabytes). Now a declared length over the cap is refused before reading (413), the key is
checked from the headers before the body is read (401), a chunked body is counted while read
and reading stops at the cap (413); the server's RSS grows by less than 50 MiB.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from loraplex.testing.server import free_port
from loraplex.testing.sync import EVENT_TIMEOUT_S, wait_healthy

KEY = "sk-body-test"
BASE = "tiny"
HUGE = 200 << 20
CAP = 1 << 20  # --max-request-bytes
CHUNK = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[tuple[str, int, psutil.Process]]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "loraplex.cli", "serve", str(tiny_model), "--port", str(port),
        "--served-model-name", BASE, "--api-key", KEY, "--num-threads", "1",
        "--max-request-bytes", "1MiB", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        yield "127.0.0.1", port, psutil.Process(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _read_response(s: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of one HTTP response on ``s``."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed before a response ({buf!r})")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(int(x.split(":")[1]) for x in lines[1:] if x.lower().startswith("content-length"))
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, json.loads(rest[:length])


def _send_huge(host: str, port: int, *, key: str | None, chunked: bool) -> tuple[int, dict, int]:
    """POST a 200 MiB completion body (declared with Content-Length, or chunked), stopping as
    soon as the server answers. Returns (status, error body, body bytes sent)."""
    prefix = json.dumps({"model": BASE, "prompt": ""})[:-2].encode()  # ... "prompt": "
    filler = memoryview(b"a" * CHUNK)
    headers = ["POST /v1/completions HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    if key:
        headers.append(f"Authorization: Bearer {key}")
    headers.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {HUGE}")
    s = socket.create_connection((host, port))
    s.settimeout(EVENT_TIMEOUT_S)
    sent = 0
    try:
        s.sendall(("\r\n".join(headers) + "\r\n\r\n").encode())
        pieces = [prefix] + [filler] * (HUGE // CHUNK)
        for piece in pieces:
            if select.select([s], [], [], 0)[0]:
                break  # the server answered: stop sending, as any client would
            s.sendall(b"%x\r\n" % len(piece) + bytes(piece) + b"\r\n" if chunked else piece)
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server closed the connection after answering
    try:
        status, body = _read_response(s)
    finally:
        s.close()
    return status, body, sent


class _PeakRSS:
    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.peak = proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> _PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_huge_bodies_cost_no_memory_before_auth_or_over_the_cap(
    server: tuple[str, int, psutil.Process],
) -> None:
    host, port, proc = server
    url = f"http://{host}:{port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": BASE, "prompt": "Hello", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60).is_success
    base = proc.memory_info().rss
    attacks = [(None, False)] * 12 + [(KEY, False)] * 4 + [(KEY, True)] * 4 + [(None, True)] * 2
    with _PeakRSS(proc) as rss, ThreadPoolExecutor(len(attacks)) as pool:
        results = list(pool.map(lambda a: _send_huge(host, port, key=a[0], chunked=a[1]), attacks))
    for (key, chunked), (status, err, sent) in zip(attacks, results, strict=True):
        # a declared length over the cap: 413 before anything else; chunked: 401 without a
        # key (from the headers), 413 with one (counted while read)
        want = 401 if key is None and chunked else 413
        assert status == want, (key, chunked, status, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}
        if key is None or not chunked:  # refused from the headers: the body was never wanted
            assert sent < HUGE // 2, sent
    grown = rss.peak - base
    assert grown < 50 << 20, f"the server's RSS grew by {grown / 2**20:.0f} MiB"
    # a body under the cap is parsed and served as before
    assert httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60).is_success
    r = httpx.post(f"{url}/v1/completions", content=b"{" * 10, headers=auth, timeout=60)
    assert r.status_code == 400


def test_a_request_without_a_key_is_refused_before_its_body_arrives(
    server: tuple[str, int, psutil.Process],
) -> None:
    """The 401 comes from the headers alone: the client has sent none of the body it
    declared (before the fix the server waited for the body, then parsed it, then refused)."""
    host, port, _ = server
    s = socket.create_connection((host, port))
    s.settimeout(EVENT_TIMEOUT_S)
    try:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {CAP // 2}\r\n\r\n".encode()
        )
        status, err = _read_response(s)
    finally:
        s.close()
    assert status == 401 and err["error"]["code"] == "invalid_api_key"


def _send_endless_headers(host: str, port: int, limit: int) -> tuple[int, int | None]:
    """Send header lines (1 KiB each) until the server stops the request or ``limit`` bytes
    went out; (bytes sent, the status it answered or None when it just closed)."""
    line = b"X-Filler: " + b"a" * 1012 + b"\r\n"
    s = socket.create_connection((host, port))
    s.settimeout(EVENT_TIMEOUT_S)
    sent = 0
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        while sent < limit and not select.select([s], [], [], 0)[0]:
            s.sendall(line)
            sent += len(line)
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        head = s.recv(65536)
    except (ConnectionResetError, TimeoutError):
        head = b""
    finally:
        s.close()
    status = int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else None
    return sent, status


def test_an_endless_header_block_is_cut_off_without_memory(
    server: tuple[str, int, psutil.Process],
) -> None:
    """Header lines that never end (8 clients at once): the HTTP parser bounds a header block
    (h11, as the server runs it), so each request is refused long before its 64 MiB are out,
    and the server's RSS does not grow by what was sent."""
    host, port, proc = server
    limit = 64 << 20
    base = proc.memory_info().rss
    with _PeakRSS(proc) as rss, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _send_endless_headers(host, port, limit), range(8)))
    for sent, status in results:
        assert sent < limit, "the server kept reading headers"
        assert status in (None, 400, 431)
    assert rss.peak - base < 50 << 20
    assert httpx.get(f"http://{host}:{port}/health", timeout=60).is_success
