"""Phi-3 / Phi-4 base numerics against transformers: fused qkv_proj / gate_up_proj loaded into
the fused slots, partial rotary (Phi-4-mini's 0.75) and LongRoPE (short and long factors, the
attention factor, the long set for a sequence past ``original_max_position_embeddings``), and
the config refusals.

LongRoPE's choice in transformers is per forward call (``max(position_ids) + 1 >
original_max_position_embeddings``); loraplex makes it per sequence of a step, as HF does for
that sequence alone. With prompts both shorter and longer than the original length in one
batch, each matches HF run on it alone; a sequence that crosses the length while decoding
matches HF's own cached decoding (earlier keys keep the set of the call that wrote them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex import LLM, ModelLoadError, SamplingParams
from loraplex.model.config import parse_model_config
from loraplex.model.rotary import LongRoPERotaryEmbedding
from loraplex.testing import load_merged_reference, make_random_model, reference_greedy

HEAD_DIM = 16  # hidden 64 / 4 heads
ORIGINAL = 16  # LongRoPE's original_max_position_embeddings: prompts on both sides of it
LP_TOL = 1e-4  # float32 logprobs, as tests/model/test_base_model_numerics.py
SHORT_PROMPTS = ["Hello world! How are", "def add(a, b):"]  # < 16 tokens with their 6 new
LONG_PROMPTS = [  # > 16 tokens
    "What is the capital of France? Answer in one word please, thank you very much.",
    "Once upon a time there was a small model that answered every question.",
]


def _longrope(partial: float = 1.0, **extra: Any) -> dict[str, Any]:
    half = int(HEAD_DIM * partial) // 2
    return dict(
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.75 * i for i in range(half)],
            "partial_rotary_factor": partial,
            **extra,
        },
        original_max_position_embeddings=ORIGINAL,
        max_position_embeddings=4 * ORIGINAL,
    )


def _model(tmp_path: Path, **extra: Any) -> Path:
    # Phi3Config's pad_token_id (32000) lies outside a tiny vocabulary
    return make_random_model(
        tmp_path / "phi3", "phi3", num_layers=2, seed=11, pad_token_id=None, **extra
    )


def _check_against_hf(model_dir: Path, prompts: list[str], n_new: int = 6) -> None:
    """One batch of ``prompts``: each one's greedy tokens and logprobs equal HF's on it alone
    (a full forward per step)."""
    llm = LLM(str(model_dir), enable_lora=False, dtype="float32")
    tok, ref = llm.get_tokenizer(), load_merged_reference(model_dir, None)
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, sp), strict=True):
        want, ref_lp = reference_greedy(ref, tok(prompt).input_ids, n_new)
        got = out.outputs[0]
        assert got.token_ids == want, prompt
        worst = max(
            abs(v - float(ref_lp[s, t]))
            for s, lp in enumerate(got.logprobs)
            for t, v in lp.top.items()
        )
        assert worst < LP_TOL, (prompt, worst)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
            }
        },
        {"tie_word_embeddings": True, "sliding_window": 6},
    ],
    ids=["plain", "partial-rotary-0.75", "tied-sliding-window"],
)
def test_base_matches_transformers(tmp_path: Path, extra: dict[str, Any]) -> None:
    _check_against_hf(_model(tmp_path, **extra), SHORT_PROMPTS + LONG_PROMPTS[:1])


@pytest.mark.parametrize("partial", [1.0, 0.75], ids=["full", "partial-0.75"])
def test_longrope_short_and_long_prompts_in_one_batch(tmp_path: Path, partial: float) -> None:
    """Short sequences take the short factors and long ones the long factors (and the attention
    factor sqrt(1 + ln 4 / ln 16)) in the same steps, each as HF on it alone."""
    d = _model(tmp_path, **_longrope(partial))
    llm = LLM(str(d), enable_lora=False, dtype="float32")
    (rope,) = llm.engine.model.rotaries
    assert isinstance(rope, LongRoPERotaryEmbedding)
    assert rope.rotary_dim == int(HEAD_DIM * partial)
    assert rope.attention_factor == pytest.approx(
        (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(16.0))).sqrt().item()
    )
    del llm
    _check_against_hf(d, [SHORT_PROMPTS[0], LONG_PROMPTS[0], SHORT_PROMPTS[1], LONG_PROMPTS[1]])


@torch.no_grad()
def _hf_cached_greedy(model: Any, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF's own KV-cached greedy decoding: prefill the prompt in one call, then one call per
    token (each call picks LongRoPE's set by its own max position)."""
    out = model(torch.tensor([ids]), use_cache=True)
    new, rows = [], []
    for _ in range(n):
        logits = out.logits[0, -1].float()
        rows.append(torch.log_softmax(logits, dim=-1))
        new.append(int(logits.argmax()))
        out = model(torch.tensor([[new[-1]]]), cache=out.cache, use_cache=True)
    return new, torch.stack(rows)


def test_longrope_sequence_crossing_the_original_length_matches_hf_cached_decoding(
    tmp_path: Path,
) -> None:
    d = _model(tmp_path, **_longrope())
    llm = LLM(str(d), enable_lora=False, dtype="float32")
    tok, ref = llm.get_tokenizer(), load_merged_reference(d, None)
    prompt = SHORT_PROMPTS[0]
    ids = tok(prompt).input_ids
    n_new = ORIGINAL + 4 - len(ids)  # decodes past position 16
    assert len(ids) < ORIGINAL < len(ids) + n_new
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=5)
    got = llm.generate([prompt], sp)[0].outputs[0]
    want, ref_lp = _hf_cached_greedy(ref, ids, n_new)
    assert got.token_ids == want
    worst = max(
        abs(v - float(ref_lp[s, t])) for s, lp in enumerate(got.logprobs) for t, v in lp.top.items()
    )
    assert worst < LP_TOL, worst


@torch.no_grad()
def test_longrope_picks_each_sequences_set_within_one_step() -> None:
    """One step with a long prefill, a short chunk, and decode tokens either side of the
    original length: each sequence's cos/sin equal HF's rotary run on that sequence alone."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from loraplex.model.attention import AttentionMetadata, PrefillSpan
    from loraplex.model.phi3 import phi3_rope_scaling

    extra = _longrope(0.75)
    cfg = Phi3Config(hidden_size=64, num_attention_heads=4, **extra)
    scaling = phi3_rope_scaling(cfg.to_dict(), HEAD_DIM, "test")
    rope = LongRoPERotaryEmbedding(HEAD_DIM, 10000.0, scaling, torch.float32, torch.device("cpu"))
    hf = Phi3RotaryEmbedding(cfg)
    seqs = [torch.arange(20), torch.arange(3, 8), torch.tensor([15]), torch.tensor([16])]
    positions = torch.cat(seqs)  # [27]
    attn = AttentionMetadata(
        slot_mapping=torch.zeros(27, dtype=torch.long),
        decode_tokens=torch.tensor([25, 26]),
        prefills=[PrefillSpan(0, 20), PrefillSpan(20, 25)],
    )
    rope.begin_step(positions, attn)
    cos, sin = rope.cos_sin(positions)  # [27, 1, 12]
    start = 0
    x = torch.zeros(1, dtype=torch.float32)
    for seq in seqs:
        want_cos, want_sin = hf(x, seq[None])  # [1, n, 12]: HF on this sequence alone
        n = len(seq)
        torch.testing.assert_close(cos[start : start + n, 0], want_cos[0])
        torch.testing.assert_close(sin[start : start + n, 0], want_sin[0])
        start += n
    long_set = rope._tables(32, rope._factored("long_factor"))[0]
    assert not torch.allclose(long_set[3:8], rope.tables(32)[0][3:8])  # the sets differ


# --------------------------------------------------------------------------------- config


def _raw(**fields: Any) -> dict[str, Any]:
    base = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
        "max_position_embeddings": 128,
    }
    return {**base, **fields}


def test_longrope_config_resolves_as_transformers() -> None:
    """The top-level original_max_position_embeddings wins (HF's Phi3 exception; its default is
    4096), factor defaults to max / original, rope_scaling's legacy layout is read too."""
    rope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    c = parse_model_config(_raw(rope_scaling=rope, original_max_position_embeddings=32))
    assert c.rope_scaling is not None
    assert (c.rope_scaling["original_max_position_embeddings"], c.rope_scaling["factor"]) == (
        32,
        4.0,
    )
    c = parse_model_config(_raw(rope_parameters={**rope, "rope_type": "longrope", "factor": 2.0}))
    assert c.rope_scaling is not None
    assert (c.rope_scaling["original_max_position_embeddings"], c.rope_scaling["factor"]) == (
        4096,
        2.0,
    )
    partial = parse_model_config(
        _raw(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            }
        )
    )
    assert partial.rope_scaling == {"rope_type": "default", "partial_rotary_factor": 0.5}
    assert parse_model_config(_raw()).rope_scaling is None


@pytest.mark.parametrize(
    "rope,match",
    [
        (
            {"rope_type": "linear", "factor": 2.0},
            r"unsupported rope_scaling type 'linear' for Phi3; supported: \('default', 'longrope'\)",
        ),
        (
            {"rope_type": "dynamic", "factor": 2.0},
            r"unsupported rope_scaling type 'dynamic'; supported: ",
        ),
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 7, "long_factor": [2.0] * 8},
            r"rope_scaling\.short_factor must list 8 numbers",
        ),
    ],
    ids=["linear", "unknown", "short-factor-length"],
)
def test_phi3_rope_refusals_are_one_line(rope: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelLoadError, match=match) as e:
        parse_model_config(_raw(rope_parameters=rope))
    assert "\n" not in str(e.value)
