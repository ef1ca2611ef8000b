"""``python -m loraplex.tools.bench.quant`` end to end on a tiny shape: every mode's figures land in
its JSON line and the table, and the quantized base is the smaller one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.tools.bench import quant


def test_quant_bench_runs_on_a_tiny_shape(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--shape", "tiny", "--modes", "float32", "float32+int4", "bfloat16+W4A8",
            "--new-tokens", "3", "--threads", "1", "--cache-dir", str(tmp_path)]  # fmt: skip
    assert quant.main(argv) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in rows] == ["float32", "float32+int4", "bfloat16+W4A8"]
    for r in rows:
        assert r["tok_s_16_adapters"] > 0 and r["tok_s_1_adapter"] > 0 and r["bandwidth_gbs"] > 0
    f32, int4, w4a8 = rows
    assert int4["weights"] < f32["weights"] / 4  # int4 projections, int8 embedding and head
    assert int4["kernels"].startswith("int4-g128") and "tiny: decode tok/s" in out
    # a W4A8 checkpoint written beside the model: its base products W4A8 (VNNI or emulated)
    assert (tmp_path / "tiny" / "model-w4a8" / "config.json").is_file()
    assert w4a8["kernels"].startswith("compressed-tensors-w4g128-a-int8: ")
    assert "w4a8 g128: " in w4a8["kernels"]  # down_proj's 256 inputs (the others: one group)
    assert w4a8["weights"] < f32["weights"]
