"""One adapter merged into the base weights: outputs equal the PEFT-merged reference, a second
adapter or a base request unmerges, and the base weights come back untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.merge import build_merged, projection_rows, targeted_groups
from loraplex.model.linear import dense_weight
from loraplex.testing import load_merged_reference, logprob_gap, reference_greedy
from loraplex.testing.sync import EVENT_TIMEOUT_S

N_NEW = 10
PROMPTS = ["Once upon a time", "def add(a, b):", "SELECT name FROM users"]


@pytest.fixture()
def llm(tiny_model: Path) -> LLM:
    return LLM(
        str(tiny_model),
        enable_lora=True,
        max_loras=4,
        max_lora_rank=64,
        dtype="float32",
        lora_merge_after_steps=2,
    )


def base_linears(eng: LLMEngine) -> list[tuple[object, ...]]:
    return [(L.qkv, L.o, L.gate_up, L.down) for L in eng.model.layers]


def run_until_merged(eng: LLMEngine, results: dict) -> None:
    """Step until the merger has installed its build (waiting for the build, never the clock)."""
    assert eng.merger is not None
    while eng.merger.merged_digest is None:
        assert eng.has_unfinished_requests(), "finished before merging: make the requests longer"
        collect(eng.step(), results)
        assert eng.merger.wait_build(EVENT_TIMEOUT_S)


def collect(outs: list, results: dict) -> None:
    for out in outs:
        if out.finished:
            results[out.request_id] = out.outputs[0]


def check(tiny_model: Path, tok, adapter: Path | None, prompt: str, got) -> None:  # type: ignore[no-untyped-def]
    ref = load_merged_reference(tiny_model, adapter)
    want, ref_lp = reference_greedy(ref, tok(prompt).input_ids, len(got.token_ids))
    assert got.token_ids == want, (adapter, prompt)
    worst = logprob_gap(got.logprobs, ref_lp)
    assert worst < 2e-4, (adapter, prompt, worst)


@pytest.mark.parametrize("name", ["patterns", "qv_r32_regex", "all_r64_layer1"])
def test_merged_outputs_equal_the_peft_merged_reference(
    llm: LLM, tiny_model: Path, adapters: dict[str, Path], name: str
) -> None:
    eng = llm.engine
    assert eng.merger is not None
    before = base_linears(eng)
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    for i, p in enumerate(PROMPTS[:2]):
        eng.add_request(f"r{i}", p, params, LoRARequest(name, adapters[name]))
    results: dict = {}
    run_until_merged(eng, results)
    merged_steps = 0
    while eng.has_unfinished_requests():
        collect(eng.step(), results)
        merged_steps += eng.runner.merged_slot is not None
    assert eng.merger.merges == 1 and merged_steps >= 3
    tok = llm.get_tokenizer()
    for i, p in enumerate(PROMPTS[:2]):
        check(tiny_model, tok, adapters[name], p, results[f"r{i}"])
    # a base request afterwards: unmerged, on the very same base Linear objects
    eng.add_request("base", PROMPTS[2], params)
    while eng.has_unfinished_requests():
        collect(eng.step(), results)
    assert eng.merger.merged_digest is None and eng.runner.merged_slot is None
    assert base_linears(eng) == before  # tuples of the same objects (identity compares equal)
    assert all(
        a is b
        for old, new in zip(before, base_linears(eng), strict=True)
        for a, b in zip(old, new, strict=True)
    )
    check(tiny_model, tok, None, PROMPTS[2], results["base"])
    assert eng.is_idle()


def test_second_adapter_or_base_request_unmerges(
    llm: LLM, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    eng = llm.engine
    assert eng.merger is not None
    params = SamplingParams(temperature=0, max_tokens=N_NEW + 6, ignore_eos=True, logprobs=3)
    x, y = "all_r8", "mlp_r16"
    eng.add_request("x", PROMPTS[0], params, LoRARequest(x, adapters[x]))
    results: dict = {}
    run_until_merged(eng, results)
    collect(eng.step(), results)
    assert eng.runner.merged_slot is not None
    eng.add_request("y", PROMPTS[1], params, LoRARequest(y, adapters[y]))
    eng.add_request("b", PROMPTS[2], params)
    seen_mixed = False
    while eng.has_unfinished_requests():
        collect(eng.step(), results)
        if eng.last_step.num_seqs == 3:
            seen_mixed = True
            assert eng.merger.merged_digest is None and eng.runner.merged_slot is None
    assert seen_mixed
    tok = llm.get_tokenizer()
    check(tiny_model, tok, adapters[x], PROMPTS[0], results["x"])
    check(tiny_model, tok, adapters[y], PROMPTS[1], results["y"])
    check(tiny_model, tok, None, PROMPTS[2], results["b"])


def test_merged_weights_equal_peft_merge(
    llm: LLM, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    eng = llm.engine
    name = "patterns"
    assert eng.adapters is not None and eng.adapter_catalog is not None
    spec = eng.adapter_catalog.spec(LoRARequest(name, adapters[name]))
    adapter, _ = eng.adapters.acquire(spec, count=False)
    try:
        layers = eng.model.layers
        base = {k: getattr(layers[k[0]], k[1]) for k in targeted_groups(eng.model, adapter.weights)}
        assert eng.merger is not None
        make = eng.merger.make
        merged = build_merged(eng.model, base, adapter.weights, make)
    finally:
        eng.adapters.release(adapter)
    ref = load_merged_reference(tiny_model, adapters[name])
    checked = 0
    for layer, proj in adapter.weights:
        group, first, d_in = projection_rows(eng.model, layer)[proj]
        got, _ = dense_weight(merged[(layer, group)], d_in)
        mod = ref.model.layers[layer]
        want = getattr(mod.self_attn if proj[0] in "qkvo" else mod.mlp, proj).weight
        assert torch.allclose(got[first : first + want.shape[0]], want, atol=1e-6), (layer, proj)
        checked += 1
    assert checked == len(adapter.weights) > 0
