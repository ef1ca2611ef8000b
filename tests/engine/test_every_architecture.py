"""The guarantees beside exact mixed batches, on every architecture family of
``test_mixed_batch_architectures.FAMILIES`` and ``test_moe_experts.FAMILIES``: the prefix cache keyed by the adapter's digest
(hits within one adapter, none across adapters or after a hot swap), structured outputs with an
adapter, ``loraplex verify``, the byte model (``ModelConfig.num_parameters``, ``loraplex plan``'s
model and adapter counts) against what is really loaded and saved, and the registry's refusal of
an adapter made for another base. (The Triton path of every family runs under the interpreter in
``tests/lora/interpreted_triton_kernels.py``.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.model.config import load_model_config
from loraplex.registry.errors import ValidationError
from loraplex.registry.inspect import base_model_info, inspect_adapter
from loraplex.requests import StructuredOutput
from loraplex.testing import (
    load_merged_reference,
    make_random_adapter,
    make_random_model,
    reference_greedy,
    reference_greedy_alora,
)
from loraplex.tools import plan, verify
from tests.engine.test_mixed_batch_architectures import FAMILIES, LLAMA_PROJ
from tests.engine.test_moe_experts import FAMILIES as MOE_FAMILIES

EVERY_FAMILY = {
    **FAMILIES,
    **{
        name: {k: v for k, v in spec.items() if k != "experts"}
        for name, spec in MOE_FAMILIES.items()
    },
}
"""The dense families and the MoE ones (``all-linear`` on a MoE base is PEFT's: attention by
module, the experts and the router by ``target_parameters``)."""

PROMPT = "Multi-LoRA serving runs many adapters on one base model at once. " * 2
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=list(EVERY_FAMILY))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One family's tiny model and two adapters: every linear projection, and the attention
    projections with lm_head and embed_tokens."""
    root = tmp_path_factory.mktemp(request.param)
    spec = dict(EVERY_FAMILY[request.param])
    proj = spec.pop("proj", LLAMA_PROJ)
    model = make_random_model(root / "model", spec.pop("arch"), num_layers=2, seed=11, **spec)
    adapters = {
        "linear": make_random_adapter(model, root / "linear", r=8, seed=1),  # all-linear
        "attn_vocab": make_random_adapter(
            model,
            root / "attn_vocab",
            r=4,
            target_modules=[*proj["attn"], "lm_head", "embed_tokens"],
            std=0.1,
            seed=2,
        ),
    }
    return {"name": request.param, "model": model, "adapters": adapters, "root": root}


def _generate(e: LLMEngine, rid: str, lora: LoRARequest | None, prompt: str | list[int] = PROMPT):  # type: ignore[no-untyped-def]
    e.add_request(rid, prompt, GREEDY, lora)
    while True:
        for out in e.step():
            if out.finished:
                return out


def test_prefix_cache_is_keyed_by_the_adapters_digest(family: dict) -> None:
    model, adapters = family["model"], family["adapters"]
    e = LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size=4))
    a = LoRARequest("a", str(adapters["linear"]))
    first = _generate(e, "1", a)
    again = _generate(e, "2", a)
    n_prompt = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (n_prompt - 1) // 4 * 4 > 0
    ids = e.tokenize(PROMPT)
    want, _ = reference_greedy(load_merged_reference(model, adapters["linear"]), ids, 6)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want
    other = _generate(e, "3", LoRARequest("b", str(adapters["attn_vocab"])))
    assert other.num_cached_tokens == 0  # same prompt, other adapter: no sharing
    assert _generate(e, "4", None).num_cached_tokens == 0
    # hot swap: the same name and path with new weights never reuses the old KV
    path = family["root"] / "swap"
    shutil.copytree(adapters["linear"], path)
    _generate(e, "5", LoRARequest("x", str(path)))
    shutil.rmtree(path)
    rev2 = make_random_adapter(model, family["root"] / "rev2", r=8, std=0.2, seed=3)
    shutil.copytree(rev2, path)
    swapped = _generate(e, "6", LoRARequest("x", str(path)))
    assert swapped.num_cached_tokens == 0
    want, _ = reference_greedy(load_merged_reference(model, rev2), ids, 6)
    assert swapped.outputs[0].token_ids == want
    assert e.is_idle()


def test_activated_lora_shares_the_base_blocks_and_equals_peft(family: dict) -> None:
    """An aLoRA on the attention projections: its request over a context the base model ran
    finds the context's blocks (wholly before its invocation) in the prefix cache and equals
    PEFT's unmerged forward with ``alora_offsets``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = family["model"]
    attn = EVERY_FAMILY[family["name"]].get("proj", LLAMA_PROJ)["attn"]
    inv = [21, 22]
    path = make_random_adapter(model, family["root"] / "alora", r=8, target_modules=attn,
                               std=0.1, seed=4, alora_invocation_tokens=inv)  # fmt: skip
    e = LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size=4))
    ctx = e.tokenize(PROMPT)
    base = _generate(e, "1", None, ctx)
    ids = [*ctx, *inv, 50, 51, 52]
    got = _generate(e, "2", LoRARequest("al", str(path)), ids)
    assert base.num_cached_tokens == 0
    assert got.num_cached_tokens == len(ctx) // 4 * 4 > 0
    ref = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32), str(path)
    ).eval()
    want, _, _ = reference_greedy_alora(ref, ids, 6, len(ctx))
    assert got.outputs[0].token_ids == want
    assert e.is_idle()


def test_structured_output_with_an_adapter(family: dict) -> None:
    llm = LLM(str(family["model"]), dtype="float32", max_loras=2)
    lora = LoRARequest("linear", str(family["adapters"]["linear"]))
    sp = SamplingParams(
        temperature=0.8, seed=3, max_tokens=120, structured=StructuredOutput(json_schema=SCHEMA)
    )
    outs = llm.generate(["Answer in JSON please:"] * 2, sp, [lora, None])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert llm.engine.is_idle()


def test_verify_passes(family: dict, capsys: pytest.CaptureFixture) -> None:
    # the prompt is longer than phi3_longrope's original length (6): verify's reference scores
    # prompt + answer in one forward, so LongRoPE takes one factor set for all of it, as the
    # engine does for a sequence whose prompt already passes it
    for name, path in family["adapters"].items():
        argv = [str(path), "--model", str(family["model"]), "--max-tokens", "4", "--json",
                "--prompt", "Hello world, tell me about the sea"]  # fmt: skip
        rc = verify.main(argv)
        doc = json.loads(capsys.readouterr().out)
        assert rc == 0 and doc["verdict"] == "ok", (name, doc)


def _text_parameters(model_dir: Path) -> int:
    """Parameters of transformers' model (shared ones once), less a multimodal checkpoint's
    other towers: what serving the text model holds."""
    hf = load_merged_reference(model_dir, None)
    towers = [getattr(hf.model, t, None) for t in ("vision_tower", "multi_modal_projector")]
    other = sum(p.numel() for t in towers if t is not None for p in t.parameters())
    return hf.num_parameters() - other


def test_byte_model_counts_what_is_loaded_and_saved(family: dict) -> None:
    """``num_parameters`` and the planner's model count equal transformers' count of the text
    model; the planner's adapter count equals the LoRA tensors PEFT saved."""
    model = family["model"]
    want = _text_parameters(model)
    assert load_model_config(model).num_parameters() == want
    shape = plan.load_model(str(model))
    assert shape.params() == want
    for name, path in family["adapters"].items():
        a = plan.adapter_from_path(str(path), shape)
        assert a.file_params == a.params(shape) and not a.notes, (name, a.notes)


def test_registry_refuses_an_adapter_for_another_base(
    family: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("other-base")
    other = make_random_model(root / "other", hidden_size=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, intermediate_size=96, seed=1)  # fmt: skip
    foreign = make_random_adapter(other, root / "foreign", r=4, target_modules="all-linear")
    for adapter, base in (
        (foreign, family["model"]),  # another base's adapter on this family
        (family["adapters"]["linear"], other),  # this family's adapter on another base
    ):
        with pytest.raises(ValidationError) as info:
            inspect_adapter(adapter, base_model_info(base), max_rank=16)
        assert info.value.reason in ("shape_mismatch", "unsupported_target"), str(info.value)
        assert "\n" not in str(info.value)
