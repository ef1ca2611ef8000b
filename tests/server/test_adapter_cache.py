"""The tiered adapter cache through the server: warm policies at start-up, admin pin / unpin /
evict, tier metrics, and a full host tier answering 503 + Retry-After (not a hang, not a 500)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.app import ServerState, create_app
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import StepGate, wait_idle

ADMIN = "sk-admin-cache"
BASE = "tiny"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


def _server(model: Path, modules: list[LoRAModule], root: Path, **engine: Any) -> Any:
    return create_app(
        ServerConfig(
            EngineConfig(model=str(model), num_threads=1, **engine),
            served_model_name=[BASE],
            lora_modules=modules,
            admin_api_key=ADMIN,
            allowed_lora_roots=[str(root)],
            log_level="warning",
        )
    )


def _rows(c: httpx.Client) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in c.get("/v1/adapters").json()["data"]}


@pytest.fixture(scope="module")
def warm_server(
    tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[httpx.Client, ServerState]]:
    modules = [
        LoRAModule("dev", str(adapters["all_r8"]), warm="device-preferred"),
        LoRAModule("hosted", str(adapters["mlp_r16"]), warm="host"),
        LoRAModule("lazy", str(adapters["attn_r4_rslora"])),
    ]
    app = _server(tiny_model, modules, tmp_path_factory.mktemp("root"), max_loras=2)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c, app.state.loraplex


def test_warm_policies_at_start_up(warm_server: tuple[httpx.Client, ServerState]) -> None:
    c, _ = warm_server
    rows = _rows(c)
    assert rows["dev"]["tier"] == "device" and rows["dev"]["pinned"]
    assert rows["dev"]["warm_policy"] == "device-preferred"
    assert rows["hosted"]["pinned"] and rows["hosted"]["warm_policy"] == "host"
    assert rows["hosted"]["tier"] in ("host", "device")
    assert not rows["lazy"]["pinned"] and rows["lazy"]["warm_policy"] == "on-demand"
    assert c.get("/v1/adapters").json()["policy"] == "hybrid"


def test_admin_pin_unpin_evict(warm_server: tuple[httpx.Client, ServerState]) -> None:
    c, state = warm_server
    # pinned adapters cannot be evicted: 409, nothing changes
    r = c.post("/v1/evict_lora_adapter", json={"lora_name": "dev"}, headers=ADMIN_H)
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_in_use"
    assert _rows(c)["dev"]["tier"] == "device"

    r = c.post("/v1/pin_lora_adapter", json={"lora_name": "lazy"}, headers=ADMIN_H)
    assert r.status_code == 200 and r.json()["pinned"] is True
    assert _rows(c)["lazy"]["pinned"]
    r = c.post("/v1/evict_lora_adapter", json={"lora_name": "lazy"}, headers=ADMIN_H)
    assert r.status_code == 409
    r = c.post("/v1/unpin_lora_adapter", json={"lora_name": "lazy"}, headers=ADMIN_H)
    assert r.status_code == 200 and not _rows(c)["lazy"]["pinned"]
    r = c.post(
        "/v1/evict_lora_adapter", json={"lora_name": "lazy", "tiers": ["host"]}, headers=ADMIN_H
    )
    assert r.status_code == 200 and "host" in r.json()["evicted_from"]
    assert _rows(c)["lazy"]["tier"] == "disk"  # its directory is still on local disk

    # the next request loads it again (cold), and the response says so
    r = c.post("/v1/completions", json={"model": "lazy", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-loraplex-adapter-state"] == "cold"
    wait_idle(state.engine)

    for route in ("pin_lora_adapter", "unpin_lora_adapter", "evict_lora_adapter"):
        r = c.post(f"/v1/{route}", json={"lora_name": "nope"}, headers=ADMIN_H)
        assert r.status_code == 404, route
        r = c.post(f"/v1/{route}", json={"lora_name": "lazy"})
        assert r.status_code == 401, route
    r = c.post("/v1/evict_lora_adapter", json={"lora_name": "lazy", "tiers": ["L9"]},
               headers=ADMIN_H)  # fmt: skip
    assert r.status_code == 400


def test_tier_metrics(warm_server: tuple[httpx.Client, ServerState]) -> None:
    c, _ = warm_server
    c.post("/v1/completions", json={"model": "hosted", "prompt": "hi", "max_tokens": 2})
    text = c.get("/metrics").text
    for name in (
        'adapter_cache_hits_total{tier="device"}',
        'adapter_cache_hits_total{tier="host"}',
        'adapter_evictions_total{tier="host"}',
        'adapter_reload_after_eviction_total{tier="host"}',
        'adapter_thrash_ratio{tier="device"}',
        "adapter_cache_misses_total",
        'adapter_resident_count{tier="host"}',
        "adapter_remote_loads_total",
    ):
        assert name in text, name
    assert 'running_lora_adapters="' in text and "dev" in text


def test_full_host_tier_is_a_503_then_recovers(
    tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Host memory fits one adapter; while request A holds adapter a (the engine loop is held at
    a step gate, so A cannot finish), a request for b cannot make room: after the bounded wait it
    gets 503 + Retry-After, A is unaffected, and once A finishes b is served.

    The byte budget is computed at float32 and the server runs in float32 (``dtype="auto"``
    would pick bfloat16 on a CPU with AVX512-BF16, and then both adapters fit)."""
    from loraplex.checkpoint.modules import BaseModelSpec
    from loraplex.lora.adapter import load_peft_adapter
    from loraplex.model.config import load_model_config

    mc = load_model_config(tiny_model)
    spec = BaseModelSpec(mc.num_layers, mc.module_shapes, mc.model_type)
    sizes = {
        n: load_peft_adapter(adapters[n], spec, dtype=torch.float32).nbytes
        for n in ("all_r8", "mlp_r16")
    }
    assert sum(sizes.values()) > max(sizes.values())  # both never fit in the budget below
    modules = [LoRAModule("a", str(adapters["all_r8"])), LoRAModule("b", str(adapters["mlp_r16"]))]
    app = _server(
        tiny_model, modules, tmp_path_factory.mktemp("root"), dtype="float32",
        max_loras=2, max_cpu_lora_bytes=max(sizes.values()), adapter_load_timeout_s=0.5,
    )  # fmt: skip
    state: ServerState = app.state.loraplex
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        assert _rows(c)["a"]["bytes"] == sizes["all_r8"]  # the server sizes copies the same way
        c.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 1})
        held: dict[str, Any] = {}

        def request_a() -> None:
            r = c.post(
                "/v1/completions",
                json={"model": "a", "prompt": "hi", "max_tokens": 5, "ignore_eos": True},
            )
            held["status"] = r.status_code
            held["tokens"] = r.json()["usage"]["completion_tokens"]

        with StepGate(state.engine) as gate:
            gate.hold()
            t = threading.Thread(target=request_a)
            t.start()
            gate.wait_held()  # A is in the engine, holding adapter a, and cannot finish
            assert state.engine.adapters.request_refs
            r = c.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "adapter_capacity"
            assert r.headers.get("retry-after") == "1"
            assert t.is_alive()
            gate.open()
            t.join()
        assert held == {"status": 200, "tokens": 5}
        r = c.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        wait_idle(state.engine)
        assert c.get("/health").status_code == 200


def test_store_backed_adapter_tiers(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """An adapter served from the object store: after eviction from every tier it is reported
    ``absent`` (only in the store), and the next request fetches it again through the disk tier."""
    import shutil

    store = tmp_path / "store"
    shutil.copytree(adapters["all_r8"], store / "s")
    modules = [LoRAModule("s", str(store / "s"))]
    app = _server(
        tiny_model, modules, tmp_path, max_loras=2,
        adapter_store_url=str(store), disk_cache_dir=str(tmp_path / "l2"),
        disk_cache_bytes=64 << 20,
    )  # fmt: skip
    state: ServerState = app.state.loraplex
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        assert _rows(c)["s"]["tier"] in ("host", "disk")
        r = c.post("/v1/evict_lora_adapter", json={"lora_name": "s"}, headers=ADMIN_H)
        assert r.status_code == 200, r.text
        assert _rows(c)["s"]["tier"] == "absent"
        r = c.post("/v1/completions", json={"model": "s", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-loraplex-adapter-state"] == "cold"
        wait_idle(state.engine)
        assert _rows(c)["s"]["tier"] == "device"
        assert state.engine.adapters.stats.remote_loads == 2  # start-up, then after the evict
