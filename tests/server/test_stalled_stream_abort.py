"""A client that never reads its stream (issue 14, item 5).

It sends a streaming request with logprobs and n=8 on a raw socket with a tiny receive buffer
and never reads. Before the fix the server buffered every step's full cumulative output (an
unbounded queue of snapshots, O(tokens^2) memory) and the engine generated to ``max_tokens``.
Now each request keeps only its latest unread snapshot, and once the reader is further behind
than ``--stream-max-unread-tokens`` (or ``--stream-stall-timeout``) while the engine keeps
producing, the request is aborted in the engine (KV blocks and slot freed) and its connection
closed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.llm_engine import LLMEngine
from loraplex.requests import GenerationRequest, SamplingParams
from loraplex.server.app import ServerState, create_app
from loraplex.testing import make_random_model
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import EVENT_TIMEOUT_S, StepGate, wait_idle, wait_until

BASE = "tiny"
MAX_TOKENS = 2000
N = 8


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with room for long completions (4096 positions)."""
    return make_random_model(
        tmp_path_factory.mktemp("long") / "m", num_layers=2, max_position_embeddings=4096
    )


def _engine_config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), num_threads=1, max_num_seqs=N, num_kv_blocks=1200)


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


class _PeakRSS:
    """The process's peak RSS while the block runs (sampled by a thread)."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> _PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _never_reading_client(url: str, body: dict[str, Any]) -> socket.socket:
    """Send ``body`` as a streaming completion on a socket that never reads (small receive
    buffer, so the server's sends block soon)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    s.sendall(head + data)
    return s


def _read_to_eof(s: socket.socket) -> bytes:
    """Everything the server sent until it closed the connection (bounded by a timeout: a
    connection the server keeps open fails the test)."""
    s.settimeout(EVENT_TIMEOUT_S)
    chunks = []
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


@pytest.fixture(params=["tokens", "seconds"])
def stall_server(
    request: pytest.FixtureRequest, long_model: Path
) -> Iterator[tuple[str, ServerState]]:
    bound = (
        {"stream_max_unread_tokens": 64, "stream_stall_timeout_s": 0.0}
        if request.param == "tokens"
        else {"stream_max_unread_tokens": 0, "stream_stall_timeout_s": 0.5}
    )
    config = ServerConfig(
        _engine_config(long_model), served_model_name=[BASE], log_level="critical", **bound
    )
    app = create_app(config)
    with serve_in_thread(app) as url:
        yield url, app.state.loraplex


def test_a_client_that_never_reads_is_aborted_and_its_kv_freed(
    stall_server: tuple[str, ServerState],
) -> None:
    url, state = stall_server
    eng = state.engine
    body = {"model": BASE, "prompt": "Hello", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "logprobs": 20, "n": N, "seed": 1}  # fmt: skip
    steps_before = eng.num_steps
    with _PeakRSS() as rss:
        base = _rss()
        sock = _never_reading_client(url, body)
        try:
            wait_until(lambda: eng.num_steps > steps_before, what="the request to start")
            # the event: the engine holds nothing any more (before the fix: only after
            # generating all MAX_TOKENS tokens)
            wait_idle(eng, state.aengine)
            steps = eng.num_steps - steps_before
            grown = rss.peak - base
            received = _read_to_eof(sock)  # the server closed the connection
        finally:
            sock.close()
    assert eng.is_idle() and eng.num_free_blocks == eng.pool.num_blocks
    assert steps < MAX_TOKENS // 2, f"the engine ran {steps} steps for a client that never reads"
    assert state.client.num_stalled == 1
    assert b"[DONE]" not in received  # the stream was cut, not finished
    assert grown < 64 << 20, f"server memory grew by {grown / 2**20:.0f} MiB"


def test_an_unread_request_keeps_only_its_latest_output(long_model: Path) -> None:
    """The reader takes the first output, then the engine runs 4 more steps nobody reads: the
    next read is the latest snapshot (5 tokens), not the second of four queued ones."""
    engine = LLMEngine(_engine_config(long_model))
    aeng = AsyncEngine(engine)
    aeng.start()
    params = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0)

    async def main() -> tuple[int, int, int]:
        prepared = await aeng.prepare(GenerationRequest("r", [1, 2, 3, 4], params))
        with StepGate(engine) as gate:
            gate.hold()
            stream = aeng.generate(prepared)
            reading = asyncio.ensure_future(stream.__anext__())
            await asyncio.to_thread(wait_until, lambda: engine.requests, what="the request")
            gate.allow(1)
            first = await reading
            gate.allow(4)
            await asyncio.to_thread(gate.wait_held)
            second = await stream.__anext__()
            gate.open()
            last = second
            async for out in stream:
                last = out
        return tuple(len(o.outputs[0].token_ids) for o in (first, second, last))  # type: ignore[return-value]

    try:
        counts = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert counts == (1, 5, 50)
    assert engine.is_idle()
