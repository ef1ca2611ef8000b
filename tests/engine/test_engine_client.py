"""The engine client, the server's one way to the engine: its adapter members on a real engine
(load check, pin/unpin/evict, copies, residency), LoRA switched off (every adapter member is a
clear error, none half-works), and staging an object-store source for registration (fetched to
a temporary directory that is gone afterwards), also through a server's ``--lora-modules``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.cache.s3 import S3Store
from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.engine.client import EngineClient
from loraplex.lora.digest import digest_safetensors_dir
from loraplex.server.app import create_app
from loraplex.testing.server import serve_in_thread
from loraplex.types import AdapterError, AdapterInUseError, AdapterRef, AdapterSpec
from tests.s3fixture import fake_aws_env, run_moto_server


def _spec(name: str, path: Path) -> AdapterSpec:
    return AdapterSpec(AdapterRef(name, "r1", digest_safetensors_dir(path)), str(path))


def _client(model: Path, **kw: object) -> EngineClient:
    return EngineClient.from_config(
        EngineConfig(model=str(model), dtype="float32", num_kv_blocks=32, **kw)  # type: ignore[arg-type]
    )


def test_adapter_members(tiny_model: Path, adapters: dict[str, Path]) -> None:
    client = _client(tiny_model, max_loras=2, max_cpu_loras=4)
    spec = _spec("a", adapters["all_r8"])
    d = spec.sha256
    assert client.lora_enabled and client.max_loras == 2 and client.max_cpu_loras == 4
    assert not client.has_copy(d) and client.tier_of(d) is None
    stages: list[str] = []
    client.add_load_observer(lambda stage, s: stages.append(stage))
    assert client.check_loadable(spec) == spec.ref
    assert "resolve" in stages
    assert client.has_copy(d) and client.tier_of(d) == "host"
    [row] = client.residency()
    assert row.ref == spec.ref and row.in_flight == 0 and not row.pinned
    assert client.resident_bytes()["host"] == (1, row.nbytes)
    assert client.cache_stats.cold_requests == 0  # a load check is no request
    assert client.pin(spec) == d and client.residency()[0].pinned
    with pytest.raises(AdapterInUseError):
        client.evict(d)
    assert client.has_copy(d)  # a refused eviction changes nothing
    assert client.unpin(d) == d
    assert client.evict(d) == ["host"]
    assert not client.has_copy(d) and client.tier_of(d) is None
    assert client.is_local_source(spec)
    client.engine.adapters.check_invariants()  # type: ignore[union-attr]


def test_lora_disabled(tiny_model: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    client = _client(tiny_model, enable_lora=False)
    spec = _spec("a", adapters["all_r8"])
    assert not client.lora_enabled
    client.add_load_observer(lambda stage, s: None)  # nothing loads: accepted, never called
    for member in (
        lambda: client.max_loras,
        lambda: client.check_loadable(spec),
        lambda: client.pin(spec),
        lambda: client.evict(spec.sha256),
        lambda: client.residency(),
        lambda: client.device_adapter_digests(),
    ):
        with pytest.raises(AdapterError, match="LoRA is disabled"):
            member()
    with client.staged_source("a", str(adapters["all_r8"])) as (local, uri):  # used in place
        assert (local, uri) == (str(adapters["all_r8"]), None)
    with client.staged_source("a", adapters["all_r8"].as_uri()) as (local, uri):
        assert (local, uri) == (str(adapters["all_r8"]), None)
    with pytest.raises(AdapterError, match="no object store is configured"):
        with client.staged_source("a", "s3://bucket/a"):
            pass


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("moto-client")
    with fake_aws_env(tmp), run_moto_server(tmp) as url:
        yield url


def test_object_store_source_is_staged(
    s3_endpoint: str,
    tiny_model: Path,
    adapters: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    bucket = f"lp-{uuid.uuid4().hex[:12]}"
    s3 = S3Store(bucket, "adapters")
    s3._client.create_bucket(Bucket=bucket)
    s3.put_dir(adapters["mlp_r16"], "m")
    uri = f"s3://{bucket}/adapters/m"
    canonical = s3.uri(uri)  # the store's spelling of it (a directory: trailing slash)
    client = _client(tiny_model, adapter_store_url=f"s3://{bucket}/adapters")
    with client.staged_source("m", uri) as (local, recorded):
        staged = Path(local)
        assert recorded == canonical and staged.name == "a"
        assert digest_safetensors_dir(staged) == digest_safetensors_dir(adapters["mlp_r16"])
    assert not staged.exists() and not staged.parent.exists()  # the temporary copy is gone

    config = ServerConfig(
        EngineConfig(
            model=str(tiny_model), dtype="float32", adapter_store_url=f"s3://{bucket}/adapters"
        ),
        served_model_name=["tiny"],
        lora_modules=[LoRAModule("m", uri)],
        log_level="warning",
    )
    app = create_app(config)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        # registered with the store URI, not the temp copy (a keyless server's /v1/models
        # shows it as vLLM shows an adapter's path; tenant keys see name@revision instead)
        registered = app.state.loraplex.registry.get("m")
        assert registered.source_uri == canonical
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert models["m"]["root"] == canonical
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.headers["x-loraplex-adapter"].startswith("m;")
