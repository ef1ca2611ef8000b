"""Invariant 6: bad input gets a clear error and the engine keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraplex import LLM, AdapterError, InvalidRequestError, LoRARequest, SamplingParams
from loraplex.testing import make_random_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), max_loras=2, max_lora_rank=16, dtype="float32", max_model_len=64)


def _still_serves(llm: LLM, adapters: dict[str, Path]) -> None:
    out = llm.generate(
        ["Hello", "Hi"], GREEDY, lora_request=[None, LoRARequest("ok", adapters["all_r8"])]
    )
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    assert llm.engine.is_idle()


def test_unknown_adapter_path(llm: LLM, adapters: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="not a directory"):
        llm.generate("Hello", GREEDY, lora_request=LoRARequest("ghost", tmp_path / "missing"))
    _still_serves(llm, adapters)


def test_corrupt_safetensors(llm: LLM, adapters: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "corrupt"
    shutil.copytree(adapters["all_r8"], bad)
    f = bad / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(AdapterError, match="corrupt"):
        llm.generate(["Hello", "Hi"], GREEDY, lora_request=[None, LoRARequest("bad", bad)])
    _still_serves(llm, adapters)


def test_rank_above_max(llm: LLM, adapters: dict[str, Path]) -> None:
    with pytest.raises(AdapterError, match="max_lora_rank"):
        llm.generate("Hello", GREEDY, lora_request=LoRARequest("big", adapters["all_r64_layer1"]))
    _still_serves(llm, adapters)


def test_incompatible_base(llm: LLM, adapters: dict[str, Path], tmp_path: Path) -> None:
    from loraplex.testing import make_random_model

    other = make_random_model(
        tmp_path / "wide", hidden_size=96, num_layers=3, with_tokenizer=False, vocab_size=384
    )
    wrong = make_random_adapter(other, tmp_path / "wrong", r=4)
    with pytest.raises(AdapterError):
        llm.generate("Hello", GREEDY, lora_request=LoRARequest("wrong", wrong))
    _still_serves(llm, adapters)


def test_unsupported_dora(llm: LLM, adapters: dict[str, Path], tmp_path: Path) -> None:
    dora = tmp_path / "dora"
    shutil.copytree(adapters["all_r8"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        llm.generate("Hello", GREEDY, lora_request=LoRARequest("dora", dora))
    _still_serves(llm, adapters)


def test_prompt_too_long_and_bad_tokens(llm: LLM, adapters: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate([list(range(10, 80))], GREEDY)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([[1, 2, 10**6]], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="entries"):
        llm.generate(["a", "b"], GREEDY, lora_request=[None])
    _still_serves(llm, adapters)


def test_generation_stops_at_max_model_len(llm: LLM, adapters: dict[str, Path]) -> None:
    """max_tokens=None: up to max_model_len; an explicit max_tokens that does not fit is a clear
    error (OpenAI's message, param max_tokens), never silently clamped."""
    out = llm.generate(
        [list(range(10, 60))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 64 - 50
    assert out[0].outputs[0].finish_reason == "length"
    exact = llm.generate(
        [list(range(10, 60))], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    )
    assert exact[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(
            [list(range(10, 60))], SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
        )
    assert str(info.value) == (
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(50 in the prompt, 15 in the completion). Reduce the prompt or max_tokens."
    )
    assert info.value.param == "max_tokens"
    _still_serves(llm, adapters)
