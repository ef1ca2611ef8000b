"""Attack: change the weights under a running server (issue 14, "weights are ours").

Someone with write access to a served adapter's files rewrites bytes in place, truncates the
file, swaps the safetensors file for a pickle, or corrupts a cached copy. Whatever they do, the
server serves the bytes it verified against the registered digest or refuses the request with
one status per cause; it never serves other weights under the old digest and never dies:

- an in-place edit: the host copy is the process's own (read, hashed, then parsed), so after a
  device-slot eviction the next request is answered from it with the same output; once the
  host copy is evicted too, the changed file fails verification (500 adapter_integrity_error);
- a truncation: no SIGBUS (no memory map of the file), the server keeps serving (subprocess);
- ``adapter_model.bin`` swapped in for a registered safetensors revision: refused;
- a bad disk (L2) copy heals within the request; a bad store (L3) copy is 502
  ``adapter_copy_invalid``; changed registered local files are 500 ``adapter_integrity_error``.
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from loraplex.checkpoint.safetensors import safetensors_header
from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.app import ServerState, create_app
from loraplex.testing.server import free_port, serve_in_thread
from loraplex.testing.sync import wait_healthy, wait_idle

ADMIN = "sk-admin-weights"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
WEIGHTS = "adapter_model.safetensors"


def _app(model: Path, modules: list[LoRAModule], root: Path, **engine: Any) -> Any:
    # float32: the host copy keeps the file's dtype, so it is the tensors as read (an mmap'd
    # file's pages before the fix, this process's own bytes after it)
    return create_app(
        ServerConfig(
            EngineConfig(model=str(model), num_threads=1, dtype="float32", **engine),
            served_model_name=["tiny"],
            lora_modules=modules,
            admin_api_key=ADMIN,
            allowed_lora_roots=[str(root)],
            log_level="warning",
        )
    )


def _ask(c: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello there", "max_tokens": 6, "temperature": 0,
            "logprobs": 1, "ignore_eos": True}  # fmt: skip
    return c.post("/v1/completions", json=body)


def _output(r: httpx.Response) -> tuple[str, list[float]]:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def _evict(c: httpx.Client, name: str, tiers: list[str]) -> None:
    r = c.post("/v1/evict_lora_adapter", json={"lora_name": name, "tiers": tiers}, headers=ADMIN_H)
    assert r.status_code == 200, r.text


def _overwrite_b_in_place(weights: Path, value: float = 0.5) -> None:
    """Rewrite every lora_B tensor's bytes inside the file (same size, same header)."""
    header = safetensors_header(weights)
    with open(weights, "r+b") as f:
        for name, t in header.items():
            if "lora_B" in name:
                f.seek(t.start)
                f.write(struct.pack("<f", value) * (t.nbytes // 4))
        f.flush()
        os.fsync(f.fileno())


def _error_code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


@pytest.fixture
def root(tmp_path: Path, adapters: dict[str, Path]) -> Path:
    """A private copy of two adapters the tests may damage."""
    root = tmp_path / "root"
    shutil.copytree(adapters["all_r8"], root / "a")
    shutil.copytree(adapters["mlp_r16"], root / "b")
    return root


def _reactivate_next(c: httpx.Client) -> None:
    """Evict ``a`` from the one device slot and run ``b`` in it, so that the next request for
    ``a`` copies its weights from the host copy into the slot again."""
    _evict(c, "a", ["device"])
    assert _ask(c, "b").status_code == 200


def test_in_place_edit_never_changes_what_is_served_under_the_old_digest(
    tiny_model: Path, root: Path
) -> None:
    modules = [LoRAModule("a", str(root / "a")), LoRAModule("b", str(root / "b"))]
    app = _app(tiny_model, modules, root, max_loras=1)
    state: ServerState = app.state.loraplex
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        before = _output(_ask(c, "a"))
        _overwrite_b_in_place(root / "a" / WEIGHTS)
        _reactivate_next(c)
        r = _ask(c, "a")
        assert r.headers["x-loraplex-adapter-state"] == "warm"
        assert _output(r) == before  # the verified bytes, not the file's new ones
        _evict(c, "a", ["device", "host"])  # now the next request must read the changed file
        r = _ask(c, "a")
        assert r.status_code == 500 and _error_code(r) == "adapter_integrity_error", r.text
        assert _ask(c, "tiny").status_code == 200  # everything else goes on
        wait_idle(state.engine)


def test_truncated_file_never_crashes_the_server(
    tiny_model: Path, root: Path, tmp_path: Path
) -> None:
    """In a subprocess: before the fix the next activation died of SIGBUS (a mapped page past
    the new end of the file), which would have taken the test process with it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "loraplex.cli", "serve", str(tiny_model), "--port", str(port),
        "--enable-lora", "--max-loras", "1",
        "--lora-modules", f"a={root / 'a'}", f"b={root / 'b'}",
        "--served-model-name", "tiny", "--num-threads", "1", "--dtype", "float32",
        "--admin-api-key", ADMIN,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, url)
        with httpx.Client(base_url=url, timeout=120) as c:
            before = _output(_ask(c, "a"))
            os.truncate(root / "a" / WEIGHTS, 64)
            _reactivate_next(c)
            try:
                r = _ask(c, "a")
            except httpx.TransportError as e:  # the server died under the request
                raise AssertionError(f"the server died ({proc.poll()}): {e}") from e
            assert proc.poll() is None
            assert _output(r) == before  # served from the owned, verified host copy
            _evict(c, "a", ["device", "host"])
            r = _ask(c, "a")  # the truncated file itself: a clean error for this request
            assert r.status_code == 500 and _error_code(r) == "adapter_integrity_error", r.text
            assert _ask(c, "tiny").status_code == 200
            assert proc.poll() is None and c.get("/health").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_bin_swapped_in_for_registered_safetensors_is_refused(tiny_model: Path, root: Path) -> None:
    """The registry registered safetensors: a pickle put in its place (same tensors, so the
    same digest) is never unpickled for that revision."""
    from safetensors.torch import load_file

    app = _app(tiny_model, [LoRAModule("a", str(root / "a"))], root, max_loras=1)
    state: ServerState = app.state.loraplex
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        assert _ask(c, "a").status_code == 200
        tensors = {k: v.clone() for k, v in load_file(str(root / "a" / WEIGHTS)).items()}
        torch.save(tensors, str(root / "a" / "adapter_model.bin"))
        (root / "a" / WEIGHTS).unlink()
        _evict(c, "a", ["device", "host"])
        r = _ask(c, "a")
        assert r.status_code == 500 and _error_code(r) == "adapter_integrity_error", r.text
        assert "adapter_model.bin" in r.json()["error"]["message"]
        assert _ask(c, "tiny").status_code == 200
        wait_idle(state.engine)
        assert state.engine.adapters.tier_of(state.registry.get("a").sha256) is None


@pytest.fixture
def store_app(tiny_model: Path, root: Path, tmp_path: Path) -> Iterator[tuple[httpx.Client, Any]]:
    """A server with an object store (``root/store``), a disk tier, a store adapter ``s`` and
    a local adapter ``b``."""
    store = root / "store"
    shutil.copytree(root / "a", store / "s")
    modules = [LoRAModule("s", str(store / "s")), LoRAModule("b", str(root / "b"))]
    app = _app(
        tiny_model, modules, root, max_loras=1, adapter_store_url=str(store),
        disk_cache_dir=str(tmp_path / "l2"), disk_cache_bytes=64 << 20,
    )  # fmt: skip
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c, app.state.loraplex


def test_bad_disk_copy_heals_within_the_request(store_app: tuple[httpx.Client, Any]) -> None:
    c, state = store_app
    cache = state.engine.adapters
    before = _output(_ask(c, "s"))
    (digest,) = cache.disk.entries()
    _evict(c, "s", ["device", "host"])
    weights = cache.disk.root / digest / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-100])  # the L2 copy only
    loads = cache.stats.remote_loads
    r = _ask(c, "s")
    assert r.headers["x-loraplex-adapter-state"] == "cold"
    assert _output(r) == before  # fetched again from the store, in this request
    assert cache.stats.remote_loads == loads + 1 and cache.stats.bad_copies_replaced == 1
    assert digest in cache.disk.entries()
    wait_idle(state.engine)


def test_bad_store_copy_is_502_and_changed_local_files_500(
    store_app: tuple[httpx.Client, Any], root: Path
) -> None:
    c, state = store_app
    assert _ask(c, "s").status_code == 200 and _ask(c, "b").status_code == 200
    _overwrite_b_in_place(root / "store" / "s" / WEIGHTS)  # the source of truth itself
    _evict(c, "s", ["device", "host", "disk"])
    r = _ask(c, "s")
    assert r.status_code == 502 and _error_code(r) == "adapter_copy_invalid", r.text
    assert (root / "store" / "s" / WEIGHTS).is_file()  # reported, never deleted
    _overwrite_b_in_place(root / "b" / WEIGHTS)
    _evict(c, "b", ["device", "host"])
    r = _ask(c, "b")
    assert r.status_code == 500 and _error_code(r) == "adapter_integrity_error", r.text
    assert _ask(c, "tiny").status_code == 200
    wait_idle(state.engine)
    assert state.engine.adapters.stats.load_failures == 2
