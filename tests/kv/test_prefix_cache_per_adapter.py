"""Prefix caching keyed by adapter content digest: hits within one adapter, never across."""

from __future__ import annotations

import shutil
from pathlib import Path

from loraplex import LoRARequest, SamplingParams
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.testing import load_merged_reference, make_random_adapter, reference_greedy

PROMPT = "Multi-LoRA serving runs many adapters on one base model at once. " * 2
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _generate(e: LLMEngine, rid: str, lora: LoRARequest | None):
    e.add_request(rid, PROMPT, GREEDY, lora)
    while True:
        for out in e.step():
            if out.finished:
                return out


def test_hit_on_repeat_and_isolation_across_adapters(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    e = LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32", block_size=4))
    a = LoRARequest("a", adapters["all_r8"])
    b = LoRARequest("b", adapters["attn_r4_rslora"])
    first = _generate(e, "1", a)
    assert first.num_cached_tokens == 0
    again = _generate(e, "2", a)
    n_prompt = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (n_prompt - 1) // 4 * 4 > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other = _generate(e, "3", b)
    assert other.num_cached_tokens == 0  # same prompt, other adapter: no sharing
    base = _generate(e, "4", None)
    assert base.num_cached_tokens == 0
    base2 = _generate(e, "5", None)
    assert base2.num_cached_tokens > 0
    assert e.pool.hit_tokens == again.num_cached_tokens + base2.num_cached_tokens
    assert e.is_idle()


def test_new_revision_of_same_name_never_reuses_old_kv(tiny_model: Path, tmp_path: Path) -> None:
    """Hot swap: rewrite the adapter directory under the same name; output follows rev 2."""
    path = tmp_path / "swap"
    rev1 = make_random_adapter(tiny_model, tmp_path / "rev1", r=8, seed=21)
    rev2 = make_random_adapter(tiny_model, tmp_path / "rev2", r=8, seed=22, std=0.2)
    shutil.copytree(rev1, path)
    e = LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32", block_size=4))
    out1 = _generate(e, "1", LoRARequest("x", path))
    _generate(e, "1b", LoRARequest("x", path))  # prefix cache now holds rev 1's KV
    shutil.rmtree(path)
    shutil.copytree(rev2, path)
    out2 = _generate(e, "2", LoRARequest("x", path))
    assert out2.adapter.sha256 != out1.adapter.sha256
    assert out2.num_cached_tokens == 0
    ids = e.tokenize(PROMPT)
    want, _ = reference_greedy(load_merged_reference(tiny_model, rev2), ids, 6)
    assert out2.outputs[0].token_ids == want
    want1, _ = reference_greedy(load_merged_reference(tiny_model, rev1), ids, 6)
    assert out1.outputs[0].token_ids == want1
    assert want != want1
