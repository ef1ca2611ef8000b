"""``loraplex sim --plot``: a PNG of the L0 hit ratio over time per policy with Belady's line;
the binned ratio is exact; without matplotlib a clear error (exit 2) before any run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loraplex.cache.policy import belady_hits
from loraplex.tools.sim.cli import main
from loraplex.tools.sim.plot import windowed_ratio
from loraplex.tools.sim.simulate import SimConfig, policy_factory, simulate
from loraplex.tools.sim.workloads import generate_workload


def test_windowed_ratio_counts_each_bin() -> None:
    tl = [(0.0, True), (0.4, False), (1.0, True), (1.9, True), (2.0, False)]
    xs, ys = windowed_ratio(tl, 0.0, 2.0, 2)
    assert xs == [0.5, 1.5]
    assert ys == [0.5, 2 / 3]  # [0, 1): 1 of 2; [1, 2] (the end falls in the last bin): 2 of 3
    assert windowed_ratio([(5.0, True)], 0.0, 10.0, 4)[1] == [None, None, 1.0, None]


def test_timeline_agrees_with_the_result() -> None:
    wl = generate_workload("zipf:s=1,n=32,requests=400,rate=50")
    cfg = SimConfig(slots=4)
    timeline: list[tuple[float, bool]] = []
    r = simulate(wl.requests, policy_factory("lru", cfg.tier_names), cfg, timeline=timeline)
    assert len(timeline) == r.requests - r.unserved
    assert sum(h for _, h in timeline) == round(r.l0_hit_ratio * r.requests)
    keys = [q.adapter for q in wl.requests]
    assert sum(belady_hits(keys, 4)) >= sum(h for _, h in timeline)  # the optimum bounds it


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hit.png"
    argv = ["--workload", "zipf:s=1,n=32,requests=300,rate=50", "--slots", "4"]
    assert main([*argv, "--policy", "lru,hybrid", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert "belady" in capsys.readouterr().out
    bad = tmp_path / "no" / "such" / "dir" / "x.png"
    assert main([*argv, "--plot", str(bad)]) == 2
    assert "cannot write plot" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "hit.png"
    assert main(["--workload", "uniform:n=8", "--plot", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "loraplex[bench]" in err
    assert not out.exists()
