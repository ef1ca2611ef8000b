"""The server's forecast load-ahead (``hybrid-forecast``): the engine's waiting queue reaches
the cache policy, and adapters the forecast expects soon are loaded into host memory ahead of
their requests (off the engine thread, through the engine client)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from loraplex import LoRARequest, SamplingParams
from loraplex.cache.adapters import TIERS
from loraplex.cache.policy import ForecastHybridPolicy
from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.client import EngineClient, LLMEngine
from loraplex.lora.digest import digest_safetensors_dir
from loraplex.server.app import create_app
from loraplex.types import AdapterRef, AdapterSpec

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def engine_of(model: Path, policy: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            device="cpu",
            enable_lora=True,
            max_loras=2,
            max_cpu_loras=4,
            adapter_eviction_policy=policy,
        )
    )


def spec_of(name: str, path: Path) -> AdapterSpec:
    return AdapterSpec(AdapterRef(name, "1", digest_safetensors_dir(path)), str(path))


def test_forecast_policy_knows_the_tier_order(tiny_model: Path) -> None:
    policy = engine_of(tiny_model, "hybrid-forecast").adapters.policy
    assert isinstance(policy, ForecastHybridPolicy) and policy.tier_order == TIERS


def test_waiting_queue_reaches_the_policy(tiny_model: Path, adapters: dict[str, Path]) -> None:
    engine = engine_of(tiny_model, "hybrid-forecast")
    client = EngineClient(engine)
    lora = LoRARequest("a", adapters["all_r8"])
    for i in range(3):
        engine.add_request(f"r{i}", "Hello world!", GREEDY, lora)
    engine.add_request("base", "Hello world!", GREEDY)
    d = digest_safetensors_dir(adapters["all_r8"])
    assert client.waiting_adapter_counts() == {d: 3}
    assert client.load_ahead({}, limit=4) == []  # nothing may be loaded; the queue is seen
    policy = engine.adapters.policy
    assert isinstance(policy, ForecastHybridPolicy)
    now = engine.adapters.tiers.clock()
    assert policy.predicted(d, now) == pytest.approx(3 * policy._k[0])  # the queue term
    while engine.has_unfinished_requests():
        engine.step()
    client.load_ahead({}, limit=4)
    assert policy.predicted(d, engine.adapters.tiers.clock()) == 0.0  # the queue drained


def teach(engine: LLMEngine, specs: list[tuple[AdapterSpec, int]]) -> tuple[Clock, float]:
    """Give the engine's cache a fake clock and four days of history: each spec requested eight
    times a day at its UTC hour (:10); then its host copy goes. (clock, its epoch)."""
    mgr = engine.adapters
    policy = mgr.policy
    epoch = policy.forecast.epoch_s if isinstance(policy, ForecastHybridPolicy) else 0.0
    assert policy.forecast is not None or not isinstance(policy, ForecastHybridPolicy)
    clock = Clock(0.0)
    mgr.tiers.clock = clock
    for day in (2, 3, 4, 5):
        for spec, hour in specs:
            for k in range(8):
                clock.t = utc(day, hour, 10 + k) - epoch
                adapter, _ = mgr.acquire(spec)
                mgr.release(adapter)
    clock.t = utc(5, 23, 0) - epoch
    for spec, _ in specs:
        mgr.unpin(spec.sha256)
        mgr.evict(spec.sha256, tiers=["host"])
        assert mgr.tier_of(spec.sha256) != "host"
    return clock, epoch


def utc(day: int, hour: int, minute: int = 0) -> float:
    return dt.datetime(2026, 3, day, hour, minute, tzinfo=dt.UTC).timestamp()


def hits_of(client: EngineClient, digest: str) -> int:
    return next(r.hits for r in client.residency() if r.ref.sha256 == digest)


def test_load_ahead_loads_what_the_forecast_expects(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """A (requested every morning at 08:10 UTC) is loaded at 07:50 the next morning after it
    left host memory; B (requested at 02:10) is not; nothing at noon."""
    engine = engine_of(tiny_model, "hybrid-forecast")
    client = EngineClient(engine)
    a, b = spec_of("a", adapters["all_r8"]), spec_of("b", adapters["mlp_r16"])
    clock, epoch = teach(engine, [(b, 2), (a, 8)])
    specs = {a.sha256: a, b.sha256: b}
    hits = hits_of(client, a.sha256)
    clock.t = utc(6, 12, 0) - epoch
    assert client.load_ahead(specs, limit=4) == []  # no demand expected at noon
    clock.t = utc(6, 7, 50) - epoch
    assert client.load_ahead({b.sha256: b}, limit=4) == []  # only what the server may serve
    assert client.load_ahead(specs, limit=4) == [a.sha256]
    assert client.tier_of(a.sha256) == "host" and client.tier_of(b.sha256) != "host"
    assert client.load_ahead(specs, limit=4) == []  # already there
    assert hits_of(client, a.sha256) == hits  # uncounted: a load-ahead is no request


def test_server_loads_ahead_from_the_retire_loop_body(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """ServerState.load_ahead_due (run by the retire loop) loads the catalog's revisions the
    forecast expects, at most every LOAD_AHEAD_S; with plain hybrid it loads nothing."""
    from loraplex.config import LoRAModule

    for policy, want in (("hybrid-forecast", 1), ("hybrid", 0)):
        app = create_app(
            ServerConfig(
                EngineConfig(
                    model=str(tiny_model),
                    num_threads=1,
                    enable_lora=True,
                    max_loras=2,
                    adapter_eviction_policy=policy,
                ),
                served_model_name=["tiny"],
                lora_modules=[LoRAModule("a", str(adapters["all_r8"]))],
                log_level="warning",
            )
        )
        state = app.state.loraplex
        try:
            spec = state.adapter_spec(state.catalog.servables()["a"].active)
            clock, epoch = teach(state.engine, [(spec, 8)])
            clock.t = utc(6, 7, 50) - epoch
            assert state.load_ahead_due() == [spec.sha256] * want
            assert (state.client.tier_of(spec.sha256) == "host") == bool(want)
            state.client.evict(spec.sha256, tiers=["host"])
            assert state.load_ahead_due() == []  # not due again within LOAD_AHEAD_S
        finally:
            state.close()
