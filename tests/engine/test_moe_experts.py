"""Mixture-of-experts bases with LoRA on the experts (invariant 2 for Qwen3-MoE, Mixtral and
Qwen3.5-MoE, whose hybrid layers carry a gated shared expert beside the experts).

A mixed batch of the base and adapters built by PEFT itself (experts only, attention only, both,
the router, different ranks, per-expert keys and PEFT's ``target_parameters`` on the packed
experts) equals transformers + PEFT with each adapter merged: greedy tokens equal and logprobs
within the float32 tolerance of the dense families, on the C LoRA kernel and the torch path.
Per-expert adapters are the layout PEFT wrote while the experts were ``nn.Linear`` modules; the
reference reads them through PEFT's own conversion onto transformers 5's packed experts.

Two gaps of that conversion shape the cases: it drops the LoRA of a dense layer's MLP in a
model with ``mlp_only_layers`` (so per-expert adapters run on an all-sparse model here, and the
model with a dense layer takes ``target_parameters`` adapters; asked for ``gate_proj`` /
``up_proj`` / ``down_proj`` there, PEFT itself writes them as bare ``target_parameters`` of the
experts with a doubled gate_up rank and no dense LoRA, and loraplex reads that as written), and it loads nothing for an
adapter on ``gate_proj`` + ``up_proj`` without ``down_proj`` (so per-expert adapters target all
three). loraplex serves both as the adapter says.

Each model has 16 experts and a top-k that leaves most of them idle for a token, so a batch
touches a subset; one test poisons the experts no token chose (base weights and LoRA rows) with
NaN and gets the same output.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.checkpoint.modules import EXPERT_PROJ_NAMES
from loraplex.model.layers import LayerStep
from loraplex.model.moe import SparseMoE
from loraplex.testing import (
    load_merged_reference,
    logprob_gap,
    make_per_expert_adapter,
    make_random_adapter,
    make_random_model,
    reference_greedy,
)
from loraplex.types import AdapterError
from tests.engine.test_mixed_batch_architectures import (  # the dense families' references
    PROMPTS,
    SAMPLE_TOL,
    check_mixed_batch,
    llm_on,
)

QWEN_EXPERTS = ["gate_proj", "up_proj", "down_proj"]
MIXTRAL_EXPERTS = ["w1", "w3", "w2"]
PACKED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
HYBRID_TOL = 1e-3
"""A hybrid's float32 sample logprobs: the decode recurrence rounds otherwise than the full
forward (``tests/model/test_qwen3_5.py``)."""

FAMILIES: dict[str, dict] = {
    # 16 experts, top-4 renormalised; every layer sparse
    "qwen3_moe": dict(
        arch="qwen3_moe",
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        experts=QWEN_EXPERTS,
    ),
    # top-2 of 16, the weights kept float32, block_sparse_moe / w1 w3 w2 in the checkpoint
    "mixtral": dict(
        arch="mixtral",
        num_local_experts=16,
        num_experts_per_tok=2,
        intermediate_size=32,
        experts=MIXTRAL_EXPERTS,
    ),
    # a dense layer (mlp_only_layers) beside a sparse one; top-3 not renormalised
    "qwen3_moe_dense_layer": dict(
        arch="qwen3_moe",
        num_experts=16,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        experts=None,
    ),
    # Qwen3.5-MoE: a Gated DeltaNet layer and a gated full-attention one, each with a sparse
    # block of 16 experts (top-4) and a gated shared expert; adapters also on the
    # linear-attention projections and the shared expert
    "qwen3_5_moe": dict(
        arch="qwen3_5_moe",
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        experts=None,
        tol=HYBRID_TOL,
        extra={
            "gdn_shared_r8": (
                "peft",
                dict(
                    r=8,
                    lora_alpha=16,
                    std=0.1,
                    seed=8,
                    target_modules=[
                        "in_proj_qkv",
                        "in_proj_b",
                        "out_proj",
                        "shared_expert.up_proj",
                        "shared_expert.down_proj",
                        "shared_expert_gate",
                    ],
                ),
            ),
        },
    ),
    # GPT-OSS: packed experts only (gate/up interleaved in the base and in B), biases, the
    # clamped SwiGLU, top-4 logits softmaxed; its router is no Linear (adapters leave it)
    "gpt_oss": dict(
        arch="gpt_oss",
        num_local_experts=16,
        num_experts_per_tok=4,
        intermediate_size=32,
        experts="packed",
    ),
}


def adapters_for(experts: list[str] | str | None) -> dict[str, tuple[str, dict]]:
    """name -> (builder, its arguments); per-expert adapters only where PEFT's conversion reads
    them (module docstring); ``"packed"``: a base whose experts PEFT reaches only through
    ``target_parameters`` and whose router it cannot adapt (GPT-OSS: its ``down_`` adapter
    takes the vocabulary modules instead of the router)."""
    router = "packed" != experts
    out: dict[str, tuple[str, dict]] = {
        "attn_r4_rslora": (
            "peft",
            dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True, seed=2),
        ),
        "packed_r8": (
            "peft",
            dict(
                r=8,
                lora_alpha=16,
                target_modules=["q_proj"],
                target_parameters=PACKED,
                std=0.1,
                seed=3,
            ),
        ),
        "down_router_r16": (
            "peft",
            dict(
                r=16,
                lora_alpha=8,
                target_modules=["k_proj", "o_proj"]
                + ([] if router else ["lm_head", "embed_tokens"]),
                target_parameters=["mlp.experts.down_proj"]
                + (["mlp.gate.weight"] if router else []),
                std=0.1,
                seed=4,
            ),
        ),
    }
    if experts == "packed":
        out["gate_up_r4"] = (
            "peft",
            dict(r=4, lora_alpha=8, target_modules=["v_proj"],
                 target_parameters=["mlp.experts.gate_up_proj"], std=0.2, seed=5),
        )  # fmt: skip
        return out
    if experts is None:  # PEFT moves the dense targets onto the packed experts (docstring)
        out["converted_r8"] = (
            "peft",
            dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"],
                 target_parameters=PACKED, std=0.1, seed=5),
        )  # fmt: skip
        return out
    out["experts_r8"] = ("per_expert", dict(r=8, target_modules=experts, std=0.1, seed=6))
    out["all_r16"] = (
        "per_expert",
        dict(r=16, lora_alpha=16, target_modules=["q_proj", "o_proj", "gate", *experts],
             std=0.1, seed=7),
    )  # fmt: skip
    return out


N_NEW = 6


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp(request.param)
    spec = dict(FAMILIES[request.param])
    experts, extra, tol = spec.pop("experts"), spec.pop("extra", {}), spec.pop("tol", SAMPLE_TOL)
    model = make_random_model(root / "model", spec.pop("arch"), num_layers=2, seed=5, **spec)
    adapters = {}
    for name, (kind, kw) in {**adapters_for(experts), **extra}.items():
        make = make_random_adapter if kind == "peft" else make_per_expert_adapter
        adapters[name] = make(model, root / name, **kw)
    refs = {n: load_merged_reference(model, adapters.get(n)) for n in [None, *adapters]}
    return {"name": request.param, "model": model, "adapters": adapters, "refs": refs, "tol": tol}


@pytest.fixture(scope="module", params=["cpu-kernel", "torch"])
def llm(request: pytest.FixtureRequest, family: dict) -> Iterator[LLM]:
    yield llm_on(request.param, family, max_lora_rank=16)


def test_mixed_batch_equals_merged_references(llm: LLM, family: dict) -> None:
    runs = check_mixed_batch(llm, family["adapters"], family["refs"], N_NEW, family["tol"])
    # every adapter moves its outputs (non-zero B on every target): none is a silent no-op
    first = {p: o.outputs[0].logprobs[0].top for p, n, o in runs if n is None}
    for prompt, name, out in runs:
        if name is not None and prompt in first:
            top = out.outputs[0].logprobs[0].top
            shared = [t for t in top if t in first[prompt]]
            moved = max((abs(top[t] - first[prompt][t]) for t in shared), default=float("inf"))
            assert moved > 1e-3, (name, moved)
    # the expert tables hold every expert's rows for every slot
    bank = llm.engine.adapters.bank
    cfg = llm.engine.model_config
    for layer in cfg.sparse_layers:
        for proj in EXPERT_PROJ_NAMES:
            a, bt = bank.tables(layer, proj)
            assert a.shape[0] == cfg.num_experts * bank.capacity == bt.shape[0]
    assert llm.engine.is_idle()


def _poison_unused(moe: SparseMoE, L: Any, counts: list[int], lora: object, make: Any) -> list:
    """NaN into the base weights (and every slot's LoRA rows) of the experts without rows;
    returns what to restore."""
    saved = []
    unused = [e for e, n in enumerate(counts) if n == 0]
    assert unused and len(unused) < len(counts)  # the batch touches a strict subset
    for attr in ("w_gate_up", "w_down"):
        w = getattr(L, attr)  # ExpertLinears: one Linear per expert
        _, m, k = w.shape
        nan = make(torch.full((m, k), float("nan")), None)
        saved.append((w.linears, [w.linears[e] for e in unused], unused))
        for e in unused:
            w.linears[e] = nan
    if lora is not None:
        cap = lora.bank.capacity  # type: ignore[attr-defined]
        for proj in EXPERT_PROJ_NAMES:
            for t in lora.bank.tables(L.index, proj):  # type: ignore[attr-defined]
                rows = [r for e in unused for r in range(e * cap, (e + 1) * cap)]
                saved.append((t, t[rows].clone(), rows))
                t[rows] = float("nan")
    return saved


def test_experts_no_token_chose_are_not_read(family: dict) -> None:
    """A decode step of three sequences (the base and two expert adapters) picks at most
    ``3 k`` of the 16 experts per layer. Run it once to see which; run the same requests again
    with NaN in every other expert's base weights and LoRA rows for that step (the adapters
    resident both times, so both runs batch alike): the outputs are bitwise the same (the grouped GEMMs and the expert LoRA never read those experts)."""
    llm = LLM(
        str(family["model"]), max_loras=2, max_lora_rank=16, dtype="float32",
        enable_prefix_caching=False,
    )  # fmt: skip
    eng, model = llm.engine, llm.engine.model
    names = list(family["adapters"])[-2:]
    loras = [None, *(LoRARequest(n, str(family["adapters"][n])) for n in names)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    seen: dict[tuple[int, int], tuple[int, list[int]]] = {}  # (step, layer) -> (T, rows/expert)
    original = SparseMoE.__call__
    step_no = [0]
    decode = [-1]

    def spy(self: SparseMoE, L: object, i: int, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        out = original(self, L, i, x, step)  # type: ignore[arg-type]
        seen.setdefault((step_no[0], i), (x.shape[0], list(self.last_counts or [])))
        return out

    def run(tag: str, poison: bool) -> dict:
        for j, lora in enumerate(loras):
            eng.add_request(f"{tag}{j}", PROMPTS[j], sp, lora)
        results: dict = {}
        step_no[0] = 0
        while eng.has_unfinished_requests():
            saved = []
            if poison and step_no[0] == decode[0]:
                for (s, i), (_, counts) in seen.items():
                    if s == decode[0]:
                        L = model.layers[i]
                        L.index = i  # type: ignore[attr-defined]
                        saved += _poison_unused(model.moe, L, counts, model.lora, model.make_linear)
            try:
                for out in eng.step():
                    if out.finished:
                        results[out.request_id[len(tag) :]] = out.outputs[0]
            finally:
                for t, values, rows in saved:
                    if isinstance(t, list):  # an expert's Linears
                        for e, lin in zip(rows, values, strict=True):
                            t[e] = lin
                    else:
                        t[rows] = values
            step_no[0] += 1
        return results

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SparseMoE, "__call__", spy)
        run("warm", poison=False)  # adapters resident: runs a and b schedule alike
        seen.clear()
        clean = run("a", poison=False)
        # the first step all three decode in (one token each)
        decode[0] = min(s for (s, _), (t, _) in seen.items() if t == len(loras))
        poisoned = run("b", poison=True)
    for j in clean:
        a, b = clean[j], poisoned[j]
        assert b.token_ids == a.token_ids
        assert [lp.top for lp in b.logprobs] == [lp.top for lp in a.logprobs]  # bitwise


def test_refusals_name_the_problem(family: dict, tmp_path: Path) -> None:
    """An adapter for another expert count, target_parameters on a parameter we do not serve,
    an expert of a module that is not targeted: refused at load naming it; the engine serves
    on."""
    llm = LLM(str(family["model"]), max_loras=2, max_lora_rank=16, dtype="float32")
    sp = SamplingParams(max_tokens=1)
    packed = family["adapters"]["packed_r8"]
    # 1. a packed adapter made for 8 experts: its A rows are no rank for each of 16
    few = tmp_path / "few"
    shutil.copytree(packed, few)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(few / "adapter_model.safetensors"))
    sd = {k: (v[: v.shape[0] // 2 + 1] if k.endswith("experts.lora_A.weight") else v)
          for k, v in sd.items()}  # fmt: skip
    save_file(sd, str(few / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"expert count|rank mismatch") as info:
        llm.generate("Hello", sp, lora_request=LoRARequest("few", str(few)))
    assert "\n" not in str(info.value)
    # 2. target_parameters naming something else
    odd = tmp_path / "odd"
    shutil.copytree(packed, odd)
    cfg = json.loads((odd / "adapter_config.json").read_text())
    cfg["target_parameters"] = ["self_attn.q_proj.weight"]
    (odd / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=r"target_parameters entry 'self_attn\.q_proj\.weight'"):
        llm.generate("Hello", sp, lora_request=LoRARequest("odd", str(odd)))
    # 3. per-expert keys for an expert the base does not have
    many = tmp_path / "many"
    many.mkdir()
    E = llm.engine.model_config.num_experts
    block = llm.engine.model_config.moe_block
    proj = "w1" if block == "block_sparse_moe" else "gate_proj"
    key = f"base_model.model.model.layers.0.{block}.experts.{E}.{proj}"
    hidden = llm.engine.model_config.hidden_size
    inter = llm.engine.model_config.moe_intermediate_size
    save_file(
        {
            f"{key}.lora_A.weight": torch.ones(4, hidden),
            f"{key}.lora_B.weight": torch.ones(inter, 4),
        },
        str(many / "adapter_model.safetensors"),
    )
    (many / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": [proj]})
    )
    with pytest.raises(AdapterError, match=f"expert {E} >= the base model's num_experts {E}"):
        llm.generate("Hello", sp, lora_request=LoRARequest("many", str(many)))
    assert llm.generate("Hello", sp)[0].outputs[0].token_ids  # the engine serves on


def test_router_and_experts_stay_gathered_when_merged(family: dict) -> None:
    """The single-adapter merge fast path merges an expert adapter's attention projections and
    keeps its router and experts on the gathered path; outputs equal the merged reference."""
    name = "down_router_r16"
    llm = LLM(
        str(family["model"]), max_loras=2, max_lora_rank=16, dtype="float32",
        lora_merge_after_steps=2,
    )  # fmt: skip
    eng, tok = llm.engine, llm.get_tokenizer()
    assert eng.merger is not None
    experts_before = [(L.w_gate_up, L.w_down) for L in eng.model.layers if hasattr(L, "w_down")]
    sp = SamplingParams(temperature=0, max_tokens=N_NEW + 4, ignore_eos=True, logprobs=3)
    adapter = family["adapters"][name]
    eng.add_request("r0", PROMPTS[0], sp, LoRARequest(name, str(adapter)))
    results: dict = {}
    merged_steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
        merged_steps += eng.runner.merged_slot is not None
        assert eng.merger.wait_build(60)
    assert eng.merger.merges == 1 and merged_steps >= 3
    after = [(L.w_gate_up, L.w_down) for L in eng.model.layers if hasattr(L, "w_down")]
    assert all(
        a is b
        for x, y in zip(experts_before, after, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    got = results["r0"]
    want, ref_lp = reference_greedy(family["refs"][name], tok(PROMPTS[0]).input_ids, N_NEW + 4)
    assert got.token_ids == want
    worst = logprob_gap(got.logprobs, ref_lp)
    assert worst < SAMPLE_TOL


def test_registry_reads_expert_adapters_and_refuses_foreign_ones(
    family: dict, tmp_path: Path
) -> None:
    """The registry's inspection (no torch) accepts both expert layouts on their base, lists the
    expert modules it found, and refuses an expert adapter on a dense base and a dense-shaped
    one on this base, naming why."""
    from loraplex.registry.errors import ValidationError
    from loraplex.registry.inspect import base_model_info, inspect_adapter

    base = base_model_info(family["model"])
    for name, path in family["adapters"].items():
        info = inspect_adapter(path, base, max_rank=16)
        if "packed" in name or "experts" in name or "all" in name:
            assert {"experts.gate_proj", "experts.down_proj"} <= set(info.target_modules), name
    dense = make_random_model(tmp_path / "dense", "qwen3", num_layers=2, seed=1)
    with pytest.raises(ValidationError) as err:
        inspect_adapter(family["adapters"]["packed_r8"], base_model_info(dense), max_rank=16)
    assert err.value.reason == "unsupported_target" and "no" in str(err.value)
    foreign = make_random_adapter(dense, tmp_path / "foreign", r=4, target_modules="all-linear")
    with pytest.raises(ValidationError) as err:
        inspect_adapter(foreign, base, max_rank=16)
    assert err.value.reason in ("shape_mismatch", "unsupported_target"), str(err.value)
    assert "\n" not in str(err.value)


def test_expert_bytes_count_in_the_slot_budget_and_the_host_tier(family: dict) -> None:
    """One slot's bytes are every expert's rows (what the bank allocates per slot), so
    ``--max-lora-device-fraction`` caps the slot count by them; a host copy's bytes are the
    served tensors' (what the adapter file holds, in the model dtype)."""
    from dataclasses import replace

    from safetensors import safe_open

    from loraplex.engine.builder import MemoryBudget

    llm = LLM(str(family["model"]), max_loras=3, max_lora_rank=16, dtype="float32")
    eng = llm.engine
    bank, cfg = eng.adapters.bank, eng.model_config
    per_slot = bank.nbytes // bank.max_loras  # what one slot costs the bank, experts included
    experts = {k: n for k in bank.module_shapes if (n := bank.module_experts.get(k, 0))}
    expert_bytes = sum(bank.tables(*k)[0].nbytes + bank.tables(*k)[1].nbytes for k in experts)
    assert expert_bytes > bank.nbytes // 2  # the expert tables are most of a slot
    available = 10 * per_slot
    config = replace(eng.config, kv_cache_memory_bytes=available, max_lora_device_fraction=0.25)
    budget = MemoryBudget(config, cfg, torch.device("cpu"), torch.float32)
    assert budget.lora_slots(dict(bank.module_shapes), torch.float32, experts) == 2  # 2.5 fit
    assert budget.lora_slots(dict(bank.module_shapes), torch.float32) == 3  # experts uncounted
    # a host copy: the bytes of the tensors served
    name = "packed_r8"
    path = family["adapters"][name]
    llm.generate("Hi", SamplingParams(max_tokens=1), lora_request=LoRARequest(name, str(path)))
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        file_bytes = sum(f.get_tensor(k).nbytes for k in f.keys())
    assert eng.adapters.resident_bytes()["host"] == (1, file_bytes)
