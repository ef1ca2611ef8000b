"""``python -m loraplex.tools.bench.profile_step`` end to end on the tiny model: it runs every mix,
its breakdown accounts for the instrumented steps, and its byte counts are the engine's."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.tools.bench import profile_step


def test_profile_step_runs_and_counts_bytes(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model-dir", str(tiny_model), "--adapter-dir", str(tmp_path / "ad")]
    assert (
        profile_step.main([*argv, "--dtypes", "float32", "--steps", "2", "--layer-ops", "both"])
        == 0
    )
    out = capsys.readouterr().out
    assert "layer ops: torch" in out and "layer ops: cpu-kernel" in out  # before, then after
    assert "base step: layer ops torch" in out
    assert "float32" in out and "byte floor ms" in out and "byte bound" in out
    out = out[out.index("layer ops: cpu-kernel") :]
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("lora MiB")}
    assert rows, out
    base, one, many = (float(v) for v in rows["lora"].split()[2:5])
    assert base == 0.0 and 0.0 < one < many  # 16 distinct adapters read 16x one's rows
    assert many == pytest.approx(16 * one, rel=0.05)  # printed to 3 decimals
