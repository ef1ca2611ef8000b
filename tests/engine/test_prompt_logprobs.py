"""Prompt logprobs (what ``echo`` + ``logprobs`` and lm-eval's loglikelihood need) equal
transformers + PEFT merged, for the base model and an adapter, through chunked prefill and a
warm prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex import LLM, InvalidRequestError, LoRARequest, SamplingParams
from loraplex.testing import load_merged_reference

PROMPTS = [
    "The capital of France is Paris. The capital of Italy is",
    "SELECT name FROM users WHERE id = 42 ORDER BY created_at DESC; Once upon a time there",
]


@torch.no_grad()
def _reference(model: object, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) rows: [len(ids) - 1, vocab] (row i predicts ids[i + 1])."""
    logits = model(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)[:-1]


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    # small step budget: long prompts are prefilled in several chunks
    return LLM(
        str(tiny_model),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )


@pytest.mark.parametrize("adapter", [None, "all_r8", "attn_r4_rslora"])
def test_prompt_logprobs_equal_merged_reference(
    llm: LLM, tiny_model: Path, adapters: dict[str, Path], adapter: str | None
) -> None:
    ref = load_merged_reference(tiny_model, adapters[adapter] if adapter else None)
    lora = LoRARequest(adapter, str(adapters[adapter])) if adapter else None
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    # twice: the second run finds the prompt's blocks in the prefix cache and must still
    # compute every position
    for _ in range(2):
        outs = llm.generate(PROMPTS, sp, lora)
        for out in outs:
            ids = out.prompt_token_ids
            assert len(ids) > 16  # several prefill chunks
            want = _reference(ref, ids)
            got = out.prompt_logprobs
            assert got is not None and len(got) == len(ids) and got[0] is None
            for i, entry in enumerate(got[1:]):
                assert entry is not None
                assert next(iter(entry)) == ids[i + 1]  # the prompt token comes first
                assert entry[ids[i + 1]] == pytest.approx(float(want[i, ids[i + 1]]), abs=1e-4)
                top_v, top_i = want[i].topk(3)
                for t, v in zip(top_i.tolist(), top_v.tolist(), strict=True):
                    assert entry[t] == pytest.approx(v, abs=1e-4)
                assert len(entry) in (3, 4)
    assert llm.engine.is_idle()


def test_prompt_logprobs_zero_and_none(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    got = out[0].prompt_logprobs
    assert got is not None and got[0] is None
    assert all(len(e) == 1 for e in got[1:])  # type: ignore[arg-type]
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="prompt_logprobs") as e:
        SamplingParams(prompt_logprobs=21)
    assert e.value.param == "prompt_logprobs"


def test_prompt_logprobs_with_n_and_mixed_batch(llm: LLM, adapters: dict[str, Path]) -> None:
    """n > 1 reports the prompt logprobs once; requests without them in the same batch are
    unchanged."""
    lora = LoRARequest("all_r8", str(adapters["all_r8"]))
    sp_plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], sp_plain, lora)[0]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2, prompt_logprobs=1)
    a, b = llm.generate([PROMPTS[0], PROMPTS[1]], [sp, sp_plain], [None, lora])
    assert a.prompt_logprobs is not None and len(a.prompt_logprobs) == len(a.prompt_token_ids)
    assert len(a.outputs) == 2 and a.outputs[0].token_ids == a.outputs[1].token_ids
    assert b.prompt_logprobs is None and b.outputs[0].token_ids == alone.outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(tiny_model: Path) -> None:
    """Sequences preempted (KV freed, recomputed) mid-prompt or mid-output keep one complete,
    correct list of prompt logprobs."""
    llm = LLM(
        str(tiny_model),
        dtype="float32",
        enable_lora=False,
        block_size=16,
        num_kv_blocks=8,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    ref = load_merged_reference(tiny_model, None)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    prompts = [p + " " + str(i) for i, p in enumerate(PROMPTS * 2)]
    outs = llm.generate(prompts, sp)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        ids = out.prompt_token_ids
        want = _reference(ref, ids)
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(ids)
        for i, entry in enumerate(got[1:]):
            assert entry[ids[i + 1]] == pytest.approx(float(want[i, ids[i + 1]]), abs=1e-4)
    assert llm.engine.is_idle()
