"""Run an ASGI app with uvicorn in a background thread on a free loopback port (tests, benches)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_in_thread(app: Any, *, timeout: float = 30.0) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL (``http://127.0.0.1:PORT``)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        # as the servers run (loraplex.server.app.run_server): h11, uvloop when installed
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", http="h11"
        )
    )
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread exited during start-up")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"server did not start within {timeout} s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
