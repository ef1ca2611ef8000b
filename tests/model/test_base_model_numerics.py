"""Base-model numerics against transformers for each supported architecture and layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loraplex import LLM, ModelLoadError, SamplingParams
from loraplex.testing import load_merged_reference, make_random_model, reference_greedy

PROMPTS = ["What is the capital of France?", "def add(a, b):", "Hello world! How are"]


def _check_against_hf(model_dir: Path, n_new: int = 12, **llm_kwargs) -> None:
    llm = LLM(str(model_dir), enable_lora=False, dtype="float32", **llm_kwargs)
    tok = llm.get_tokenizer()
    ref = load_merged_reference(model_dir, None)
    params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt).input_ids
        want, ref_lp = reference_greedy(ref, ids, n_new)
        got = out.outputs[0]
        assert got.token_ids == want, prompt
        for step, lp in enumerate(got.logprobs):
            for tid, val in lp.top.items():
                assert abs(val - float(ref_lp[step, tid])) < 1e-4


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("llama", {}),
        ("mistral", {}),
        ("qwen2", {}),  # q/k/v bias
        ("qwen3", {"attention_bias": True}),  # per-head q/k norms, q/k/v/o biases
        ("qwen3", {"head_dim": 24, "tie_word_embeddings": True}),  # q wider than hidden
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
        ),
    ],
    ids=[
        "llama",
        "mistral",
        "qwen2-bias",
        "qwen3-bias",
        "qwen3-head-dim-tied",
        "tied",
        "attn-mlp-bias",
        "llama3-rope",
        "linear-rope",
    ],
)
def test_base_model_matches_transformers(tmp_path: Path, arch: str, extra: dict) -> None:
    d = make_random_model(tmp_path / arch, arch, num_layers=2, seed=11, **extra)
    _check_against_hf(d)


def test_sharded_bf16_checkpoint(tmp_path: Path) -> None:
    """Sharded index + bf16 on disk, upcast to float32 while loading (one tensor at a time)."""
    d = make_random_model(tmp_path / "sharded", dtype=torch.bfloat16, max_shard_size="40KB", seed=3)
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("*.safetensors"))) > 1
    _check_against_hf(d)


def test_chunked_prefill_matches(tmp_path: Path, tiny_model: Path) -> None:
    """A prompt split over several steps (tiny token budget) gives the same tokens."""
    _check_against_hf(tiny_model, max_num_batched_tokens=5, enable_prefix_caching=False)


def test_bfloat16_runs_close_to_reference(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), enable_lora=False, dtype="bfloat16")
    assert llm.engine.dtype == torch.bfloat16
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    )
    ref = load_merged_reference(tiny_model, None)
    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    _, ref_lp = reference_greedy(ref, ids, 1)
    first = out[0].outputs[0].logprobs[0]
    assert abs(first.logprob - float(ref_lp[0, first.token_id])) < 0.1


def test_loader_errors_name_the_problem(tmp_path: Path, tiny_model: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(str(tmp_path / "nope"))
    bad = tmp_path / "arch"
    bad.mkdir()
    cfg = json.loads((tiny_model / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLM(str(bad))
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(empty), skip_tokenizer_init=True)
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    (trunc / "config.json").write_text(json.dumps(cfg))
    data = (tiny_model / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        LLM(str(trunc), skip_tokenizer_init=True)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        LLM(str(trunc))
