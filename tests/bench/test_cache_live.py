"""Smoke test of the live-server cache benchmark at tiny sizes (not a timed test)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loraplex.tools.bench import cache_live


def test_cache_live_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--cache-dir", str(tmp_path / "assets"), "--shape", "tiny", "--adapters", "6",
        "--requests", "20", "--host-adapters", "2", "--disk-adapters", "4",
        "--sample", "3", "--repeats", "2", "--cold-repeats", "1",
    ]  # fmt: skip
    assert cache_live.main(argv) == 0
    out = capsys.readouterr().out
    rows = {m[1]: int(m[2]) for m in re.finditer(r"^(warm|cold|all)\s+(\d+)\s", out, re.M)}
    assert rows["all"] == 20, out
    assert rows["warm"] > 0 and rows["cold"] > 0, out
    assert rows["warm"] + rows["cold"] == 20, out
    assert "0 errors" in out, out
    ratio = re.search(r"L2 verified / raw = ([0-9.]+)x", out)
    assert ratio is not None and float(ratio[1]) > 0, out
    assert re.search(r"^disk_load\s+\d+", out, re.M), out
    assert re.search(r"sha256 \d+ MB/s", out), out
    assert re.search(r"blake3 \d+ MB/s 1 thread", out), out
    assert re.search(r"target <= 2x: (met|NOT met)", out), out
