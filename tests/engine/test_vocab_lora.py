"""LoRA on ``lm_head`` and ``embed_tokens`` in mixed batches: the base model and adapters with a
head LoRA, an embedding LoRA, both (beside every projection) and neither, in one batch, equal
transformers + PEFT with each adapter merged (greedy tokens, sample and prompt logprobs), with
tied and untied embeddings, on the CPU LoRA kernel and on the torch path; a tied head's LoRA
reaches the logits only, never the lookup (PEFT's unmerged forward is then the reference:
merging would write the one shared matrix). The single-adapter merged fast path keeps those two
modules gathered and equals the same references; ``modules_to_save`` is refused at load."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.lora.peft_format import EMBED_KEY, LM_HEAD_KEY
from loraplex.testing import (
    ALL_PROJ,
    load_merged_reference,
    make_random_adapter,
    make_random_model,
    reference_greedy,
)
from loraplex.testing.sync import EVENT_TIMEOUT_S
from loraplex.types import AdapterError

MODELS = {"untied": dict(tie_word_embeddings=False), "tied": dict(tie_word_embeddings=True)}
ADAPTERS: dict[str, dict] = {
    "head_r8": dict(r=8, lora_alpha=16, target_modules=["lm_head"], std=0.1, seed=1),
    "embed_r4_rslora": dict(
        r=4, lora_alpha=8, target_modules=["embed_tokens"], use_rslora=True, std=0.1, seed=2
    ),
    "both_all_r16": dict(
        r=16,
        lora_alpha=16,
        target_modules=[*ALL_PROJ, "lm_head", "embed_tokens"],
        rank_pattern={"lm_head": 4},
        alpha_pattern={"embed_tokens": 24},
        std=0.1,
        seed=3,
    ),
    "qv_r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=4),
}
PROMPTS = [
    "What is the capital of France?",
    "def add(a, b):",
    "SELECT name FROM users WHERE id = 42",
    "Once upon a time there was",
    "Hello world! How are you",
]
N_NEW = 8
SAMPLE_TOL = 2e-4  # float32 logprobs, as the Llama mixed-batch test
PROMPT_TOL = 1e-4  # float32 prompt logprobs, as the Llama prompt-logprob test


@pytest.fixture(scope="module", params=list(MODELS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny Llama (tied or untied), the adapters and their references."""
    root = tmp_path_factory.mktemp(request.param)
    model = make_random_model(root / "model", num_layers=2, seed=7, **MODELS[request.param])
    adapters = {n: make_random_adapter(model, root / n, **kw) for n, kw in ADAPTERS.items()}
    refs = {n: load_merged_reference(model, adapters.get(n)) for n in [None, *adapters]}
    return {"model": model, "adapters": adapters, "refs": refs, "tied": request.param == "tied"}


@pytest.fixture(scope="module", params=["cpu-kernel", "torch"])
def llm(request: pytest.FixtureRequest, family: dict) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as mp:  # the backend is chosen once, at start-up
        mp.setenv("LORAPLEX_LORA_CPU_KERNEL", "1" if request.param == "cpu-kernel" else "0")
        llm = LLM(str(family["model"]), max_loras=4, max_lora_rank=16, dtype="float32")
    assert llm.engine.model.lora is not None
    assert llm.engine.model.lora.ops.name.startswith(request.param)
    yield llm


@torch.no_grad()
def _prompt_reference(model: object, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) rows: [len(ids) - 1, vocab]."""
    logits = model(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check(ref: object, tok: object, prompt: str, out: object, name: str | None) -> None:
    ids = tok(prompt).input_ids  # type: ignore[operator]
    got = out.outputs[0]  # type: ignore[attr-defined]
    want, ref_lp = reference_greedy(ref, ids, len(got.token_ids))
    assert got.token_ids == want, f"adapter {name} prompt {prompt!r}"
    worst = max(
        abs(val - float(ref_lp[step, tid]))
        for step, lp in enumerate(got.logprobs)
        for tid, val in lp.top.items()
    )
    assert worst < SAMPLE_TOL, f"adapter {name}: logprob diff {worst}"
    if out.prompt_logprobs is not None:  # type: ignore[attr-defined]
        want_prompt = _prompt_reference(ref, ids)
        worst = max(
            abs(val - float(want_prompt[i, tid]))
            for i, entry in enumerate(out.prompt_logprobs[1:])  # type: ignore[attr-defined]
            for tid, val in entry.items()
        )
        assert worst < PROMPT_TOL, f"adapter {name}: prompt logprob diff {worst}"


def test_mixed_batch_equals_the_references(llm: LLM, family: dict) -> None:
    adapters, refs = family["adapters"], family["refs"]
    names = [None, *adapters]
    prompts, loras, expect = [], [], []
    for i, name in enumerate(names):  # each adapter twice, with different prompts
        for j in range(2):
            prompts.append(PROMPTS[(i + j) % len(PROMPTS)])
            loras.append(LoRARequest(name, str(adapters[name])) if name else None)
            expect.append(name)
    sp = SamplingParams(
        temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    outs = llm.generate(prompts, sp, lora_request=loras)
    tok = llm.get_tokenizer()
    for prompt, name, out in zip(prompts, expect, outs, strict=True):
        _check(refs[name], tok, prompt, out, name)
    # the vocabulary LoRAs really move the outputs (non-zero B): not silent no-ops
    base = {
        p: o.outputs[0].logprobs[0]
        for p, n, o in zip(prompts, expect, outs, strict=True)
        if n is None
    }
    for prompt, name, out in zip(prompts, expect, outs, strict=True):
        if name in ("head_r8", "embed_r4_rslora") and prompt in base:
            first = out.outputs[0].logprobs[0].top
            moved = max(
                abs(v - base[prompt].top[t]) for t, v in first.items() if t in base[prompt].top
            )
            assert moved > 1e-2, (name, moved)
    # the step's plan covered the two modules (the bank holds their rows for every slot)
    bank = llm.engine.adapters.bank
    assert {EMBED_KEY, LM_HEAD_KEY} <= set(bank.module_shapes)
    assert llm.engine.is_idle()


def test_merged_fast_path_keeps_the_vocab_loras_gathered(family: dict) -> None:
    """An adapter with LoRA on every projection, lm_head and embed_tokens, alone for a few
    steps, runs its layers merged and its embedding / head LoRA gathered; the base Linears and
    the embedding come back untouched."""
    llm = LLM(
        str(family["model"]), max_loras=2, max_lora_rank=16, dtype="float32",
        lora_merge_after_steps=2,
    )  # fmt: skip
    eng, tok = llm.engine, llm.get_tokenizer()
    assert eng.merger is not None
    name = "both_all_r16"
    adapter = family["adapters"][name]
    base_linears = [(L.qkv, L.o, L.gate_up, L.down) for L in eng.model.layers]
    head = eng.model.head
    sp = SamplingParams(
        temperature=0, max_tokens=N_NEW + 4, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    for i, p in enumerate(PROMPTS[:2]):
        eng.add_request(f"r{i}", p, sp, LoRARequest(name, str(adapter)))
    results: dict = {}
    merged_steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out
        merged_steps += eng.runner.merged_slot is not None
        assert eng.merger.wait_build(EVENT_TIMEOUT_S)
    assert eng.merger.merges == 1 and merged_steps >= 3
    assert eng.model.head is head  # never merged into
    eng.add_request("base", PROMPTS[2], sp)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out
    assert eng.merger.merged_digest is None
    now = [(L.qkv, L.o, L.gate_up, L.down) for L in eng.model.layers]
    assert all(
        a is b
        for old, new in zip(base_linears, now, strict=True)
        for a, b in zip(old, new, strict=True)
    )
    for rid, prompt, ref_name in (("r0", PROMPTS[0], name), ("r1", PROMPTS[1], name),
                                  ("base", PROMPTS[2], None)):  # fmt: skip
        _check(family["refs"][ref_name], tok, prompt, results[rid], ref_name)
    assert eng.is_idle()


def test_modules_to_save_is_refused_at_load(llm: LLM, family: dict, tmp_path: Path) -> None:
    full = tmp_path / "full"
    shutil.copytree(family["adapters"]["head_r8"], full)
    cfg = json.loads((full / "adapter_config.json").read_text())
    (full / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": ["lm_head"]}))
    sp = SamplingParams(max_tokens=1)
    with pytest.raises(AdapterError, match="full replacement weights for lm_head") as info:
        llm.generate("Hello", sp, lora_request=LoRARequest("full", str(full)))
    assert "\n" not in str(info.value)
    assert llm.generate("Hello", sp)[0].outputs[0].token_ids  # the engine serves on
