"""Attack: exhaust adapter capacity with many adapters or slow loads (issue 14).

- ``--max-cpu-loras`` is a hard cap on host copies, like the byte budget: with every copy in use
  by live requests, a request for one more adapter waits ``--adapter-load-timeout`` and then gets
  503 + Retry-After (before the fix it was admitted: 8 allowed, 32 held);
- a request that joins another request's load of the same adapter waits a bounded time, then
  gets a retryable 503; the load goes on and later requests get its copy; requests for other
  models are served meanwhile.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import httpx

from loraplex.cache.store import LocalDirStore
from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.app import ServerState, create_app
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import EVENT_TIMEOUT_S, StepGate, wait_idle, wait_until

ADMIN = "sk-admin-capacity"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


def _app(model: Path, modules: list[LoRAModule], root: Path, **engine: Any) -> Any:
    return create_app(
        ServerConfig(
            EngineConfig(model=str(model), num_threads=1, **engine),
            served_model_name=["tiny"],
            lora_modules=modules,
            admin_api_key=ADMIN,
            allowed_lora_roots=[str(root)],
            log_level="warning",
        )
    )


def _complete(c: httpx.Client, model: str, **kw: Any) -> httpx.Response:
    body = {"model": model, "prompt": "hi", "max_tokens": 3, "ignore_eos": True, **kw}
    return c.post("/v1/completions", json=body)


def test_max_cpu_loras_is_a_hard_cap_under_load(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    names = ("all_r8", "mlp_r16", "attn_r4_rslora")
    modules = [LoRAModule(f"m{i}", str(adapters[n])) for i, n in enumerate(names)]
    app = _app(
        tiny_model, modules, tmp_path, max_loras=1, max_cpu_loras=2, adapter_load_timeout_s=0.5
    )
    state: ServerState = app.state.loraplex
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        done: dict[str, int] = {}

        def run(model: str) -> None:
            done[model] = _complete(c, model).status_code

        with StepGate(state.engine) as gate:
            gate.hold()
            threads = [threading.Thread(target=run, args=(m,)) for m in ("m0", "m1")]
            for t in threads:
                t.start()
            # both requests are in the engine, each holding its adapter's host copy
            wait_until(lambda: len(state.engine.adapters.request_refs) == 2, what="two holders")
            r = _complete(c, "m2")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "adapter_capacity"
            assert r.headers.get("retry-after") == "1"
            assert state.engine.adapters.resident_bytes()["host"][0] == 2  # never 3
            gate.open()
            for t in threads:
                t.join()
        assert done == {"m0": 200, "m1": 200}
        assert _complete(c, "m2").status_code == 200  # room again once they finished
        wait_idle(state.engine)
        assert state.engine.adapters.resident_bytes()["host"][0] <= 2


class GatedStore(LocalDirStore):
    """A local-dir object store whose fetches wait until ``release`` is set (a slow store)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.fetching = threading.Event()
        self.fetches = 0

    def fetch(self, uri, dest):  # type: ignore[no-untyped-def]
        self.fetches += 1
        self.fetching.set()
        assert self.release.wait(EVENT_TIMEOUT_S), "the test never released the fetch"
        return super().fetch(uri, dest)


def test_a_wait_on_another_request_s_load_is_bounded(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    store_root = tmp_path / "store"
    shutil.copytree(adapters["all_r8"], store_root / "s")
    app = _app(
        tiny_model, [LoRAModule("s", str(store_root / "s"))], tmp_path, max_loras=1,
        adapter_store_url=str(store_root), adapter_load_timeout_s=0.5,
    )  # fmt: skip
    state: ServerState = app.state.loraplex
    cache = state.engine.adapters
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/evict_lora_adapter", json={"lora_name": "s"}, headers=ADMIN_H)
        assert r.status_code == 200, r.text
        slow = GatedStore(store_root)
        cache.loader.store = slow  # from now on every fetch waits for the test
        first: dict[str, httpx.Response] = {}
        leader = threading.Thread(target=lambda: first.setdefault("r", _complete(c, "s")))
        try:
            leader.start()
            assert slow.fetching.wait(EVENT_TIMEOUT_S)  # the leader's load is in progress
            with httpx.Client(base_url=url, timeout=30) as c2:
                r = _complete(c2, "s")  # joins that load, and stops waiting after 0.5 s
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "adapter_capacity"
                assert r.headers.get("retry-after") == "1"
                assert "did not finish" in r.json()["error"]["message"]
                assert _complete(c2, "tiny").status_code == 200  # others are served meanwhile
            assert cache.stats.join_timeouts == 1 and leader.is_alive()
        finally:
            slow.release.set()
            leader.join()
        assert first["r"].status_code == 200  # the load went on
        r = _complete(c, "s")
        assert r.status_code == 200 and r.headers["x-loraplex-adapter-state"] == "warm"
        assert slow.fetches == 1
        wait_idle(state.engine)
        cache.check_invariants()


def test_offline_generate_holds_more_adapters_than_max_cpu_loras_for_one_call(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """``LLM.generate`` holds every adapter of its call at once, so the call widens the count
    for itself; the hard cap is back (and holds) once it returns."""
    from loraplex.entrypoints.llm import LLM
    from loraplex.requests import LoRARequest, SamplingParams

    llm = LLM(str(tiny_model), max_loras=1, max_cpu_loras=1, max_lora_rank=64, num_threads=1)
    names = ("all_r8", "mlp_r16", "attn_r4_rslora")
    outs = llm.generate(
        [[1, 2, 3]] * 3,
        SamplingParams(max_tokens=2, ignore_eos=True),
        lora_request=[LoRARequest(n, str(adapters[n])) for n in names],
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2, 2]
    cache = llm.engine.adapters
    assert cache is not None and cache.tiers.max_host_copies == 1
    assert cache.resident_bytes()["host"][0] == 1 and cache.is_idle()
    cache.check_invariants()
