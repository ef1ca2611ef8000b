"""``loraplex plan`` against hand-computed numbers (Llama-3-8B and Llama-2-7B shapes, and the
mixture-of-experts Qwen3-30B-A3B and Mixtral-8x7B) and against the real PEFT adapters of the test
fixtures (their safetensors give the exact count; MoE fixtures: ``test_moe_plan_verify``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from loraplex.testing import make_random_adapter
from loraplex.tools import plan
from loraplex.tools.plan import (
    PRESETS,
    PlanError,
    adapter_from_config,
    build_plan,
    model_from_config,
)

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


# Qwen3-30B-A3B: hidden 2048, 48 layers (all sparse), 32 query heads and 4 KV heads of 128,
# 128 experts of 768, top-8, vocab 151936, untied. (d_in, d_out): q 2048->4096, k/v 2048->512,
# o 4096->2048, router 2048->128; per expert gate/up 2048->768, down 768->2048.
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
}  # fmt: skip
QWEN_MOE = PRESETS["qwen3-30b-a3b"]


def test_qwen3_30b_a3b_hand_computed() -> None:
    # the preset is what its config.json parses to
    from_config = plan.model_from_config(QWEN3_30B_A3B_CONFIG, "qwen3-30b-a3b")
    assert from_config.params() == QWEN_MOE.params()
    assert from_config.active_params() == QWEN_MOE.active_params()
    assert from_config.sparse == QWEN_MOE.sparse == tuple(range(48))
    # per layer: attention 8,388,608 + 2 x 1,048,576 + 8,388,608 = 18,874,368; router 262,144;
    # one expert 3 x 1,572,864 = 4,718,592, x 128 = 603,979,776; norms 2 x 2048 + q/k 2 x 128
    # = 4352: 623,120,640, x 48 = 29,909,790,720; + embedding and head 2 x 311,164,928 + the
    # final norm 2048 = 30,532,122,624 ("30.5B")
    assert QWEN_MOE.params() == 30_532_122_624
    # a token reads 8 experts: 120 x 4,718,592 x 48 = 27,179,089,920 fewer: 3,353,032,704 ("A3B")
    assert QWEN_MOE.active_params() == 3_353_032_704
    a = adapter_from_config(
        {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"]}, QWEN_MOE, "experts16",
    )  # fmt: skip
    p = build_plan(QWEN_MOE, [a], decode_k=(1, 8), decode_batch=64)
    # attention r16: 16 x (6144 + 2560 + 2560 + 6144) = 278,528 per layer, x 48 = 13,369,344;
    # experts: 16 x 128 x 3 x 2816 = 17,301,504 per layer, x 48 = 830,472,192: 98% of it
    row = p["adapters"][0]
    assert row["parts"] == {"attention": 2 * 13_369_344, "experts": 2 * 830_472_192}
    assert row["bytes"] == 2 * 843_841_536 and round(row["experts_share"], 3) == 0.984
    assert row["adapted_experts"] == 128 and row["expert_layout"] == "per_expert"
    d = p["device"]
    # KV: 2 x 48 layers x 4 heads x 128 x 2 bytes = 98,304 bytes per token
    assert d["kv_bytes_per_token"] == 98_304 and d["slot_bytes"] == row["bytes"]
    # serve's slot: + the router 16 x (2048 + 128) x 48 = 1,671,168 and embed_tokens/lm_head
    # 2 x 16 x (151936 + 2048) = 4,927,488
    assert d["engine_router_slot_bytes"] == 2 * 1_671_168
    assert d["engine_expert_slot_bytes"] == 2 * 830_472_192
    assert d["engine_slot_bytes"] == 2 * (843_841_536 + 1_671_168 + 4_927_488)
    dec = p["decode"]
    # one token: all but 120 experts per layer and the embedding, 3,041,867,776 x 2 bytes; a
    # batch of 64 tokens may touch min(128, 64 x 8) = 128 experts: all but the embedding
    assert dec["base_bytes_per_step"] == 2 * 3_041_867_776
    assert dec["base_bytes_full_batch"] == 2 * 30_220_957_696
    assert dec["experts_read_per_layer"] == {"one_token": 8, "full_batch": 128}
    k1, k8 = dec["rows"]
    # one token of the adapter reads its attention part and 8 experts' LoRA:
    # 13,369,344 + 16 x 8 x 8448 x 48 = 65,273,856 parameters
    assert k1["extra_bytes"] == 2 * 65_273_856 and k8["extra_bytes"] == 8 * 2 * 65_273_856
    # 8 adapters, one token each: the base reads min(128, 64) = 64 experts per layer
    assert k8["base_bytes"] == 2 * (3_041_867_776 + 56 * 4_718_592 * 48)
    # a full batch: 8 tokens per adapter, each adapter min(128, 64) experts
    assert k8["extra_bytes_full_batch"] == 8 * 2 * (13_369_344 + 16 * 64 * 8448 * 48)
    # PEFT's target_parameters on the packed experts: gate_up_proj's one A serves gate and up
    # (16 x 128 x (2048 + 1536) + 16 x 128 x (768 + 2048) = 13,107,200 per layer): smaller on
    # disk and host, the same slot (the engine splits it) and decode bytes
    packed = adapter_from_config(
        {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
         "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
        QWEN_MOE, "packed16",
    )  # fmt: skip
    pp = build_plan(QWEN_MOE, [packed], decode_k=(1, 8), decode_batch=64)
    assert pp["adapters"][0]["parts"]["experts"] == 2 * 48 * 13_107_200
    assert pp["device"]["slot_bytes"] == d["slot_bytes"] and pp["decode"] == dec
    # the router alone: r16 x (2048 + 128) per layer
    router = adapter_from_config({"r": 16, "target_modules": ["gate"]}, QWEN_MOE, "router")
    assert router.part_params(QWEN_MOE) == {"router": 1_671_168}


def test_mixtral_8x7b_preset(capsys: pytest.CaptureFixture) -> None:
    """46.7B parameters, 12.9B active (2 of 8 experts of 14336)."""
    m = PRESETS["mixtral-8x7b"]
    # per layer: attention 41,943,040, router 8 x 4096, experts 8 x 3 x 58,720,256; norms 8192;
    # x 32, + 2 x 32000 x 4096 + 4096
    assert m.params() == 46_702_792_704
    assert m.active_params() == 46_702_792_704 - 32 * 6 * 176_160_768 == 12_879_925_248
    # w1 / w3 / w2 are Mixtral's per-expert names: 16 x 8 x 3 x (4096 + 14336) x 32
    a = adapter_from_config({"r": 16, "target_modules": ["w1", "w3", "w2"]}, m, "x")
    assert a.part_params(m) == {"experts": 226_492_416}
    assert plan.main(["--model", "mixtral-8x7b", "--rank", "8", "--targets", "q_proj",
                      "--target-parameters", "mlp.experts.down_proj", "--json"]) == 0  # fmt: skip
    row = json.loads(capsys.readouterr().out)["adapters"][0]
    # q: 8 x 8192 x 32 = 2,097,152; packed down_proj: 8 x 8 x (14336 + 4096) x 32 = 37,748,736
    assert row["parts"] == {"attention": 2 * 2_097_152, "experts": 2 * 37_748_736}
    assert row["expert_layout"] == "packed"


def test_quantized_base_bytes_hand_computed() -> None:
    """A quantized base's projections at their stored bytes; embedding, norms, head and the
    adapters stay in the dtype. Llama-3-8B: 6,979,321,856 projection weights of 8,030,261,248."""
    a = adapter_from_config({"r": 16, "target_modules": ["q_proj", "v_proj"]}, L3, "qv16")
    bf16 = build_plan(L3, [a], dtype="bfloat16")
    linear = L3.linear_params()
    assert linear == 32 * (4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336)
    other = L3.params() - linear
    # int4 g128: half a byte a weight, a float32 scale and an int8 zero point per 128
    int4 = build_plan(L3, [a], dtype="bfloat16", quantization="int4")
    assert int4["model"]["weight_bytes"] == int(other * 2 + linear * (0.5 + 5 / 128))
    int4_g32 = build_plan(
        L3, [a], dtype="bfloat16", quantization="int4", quantization_group_size=32
    )
    assert int4_g32["model"]["weight_bytes"] == int(other * 2 + linear * (0.5 + 5 / 32))
    int8 = build_plan(L3, [a], dtype="bfloat16", quantization="int8")
    assert int8["model"]["weight_bytes"] == other * 2 + linear
    # the decode model reads the quantized projections and the bf16 head
    head = L3.vocab_size * L3.hidden_size
    norms = bf16["decode"]["base_bytes_per_step"] - 2 * (linear + head)
    assert int8["decode"]["base_bytes_per_step"] == linear + 2 * head + norms
    assert int4["adapters"] == bf16["adapters"]  # adapters keep the activation dtype
    with pytest.raises(PlanError, match="unknown quantization 'int3'"):
        build_plan(L3, [a], quantization="int3")


def test_pipeline_of_activated_loras_hand_computed(capsys: pytest.CaptureFixture) -> None:
    """Four steps over a 2,000-token context with 40-token questions, 16-token blocks: a
    standard LoRA step prefills 2,040 tokens; an aLoRA step finds the 125 base blocks (2,000
    tokens) the base answer computed and prefills its 40 tokens."""
    rc = plan.main(["--model", "llama-3-8b", "--rank", "16", "--targets", "all-linear",
                    "--alora", "--pipeline-context", "2000", "--pipeline-question", "40",
                    "--json"])  # fmt: skip
    assert rc == 0
    p = json.loads(capsys.readouterr().out)["pipeline"]
    assert [s["tokens"] for s in p["steps"]] == [40] * 4
    assert p["standard_prefill_tokens"] == 4 * 2040 and p["prefill_tokens"] == 160
    assert p["prefill_ratio"] == pytest.approx(160 / 8160)
    # Llama-3-8B KV: 2 x 32 layers x 8 heads x 128 x 2 bytes = 131072 bytes a token
    assert p["kv_bytes"] == 160 * 131072
    # a context that ends mid-block: that block is recomputed (2,008 = 125 blocks + 8)
    rc = plan.main(["--model", "llama-3-8b", "--rank", "16", "--alora",
                    "--pipeline-context", "2008", "--pipeline-question", "40", "--json"])  # fmt: skip
    assert rc == 0
    p = json.loads(capsys.readouterr().out)["pipeline"]
    assert [s["tokens"] for s in p["steps"]] == [48] * 4
    # standard LoRAs share nothing; the text report says so side by side
    rc = plan.main(["--model", "llama-3-8b", "--rank", "16", "--pipeline-context", "2000"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "prefill tokens 8,256 of 8,256 (100.0%)" in text


def test_windowed_kv_per_sequence_hand_computed() -> None:
    """Gemma 3 1B's shape (26 layers, every 6th global, 1 KV head x 256, window 512, bf16):
    one group of the 4 global layers and 6 of the 22 sliding ones (4 per page, one padded).
    At 8k a sequence holds 512 blocks of the global group and ceil(511 / 16) + 1 = 33 of each
    sliding group, pages of 4 layers x 16 tokens x 2 x 256 x 2 bytes; a model without windows
    holds every layer at every token."""
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    cfg = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 1152,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 6912,
        "vocab_size": 262144,
        "sliding_window": 512,
        "layer_types": types,
        "torch_dtype": "bfloat16",
    }
    m = model_from_config(cfg, "gemma-3-1b")
    assert m.layer_windows == tuple(None if t == "full_attention" else 512 for t in types)
    page = 4 * 16 * 2 * 256 * 2
    assert m.kv_bytes_per_sequence(8192, 2) == (512 + 6 * 33) * page  # 44.4 MiB
    assert m.kv_bytes_per_sequence(32768, 2) == (2048 + 6 * 33) * page
    flat = replace(m, layer_windows=())
    assert flat.kv_bytes_per_sequence(8192, 2) == 8192 * m.kv_bytes_per_token(2)  # 208 MiB
    a = adapter_from_config({"r": 8, "target_modules": ["q_proj"]}, m, "a")
    assert build_plan(m, [a])["device"]["kv_bytes_per_sequence"] == {
        8192: (512 + 6 * 33) * page,
        32768: (2048 + 6 * 33) * page,
    }
