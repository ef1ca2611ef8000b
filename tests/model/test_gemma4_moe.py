"""Gemma 4's MoE variant (``enable_moe_block``, the 26B-A4B; ``model/gemma4_moe.py``) against
transformers + PEFT unmerged: a mixed batch of the base and adapters of four ranks on attention,
the dense MLP, the router (``router.proj``), the packed experts (``target_parameters``), the
per-layer input modules, ``embed_tokens`` and ``lm_head``, over KV-sharing layers, sliding
windows and non-trivial router scales; on the C kernels and on the torch path; tensor
parallelism (two ranks over gloo) against one device; the registry's choice of the class, the
byte model, the planner and ``loraplex verify``; the one-line refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, ModelLoadError, SamplingParams
from loraplex.model.config import load_model_config, parse_model_config
from loraplex.model.gemma4 import Gemma4ForCausalLM
from loraplex.model.gemma4_moe import Gemma4MoeForCausalLM, Gemma4MoeForConditionalGeneration
from loraplex.model.registry import SUPPORTED_ARCHITECTURES, model_class
from loraplex.testing import logprob_gap, make_random_adapter, make_random_model, reference_greedy
from loraplex.tools import plan, verify
from tests.engine.test_mixed_batch_architectures import check_mixed_batch, llm_on
from tests.model.test_gemma4 import (
    PROMPTS,
    SAMPLE_TOL,
    _config,
    _reference,
    check_tp2_equals_tp1,
)

S, F = "sliding_attention", "full_attention"
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
ADAPTERS = {  # four ranks; every kind of module the MoE variant adapts
    # attention, MLP, per-layer modules and router.proj (PEFT's all-linear takes the router)
    "all_linear_r8": dict(r=8, target_modules="all-linear", seed=1),
    "experts_qo_r4": dict(r=4, target_modules=["q_proj", "o_proj"], target_parameters=EXPERTS,
                          use_rslora=True, std=0.1, seed=2),
    "router_vocab_r16": dict(r=16, lora_alpha=8, std=0.1, seed=3,
                             target_modules=["router.proj", "embed_tokens", "lm_head", "up_proj"]),
    "down_experts_r2": dict(r=2, target_modules=["per_layer_input_gate"], std=0.2, seed=4,
                            target_parameters=["experts.down_proj"]),
}  # fmt: skip
N_NEW = 8
E, K, WIDTH = 8, 2, 32  # ARCH_DEFAULTS["gemma4_moe_text"]: experts, top-k, expert width


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Four layers (sliding, full, then two sharing their KV), per-layer inputs, 8 experts of
    32 (top 2) beside each layer's MLP, a soft-cap that bites."""
    root = tmp_path_factory.mktemp("gemma4_moe")
    model = make_random_model(
        root / "model", "gemma4_moe_text", num_layers=4, seed=5, layer_types=[S, F, S, F],
        num_kv_shared_layers=2, final_logit_softcapping=3.0, init_std=0.05, global_head_dim=32,
    )  # fmt: skip
    adapters = {n: make_random_adapter(model, root / n, **kw) for n, kw in ADAPTERS.items()}
    refs = {n: _reference(model, adapters.get(n)) for n in [None, *adapters]}
    return {"model": model, "adapters": adapters, "refs": refs}


@pytest.fixture(scope="module", params=["cpu-kernel", "torch"])
def llm(request: pytest.FixtureRequest, moe: dict) -> Iterator[LLM]:
    """An engine with its LoRA on the C kernel (the CPU default) or on the torch path."""
    yield llm_on(request.param, moe, max_lora_rank=16)


def test_mixed_batch_equals_peft_unmerged(llm: LLM, moe: dict) -> None:
    """Greedy tokens, sample and prompt logprobs of the base and each adapter in one batch
    equal transformers + PEFT's; each adapter moves the logits, and the step spread its
    tokens over several experts."""
    model = llm.engine.model
    assert isinstance(model, Gemma4MoeForCausalLM)
    adapters, refs = moe["adapters"], moe["refs"]
    spread: list[int] = []  # experts each routing call chose, over the whole run (the last
    route = model.moe.route  # step alone may hold one sequence, whichever ends last)

    def spying(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, e = route(logits)
        spread.append(int(e.unique().numel()))
        return w, e

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model.moe, "route", spying)
        check_mixed_batch(llm, adapters, refs, N_NEW, SAMPLE_TOL, PROMPTS)
    assert spread and max(spread) > K
    ids = torch.tensor([llm.get_tokenizer()(PROMPTS[0]).input_ids])
    with torch.no_grad():
        plain = refs[None](ids).logits
        for name in adapters:
            assert (refs[name](ids).logits - plain).abs().max() > 1e-2, name
    bank = llm.engine.adapters.bank.module_shapes
    assert (0, "gate") in bank and (0, "experts.down_proj") in bank and (0, "up_proj") in bank
    assert llm.engine.is_idle()


def test_registry_picks_the_moe_class_by_config() -> None:
    """One architecture name, two classes: ``enable_moe_block`` picks the MoE one (the name
    and its model_type stay the dense model's); the dense class refuses a MoE config."""
    dense = _config()
    sparse = _config(enable_moe_block=True, num_experts=4, top_k_experts=2,
                     moe_intermediate_size=16)  # fmt: skip
    assert model_class("Gemma4ForCausalLM", dense) is Gemma4ForCausalLM
    assert model_class("Gemma4ForCausalLM", sparse) is Gemma4MoeForCausalLM
    multimodal = {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": sparse}
    assert model_class("Gemma4ForConditionalGeneration", multimodal) is (
        Gemma4MoeForConditionalGeneration
    )
    assert SUPPORTED_ARCHITECTURES["Gemma4ForCausalLM"] == "gemma4_text"
    cfg = parse_model_config(sparse)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 16)
    assert cfg.sparse_layers == (0, 1) and cfg.intermediate_size == 64  # the MLP stays
    with pytest.raises(ModelLoadError, match="enable_moe_block=True") as info:
        Gemma4ForCausalLM.config_fields(sparse, "config")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"num_experts": None}, "enable_moe_block needs num_experts >= 1"),
        ({"top_k_experts": 5}, r"top_k_experts must be in \[1, num_experts=4\], got 5"),
        ({"top_k_experts": None}, r"top_k_experts must be in \[1, num_experts=4\], got 0"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size must be >= 1"),
    ],
)
def test_unservable_moe_configs_are_refused_in_one_line(over: dict, named: str) -> None:
    raw = _config(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
    with pytest.raises(ModelLoadError, match=named) as info:
        parse_model_config({k: v for k, v in {**raw, **over}.items() if v is not None})
    assert "\n" not in str(info.value)


def test_byte_model_planner_and_verify(moe: dict, capsys: pytest.CaptureFixture) -> None:
    """``num_parameters`` and the planner count what transformers holds (every expert, the
    router's scales, the three extra norms); a token reads ``K`` of the ``E`` experts; the
    planner's adapter counts equal what PEFT saved, and ``loraplex verify`` passes each."""
    model = moe["model"]
    want = moe["refs"][None].num_parameters()
    cfg = load_model_config(model)
    assert cfg.num_parameters() == want
    idle = cfg.num_layers * (E - K) * 3 * cfg.hidden_size * WIDTH  # gate, up, down per expert
    assert cfg.active_parameters() == want - idle
    shape = plan.load_model(str(model))
    assert shape.params() == want
    for name, path in moe["adapters"].items():
        a = plan.adapter_from_path(str(path), shape)
        assert a.file_params == a.params(shape) and not a.notes, (name, a.notes)
        rc = verify.main([str(path), "--model", str(model), "--max-tokens", "2", "--json"])
        doc = json.loads(capsys.readouterr().out)
        assert rc == 0 and doc["verdict"] == "ok", (name, doc)


def test_conditional_generation_serves_its_language_model(tmp_path: Path) -> None:
    """The multimodal wrapper with the MoE block: its language model (the vision tower
    skipped) with an adapter on the experts and the router, against transformers + PEFT."""
    model = make_random_model(tmp_path / "model", "gemma4_moe", num_layers=2, seed=3,
                              layer_types=[S, F], init_std=0.05)  # fmt: skip
    adapter = make_random_adapter(
        model, tmp_path / "a", r=4, target_modules=r".*language_model.*\.(router\.proj|q_proj)",
        target_parameters=EXPERTS, std=0.1, seed=8,
    )  # fmt: skip
    llm = LLM(str(model), max_loras=1, max_lora_rank=8, dtype="float32")
    assert isinstance(llm.engine.model, Gemma4MoeForConditionalGeneration)
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    ids = tok(PROMPTS[1]).input_ids
    for lora in (None, adapter):
        req = LoRARequest("a", str(lora)) if lora else None
        got = llm.generate([PROMPTS[1]], sp, lora_request=req)[0].outputs[0]
        want, ref_lp = reference_greedy(_reference(model, lora), ids, N_NEW)
        assert got.token_ids == want
        assert logprob_gap(got.logprobs, ref_lp) < SAMPLE_TOL


@pytest.fixture(scope="module")
def moe_tp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two layers (sliding, full), an odd vocabulary (uneven vocabulary cuts), the four
    adapters."""
    root = tmp_path_factory.mktemp("gemma4_moe_tp")
    model = make_random_model(
        root / "model", "gemma4_moe_text", num_layers=2, seed=7, layer_types=[S, F],
        global_head_dim=32, init_std=0.05, with_tokenizer=False, vocab_size=389,
    )  # fmt: skip
    adapters = [make_random_adapter(model, root / n, **kw) for n, kw in ADAPTERS.items()]
    return {"model": model, "adapters": adapters}


@pytest.mark.parametrize("fully_sharded", [False, True])
def test_tp2_equals_tp1(moe_tp: dict, fully_sharded: bool) -> None:
    """Two ranks (each expert's columns and the dense MLP's cut, the router and its scales
    whole) give one device's greedy tokens and logprobs for a mixed batch of the base and
    the four adapters, in the default LoRA split and with ``--fully-sharded-loras``; each
    adapter really moves its row."""
    check_tp2_equals_tp1(moe_tp["model"], moe_tp["adapters"], fully_sharded)


def test_tp_refuses_experts_that_do_not_split(tmp_path: Path) -> None:
    model = make_random_model(tmp_path / "m", "gemma4_moe_text", layer_types=[S, F],
                              moe_intermediate_size=31, with_tokenizer=False)  # fmt: skip
    with pytest.raises(ModelLoadError, match="moe_intermediate_size=31") as info:
        LLM(str(model), dtype="float32", tensor_parallel_size=2, skip_tokenizer_init=True)
    assert "\n" not in str(info.value)


def test_quantized_bases_are_refused_in_one_line(moe_tp: dict) -> None:
    """The experts (and Gemma 4's own projections) load in float only."""
    with pytest.raises(ModelLoadError, match="quantized bases are not supported") as info:
        LLM(str(moe_tp["model"]), dtype="float32", quantization="int8", skip_tokenizer_init=True)
    assert "\n" not in str(info.value)
