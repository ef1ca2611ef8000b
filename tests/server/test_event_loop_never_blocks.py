"""The event loop and the preparation pools never wait on slow I/O (issue 14, code reading).

Before the fix, request preparation, adapter loads and registry polls shared four worker
threads, so four cold loads stalled every warm request; and request handlers refreshed the
registry catalog (a query and a rebuild under a lock) on the event loop, so a slow registry
stalled every route. Now cold requests prepare in their own pool, the catalog is refreshed in
the background (requests only read its snapshot), and a preparation that takes too long is a
503 whose late result is discarded.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.cache.store import LocalDirStore
from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.registry import Registry, RegistryPolicy, base_model_info
from loraplex.server.app import ServerState, create_app
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import EVENT_TIMEOUT_S, wait_idle, wait_until

BASE = "tiny"
COLD = [f"cold{i}" for i in range(6)]  # more cold adapters than preparation workers (4)
SOURCES = ["all_r8", "mlp_r16", "attn_r4_rslora", "qv_r32_regex", "alllinear_r12", "patterns"]


class HeldStore(LocalDirStore):
    """A local-dir object store whose fetches wait while ``held`` is set (a slow download)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.release.set()
        self.fetching = 0
        self._lock = threading.Lock()

    def hold(self) -> None:
        self.release.clear()

    def fetch(self, uri, dest):  # type: ignore[no-untyped-def]
        with self._lock:
            self.fetching += 1
        try:
            assert self.release.wait(EVENT_TIMEOUT_S), "the test never released the fetch"
            return super().fetch(uri, dest)
        finally:
            with self._lock:
                self.fetching -= 1


@dataclass
class Live:
    url: str
    state: ServerState
    store: HeldStore

    def complete(self, model: str, **kw: Any) -> httpx.Response:
        body = {"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0, **kw}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=EVENT_TIMEOUT_S)


@contextlib.contextmanager
def _server(model: Path, adapters: dict[str, Path], tmp: Path, **server: Any) -> Iterator[Live]:
    """Six adapters in a (held-able) object store, cold, and ``warm`` in host memory."""
    store_root = tmp / "store"
    for name, src in zip(COLD, SOURCES, strict=True):
        shutil.copytree(adapters[src], store_root / name)
    # registered, not --lora-modules (which are all loaded at start-up): on-demand, so cold
    registry = Registry.open(
        f"sqlite:///{tmp / 'r.db'}", policy=RegistryPolicy(allowed_roots=(str(store_root),))
    )
    base = base_model_info(model, name=BASE)
    for name in COLD:
        m = registry.register(store_root / name, name, base=base, actor="test")
        registry.activate(name, m.revision, actor="test")
    config = ServerConfig(
        EngineConfig(
            model=str(model), num_threads=1, max_loras=2, max_cpu_loras=8, dtype="float32",
            adapter_store_url=str(store_root), disk_cache_dir=str(tmp / "l2"),
            disk_cache_bytes=1 << 26,
        ),
        served_model_name=[BASE],
        lora_modules=[LoRAModule("warm", str(adapters["all_r64_layer1"]), warm="host")],
        registry_poll_s=0.05,
        log_level="warning",
        **server,
    )  # fmt: skip
    engine = LLMEngine(config.engine)
    assert engine.adapters is not None
    store = HeldStore(store_root)
    engine.adapters.loader.store = store
    app = create_app(config, engine=engine, registry=registry)
    try:
        with serve_in_thread(app) as url:
            yield Live(url, app.state.loraplex, store)
    finally:
        registry.close()


@pytest.fixture
def live(tiny_model: Path, adapters: dict[str, Path], tmp_path: Path) -> Iterator[Live]:
    with _server(tiny_model, adapters, tmp_path) as live:
        yield live


def test_warm_requests_complete_while_cold_loads_are_held(live: Live) -> None:
    """Six cold adapters' downloads are held (more than the four preparation workers): warm
    requests — the base model and an adapter in host memory — still complete meanwhile."""
    store, state = live.store, live.state
    assert live.complete("warm").status_code == 200
    store.hold()
    with ThreadPoolExecutor(len(COLD)) as pool:
        cold = [pool.submit(live.complete, name) for name in COLD]
        wait_until(lambda: store.fetching == 4, what="four cold downloads in progress")
        for _ in range(3):
            for model in (BASE, "warm"):
                r = live.complete(model)
                assert r.status_code == 200, r.text
        assert store.fetching == 4 and not any(c.done() for c in cold)  # still held
        store.release.set()
        codes = [c.result().status_code for c in cold]
    assert codes == [200] * len(COLD), codes
    wait_idle(state.engine, state.aengine)


def test_a_slow_registry_never_stalls_the_event_loop(live: Live) -> None:
    """The registry's generation query hangs (a slow database) while the server polls it:
    completions, ``/v1/models`` and ``/health`` still answer (the request path reads the
    catalog's snapshot; the refresh waits in its own thread)."""
    state = live.state
    registry = state.registry
    real = registry.generation
    entered, release = threading.Event(), threading.Event()

    def slow_generation() -> int:
        entered.set()
        assert release.wait(EVENT_TIMEOUT_S), "the test never released the registry"
        return real()

    registry.generation = slow_generation  # type: ignore[method-assign]
    try:
        assert entered.wait(EVENT_TIMEOUT_S)  # the background refresh is stuck in the query
        for model in (BASE, "warm"):
            assert live.complete(model).status_code == 200
        with httpx.Client(base_url=live.url, timeout=EVENT_TIMEOUT_S) as h:
            assert h.get("/v1/models").status_code == 200
            assert h.get("/health").status_code == 200
            assert h.get("/v1/adapters").status_code == 200
        assert not release.is_set()
    finally:
        release.set()
        del registry.generation
    wait_idle(state.engine, state.aengine)


def test_a_preparation_that_takes_too_long_is_a_503_and_leaks_nothing(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """With ``--prepare-timeout``, a request whose adapter download is held gets 503 +
    Retry-After once the bound passes; when the download finishes later, its prepared request
    is discarded (no adapter reference left), and the adapter serves the next request warm."""
    with _server(tiny_model, adapters, tmp_path, prepare_timeout_s=0.5) as live:
        live.store.hold()
        r = live.complete("cold0")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "prepare_timeout" and r.headers["retry-after"]
        assert live.store.fetching == 1  # the download goes on
        live.store.release.set()
        cache = live.state.engine.adapters
        assert cache is not None
        digest = live.state.registry.get("cold0").sha256

        def discarded() -> bool:  # loaded into host memory, and no request holds it
            return cache.tier_of(digest) == "host" and not cache.request_refs.get(digest)

        wait_until(discarded, what="the late preparation to be discarded")
        wait_idle(live.state.engine, live.state.aengine)
        r = live.complete("cold0")
        assert r.status_code == 200 and r.headers["x-loraplex-adapter-state"] == "warm"
