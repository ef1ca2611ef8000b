"""Predictive prewarming in the cache: the demand forecast, forecast-aware hybrid, load-ahead
slots, the diurnal workload and the simulator's window-opening report."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import random
from zoneinfo import ZoneInfo

import pytest

from loraplex.cache.controller import TierController
from loraplex.cache.policy import (
    AdapterInfo,
    DemandForecast,
    ForecastHybridPolicy,
    HybridPolicy,
    make_policy,
)
from loraplex.tools.sim.cli import main, opening_cold_rates
from loraplex.tools.sim.simulate import SimConfig, policy_factory, simulate
from loraplex.tools.sim.workloads import WorkloadSpecError, generate_workload

H, DAY = 3600.0, 86400.0
MONDAY = dt.datetime(2026, 3, 23, tzinfo=dt.UTC).timestamp()  # a Monday, 00:00 UTC


def info(key: str, size: int = 16 << 20) -> AdapterInfo:
    return AdapterInfo(key, size, "t", 0, 16)


def office_days(fc: DemandForecast, key: str, days: range, hours: tuple[int, int], n: int) -> None:
    """``n`` requests per hour in ``hours`` (UTC) on weekdays of ``days`` (day 0 = Monday)."""
    for d in days:
        if d % 7 >= 5:
            continue
        for h in range(*hours):
            for i in range(n):
                fc.observe(key, d * DAY + h * H + (i + 0.5) * H / n)


# ------------------------------------------------------------------------------ forecast


def test_forecast_learns_a_daily_pattern() -> None:
    fc = DemandForecast(epoch_s=MONDAY)
    office_days(fc, "a", range(3), (8, 10), 30)  # Mon-Wed, 08:00-10:00 UTC, 30 req/h
    now = 3 * DAY + 7.5 * H  # Thursday 07:30
    assert fc.hourly("a", int((MONDAY + 3 * DAY) // H) + 8, now) == pytest.approx(30, rel=0.05)
    ahead = fc.rate("a", now, now + H)  # half an hour idle, half an hour of office
    assert ahead == pytest.approx(15 / H, rel=0.05)
    assert fc.rate("a", now, now + 0.5 * H) == 0.0  # 07:30-08:00: nobody works then
    assert fc.rate("a", 3 * DAY + 14 * H, 3 * DAY + 15 * H) == 0.0
    assert fc.rate("never-seen", now, now + H) == 0.0
    # before a day has passed nothing is known: no forecast, not a wrong one
    young = DemandForecast(epoch_s=MONDAY)
    young.observe("b", 8.5 * H)
    assert young.rate("b", 9 * H, 12 * H) == 0.0


def test_forecast_tells_weekends_from_weekdays_after_a_week() -> None:
    # the first Saturday: its week bucket has never elapsed, the day bucket speaks (a guess)
    first = DemandForecast(epoch_s=MONDAY)
    office_days(first, "a", range(5), (8, 10), 20)  # Mon-Fri, 08:00-10:00 UTC, 20 req/h
    sat = 5 * DAY
    assert first.rate("a", sat + 7.5 * H, sat + 9 * H) == pytest.approx(20 / (1.5 * H), rel=0.1)
    # once a weekend has passed, Saturday is known to be quiet and Monday busy
    fc = DemandForecast(epoch_s=MONDAY)
    office_days(fc, "a", range(12), (8, 10), 20)  # two weeks' Mon-Fri, up to day 11 (Friday)
    sat2, mon3 = 12 * DAY, 14 * DAY
    assert fc.rate("a", sat2 + 7.5 * H, sat2 + 9 * H) == 0.0
    assert fc.rate("a", mon3 + 7.5 * H, mon3 + 9 * H) == pytest.approx(20 / (1.5 * H), rel=0.1)


def test_forecast_decays_and_is_bounded() -> None:
    fc = DemandForecast(epoch_s=MONDAY, day_half_life_s=DAY, week_half_life_s=DAY)
    office_days(fc, "a", range(3), (8, 9), 40)
    fresh = fc.hourly("a", int(MONDAY // H) + 3 * 24 + 8, 3 * DAY + 7 * H)
    # the tenant stopped working: two weeks later the pattern has faded
    faded = fc.hourly("a", int(MONDAY // H) + 17 * 24 + 8, 17 * DAY + 7 * H)
    assert fresh == pytest.approx(40, rel=0.05) and faded < fresh / 100
    small = DemandForecast(max_keys=50)
    for i in range(500):
        small.observe(f"k{i}", float(i))
    assert len(small) <= 50
    with pytest.raises(ValueError, match="max_keys"):
        DemandForecast(max_keys=0)


# ------------------------------------------------------------------------- forecast policy


def test_forecast_term_raises_the_keep_score_ahead_of_the_window() -> None:
    p = make_policy("hybrid-forecast", epoch_s=MONDAY)
    plain = make_policy("hybrid")
    assert isinstance(p, ForecastHybridPolicy) and p.forecast is not None
    assert isinstance(plain, HybridPolicy) and plain.forecast is None
    for d in range(3):  # office adapter: 08:00-10:00 every day; one-off: requested at 07:40
        for i in range(20):
            t = d * DAY + 8 * H + i * 300.0
            for pol in (p, plain):
                pol.on_access("office", info("office"), t)
    t = 3 * DAY + 7 * H + 40 * 60
    for pol in (p, plain):
        pol.on_access("oneoff", info("oneoff"), t)
    now = t + 15 * 60  # 07:55: the office opens within the forecast's horizon
    assert plain.order_victims(["office", "oneoff"], "L0", now, by_bytes=False)[0] == "office"
    assert p.order_victims(["office", "oneoff"], "L0", now, by_bytes=False)[0] == "oneoff"
    assert p.forecast_demand(now, 5)[0][0] == "office"
    assert plain.forecast_demand(now, 5) == []
    # below forecast_min_requests expected in the horizon the forecast says nothing
    assert isinstance(p, HybridPolicy) and 1.0 < p.predicted("office", now) * 1800 < 100.0
    strict = ForecastHybridPolicy(epoch_s=MONDAY, forecast_min_requests=100.0)
    for d in range(3):
        for i in range(20):
            strict.on_access("office", info("office"), d * DAY + 8 * H + i * 300.0)
    assert strict.predicted("office", now) == 0.0 and strict.forecast_demand(now, 5) == []
    # the waiting queue counts: queued requests lift an adapter with no history at all
    p.on_access("queued", info("queued"), now - 3 * H)
    base = p.keep_score("queued", "L0", now, by_bytes=False)
    p.set_waiting({"queued": 3})
    assert p.keep_score("queued", "L0", now, by_bytes=False) > base + 3 * 0.01
    p.set_waiting({})
    assert p.keep_score("queued", "L0", now, by_bytes=False) == pytest.approx(base)


def test_forecast_inline_order_matches_keep_score() -> None:
    rng = random.Random(3)
    p = ForecastHybridPolicy(tier_order=("L0", "L1"), epoch_s=MONDAY)
    keys = [f"k{i}" for i in range(30)]
    for t in range(0, 4 * 86400, 97):
        if 7 * H <= t % DAY <= 12 * H or rng.random() < 0.1:
            k = rng.choice(keys[: rng.randint(1, 30)])
            p.on_access(k, info(k, size=rng.choice([8, 16]) << 20), float(t))
            if rng.random() < 0.2:
                p.on_insert(k, info(k), rng.choice(["L0", "L1"]), float(t))
    p.set_waiting({"k3": 2})
    now = 4 * DAY + 7.5 * H
    for by_bytes in (True, False):
        got = p.order_victims(keys, "L0", now, by_bytes=by_bytes)
        scores = [p.keep_score(k, "L0", now, by_bytes=by_bytes) for k in got]
        assert sorted(got) == sorted(keys) and scores == sorted(scores)


# ------------------------------------------------------------------------------ prefetch


def test_prefetch_slot_loads_ahead_only_over_lesser_victims() -> None:
    now = [0.0]
    p = ForecastHybridPolicy(epoch_s=MONDAY)
    ctl = TierController(p, slots=2, clock=lambda: now[0], host_bytes=1 << 30)
    for d in range(2):  # "office" is busy 08:00-09:00 on days 0 and 1
        for i in range(12):
            now[0] = d * DAY + 8 * H + i * 300.0
            ctl.serve_from_host(info("office")) or ctl.admit_host(info("office"))
            slot, _ = ctl.reserve_slot(info("office")) or (None, False)
            assert slot is not None
            ctl.release_slot(slot)
            ctl.release_request("office")
    ctl.evict("office", ["device"])
    now[0] = 2 * DAY + 7.5 * H
    for k in ("hot", "cold"):  # two idle slots: "hot" was requested a lot just now
        for _ in range(30 if k == "hot" else 1):
            ctl.serve_from_host(info(k)) or ctl.admit_host(info(k))
            got = ctl.reserve_slot(info(k))
            assert got is not None
            ctl.release_slot(got[0])
            ctl.release_request(k)
    now[0] = 2 * DAY + 7.95 * H  # 07:57: the office opens within the forecast's horizon
    misses = ctl.device.counters.misses
    hits = ctl.device.counters.hits
    assert ctl.worth_prefetching(info("office"))  # asked before its host copy is loaded
    slot = ctl.prefetch_slot(info("office"))  # evicts the one-off, not the hot one
    assert slot is not None and ctl.slot_digest[slot] == "office"
    assert set(ctl.slot_of) == {"hot", "office"}
    assert (ctl.device.counters.misses, ctl.device.counters.hits) == (misses, hits)
    assert ctl.prefetch_slot(info("office")) is None  # already there
    assert not ctl.worth_prefetching(info("office"))
    ctl.check_invariants()
    got = ctl.reserve_slot(info("office"))  # its first request finds it warm
    assert got == (slot, False)
    ctl.release_slot(slot)
    # a newcomer with no forecast is not worth evicting anyone for
    assert not ctl.worth_prefetching(info("nobody"))
    ctl.admit_host(info("nobody"), holds=0, counted=0)
    assert ctl.prefetch_slot(info("nobody")) is None
    with pytest.raises(RuntimeError, match="not held in host memory"):
        ctl.prefetch_slot(info("absent"))
    ctl.check_invariants()


# ------------------------------------------------------------------------------ workload


def test_diurnal_workload_is_deterministic_and_follows_office_hours() -> None:
    spec = "diurnal:days=8,rate=0.05,background=50,background_rate=0.01"
    wl = generate_workload(spec)
    assert wl.requests == generate_workload(spec).requests
    assert wl.requests != generate_workload(spec + ",seed=1").requests
    assert all(a.time <= b.time for a, b in itertools.pairwise(wl.requests))
    zones = {"office0": "Europe/Berlin", "office1": "America/New_York", "office2": "Asia/Tokyo"}
    for r in wl.requests:
        if r.tenant == "batch":
            assert r.adapter.startswith("bg")
            continue
        assert r.adapter.startswith(r.tenant + "-")
        local = dt.datetime.fromtimestamp(wl.epoch_s + r.time, ZoneInfo(zones[r.tenant]))
        assert local.weekday() < 5 and 8 <= local.hour < 18, (r, local)
    assert {r.tenant for r in wl.requests} == {*zones, "batch"}
    # DST: Berlin's office opens at 07:00 UTC in winter time and 06:00 UTC from 2026-03-29
    opens = [lo for lo, _ in wl.windows["office0"]]
    assert [(lo % DAY) / H for lo in opens] == [7, 7, 7, 7, 7, 6]
    assert [int(lo // DAY) for lo in opens] == [0, 1, 2, 3, 4, 7]  # no weekend
    # Tokyo's Monday window opened before the trace (Sunday 23:00 UTC)
    assert wl.windows["office2"][0][0] < 0 < wl.windows["office2"][0][1]
    assert wl.hot_adapters == {r.adapter for r in wl.requests if r.tenant != "batch"}


def test_diurnal_spec_errors() -> None:
    bad = {
        "diurnal:tz=Mars/Olympus": "unknown time zone",
        "diurnal:hours=18:00-08:00": "must end after they start",
        "diurnal:hours=8-18": "look like 08:00-18:00",
        "diurnal:weekdays=mon-fun": "look like mon-fri",
        "diurnal:start=yesterday": "a date like",
        "diurnal:days=0": "1 <= days <= 366",
        "diurnal:rate=0": "rate > 0",
        "diurnal:cold=3": "unknown key 'cold'",
    }
    for spec, msg in bad.items():
        with pytest.raises(WorkloadSpecError, match=msg):
            generate_workload(spec)
    wl = generate_workload("diurnal:tz=UTC,weekdays=sat,days=7,adapters=2,background=0")
    assert {int(r.time // DAY) for r in wl.requests} == {5}


# ---------------------------------------------------------------------------- simulation

SPEC = "diurnal:days=4,tz=Europe/Berlin+America/New_York,adapters=6,background=300"
SLOTS = 12


def test_forecast_halves_cold_starts_at_window_opening() -> None:
    """The proof's shape on a short trace: hybrid-forecast's cold-start rate in the first 10
    minutes after each opening is at most half of hybrid's (the forecast starts on day 2)."""
    wl = generate_workload(SPEC)
    assert wl.windows is not None
    cfg = SimConfig(slots=SLOTS)
    at_open = {}
    for name in ("hybrid", "hybrid-forecast"):
        outcomes: list = []
        res = simulate(
            wl.requests,
            policy_factory(name, cfg.tier_names, epoch_s=wl.epoch_s),
            cfg,
            outcomes=outcomes,
        )
        assert len(outcomes) == len(wl.requests) and res.unserved == 0
        overall, at_open[name], n = opening_cold_rates(outcomes, wl.windows, 10.0)
        assert n > 100 and overall == pytest.approx(1 - res.l0_hit_ratio)
        assert (res.prefetches > 0) is (name == "hybrid-forecast")
    assert at_open["hybrid"] > 0.05
    assert at_open["hybrid-forecast"] <= 0.5 * at_open["hybrid"]


def test_sim_prints_the_window_opening_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["--workload", SPEC.replace("days=4", "days=2"), "--slots", str(SLOTS),
         "--policy", "lru,hybrid,hybrid-forecast", "--opening-minutes", "15"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    head, _, table = out.partition("window openings: ")
    assert "hybrid-forecast" in head  # the usual per-policy table first
    lines = table.splitlines()
    assert "first 15 min after an opening" in lines[0]
    assert lines[1].split()[:3] == ["policy", "cold-start", "rate"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert set(rows) == {"lru", "hybrid", "hybrid-forecast", "belady"}
    assert all(0.0 <= float(v[0]) <= 1.0 and 0.0 <= float(v[1]) <= 1.0 for v in rows.values())
    assert int(rows["hybrid-forecast"][2]) > 0 and rows["belady"][2] == "-"
    assert (
        main(["--workload", SPEC.replace("days=4", "days=1"), "--policy", "hybrid", "--json"]) == 0
    )
    report = json.loads(capsys.readouterr().out)["openings"]
    assert report["minutes"] == 10.0 and report["requests"] > 0
    assert set(report["cold_start_rate"]) == {"hybrid", "belady"}
    # workloads without office windows print no such section
    assert main(["--workload", "zipf:requests=300", "--policy", "hybrid-forecast"]) == 0
    assert "window openings" not in capsys.readouterr().out
