"""Presence / frequency / repetition penalties, logit_bias, min_p and best_of.

Penalties and logit_bias are checked against a straightforward reference of vLLM's formula
(Python loops over token ids) driving transformers + PEFT merged, greedily, on the tiny model,
with base and adapter rows mixed in one batch."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from loraplex import LLM, InvalidRequestError, LoRARequest, SamplingParams
from loraplex.engine.sampler import _filter_min_p, apply_logit_bias, apply_penalties
from loraplex.testing import load_merged_reference

PROMPT = "Hello world! How are you today? I am"


def _reference_row(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
    bias: dict[int, float],
) -> list[float]:
    """vLLM's logit processing, one token at a time: bias, repetition over prompt + output,
    then frequency x count and presence once for each generated token."""
    row = list(logits)
    for t, b in bias.items():
        row[t] += b
    for t in set(prompt) | set(output):
        row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
    for t, c in Counter(output).items():
        row[t] -= frequency * c + presence
    return row


@torch.no_grad()
def _reference_greedy(model: object, prompt: list[int], n: int, sp: SamplingParams) -> list[int]:
    ids: list[int] = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float().tolist()  # type: ignore[operator]
        row = _reference_row(
            logits,
            prompt,
            ids[len(prompt) :],
            sp.presence_penalty,
            sp.frequency_penalty,
            sp.repetition_penalty,
            sp.logit_bias or {},
        )
        ids.append(max(range(len(row)), key=row.__getitem__))
    return ids[len(prompt) :]


def test_penalty_ops_match_the_loop_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(50, generator=gen) * 3
        prompt = torch.randint(0, 50, (7,), generator=gen).tolist()
        output = torch.randint(0, 50, (trial,), generator=gen).tolist()
        pres = float(torch.rand(1, generator=gen)) * 4 - 2
        freq = float(torch.rand(1, generator=gen)) * 4 - 2
        rep = float(torch.rand(1, generator=gen)) * 1.9 + 0.1
        got = apply_penalties(logits, prompt, output, pres, freq, rep)
        want = _reference_row(logits.tolist(), prompt, output, pres, freq, rep, {})
        assert got.tolist() == pytest.approx(want, abs=1e-5)
    bias = {3: 5.0, 7: -100.0}
    got = apply_logit_bias(logits, bias)
    want = _reference_row(logits.tolist(), [], [], 0.0, 0.0, 1.0, bias)
    assert got.tolist() == pytest.approx(want, abs=1e-4)  # float32 vs Python floats


def test_min_p_filter() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -3.0])
    probs = logits.softmax(-1)
    kept = _filter_min_p(logits, float(probs[1] / probs[0]) - 1e-4)
    assert torch.isfinite(kept[:2]).all() and torch.isinf(kept[2:]).all()
    assert torch.isfinite(_filter_min_p(logits, 0.0)).all()


CASES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),  # < 1 rewards repeats
    dict(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=1.3),
    dict(logit_bias={40: 3.0, 41: -2.0}),
    dict(logit_bias={50: 1.0}, frequency_penalty=1.0),
]


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), dtype="float32", enable_lora=True, max_loras=2)


def test_penalties_equal_reference_in_a_mixed_batch(
    llm: LLM, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    ids = llm.get_tokenizer()(PROMPT).input_ids
    lora = LoRARequest("mlp_r16", str(adapters["mlp_r16"]))
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw) for kw in CASES]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # each case twice (base and adapter) plus unpenalised rows, all in one batch
    prompts = [ids] * (2 * len(CASES) + 2)
    sps = [*params, *params, plain, plain]
    loras = [None] * len(CASES) + [lora] * len(CASES) + [None, lora]
    outs = llm.generate(prompts, sps, loras)
    refs = {
        None: load_merged_reference(tiny_model, None),
        "mlp_r16": load_merged_reference(tiny_model, adapters["mlp_r16"]),
    }
    changed = 0
    for out, sp, lr in zip(outs, sps, loras, strict=True):
        want = _reference_greedy(refs[lr.name if lr else None], ids, 12, sp)
        assert out.outputs[0].token_ids == want, (sp, lr)
        changed += want != outs[-2 if lr is None else -1].outputs[0].token_ids
    assert changed >= len(CASES)  # the penalties do change what greedy picks


def test_logit_bias_forces_and_forbids(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = llm.generate(PROMPT, sp)[0].outputs[0].token_ids
    forced = llm.generate(
        PROMPT, SamplingParams(temperature=0.9, seed=1, max_tokens=6, logit_bias={77: 100.0})
    )[0]
    assert forced.outputs[0].token_ids == [77] * 6
    banned = {t: -100.0 for t in set(base)}
    out = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias=banned)
    )[0]
    assert not set(out.outputs[0].token_ids) & set(base)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="logit_bias") as e:
        llm.generate(PROMPT, SamplingParams(logit_bias={vocab: 1.0}))
    assert e.value.param == "logit_bias"
    assert llm.engine.is_idle()


def test_min_p_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    sampled = llm.generate(
        PROMPT, SamplingParams(temperature=1.5, min_p=1.0, seed=5, max_tokens=8, ignore_eos=True)
    )
    loose = llm.generate(
        PROMPT, SamplingParams(temperature=1.5, seed=5, max_tokens=8, ignore_eos=True)
    )
    assert sampled[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    assert loose[0].outputs[0].token_ids != greedy[0].outputs[0].token_ids


def test_best_of_returns_the_n_most_likely(llm: LLM) -> None:
    kw = dict(temperature=1.2, seed=11, max_tokens=6, ignore_eos=True)
    every = llm.generate(PROMPT, SamplingParams(n=5, logprobs=0, **kw))[0].outputs
    cum = sorted((o.cumulative_logprob, o.token_ids) for o in every)[::-1]
    assert len({c for c, _ in cum}) == 5  # distinct candidates
    best = llm.generate(PROMPT, SamplingParams(n=2, best_of=5, **kw))[0]
    assert [o.index for o in best.outputs] == [0, 1]
    assert [o.token_ids for o in best.outputs] == [ids for _, ids in cum[:2]]
    for o, (c, _) in zip(best.outputs, cum[:2], strict=True):
        assert o.cumulative_logprob == pytest.approx(c, abs=1e-5)
        assert o.logprobs is None  # not asked for


def test_best_of_reports_only_when_finished(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request(
        "bo", PROMPT, SamplingParams(n=1, best_of=3, temperature=1.0, max_tokens=4, seed=2)
    )
    reports = []
    while eng.has_unfinished_requests():
        reports += eng.step()
    assert len(reports) == 1 and reports[0].finished and len(reports[0].outputs) == 1
    assert eng.is_idle()


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=True), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(logit_bias={"12": 1.0}), "logit_bias"),
        (dict(logit_bias={12: 101.0}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(best_of=1.5), "best_of"),
    ],
)
def test_invalid_values_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field) as e:
        SamplingParams(**kw)
    assert e.value.param == field
