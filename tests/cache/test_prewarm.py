"""Warm windows: the manifest's ``warm`` schedules (strict parsing, time zones, DST) and the
prewarm scheduler on a fake clock (load ahead of the opening, release after the close), through
a real engine client and through the server's wiring."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from loraplex.cache.prewarm import PrewarmScheduler, windows
from loraplex.config import EngineConfig, LoRAModule, ServerConfig, parse_lora_module
from loraplex.engine.client import EngineClient, LLMEngine
from loraplex.lora.digest import digest_safetensors_dir
from loraplex.registry import Principal, Registry, RegistryPolicy
from loraplex.server.app import create_app
from loraplex.server.residency import residency_view
from loraplex.types import AdapterError, AdapterRef, AdapterSpec
from loraplex.warm import WarmSchedule, WarmWindow, parse_warm

BERLIN = ZoneInfo("Europe/Berlin")
OPERATOR = Principal("admin", None, frozenset({"admin:*"}))
OFFICE = {"device": "Mon-Fri 08:00-18:00", "tz": "Europe/Berlin"}


def berlin(y: int, mo: int, d: int, h: int, mi: int = 0) -> float:
    return dt.datetime(y, mo, d, h, mi, tzinfo=BERLIN).timestamp()


# ------------------------------------------------------------------------------ parsing


def test_parse_warm_schedules_and_the_old_strings() -> None:
    for name in ("device-preferred", "host", "on-demand"):
        assert parse_warm(name) == name
    s = parse_warm(
        {"device": "Mon-Fri 08:00-18:00", "host": "Sat 09:00-12:30, Fri-Mon 20:00-24:00",
         "tz": "Europe/Berlin", "lead_s": 600}
    )  # fmt: skip
    assert isinstance(s, WarmSchedule) and s.tz == "Europe/Berlin" and s.lead_s == 600.0
    assert s.device == (WarmWindow(0, 4, 8 * 60, 18 * 60),)
    assert s.device[0].days == frozenset(range(5))
    assert s.host == (WarmWindow(5, 5, 9 * 60, 12 * 60 + 30), WarmWindow(4, 0, 20 * 60, 24 * 60))
    assert s.host[1].days == frozenset({4, 5, 6, 0})
    assert parse_warm(s.to_dict()) == s  # the manifest form reads back
    daily = parse_warm({"host": ["daily 00:00-01:00"], "tz": "UTC"})
    assert isinstance(daily, WarmSchedule) and daily.host[0].days == frozenset(range(7))
    m = parse_lora_module(json.dumps({"name": "sql", "path": "/a/sql", "warm": OFFICE}))
    assert isinstance(m.warm, WarmSchedule) and m.warm.device[0].start_min == 480


def test_parse_warm_rejects_bad_specs_naming_the_field() -> None:
    bad: dict[str, object] = {
        "always": "'warm' must be one of device-preferred, host, on-demand",
        42: "'warm' must be a warm policy string or an object",
        '{"device": "Mon-Fri 08:00-18:00"}': "'warm.tz' must be a time zone",
        "tz-unknown": "'warm.tz': unknown time zone",
        "no-window": "needs 'device' and/or 'host'",
        "unknown-key": "unknown field warm.every",
        "bad-day": "'warm.device': bad day",
        "bad-time": "'warm.device': bad time",
        "backwards": "must end after it starts",
        "shape": "'warm.host': bad window",
        "lead": "'warm.lead_s' must be in",
        "lead-type": "'warm.lead_s' must be a number",
        "long": "longer than 256 characters",
        "many": "'warm.host' has more than 16 windows",
        "many-in-one": "'warm.device': bad window",
        "empty": "names no window",
    }
    values: dict[str, object] = {
        '{"device": "Mon-Fri 08:00-18:00"}': {"device": "Mon-Fri 08:00-18:00"},
        "tz-unknown": {"device": "Mon 08:00-09:00", "tz": "Mars/Olympus_Mons"},
        "no-window": {"tz": "UTC"},
        "unknown-key": {"device": "Mon 08:00-09:00", "tz": "UTC", "every": 1},
        "bad-day": {"device": "Mon-Fun 08:00-09:00", "tz": "UTC"},
        "bad-time": {"device": "Mon 08:00-25:00", "tz": "UTC"},
        "backwards": {"device": "Mon 22:00-06:00", "tz": "UTC"},
        "shape": {"host": "weekdays at eight", "tz": "UTC"},
        "lead": {"host": "Mon 08:00-09:00", "tz": "UTC", "lead_s": -1},
        "lead-type": {"host": "Mon 08:00-09:00", "tz": "UTC", "lead_s": "5m"},
        "long": {"host": "Mon 08:00-09:00" + " " * 300, "tz": "UTC"},
        "many": {"host": ["Mon 08:00-09:00"] * 17, "tz": "UTC"},
        "many-in-one": {"host": ",".join(["Mon 08:00-09:00"] * 9), "device": "x", "tz": "UTC"},
        "empty": {"host": " , ", "tz": "UTC"},
    }
    for key, msg in bad.items():
        value = values.get(key, key) if isinstance(key, str) else key
        with pytest.raises(ValueError, match=msg):
            parse_warm(value)
    with pytest.raises(ValueError, match="unknown time zone"):
        parse_lora_module(json.dumps({"name": "x", "path": "/x", "warm": values["tz-unknown"]}))


def test_windows_follow_the_time_zone_and_dst() -> None:
    s = parse_warm(OFFICE)
    assert isinstance(s, WarmSchedule)
    # the week of 2026-03-23: Berlin switches to summer time on Sunday the 29th
    wins = windows(s, berlin(2026, 3, 23, 0), berlin(2026, 4, 1, 0))
    utc = [dt.datetime.fromtimestamp(lo, dt.UTC) for lo, _, _ in wins]
    assert [(t.day, t.hour) for t in utc] == [
        (23, 7), (24, 7), (25, 7), (26, 7), (27, 7), (30, 6), (31, 6)
    ]  # fmt: skip
    assert all(hi - lo == 10 * 3600 and tier == "device" for lo, hi, tier in wins)
    ny = parse_warm({"host": "Mon 08:00-09:00", "tz": "America/New_York"})
    assert isinstance(ny, WarmSchedule)
    (lo, _, tier), *_ = windows(ny, berlin(2026, 3, 23, 0), berlin(2026, 3, 24, 0))
    assert dt.datetime.fromtimestamp(lo, dt.UTC).hour == 12 and tier == "host"  # EDT, UTC-4


# ------------------------------------------------------------------------------ scheduler


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def client(tiny_model: Path) -> EngineClient:
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model), device="cpu", enable_lora=True, max_loras=2)
    )
    return EngineClient(engine)


def spec_of(client: EngineClient, name: str, path: Path) -> AdapterSpec:
    spec = AdapterSpec(AdapterRef(name, "1", digest_safetensors_dir(path)), str(path))
    assert client.check_loadable(spec) == spec.ref
    return spec


def test_scheduler_warms_ahead_of_the_opening_and_releases_after_the_close(
    client: EngineClient, adapters: dict[str, Path]
) -> None:
    spec = spec_of(client, "office", adapters["all_r8"])
    d = spec.sha256
    client.unpin(d)
    clock, timer = Clock(berlin(2026, 3, 27, 7, 0)), Clock(0.0)  # Friday 07:00
    sched = PrewarmScheduler(client, clock=clock, timer=timer, lead_s=600, max_sleep_s=86400)
    schedule = parse_warm(OFFICE)
    assert isinstance(schedule, WarmSchedule)
    sched.schedule(spec, schedule)
    sleep = sched.tick()
    assert sched.held() == {} and not client.engine.adapters.is_pinned(d)
    assert sleep == pytest.approx(50 * 60)  # due at 07:50, ten minutes ahead of 08:00
    clock.t += sleep
    assert sched.tick() == pytest.approx(10 * 3600 + 600)  # next change: the close at 18:00
    assert sched.held() == {"office": "device"}
    assert client.engine.adapters.is_pinned(d) and client.tier_of(d) in ("host", "device")
    clock.t = berlin(2026, 3, 27, 17, 59)
    sched.tick()
    assert client.engine.adapters.is_pinned(d)  # still inside the window
    clock.t = berlin(2026, 3, 27, 18, 0)
    sleep = sched.tick()
    assert sched.held() == {} and not client.engine.adapters.is_pinned(d)
    assert client.tier_of(d) is not None  # released, not evicted: on-demand from now on
    # the weekend: nothing until Monday, which opens at 06:00 UTC after the DST switch
    clock.t = berlin(2026, 3, 28, 12, 0)
    sched.tick()
    assert sched.held() == {}
    assert sched.wanted(sched.adapters["office"], clock.t) == (None, berlin(2026, 3, 30, 7, 50))
    sched.close()


def test_scheduler_lead_from_the_measured_load_cost_and_retries(
    client: EngineClient, adapters: dict[str, Path], tmp_path: Path
) -> None:
    spec = spec_of(client, "lead", adapters["mlp_r16"])
    clock, timer = Clock(berlin(2026, 3, 24, 7, 54)), Clock(0.0)

    class Timed:  # the real client; each pin takes 30 s of (fake) measured time
        def pin_window(self, s: AdapterSpec, *, device: bool = False) -> str:
            timer.t += 30.0
            return client.pin_window(s, device=device)

        def unpin_window(self, digest: str) -> str:
            return client.unpin_window(digest)

    sched = PrewarmScheduler(Timed(), clock=clock, timer=timer, lead_s=300, lead_factor=20)
    host = parse_warm({"host": "Tue 08:00-09:00", "tz": "Europe/Berlin"})
    assert isinstance(host, WarmSchedule)
    sched.schedule(spec, host)
    sched.tick()  # 07:54: six minutes ahead, outside the default 5 min lead
    assert sched.held() == {}
    clock.t = berlin(2026, 3, 24, 7, 55)
    sched.tick()
    assert sched.held() == {"lead": "host"} and sched.adapters["lead"].load_s == 30.0
    assert sched.lead_for(sched.adapters["lead"]) == 600.0  # 20 x the measured 30 s
    assert client.engine.adapters.is_pinned(spec.sha256)
    clock.t = berlin(2026, 3, 24, 9, 0)
    sched.tick()
    assert not client.engine.adapters.is_pinned(spec.sha256)
    # a broken adapter: logged, retried after retry_s, the other schedules unaffected
    broken = AdapterSpec(AdapterRef("broken", "1", "f" * 64), str(tmp_path / "missing"))
    sched.schedule(broken, host)
    clock.t = berlin(2026, 3, 31, 8, 30)
    sleep = sched.tick()
    assert sched.held() == {"lead": "host"} and sleep == pytest.approx(60.0)
    assert sched.adapters["broken"].retry_at == clock.t + 60.0
    # a new revision of a scheduled name replaces the old entry and releases its pin
    sched.schedule(spec_of(client, "lead", adapters["attn_r4_rslora"]), host)
    assert not client.engine.adapters.is_pinned(spec.sha256) and sched.held() == {}
    sched.unschedule("broken")
    assert set(sched.adapters) == {"lead"}
    sched.close()
    with pytest.raises(ValueError, match="lead_s"):
        PrewarmScheduler(client, lead_s=-1)
    with pytest.raises(AdapterError):
        client.check_loadable(broken)


def test_server_wires_warm_windows_to_the_scheduler(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    schedule = parse_warm({"host": "daily 08:00-09:00", "tz": "UTC", "lead_s": 60})
    assert isinstance(schedule, WarmSchedule)
    app = create_app(
        ServerConfig(
            EngineConfig(model=str(tiny_model), num_threads=1, enable_lora=True, max_loras=2),
            served_model_name=["tiny"],
            lora_modules=[
                LoRAModule("windowed", str(adapters["all_r8"]), warm=schedule),
                LoRAModule("plain", str(adapters["mlp_r16"]), warm="host"),
            ],
            log_level="warning",
        )
    )
    state = app.state.loraplex
    try:
        assert state.prewarm is not None and set(state.warm_windows) == {"windowed"}
        manifest = state.catalog.servables()["windowed"].active
        assert manifest.warm_policy == "on-demand"  # the registry keeps a policy string
        assert manifest.warm_schedule == schedule  # and the schedule beside it
        d = manifest.sha256
        clock = Clock(dt.datetime(2026, 3, 24, 7, 59, 30, tzinfo=dt.UTC).timestamp())  # lead 60 s
        state.prewarm.clock = clock
        state._prewarm_due_at = 0.0
        state.prewarm_due()
        assert state.prewarm.held() == {"windowed": "host"} and state.client.tier_of(d)
        assert state.engine.adapters.is_pinned(d)
        rows = {r["name"]: r for r in residency_view(state, OPERATOR)["data"]}
        assert rows["windowed"]["warm_window"] == {"tz": "UTC", "host": "daily 08:00-09:00",
                                                   "lead_s": 60.0}  # fmt: skip
        assert rows["windowed"]["prewarmed"] == "host" and rows["windowed"]["pinned"]
        assert "warm_window" not in rows["plain"]
        clock.t += 3540.0  # 08:58:30
        state._prewarm_due_at = 0.0
        state.prewarm_due()
        assert state.engine.adapters.is_pinned(d)
        clock.t += 90.0  # 09:00: closed
        state._prewarm_due_at = 0.0
        state.prewarm_due()
        assert state.prewarm.held() == {} and not state.engine.adapters.is_pinned(d)
        rows = {r["name"]: r for r in residency_view(state, OPERATOR)["data"]}
        assert rows["windowed"]["prewarmed"] is None and not rows["windowed"]["pinned"]
        plain = state.catalog.servables()["plain"].active.sha256
        assert state.engine.adapters.is_pinned(plain)  # the old warm strings still work
    finally:
        state.close()


def test_window_release_keeps_an_operator_pin(
    client: EngineClient, adapters: dict[str, Path]
) -> None:
    """An operator pins the adapter by hand during its window: the window's close releases
    only the scheduler's pin; the operator's unpin lifts every pin."""
    spec = spec_of(client, "handpinned", adapters["alllinear_r12"])
    d = spec.sha256
    tiers = client.engine.adapters.tiers
    clock = Clock(berlin(2026, 3, 24, 8, 0))
    sched = PrewarmScheduler(client, clock=clock, timer=Clock(0.0), lead_s=0, max_sleep_s=86400)
    office = parse_warm(OFFICE)
    assert isinstance(office, WarmSchedule)
    sched.schedule(spec, office)
    sched.tick()
    assert sched.held() == {"handpinned": "device"}
    assert tiers.host is not None and tiers.host.pin_owners(d) == {"window"}
    client.pin(spec)  # by hand, host only
    assert tiers.host.pin_owners(d) == {"window", "operator"}
    assert tiers.device.pin_owners(d) == {"window"}
    clock.t = berlin(2026, 3, 24, 18, 0)
    sched.tick()
    assert sched.held() == {} and client.engine.adapters.is_pinned(d)
    assert tiers.host.pin_owners(d) == {"operator"} and tiers.device.pin_owners(d) == frozenset()
    # the next window pins again; the operator's unpin removes both, the window's close is a no-op
    clock.t = berlin(2026, 3, 25, 8, 0)
    sched.tick()
    client.unpin(d)
    assert not client.engine.adapters.is_pinned(d)
    clock.t = berlin(2026, 3, 25, 18, 0)
    sched.tick()
    assert not client.engine.adapters.is_pinned(d) and sched.held() == {}
    sched.close()


def test_registry_adapters_follow_their_warm_schedule(
    db_url: str, tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Registry revisions registered through the admin API with ``warm`` windows: the server
    schedules them, a new active revision replaces the old one's pin, a revision without a
    schedule unschedules the name; a bad ``warm`` is a 400 naming the field."""
    from fastapi.testclient import TestClient

    root = tmp_path / "root"
    for name in ("all_r8", "mlp_r16", "attn_r4_rslora"):
        shutil.copytree(adapters[name], root / name)
    registry = Registry.open(db_url, policy=RegistryPolicy(allowed_roots=(str(root),)))
    app = create_app(
        ServerConfig(
            EngineConfig(model=str(tiny_model), num_threads=1, enable_lora=True, max_loras=2),
            served_model_name=["tiny"],
            admin_api_key="sk-admin",
            allowed_lora_roots=[str(root)],
            log_level="warning",
        ),
        registry=registry,
    )
    state = app.state.loraplex
    http = TestClient(app, headers={"Authorization": "Bearer sk-admin"})  # no lifespan: no loop
    try:
        hours = {"host": "daily 08:00-09:00", "tz": "UTC", "lead_s": 60}

        def register(path: str, **kw: object) -> dict:
            r = http.post("/v1/admin/adapters", json={"name": "sched", "path": str(root / path),
                                                      "activate": True, **kw})  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()

        r = http.post("/v1/admin/adapters", json={"name": "bad", "path": str(root / "all_r8"),
                                                  "warm": {"host": "daily 08:00-09:00"}})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "warm"
        assert "'warm.tz'" in r.json()["error"]["message"]
        one = register("all_r8", warm=hours)
        assert one["warm_schedule"] == {"host": "daily 08:00-09:00", "tz": "UTC", "lead_s": 60.0}
        assert state.prewarm is not None
        clock = Clock(dt.datetime(2026, 3, 24, 8, 30, tzinfo=dt.UTC).timestamp())
        state.prewarm.clock = clock
        state.prewarm_due()
        assert state.prewarm.held() == {"sched": "host"} and set(state.warm_windows) == {"sched"}
        assert state.engine.adapters.is_pinned(one["sha256"])
        rows = {r["name"]: r for r in residency_view(state, OPERATOR)["data"]}
        assert rows["sched"]["prewarmed"] == "host"
        # a new active revision (same schedule): the old revision's window pin goes
        two = register("mlp_r16", warm=hours)
        state.prewarm_due()  # the catalog change made it due at once
        assert state.prewarm.adapters["sched"].spec.sha256 == two["sha256"]
        assert not state.engine.adapters.is_pinned(one["sha256"])
        assert state.engine.adapters.is_pinned(two["sha256"])
        # a revision without a schedule: the name is unscheduled, its pin released
        three = register("attn_r4_rslora")
        assert three["warm_schedule"] is None
        state.prewarm_due()
        assert state.prewarm.adapters == {} and state.warm_windows == {}
        assert not state.engine.adapters.is_pinned(two["sha256"])
        assert not state.engine.adapters.is_pinned(three["sha256"])
    finally:
        http.close()
        state.close()
        registry.close()
