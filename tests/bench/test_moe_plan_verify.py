"""``loraplex plan`` and ``loraplex verify`` on mixture-of-experts bases (Qwen3-MoE with and
without a dense layer, Mixtral) and expert adapters of both layouts: per-expert keys and PEFT's
``target_parameters`` on the packed experts, with and without the router.

The planner's counts are checked against what is really there: transformers' parameter count,
the LoRA tensors in the adapter files, the engine's loaded adapter (``LoRAAdapter.nbytes``) and
the engine's slot bank (``bank.nbytes``: every expert's rows of every expert projection)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex import LLM
from loraplex.checkpoint.modules import EXPERT_PROJ_NAMES, PROJ_NAMES, ROUTER, BaseModelSpec
from loraplex.lora.adapter import load_peft_adapter
from loraplex.model.config import load_model_config
from loraplex.testing import (
    load_merged_reference,
    make_per_expert_adapter,
    make_random_adapter,
    make_random_model,
)
from loraplex.tools import plan, verify

PACKED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MODELS = {
    # 16 experts of 32, top-4; every layer sparse
    "qwen": dict(arch="qwen3_moe", num_experts=16, num_experts_per_tok=4,
                 moe_intermediate_size=32, norm_topk_prob=True),
    # layer 1 dense (mlp_only_layers, intermediate 128 by default), experts of 24, top-3
    "qwen_dense": dict(arch="qwen3_moe", num_experts=16, num_experts_per_tok=3,
                       moe_intermediate_size=24, mlp_only_layers=[1]),
    # top-2 of 16, block_sparse_moe / w1 w3 w2 in per-expert adapters
    "mixtral": dict(arch="mixtral", num_local_experts=16, num_experts_per_tok=2,
                    intermediate_size=32),
}  # fmt: skip
# model -> adapter -> (builder, arguments)
ADAPTERS: dict[str, dict[str, tuple[str, dict]]] = {
    "qwen": {
        "per_expert": ("per_expert", dict(r=8, target_modules=[
            "q_proj", "gate", "gate_proj", "up_proj", "down_proj"], std=0.1, seed=1)),
        "packed": ("peft", dict(r=8, target_modules=["q_proj"], target_parameters=PACKED,
                                std=0.1, seed=2)),
        "down_router": ("peft", dict(r=16, lora_alpha=8, target_modules=["k_proj", "o_proj"],
                                     target_parameters=["mlp.experts.down_proj",
                                                        "mlp.gate.weight"], std=0.1, seed=3)),
    },
    "qwen_dense": {
        "dense_and_packed": ("peft", dict(r=8, target_modules=["gate_proj", "up_proj",
                                                               "down_proj"],
                                          target_parameters=PACKED, std=0.1, seed=4)),
        "per_expert": ("per_expert", dict(r=8, target_modules=[
            "q_proj", "gate_proj", "up_proj", "down_proj"], std=0.1, seed=5)),
    },
    "mixtral": {
        "per_expert": ("per_expert", dict(r=8, target_modules=["w1", "w3", "w2", "gate"],
                                          std=0.1, seed=6)),
        "packed": ("peft", dict(r=4, target_modules=["q_proj", "v_proj"],
                                target_parameters=PACKED, std=0.1, seed=7)),
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """name -> {"model": dir, "adapters": {name: dir}}."""
    root = tmp_path_factory.mktemp("moe")
    out: dict[str, dict] = {}
    for name, spec in MODELS.items():
        kw = dict(spec)
        model = make_random_model(root / name, kw.pop("arch"), num_layers=2, seed=5, **kw)
        adapters = {}
        for a, (kind, args) in ADAPTERS[name].items():
            make = make_random_adapter if kind == "peft" else make_per_expert_adapter
            adapters[a] = make(model, root / f"{name}-{a}", **args)
        out[name] = {"model": model, "adapters": adapters}
    return out


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, dict]:
    rc = verify.main([*argv, "--json", "--max-tokens", "3", "--prompt", "Hello world"])
    return rc, json.loads(capsys.readouterr().out)


def _table_bytes(bank: Any, layers: tuple[int, ...], projs: tuple[str, ...]) -> int:
    """Bytes of the slot bank's tables of ``projs`` in ``layers``."""
    return sum(
        t.numel() * t.element_size()
        for layer in layers
        for proj in projs
        for t in bank.tables(layer, proj)
    )


# -- plan ------------------------------------------------------------------------------------------


def test_plan_counts_what_is_loaded_saved_and_allocated(moe: dict[str, dict]) -> None:
    """Model parameters equal transformers' count (every expert) and the engine's; an adapter's
    parameters equal its file's LoRA tensors and the engine's loaded copy; the per-slot bank
    bytes equal the engine's real bank, expert tables (E x capacity rows) and router included."""
    for name, case in moe.items():
        model = case["model"]
        shape = plan.load_model(str(model))
        mc = load_model_config(model)
        hf = load_merged_reference(model, None)
        assert shape.params() == hf.num_parameters() == mc.num_parameters(), name
        assert shape.active_params() == mc.active_parameters(), name  # type: ignore[attr-defined]
        assert shape.sparse == tuple(mc.sparse_layers), name  # type: ignore[attr-defined]
        spec = BaseModelSpec.from_hf_config(json.loads((model / "config.json").read_text()))
        for a_name, path in case["adapters"].items():
            a = plan.adapter_from_path(str(path), shape)
            assert a.file_params == a.params(shape) and not a.notes, (name, a_name, a.notes)
            served = load_peft_adapter(path, spec, max_lora_rank=16, dtype=torch.float32)
            p = plan.build_plan(shape, [a], dtype="float32")
            row = p["adapters"][0]
            assert row["bytes"] == served.nbytes == 4 * a.params(shape), (name, a_name)
            assert sum(row["parts"].values()) == row["bytes"]
            assert a.max_rank == served.rank
            experts = {k: w for k, w in served.weights.items() if w.num_experts}
            assert row["adapted_experts"] == 16 and experts
            assert all(w.a.shape[0] == 16 for w in experts.values())
        # the engine's bank: max_loras slots of max_lora_rank rows for every module
        llm = LLM(str(model), enable_lora=True, max_loras=3, max_lora_rank=8, dtype="float32")
        bank = llm.engine.adapters.bank
        a = plan.adapter_from_config({"r": 8, "target_modules": ["q_proj"]}, shape, "q")
        d = plan.build_plan(shape, [a], dtype="float32", max_lora_rank=8)["device"]
        assert bank.nbytes == 3 * d["engine_slot_bytes"], name
        experts = _table_bytes(bank, shape.sparse, EXPERT_PROJ_NAMES)
        assert experts == 3 * d["engine_expert_slot_bytes"], name
        assert _table_bytes(bank, shape.sparse, (ROUTER,)) == 3 * d["engine_router_slot_bytes"]
        del llm


def test_plan_reports_the_expert_part(moe: dict[str, dict], capsys: pytest.CaptureFixture) -> None:
    """The bytes of the attention, router and expert parts of an adapter, separately, with the
    experts' share said plainly; a slot holds every expert's rows."""
    model = moe["qwen"]["model"]
    shape = plan.load_model(str(model))
    a = plan.adapter_from_path(str(moe["qwen"]["adapters"]["per_expert"]), shape)
    # hidden 64, 2 layers, q 64 -> 64, router 64 -> 16, experts gate/up 64 -> 32, down 32 -> 64
    # r8: q 8 x 128 = 1024, router 8 x 80 = 640, experts 16 x 8 x 96 x 3 = 36,864 per layer
    assert a.part_params(shape) == {"attention": 2048, "router": 1280, "experts": 73_728}
    assert a.targets == ["q_proj", "gate", *EXPERT_PROJ_NAMES]
    assert a.expert_layout == "per_expert" and a.adapted_experts == 16
    packed = plan.adapter_from_path(str(moe["qwen"]["adapters"]["packed"]), shape)
    # the packed gate_up_proj: one A [16 x 8, 64] for gate and up and B [64, 16 x 8]
    assert packed.targets == ["q_proj", "experts.down_proj", "experts.gate_up_proj"]
    assert packed.part_params(shape) == {"attention": 2048, "experts": 2 * 16 * 8 * (128 + 96)}
    # ... which the engine splits: a slot and a decode step hold A twice, like per-expert keys
    p = plan.build_plan(shape, [packed], dtype="float32", decode_k=(1, 4), decode_batch=2)
    assert p["device"]["slot_params"] == 2048 + 73_728
    assert p["device"]["slot_targets"] == ["q_proj", *EXPERT_PROJ_NAMES]
    # decode: one token of the adapter reads 4 of its 16 experts; k=4 adapters with 1 token
    # each: the base reads min(16, 4 x 4) = 16 experts; the full batch (2 tokens, at least k)
    rows = p["decode"]["rows"]
    per_expert = 2 * 8 * 96 * 3  # two layers, one expert's three projections at r8
    assert rows[0]["extra_bytes"] == 4 * (2048 + 4 * per_expert)
    assert rows[1]["extra_bytes"] == 4 * 4 * (2048 + 4 * per_expert)
    assert rows[1]["base_bytes"] == 4 * shape.decode_read_params(4)
    assert shape.decode_read_params(4) == shape.params() - 384 * 64  # every expert: all but emb
    assert rows[0]["base_bytes_full_batch"] == 4 * shape.decode_read_params(2)
    assert rows[0]["extra_bytes_full_batch"] == 4 * (2048 + 8 * per_expert)  # 2 tokens, 8 experts
    assert p["decode"]["experts_read_per_layer"] == {"one_token": 4, "full_batch": 8}
    argv = ["--model", str(model), "--adapter", str(moe["qwen"]["adapters"]["per_expert"])]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "experts: 96% of this adapter's bytes" in out  # 73,728 of 77,056
    assert "parts: attention 8.0 KiB, router 5.0 KiB, experts 288.0 KiB" in out
    assert "all 16 experts of each expert projection" in out
    assert "a token reads 4 of 16 experts per sparse layer" in out


def test_plan_dense_layer_and_all_linear(moe: dict[str, dict], tmp_path: Path) -> None:
    """A dense layer of a MoE base has the MLP's projections, not experts. ``all-linear`` as
    PEFT wrote it while experts and router were linears: every one of them, exactly what the
    weights hold when there are weights; PEFT on transformers 5 saves its expansion instead
    (the packed experts, gate_up_proj at rank 2r), priced as saved."""
    case = moe["qwen_dense"]
    shape = plan.load_model(str(case["model"]))
    assert shape.sparse == (0,) and shape.layer_projs(1) == PROJ_NAMES
    a = plan.adapter_from_path(str(case["adapters"]["per_expert"]), shape)
    assert sorted(a.modules) == sorted([(0, "q_proj"), (1, "q_proj"), (1, "gate_proj"),
                                        (1, "up_proj"), (1, "down_proj"),
                                        *((0, p) for p in EXPERT_PROJ_NAMES)])  # fmt: skip
    assert a.part_params(shape)["mlp"] == 8 * (192 + 192 + 192)  # 64 <-> 128 at r8
    # all-linear from a config alone: attention, the dense MLP, the router and every expert,
    # with a note on what PEFT on transformers 5 trains instead
    lin = plan.adapter_from_config({"r": 8, "target_modules": "all-linear"}, shape, "lin")
    assert {p for _, p in lin.modules} == {*PROJ_NAMES, ROUTER, *EXPERT_PROJ_NAMES}
    assert {p for layer, p in lin.modules if layer == 0} == {
        *PROJ_NAMES[:4],
        ROUTER,
        *EXPERT_PROJ_NAMES,
    }
    assert lin.notes == [plan.PER_EXPERT_NOTE] and "rank 2r" in lin.notes[0]
    # ... from a directory whose weights hold per-expert keys of some projections and no
    # router: what they hold, exact
    qwen = moe["qwen"]["model"]
    qs = plan.load_model(str(qwen))
    some = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    d = make_per_expert_adapter(qwen, tmp_path / "lin", r=4, target_modules=some)
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": "all-linear"}))
    a = plan.adapter_from_path(str(d), qs)
    assert a.file_params == a.params(qs) and not a.notes, a.notes
    assert ROUTER not in a.targets and a.expert_layout == "per_expert"
    spec = BaseModelSpec.from_hf_config(json.loads((qwen / "config.json").read_text()))
    served = load_peft_adapter(d, spec, max_lora_rank=8, dtype=torch.float32)
    assert served.nbytes == 4 * a.params(qs) and set(served.weights) == set(a.modules)
    # PEFT's own all-linear on transformers 5: attention, the router and the packed experts
    # with gate_up_proj at rank 2r (r4: 8), down_proj at r
    peft = make_random_adapter(qwen, tmp_path / "peft-lin", r=4, target_modules="all-linear")
    a = plan.adapter_from_path(str(peft), qs)
    assert a.file_params == a.params(qs) and not a.notes, a.notes
    assert a.part_params(qs) == {
        "attention": 2 * 4 * (128 + 96 + 96 + 128),
        "router": 2 * 4 * (64 + 16),
        "experts": 2 * (16 * 8 * (64 + 64) + 16 * 4 * (32 + 64)),
    }
    assert a.max_rank == 8 and a.expert_layout == "packed"


def test_plan_moe_refusals(tmp_path: Path) -> None:
    l3 = plan.PRESETS["llama-3-8b"]
    q = plan.PRESETS["qwen3-30b-a3b"]
    with pytest.raises(plan.PlanError, match="dense model"):
        plan.adapter_from_config({"r": 8, "target_parameters": PACKED}, l3, "x")
    with pytest.raises(
        plan.PlanError, match=r"target_parameters entry 'self_attn\.q_proj\.weight'"
    ):
        plan.adapter_from_config({"r": 8, "target_parameters": ["self_attn.q_proj.weight"]}, q, "x")
    with pytest.raises(plan.PlanError, match=r"w9.*change nothing"):
        plan.adapter_from_config({"r": 8, "target_modules": ["w9"]}, q, "x")
    with pytest.raises(plan.PlanError, match="not a mixture-of-experts model"):
        l3.dims("experts.gate_proj")
    # a MoE of an architecture we do not serve is refused, not counted as a dense model
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
           "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 384, "num_experts": 8}  # fmt: skip
    with pytest.raises(plan.PlanError, match=r"mixture-of-experts config .*does not serve"):
        plan.model_from_config(cfg, "qwen2moe")
    # shared experts (Qwen2-MoE style fields on a Qwen3-MoE config): the architecture's refusal
    cfg = {**cfg, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 64}  # fmt: skip
    with pytest.raises(plan.PlanError, match="shared experts"):
        plan.model_from_config(cfg, "shared")
    # a bare config (no architectures) of a MoE type we serve reads as that architecture
    del cfg["shared_expert_intermediate_size"], cfg["architectures"]
    assert plan.model_from_config(cfg, "bare").num_experts == 8


# -- verify ----------------------------------------------------------------------------------------


def test_verify_expert_adapters_pass(moe: dict[str, dict], capsys: pytest.CaptureFixture) -> None:
    """Per-expert keys (Qwen-MoE's and Mixtral's names), packed target_parameters, the router:
    the engine equals transformers + PEFT merged."""
    cases = [("qwen", "per_expert"), ("qwen", "down_router"), ("mixtral", "per_expert"),
             ("mixtral", "packed"), ("qwen_dense", "dense_and_packed")]  # fmt: skip
    for model, adapter in cases:
        path = moe[model]["adapters"][adapter]
        rc, doc = _run([str(path), "--model", str(moe[model]["model"])], capsys)
        assert rc == 0 and doc["verdict"] == "ok", (model, adapter, doc)
        assert doc["max_diff"] < 1e-3 and doc["effect"] > 1e-2, (model, adapter)
        assert doc["experts"] == 16 and "experts" in doc["parts"], (model, adapter)
    rc, doc = _run([str(moe["qwen"]["adapters"]["down_router"]), "--model",
                    str(moe["qwen"]["model"])], capsys)  # fmt: skip
    assert doc["parts"] == {"attention": 4, "router": 2, "experts": 2}
    assert doc["expert_layout"] == "packed" and doc["targets"][-2:] == [ROUTER, "experts.down_proj"]
    rc = verify.main([str(moe["mixtral"]["adapters"]["per_expert"]), "--model",
                      str(moe["mixtral"]["model"]), "--max-tokens", "2", "--prompt", "Hi"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "rank 8, 8 modules (gate,experts.gate_proj,experts.up_proj,experts.down_proj; " in out
    assert "router 2, experts 6 (16 experts each, per-expert keys)): shapes fit the base" in out


def test_verify_wrong_base(moe: dict[str, dict], tmp_path: Path, capsys) -> None:
    """Experts of another width, count or architecture; a layer without experts."""
    eight = make_random_model(tmp_path / "eight", "qwen3_moe", num_layers=2, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=32, seed=3)  # fmt: skip
    qwen = moe["qwen"]["adapters"]
    cases = [
        # 16-expert adapters on an 8-expert base
        (qwen["packed"], eight, "128 rows, the config's rank 8 for each of the base's 8 experts "
                                "makes 64 (made for 16 experts?)"),
        (qwen["per_expert"], eight, "expert 10 >= the base's 8 experts"),
        (qwen["down_router"], eight, "the base's gate gives d_out=8"),
        # experts of 32 on experts of 24, and layer 1 is dense there
        (qwen["per_expert"], moe["qwen_dense"]["model"],
         "the base's experts.down_proj takes d_in=24"),
        # Mixtral's per-expert names on Qwen-MoE, and Qwen-MoE's on Mixtral
        (moe["mixtral"]["adapters"]["per_expert"], moe["qwen"]["model"],
         "names the sparse block 'block_sparse_moe'"),
        (qwen["per_expert"], moe["mixtral"]["model"],
         "this base's experts have no 'down_proj' (theirs: w1, w3, w2"),
    ]  # fmt: skip
    for adapter, model, msg in cases:
        assert verify.main([str(adapter), "--model", str(model)]) == 1
        out = capsys.readouterr().out
        assert "FAIL (wrong_base): wrong base:" in out and msg in out, (adapter, model, out)
    # a dense MLP's LoRA on a layer that is sparse here
    d = tmp_path / "dense-mlp"
    d.mkdir()
    save_file({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.ones(4, 64),
               "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": torch.ones(128, 4)},
              str(d / "adapter_model.safetensors"))  # fmt: skip
    (d / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["up_proj"]})
    )
    assert verify.main([str(d), "--model", str(moe["qwen"]["model"])]) == 1
    out = capsys.readouterr().out
    assert "layer 0's MLP is 16 experts and a router (no up_proj)" in out, out


def test_verify_notes_experts_without_effect(
    moe: dict[str, dict], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Experts whose B is zero (never routed to in training) are listed; the adapter passes."""
    src = moe["qwen"]["adapters"]["per_expert"]
    d = tmp_path / "idle-experts"
    shutil.copytree(src, d)
    sd = load_file(str(d / "adapter_model.safetensors"))
    idle = [f"layers.0.mlp.experts.{e}.gate_proj.lora_B" for e in (1, 5, 9)]
    idle += ["layers.1.mlp.gate.lora_B"]
    sd = {k: v * 0 if any(i in k for i in idle) else v for k, v in sd.items()}
    save_file(sd, str(d / "adapter_model.safetensors"))
    rc, doc = _run([str(d), "--model", str(moe["qwen"]["model"])], capsys)
    assert rc == 0 and doc["verdict"] == "ok", doc
    assert doc["notes"] == [
        "1 of 10 modules have an all-zero B (no effect): layer 1 gate",
        "experts with an all-zero B (not adapted, or never routed to in training): "
        "layer 0 experts.gate_proj: 3 of 16",
    ]


def test_verify_says_when_the_reference_cannot_check(
    moe: dict[str, dict], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Where transformers + PEFT load less than the engine serves (a dense layer's MLP LoRA of a
    per-expert adapter; gate/up experts without down), verify does not blame the engine."""
    case = moe["qwen_dense"]
    rc, doc = _run([str(case["adapters"]["per_expert"]), "--model", str(case["model"])], capsys)
    assert rc == 1 and doc["verdict"] == "no_reference", doc
    assert "load no LoRA for layer 1 dense MLP of this adapter" in doc["problems"][0]
    gate_up = make_per_expert_adapter(moe["qwen"]["model"], tmp_path / "gu", r=4,
                                      target_modules=["gate_proj", "up_proj"])  # fmt: skip
    rc, doc = _run([str(gate_up), "--model", str(moe["qwen"]["model"])], capsys)
    assert rc == 1 and doc["verdict"] == "no_reference", doc
    assert "layer 0 experts, layer 1 experts" in doc["problems"][0]


def test_verify_silent_no_op_names_the_moe_modules(
    moe: dict[str, dict], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    d = tmp_path / "nothing"
    shutil.copytree(moe["mixtral"]["adapters"]["packed"], d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(target_modules=["c_attn"], target_parameters=None)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    assert verify.main([str(d), "--model", str(moe["mixtral"]["model"])]) == 1
    out = capsys.readouterr().out
    assert "FAIL (silent_no_op): silent no-op: target_modules ['c_attn'] match none" in out
    assert "gate, w1, w3, w2, embed_tokens, lm_head" in out
