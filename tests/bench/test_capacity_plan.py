"""``loraplex plan`` against hand-computed numbers (Llama-3-8B and Llama-2-7B shapes) and
against the real PEFT adapters of the test fixtures (their safetensors give the exact count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.bench import plan
from loraplex.bench.plan import PRESETS, PlanError, adapter_from_config, build_plan
from loraplex.testing import make_random_adapter

# Llama-3-8B: hidden 4096, 32 layers, 32 query heads and 8 KV heads of 128, intermediate 14336,
# vocab 128256. (d_in, d_out): q 4096->4096, k/v 4096->1024, o 4096->4096, gate/up 4096->14336,
# down 14336->4096. A LoRA module has r x (d_in + d_out) parameters.
L3 = PRESETS["llama-3-8b"]


def _params(rank: int, targets: object, **extra: object) -> int:
    cfg = {"r": rank, "target_modules": targets, **extra}
    return adapter_from_config(cfg, L3, "x").params(L3)


def test_llama3_8b_hand_computed() -> None:
    # q: 16 x 8192 = 131072; v: 16 x 5120 = 81920; per layer 212992; x 32 = 6,815,744
    assert _params(16, ["q_proj", "v_proj"]) == 6_815_744
    # all seven at r16: 16 x (8192 + 5120 + 5120 + 8192 + 18432 + 18432 + 18432) = 1,310,720
    # per layer, x 32 = 41,943,040
    assert _params(16, "all-linear") == 41_943_040
    # r8 on q,k,v,o: 8 x (8192 + 5120 + 5120 + 8192) = 212,992 per layer, x 32 = 6,815,744
    assert _params(8, ["q_proj", "k_proj", "v_proj", "o_proj"]) == 6_815_744
    # layers 0 and 1 only: 2 x 212,992 = 425,984
    assert _params(16, ["q_proj", "v_proj"], layers_to_transform=[0, 1]) == 425_984
    # v at rank 4 instead: 131072 + 4 x 5120 = 151,552 per layer, x 32 = 4,849,664
    assert _params(16, ["q_proj", "v_proj"], rank_pattern={"v_proj": 4}) == 4_849_664
    # a regex target_modules string is a full match on the module name (PEFT's rule)
    assert _params(16, r".*\.(q_proj|v_proj)") == 6_815_744
    # the loader's module selection: exclude_modules drops v (16 x 5120 x 32 = 2,621,440 less),
    # "all-linear" in any case, layers_pattern names the layer list, [] means every layer
    assert _params(16, "all-linear", exclude_modules=["v_proj"]) == 41_943_040 - 2_621_440
    assert _params(16, "All-Linear") == 41_943_040
    assert _params(16, "all-linear", layers_to_transform=[0], layers_pattern="layers") == 1_310_720
    assert _params(16, ["q_proj", "v_proj"], layers_to_transform=[]) == 6_815_744
    with pytest.raises(PlanError, match="change nothing"):
        _params(16, ["q_proj"], layers_to_transform=[0], layers_pattern="h")
    # Llama-2-7B (no GQA), r8 on q,v: 8 x (8192 + 8192) x 32 = 4,194,304 (PEFT's well-known
    # "trainable params: 4,194,304")
    l2 = PRESETS["llama-2-7b"]
    assert (
        adapter_from_config({"r": 8, "target_modules": ["q_proj", "v_proj"]}, l2, "x").params(l2)
        == 4_194_304
    )


def test_llama3_8b_plan_numbers() -> None:
    a = adapter_from_config({"r": 16, "target_modules": ["q_proj", "v_proj"]}, L3, "qv16")
    p = build_plan(
        L3, [a], device_budget=2 << 30, slots=8, num_adapters=1000, host_budget=64 << 30,
        decode_k=(1, 8),
    )  # fmt: skip
    # 8,030,261,248 parameters: per layer 41,943,040 (attention) + 176,160,768 (MLP) + 8192
    # (norms) = 218,112,000, x 32 = 6,979,584,000; + embedding and untied head 2 x 525,336,576
    # + final norm 4096
    assert p["model"]["params"] == 8_030_261_248
    assert p["adapters"][0]["bytes"] == 13_631_488  # 6,815,744 x 2 bytes (bf16)
    d = p["device"]
    # KV: 2 (K and V) x 32 layers x 8 heads x 128 x 2 bytes = 131,072 bytes per token
    assert d["kv_bytes_per_token"] == 131_072
    assert (
        d["slot_bytes"] == 13_631_488 and d["kv_tokens_per_slot"] == 104.0
    )  # 13,631,488 / 131,072
    # 2 GiB / 13,631,488 = 157.5 -> 157 slots, 157 x 104 = 16,328 tokens
    assert d["slots_in_budget"] == 157 and d["kv_tokens_forgone"] == 16_328
    assert d["slots_bytes"] == 8 * 13_631_488 and d["slots_kv_tokens_forgone"] == 832
    s = p["storage"]
    assert s["host_bytes_needed"] == 1000 * 13_631_488
    assert s["adapters_in_host"] == 5041  # 64 GiB / 13,631,488 = 5041.2
    # decode reads everything but the embedding: (8,030,261,248 - 525,336,576) x 2 bytes
    dec = p["decode"]
    assert dec["base_bytes_per_step"] == 15_009_849_344
    k8 = dec["rows"][1]
    assert k8["extra_bytes"] == 109_051_904
    assert k8["share_of_base"] == pytest.approx(109_051_904 / 15_009_849_344)
    # a slot sized for rank 64 over q,v is 4x the rank-16 one
    p64 = build_plan(L3, [a], max_lora_rank=64)
    assert p64["device"]["slot_bytes"] == 4 * 13_631_488


def test_lm_head_and_embedding_bytes() -> None:
    """embed_tokens and lm_head are one module each, r x (vocab + hidden); a decode step reads
    an embedding LoRA's B in full but gathers its A by token id (like the embedding)."""
    # 16 x (128256 + 4096) = 2,117,632 per module
    assert _params(16, ["lm_head"]) == 2_117_632
    assert _params(16, ["embed_tokens", "lm_head"]) == 2 * 2_117_632
    # PEFT's rule: layers_to_transform drops modules without a layer index, unless the entry
    # is the module's whole name ("lm_head" is; "embed_tokens" is "model.embed_tokens")
    assert _params(16, ["q_proj", "lm_head"], layers_to_transform=[0]) == 131_072 + 2_117_632
    assert _params(16, ["q_proj", "embed_tokens"], layers_to_transform=[0]) == 131_072
    assert _params(16, "all-linear") == 41_943_040  # never the head (PEFT's rule)
    assert _params(16, ["lm_head"], rank_pattern={"lm_head": 4}) == 2_117_632 // 4
    a = adapter_from_config({"r": 16, "target_modules": ["embed_tokens", "lm_head"]}, L3, "v")
    assert a.targets == ["embed_tokens", "lm_head"] and a.layers == 0
    p = build_plan(L3, [a], decode_k=(1,))
    row = p["adapters"][0]
    assert row["bytes"] == 2 * 2_117_632 * 2
    assert row["decode_bytes"] == row["bytes"] - 16 * 128_256 * 2  # all but the embedding's A
    assert p["decode"]["rows"][0]["extra_bytes"] == row["decode_bytes"]
    d = p["device"]
    assert d["slot_targets"] == ["embed_tokens", "lm_head"] and d["slot_bytes"] == row["bytes"]
    # what serve allocates per slot: every projection of every layer plus both vocab modules
    assert d["engine_vocab_slot_bytes"] == 2 * 2_117_632 * 2
    assert d["engine_slot_bytes"] == 41_943_040 * 2 + d["engine_vocab_slot_bytes"]


def test_peft_adapters_match_their_files(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The config-derived count equals the LoRA tensors PEFT actually saved, for ranks, regex
    targets, all-linear, rank_pattern and layers_to_transform."""
    m = plan.load_model(str(tiny_model))
    for name, path in adapters.items():
        a = plan.adapter_from_path(str(path), m)
        assert a.file_params == a.params(m), name
        assert a.file_bytes == 4 * a.params(m), name  # float32 files
        assert not a.notes, name
    # the same adapter priced on another base: its weights do not fit the config's count
    wrong = plan.adapter_from_path(str(adapters["all_r8"]), L3)
    assert wrong.notes and "another base model" in wrong.notes[0]
    # LoRA on lm_head and embed_tokens (rank_pattern on one), beside PEFT's copies of the base
    # matrices, which hold no LoRA parameters
    vocab = make_random_adapter(
        tiny_model, tmp_path / "vocab", r=4, rank_pattern={"lm_head": 2},
        target_modules=["q_proj", "lm_head", "embed_tokens"],
    )  # fmt: skip
    a = plan.adapter_from_path(str(vocab), m)
    assert a.targets == ["embed_tokens", "lm_head", "q_proj"]
    assert a.file_params == a.params(m) and not a.notes


def test_cli(tiny_model: Path, adapters: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    argv = ["--model", "llama-3-8b", "--rank", "16", "--targets", "q_proj,v_proj",
            "--device-budget", "2GiB", "--json"]  # fmt: skip
    assert plan.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["adapters"][0]["params"] == 6_815_744 and doc["device"]["slots_in_budget"] == 157
    argv = ["--model", str(tiny_model / "config.json"), "--adapter", str(adapters["mlp_r16"]),
            "--num-adapters", "10"]  # fmt: skip
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "mlp_r16" in out and "KV-cache tokens" in out and "10 adapters" in out
    bad = [
        (["--model", "llama-9b", "--rank", "8"], "neither a preset"),
        (["--model", "llama-3-8b", "--rank", "8", "--targets", "c_attn"], "change nothing"),
        (["--model", "llama-3-8b"], "no adapters"),
        (["--model", "llama-3-8b", "--rank", "0"], "integer >= 1"),
        (
            ["--model", "llama-3-8b", "--rank", "8", "--device-budget", "lots"],
            "expected a byte size",
        ),
        (["--model", "llama-3-8b", "--rank", "32", "--max-lora-rank", "16"], "below"),
    ]
    for argv, msg in bad:
        assert plan.main(argv) == 2, argv
        assert msg in capsys.readouterr().err, argv
    with pytest.raises(PlanError, match="layers_to_transform"):
        adapter_from_config({"r": 8, "target_modules": ["q_proj"], "layers_to_transform": [40]},
                            L3, "x")  # fmt: skip
