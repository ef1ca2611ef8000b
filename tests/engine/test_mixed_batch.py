"""Invariant 2: every adapter in a mixed batch equals its merged-weights reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.testing import load_merged_reference, logprob_gap, reference_greedy

PROMPTS = [
    "What is the capital of France?",
    "def add(a, b):",
    "SELECT name FROM users",
    "Once upon a time",
    "Hello world! How are you",
    "Multi-LoRA serving runs",
    "The capital of Italy is",
]
N_NEW = 10


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), enable_lora=True, max_loras=8, max_lora_rank=64, dtype="float32")


def test_mixed_batch_equals_merged_references(
    llm: LLM, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    names = [None, *adapters]  # the base model plus six adapters
    assert len(names) >= 6
    prompts, loras, expect_names = [], [], []
    for i, name in enumerate(names):  # every adapter appears twice with different prompts
        for j in range(2):
            prompts.append(PROMPTS[(i + j) % len(PROMPTS)])
            loras.append(LoRARequest(name, adapters[name]) if name else None)
            expect_names.append(name)
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, lora_request=loras)
    tok = llm.get_tokenizer()
    refs = {
        name: load_merged_reference(tiny_model, adapters[name] if name else None) for name in names
    }
    base_tokens = {}
    for prompt, name, out in zip(prompts, expect_names, outs, strict=True):
        ids = tok(prompt).input_ids
        want, ref_lp = reference_greedy(refs[name], ids, N_NEW)
        got = out.outputs[0]
        assert got.token_ids == want, f"adapter {name} prompt {prompt!r}"
        worst = logprob_gap(got.logprobs, ref_lp)
        assert worst < 2e-4, f"adapter {name}: logprob diff {worst}"
        if name is None:
            base_tokens[prompt] = got.token_ids
    # the adapters really change the outputs (non-zero B): not a silent no-op
    changed = sum(
        out.outputs[0].token_ids != base_tokens.get(p)
        for p, n, out in zip(prompts, expect_names, outs, strict=True)
        if n is not None and p in base_tokens
    )
    assert changed >= 1
    assert llm.engine.is_idle()


def test_adapter_refs_are_content_digests(llm: LLM, adapters: dict[str, Path]) -> None:
    out = llm.generate(
        "hi", SamplingParams(max_tokens=1), lora_request=LoRARequest("x", adapters["all_r8"])
    )
    ref = out[0].adapter
    assert ref is not None and ref.name == "x" and len(ref.sha256) == 64
    # the same files under another name are the same adapter (one digest)
    out2 = llm.generate(
        "hi", SamplingParams(max_tokens=1), lora_request=LoRARequest("y", 7, adapters["all_r8"])
    )
    assert out2[0].adapter.sha256 == ref.sha256


def test_more_adapters_than_slots(tiny_model: Path, adapters: dict[str, Path]) -> None:
    """max_loras=2 with six adapters: requests wait for slots, results stay exact."""
    llm = LLM(str(tiny_model), max_loras=2, max_cpu_loras=3, max_lora_rank=64, dtype="float32")
    names = list(adapters)
    loras = [LoRARequest(n, adapters[n]) for n in names]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([PROMPTS[0]] * len(names), params, lora_request=loras)
    single = {
        n: llm.generate(PROMPTS[0], params, lora_request=LoRARequest(n, adapters[n]))[0]
        .outputs[0]
        .token_ids
        for n in names
    }
    for n, out in zip(names, outs, strict=True):
        assert out.outputs[0].token_ids == single[n]
    assert llm.engine.adapters.stats.slot_evictions > 0
    assert llm.engine.is_idle()
