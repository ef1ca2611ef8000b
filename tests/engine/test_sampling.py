"""Sampling parameters: greedy, top-k/top-p, seeds, stop strings / ids, logprobs, eos."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex import LLM, InvalidRequestError, SamplingParams
from loraplex.engine.sampler import _filter_top_k_top_p, draw


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), enable_lora=False, dtype="float32")


def test_top_k_one_equals_greedy(llm: LLM) -> None:
    g = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    k1 = llm.generate(
        "Hello", SamplingParams(temperature=0.8, top_k=1, max_tokens=8, ignore_eos=True, seed=3)
    )
    assert g[0].outputs[0].token_ids == k1[0].outputs[0].token_ids


def test_seed_reproducible_and_varies(llm: LLM) -> None:
    sp = lambda s: SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, seed=s)  # noqa: E731
    a = llm.generate(["Hello"] * 2, [sp(1), sp(1)])
    b = llm.generate("Hello", sp(2))
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids
    assert a[0].outputs[0].token_ids != b[0].outputs[0].token_ids


def test_draw_follows_the_distribution_and_never_a_zero_token() -> None:
    """20000 seeded draws: each token's share within 4 standard errors of its probability
    (unnormalised input), zero-probability tokens (first, middle, last) never drawn."""
    weights = torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 0.5, 0.0, 3.5, 0.0], dtype=torch.float32)
    p = weights / weights.sum()
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(weights, g) for _ in range(n)]), minlength=9)
    assert counts[weights == 0].sum() == 0
    se = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() <= 4 * se + 1e-12).all(), counts
    one_hot = torch.zeros(5)
    one_hot[4] = 1.0
    assert {draw(one_hot, g) for _ in range(50)} == {4}


def test_draw_when_the_uniform_rounds_up_to_the_total(monkeypatch: pytest.MonkeyPatch) -> None:
    """The largest uniform below 1 times the total may round to the total itself: the draw is
    then the last token with mass, not an index past the vocabulary."""
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.tensor(1.0, dtype=torch.float64))
    assert draw(torch.tensor([0.1, 0.2, 0.7, 0.0, 0.0]), torch.Generator()) == 2


def test_filter_top_k_top_p() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(_filter_top_k_top_p(logits, 2, 1.0)[2:]).all()
    probs = logits.softmax(-1)
    kept = _filter_top_k_top_p(logits, -1, float(probs[0] + 0.01))
    assert torch.isfinite(kept[:2]).all() and torch.isinf(kept[2:]).all()
    assert torch.isfinite(_filter_top_k_top_p(logits, -1, 0.01)[:1]).all()


def test_stop_string_truncates_and_stop_token(llm: LLM) -> None:
    full = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    out = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    )
    o = out[0].outputs[0]
    assert (
        o.finish_reason == "stop"
        and o.stop_reason == stop
        and o.text == full.text[: full.text.find(stop)]
    )
    inc = llm.generate(
        "Hello",
        SamplingParams(
            temperature=0,
            max_tokens=16,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0].outputs[0]
    assert inc.text.endswith(stop)
    tid = full.token_ids[3]
    out = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[tid])
    )
    o = out[0].outputs[0]
    assert o.token_ids == full.token_ids[: full.token_ids.index(tid) + 1]
    assert o.finish_reason == "stop" and o.stop_reason == tid


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    eos = llm.get_tokenizer().eos_token_id
    full = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[
        0
    ].outputs[0]
    llm.engine.eos_token_ids.add(full.token_ids[2])
    try:
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
        assert out.token_ids == full.token_ids[:3] and out.finish_reason == "stop"
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, min_tokens=5))[
            0
        ].outputs[0]
        assert len(out.token_ids) >= 5
    finally:
        llm.engine.eos_token_ids.discard(full.token_ids[2])
        llm.engine.eos_token_ids.add(eos)


def test_logprobs_shape_and_values(llm: LLM) -> None:
    out = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=4)
    )[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 3
    for lp, tok in zip(lps, out.outputs[0].token_ids, strict=True):
        assert lp.token_id == tok and len(lp.top) == 4
        assert max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy picks the top token
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(lp.logprob for lp in lps))


def test_token_id_prompts_and_text_prompts_agree(llm: LLM) -> None:
    ids = llm.get_tokenizer()("Hello there").input_ids
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    a, b, c, d = llm.generate(
        ["Hello there", ids, {"prompt_token_ids": ids}, {"prompt": "Hello there"}], sp
    )
    for other in (b, c, d):
        assert other.outputs[0].token_ids == a.outputs[0].token_ids
        assert other.prompt_token_ids == a.prompt_token_ids
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate({"text": "x"}, sp)


def test_chat_uses_the_model_template(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tok(text, add_special_tokens=False).input_ids
    plain = llm.generate(
        [out.prompt_token_ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )[0]
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_odd_prompt_and_param_types(llm: LLM) -> None:
    import numpy as np

    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = llm.get_tokenizer()("Hello there").input_ids
    want = llm.generate([ids], sp)[0].outputs[0].token_ids
    for form in (tuple(ids), np.array(ids), [np.int64(t) for t in ids]):
        assert llm.generate(form, sp)[0].outputs[0].token_ids == want
    with pytest.raises(InvalidRequestError, match="prompt must be"):
        llm.generate([3.5], sp)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature="hot")
    with pytest.raises(InvalidRequestError, match="top_k"):
        SamplingParams(top_k=2.5)


def test_extreme_temperature_and_top_p_do_not_break_the_step(tiny_model) -> None:
    """Tiny temperatures overflow logits / T and a top_p that rounds to 0 in float32 once
    masked every token; both must sample the argmax, and a neighbour in the batch is unaffected."""
    from loraplex import LLM, SamplingParams

    llm = LLM(str(tiny_model), enable_lora=False, num_kv_blocks=64)
    greedy = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4))[0]
    params = [
        SamplingParams(temperature=1e-300, max_tokens=4),
        SamplingParams(temperature=1e-6, max_tokens=4),
        SamplingParams(temperature=1.0, top_p=5e-324, max_tokens=4, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-45, max_tokens=4, seed=1),
    ]
    outs = llm.generate(["Hello"] * len(params), params)
    for o in outs:
        assert o.outputs[0].token_ids == greedy.outputs[0].token_ids
