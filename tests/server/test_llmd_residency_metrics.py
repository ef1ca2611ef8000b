"""The residency gauges llm-d's ``lora-load-state-scorer`` reads (issue 33, item 1), parsed from
our ``/metrics`` with the rules of its core metrics extractor (llm-d-router
``pkg/epp/framework/plugins/datalayer/extractor/metrics/extractor.go``, ``populateLoraLoadState``
and ``loraTransitionMeans``; ``docs/plugin-metric-protocol.md``, "LoRA Adapter Residency"):

- ``vllm:lora_adapter_loaded``: a series whose value is 0 is skipped, one without an
  ``adapter_name`` is ignored; ``level`` is read as given (``gpu`` or ``cpu``), ``pinned`` is
  true only for ``"true"``, ``rank`` an integer (0 when it does not parse); a name seen twice
  keeps ``gpu`` over ``cpu`` and is pinned if either is. An adapter that left a tier is one
  whose series is gone.
- ``vllm:num_gpu_loaded_lora_adapters``: the largest value is the GPU count, its ``model_name``
  the base model; with neither family present residency is "not reported" (None), with only
  the count gauge at 0 it is "nothing loaded" ({}).
- ``vllm:max_gpu_lora_adapters``: the largest value is the slot capacity.
- ``vllm:lora_adapter_load_seconds``: histogram series pooled by ``transition`` (``load``,
  ``activate``; anything else ignored) into sum / count means.

The model is tiny and on the CPU; ``level="gpu"`` is the device tier whatever the device.
Every step waits for an event (a response, an idle engine), never for time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.app import ServerState, create_app
from loraplex.server.metrics import MAX_NAMES_PER_ADAPTER
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import wait_idle

ADMIN = "sk-admin-llmd"
H = {"Authorization": f"Bearer {ADMIN}"}
BASE = "base-model"
LOADED = "vllm:lora_adapter_loaded"
GPU_COUNT = "vllm:num_gpu_loaded_lora_adapters"
CPU_COUNT = "vllm:num_cpu_loaded_lora_adapters"
SLOTS = "vllm:max_gpu_lora_adapters"
TRANSITIONS = "vllm:lora_adapter_load_seconds"
SERIES_LABELS = {"model_name", "engine", "adapter_name", "level", "pinned", "rank"}


@dataclass(frozen=True)
class State:
    """What the extractor keeps of one adapter (``fwkdl.LoraLoadState``)."""

    level: str
    pinned: bool = False
    rank: int = 0


@dataclass
class Extracted:
    """The endpoint fields the extractor fills from one scrape."""

    loaded: dict[str, State] | None  # LoadedModels (None: residency not reported)
    gpu_loaded: int  # GPULoadedModels
    base_model: str  # BaseModel
    max_active: int  # MaxActiveModels
    load_s: float  # LoraLoadSeconds (mean)
    activate_s: float  # LoraActivateSeconds (mean)
    raw: dict[str, Any]  # family name -> family, for the exposition checks


def extract(text: str) -> Extracted:
    """Apply the extractor's rules to a Prometheus text exposition."""
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def present(name: str) -> Any:
        f = fams.get(name)
        return f if f is not None and f.samples else None  # lookupFamily: no series = absent

    loaded_f, count_f = present(LOADED), present(GPU_COUNT)
    loaded: dict[str, State] | None = None
    gpu, base = 0, ""
    if loaded_f is not None or count_f is not None:
        loaded = {}
        for s in loaded_f.samples if loaded_f is not None else []:
            name = s.labels.get("adapter_name", "")
            if s.value == 0 or not name:
                continue
            try:
                rank = int(s.labels.get("rank", ""))
            except ValueError:
                rank = 0
            st = State(s.labels.get("level", ""), s.labels.get("pinned") == "true", rank)
            prev = loaded.get(name)
            if prev is not None:
                level = prev.level if prev.level == "gpu" else st.level
                st = State(level, st.pinned or prev.pinned, st.rank or prev.rank)
            loaded[name] = st
        if count_f is not None:
            for s in count_f.samples:
                gpu = max(gpu, int(s.value))
                base = s.labels.get("model_name", base)
        else:
            gpu = sum(st.level == "gpu" for st in loaded.values())
    slots_f = present(SLOTS)
    max_active = max((int(s.value) for s in slots_f.samples), default=0) if slots_f else 0
    sums = {"load": 0.0, "activate": 0.0}
    counts = {"load": 0.0, "activate": 0.0}
    trans_f = present(TRANSITIONS)
    for s in trans_f.samples if trans_f is not None else []:
        t = s.labels.get("transition")
        if t not in sums:
            continue
        if s.name.endswith("_sum"):
            sums[t] += s.value
        elif s.name.endswith("_count"):
            counts[t] += s.value

    def mean(t: str) -> float:
        return sums[t] / counts[t] if counts[t] else 0.0

    return Extracted(loaded, gpu, base, max_active, mean("load"), mean("activate"), fams)


def scrape(c: httpx.Client) -> Extracted:
    r = c.get("/metrics", headers=H)
    assert r.status_code == 200, r.text
    got = extract(r.text)
    check_exposition(got)
    return got


def check_exposition(got: Extracted) -> None:
    """Label names and value semantics of every residency series, as the PRs publish them."""
    fam = got.raw.get(LOADED)
    assert fam is not None and fam.type == "gauge"  # the family is declared even when empty
    for s in fam.samples:
        assert set(s.labels) == SERIES_LABELS, s.labels
        assert s.value == 1.0  # resident: 1; not resident: no series (never a 0 left behind)
        assert s.labels["level"] in ("gpu", "cpu")
        assert s.labels["pinned"] in ("true", "false")
        assert s.labels["rank"].isdigit() and int(s.labels["rank"]) > 0
        assert s.labels["model_name"] == BASE and s.labels["engine"] == "0"
    names = [s.labels["adapter_name"] for s in fam.samples]
    assert len(names) == len(set(names)), names  # one series per served name
    for name in (GPU_COUNT, CPU_COUNT, SLOTS):
        f = got.raw[name]
        assert f.type == "gauge" and len(f.samples) == 1, name
        assert f.samples[0].labels == {"model_name": BASE, "engine": "0"}, name
    assert got.raw[TRANSITIONS].type == "histogram"
    cpu = got.raw[CPU_COUNT].samples[0].value
    assert len(fam.samples) <= cpu * MAX_NAMES_PER_ADAPTER  # bounded by host copies


def truth(state: ServerState) -> dict[str, str]:
    """Served name -> gpu | cpu from the cache's own residency rows (the dashboard's source)."""
    out: dict[str, str] = {}
    for row in state.client.residency():
        level = {"device": "gpu", "host": "cpu"}.get(row.tier)
        if level is not None:
            for name in state.catalog.names_of(row.ref.sha256):
                out[name] = level
    return out


def complete(c: httpx.Client, state: ServerState, model: str) -> None:
    body = {"model": model, "prompt": "hello there", "max_tokens": 2, "temperature": 0}
    r = c.post("/v1/completions", json=body, headers=H)
    assert r.status_code == 200, r.text
    wait_idle(state.engine, state.aengine)


def admin(c: httpx.Client, route: str, **body: Any) -> dict[str, Any]:
    r = c.post(f"/v1/{route}", json=body, headers=H)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def server(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> Iterator[tuple[httpx.Client, ServerState]]:
    modules = [
        LoRAModule("alpha", str(adapters["all_r8"])),
        LoRAModule("alpha-alias", str(adapters["all_r8"])),  # the same digest, a second name
        LoRAModule("beta", str(adapters["mlp_r16"])),
        LoRAModule("gamma", str(adapters["attn_r4_rslora"])),
        LoRAModule("delta", str(adapters["qv_r32_regex"])),  # registered, never requested
    ]
    config = ServerConfig(
        EngineConfig(
            model=str(tiny_model), device="cpu", num_threads=1, max_loras=2, max_cpu_loras=3
        ),
        served_model_name=[BASE],
        lora_modules=modules,
        admin_api_key=ADMIN,
        allowed_lora_roots=[str(tmp_path)],
        log_level="warning",
    )
    app = create_app(config)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c, app.state.loraplex


def test_residency_metrics_follow_the_extractor_rules(
    server: tuple[httpx.Client, ServerState],
) -> None:
    c, state = server
    ranks = {"alpha": 8, "alpha-alias": 8, "beta": 16, "gamma": 4}

    # start-up: residency reported (the count gauge at 0), nothing in a slot
    got = scrape(c)
    assert got.loaded is not None
    assert got.gpu_loaded == 0 and got.max_active == 2 == state.client.max_loras
    assert got.base_model == BASE  # a request for it is a base-model request
    assert got.loaded == {n: State("cpu", False, ranks.get(n, 32)) for n in truth(state)}

    # two adapters into the two slots: one series per served name, the count per digest
    complete(c, state, "alpha")
    complete(c, state, "beta")
    got = scrape(c)
    assert got.loaded is not None
    for name in ("alpha", "alpha-alias", "beta"):
        assert got.loaded[name] == State("gpu", False, ranks[name]), name
    assert got.gpu_loaded == 2
    assert {n: s.level for n, s in got.loaded.items()} == truth(state)

    # a third adapter: slots full, an idle one leaves its slot for host memory; its gpu series
    # is gone (not left at 0) and a cpu one stands in its place
    complete(c, state, "gamma")
    got = scrape(c)
    assert got.loaded is not None
    assert {n: s.level for n, s in got.loaded.items()} == truth(state)
    assert got.loaded["gamma"].level == "gpu" and got.gpu_loaded == 2
    demoted = [n for n in ("alpha", "beta") if got.loaded[n].level == "cpu"]
    assert len(demoted) == 1
    assert got.raw[CPU_COUNT].samples[0].value == 3 == state.client.resident_bytes()["host"][0]
    assert "delta" not in got.loaded  # the registry's size never shows
    assert got.gpu_loaded == len(state.client.device_adapter_digests())

    # transitions: one "load" per verified host copy made (start-up's checks included: four
    # adapters through three host places), one "activate" per slot fill (three); means > 0
    hist = {
        (s.labels["transition"], s.name.rsplit("_", 1)[-1]): s.value
        for s in got.raw[TRANSITIONS].samples
        if not s.name.endswith("_bucket")
    }
    host_loads = sum(row.loads for row in state.client.residency())
    assert hist[("load", "count")] == host_loads >= 4
    assert hist[("activate", "count")] == state.client.tier_counters()["device"].inserts == 3
    assert got.load_s > 0 and got.activate_s > 0

    # pinned: per tier. A device pin reads "true" on the gpu series; a host pin alone leaves a
    # slotted adapter's slot evictable, so its gpu series still reads "false"
    admin(c, "pin_lora_adapter", lora_name="gamma", device=True)
    other = "beta" if demoted == ["alpha"] else "alpha"  # the one still in a slot
    admin(c, "pin_lora_adapter", lora_name=other)
    got = scrape(c)
    assert got.loaded is not None
    assert got.loaded["gamma"] == State("gpu", True, ranks["gamma"])
    assert got.loaded[other] == State("gpu", False, ranks[other])
    admin(c, "unpin_lora_adapter", lora_name="gamma")
    admin(c, "unpin_lora_adapter", lora_name=other)

    # leaving the device tier: gamma's gpu series goes, a cpu one appears
    out = admin(c, "evict_lora_adapter", lora_name="gamma", tiers=["device"])
    assert out["evicted_from"] == ["device"]
    got = scrape(c)
    assert got.loaded is not None
    assert got.loaded["gamma"] == State("cpu", False, ranks["gamma"])
    assert got.gpu_loaded == 1
    assert not any(
        s.labels["adapter_name"] == "gamma" and s.labels["level"] == "gpu"
        for s in got.raw[LOADED].samples
    )

    # leaving every tier: both of alpha's names lose their series; the host count drops
    admin(c, "evict_lora_adapter", lora_name="alpha")
    got = scrape(c)
    assert got.loaded is not None
    assert "alpha" not in got.loaded and "alpha-alias" not in got.loaded
    assert got.raw[CPU_COUNT].samples[0].value == 2
    assert {n: s.level for n, s in got.loaded.items()} == truth(state)


def test_extractor_rules_on_fixed_text() -> None:
    """The parser above applies the extractor's rules (zeros skipped, gpu over cpu, pinned
    merged, the count gauge alone means "nothing loaded", no family means "not reported")."""
    text = "\n".join(
        [
            "# TYPE vllm:lora_adapter_loaded gauge",
            'vllm:lora_adapter_loaded{engine="0",adapter_name="a",level="cpu",pinned="true",'
            'rank="8"} 1',
            'vllm:lora_adapter_loaded{engine="1",adapter_name="a",level="gpu",pinned="false",'
            'rank="8"} 1',
            'vllm:lora_adapter_loaded{engine="0",adapter_name="z",level="gpu",pinned="false"} 0',
            "# TYPE vllm:num_gpu_loaded_lora_adapters gauge",
            'vllm:num_gpu_loaded_lora_adapters{model_name="m",engine="0"} 1',
            "",
        ]
    )
    got = extract(text)
    assert got.loaded == {"a": State("gpu", True, 8)} and got.gpu_loaded == 1
    assert got.base_model == "m"
    only_count = "# TYPE vllm:num_gpu_loaded_lora_adapters gauge\n"
    only_count += 'vllm:num_gpu_loaded_lora_adapters{model_name="m",engine="0"} 0\n'
    assert extract(only_count).loaded == {}
    assert extract("").loaded is None


def test_no_residency_gauges_without_lora(tiny_model: Path) -> None:
    """As vLLM without --enable-lora: no residency family, so the extractor reads "not
    reported" and the scorer falls back to its capacity tiers."""
    from fastapi.testclient import TestClient

    config = ServerConfig(
        engine=EngineConfig(model=str(tiny_model), device="cpu", num_threads=1, enable_lora=False),
        served_model_name=[BASE],
    )
    with TestClient(create_app(config)) as client:
        text = client.get("/metrics").text
    got = extract(text)
    assert got.loaded is None and got.max_active == 0
    assert not any(f in got.raw for f in (LOADED, GPU_COUNT, CPU_COUNT, SLOTS, TRANSITIONS))
