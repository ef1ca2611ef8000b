"""``python -m loraplex.tools.bench.moe --tiny`` end to end: every figure lands in the JSON, the grouped
experts matched transformers' per-expert loop, and the byte counts follow the routing (no
timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.tools.bench import moe


def test_moe_bench_tiny_writes_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "moe.json"
    argv = [
        "--tiny",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(out),
    ]
    assert moe.main(argv) == 0
    printed = capsys.readouterr().out
    assert "grouped ms" in printed and "bound ms" in printed
    res = json.loads(out.read_text())
    assert set(res) == {"meta", "decode", "grouped_vs_naive"}
    shape = moe.TINY
    assert res["meta"]["moe_active_parameters"] < res["meta"]["moe_parameters"]
    assert res["meta"]["read_bandwidth_gbs"] > 0

    rows = {(r["model"], r["requests"], r["batch"]): r for r in res["decode"]}
    adapters = f"{shape.n_adapters} adapters"
    want = {(m, "base", b) for m in ("dense", "moe") for b in shape.batches}
    assert set(rows) == want | {("moe", adapters, max(shape.batches))}
    for (model, requests, batch), r in rows.items():
        assert {"ms", "tok_s", "bytes", "bytes_total", "bound_ms", "step_over_bound"} <= set(r)
        assert r["ms"] > 0 and r["bound_ms"] > 0 and r["bytes"]["kv"] > 0
        assert r["bytes_total"] == pytest.approx(sum(r["bytes"].values()))
        touched = r["experts_touched_per_layer"]
        if model == "dense":
            assert r["bytes"]["experts"] == 0 and touched == 0
        else:  # at least one token's top-k, at most every pair's expert or every expert
            assert shape.top_k <= touched <= min(shape.num_experts, shape.top_k * batch)
        lora = r["bytes"]["lora_dense"] + r["bytes"]["lora_experts"]
        assert (lora > 0) == (requests == adapters)
    # equal active parameters: one token's step reads about the dense model's bytes
    one_moe, one_dense = rows["moe", "base", 1], rows["dense", "base", 1]
    assert one_moe["bytes_total"] == pytest.approx(one_dense["bytes_total"], rel=0.1)

    layer = res["grouped_vs_naive"]
    assert [r["tokens"] for r in layer] == list(shape.layer_tokens)
    for r in layer:
        assert r["match"] is True and r["naive_max_abs_diff"] < 1e-4
        assert r["naive_ms"] > 0 and r["grouped_ms"] > 0
        if res["meta"]["hf_experts_implementation"] is not None:  # transformers' own block
            assert r["hf_max_abs_diff"] < 1e-4 and r["hf_ms"] > 0
        assert 1 <= r["experts_hit"] <= shape.num_experts
