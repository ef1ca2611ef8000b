"""Speculative decoding (issue 51): drafts verified exactly in mixed-adapter batches.

An *oracle* proposer drafts what non-speculative decoding produces, with a wrong token planted
in every other draft, so every step mixes accepted drafts, rejected ones (whose KV is rolled
back) and sequences without a draft. Base, standard-LoRA, activated-LoRA and composed rows run
in one batch on tiny random Llama and Qwen3 models; greedy outputs must be token for token
those of the engine without speculation, logprobs within float32 rounding. The methods' own
drafts (ngram, suffix, draft model) are tested against the same reference in
``tests/engine/spec/``; this file tests the verification and rollback they all rely on.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.sequence import Sequence
from loraplex.engine.spec import speculator as speculator_mod
from loraplex.engine.spec.proposer import NO_DRAFT, Draft, Proposer
from loraplex.engine.spec.speculator import KEPT_SUFFIX
from loraplex.testing import make_random_adapter, make_random_model

N_NEW = 12
INV = [21, 22, 23]  # the aLoRA's invocation
PROMPTS = [
    [1, 5, 9, 13, 7, 2, 11],
    [3, 4, 5, 6, 40, 41],
    [8, 8, 8, 2, 1, 17, 30, *INV, 31, 32],  # the aLoRA's: its invocation mid-prompt
    [20, 21, 25, 60, 61],
    [50, 51, 52, 53, 54, 55, 56, 57, 58],
]
LP_TOL = 2e-4  # float32 logprobs, as the other exactness tests


class OracleProposer(Proposer):
    """Drafts the reference continuation of each request (found by its prompt),
    with a wrong token at position 1 of every other draft it makes; a test device, standing in
    for any method (each method has its own tests against the same engine)."""

    method = "ngram"

    def __init__(self, reference: dict[tuple, list[int]], vocab: int) -> None:
        self.reference = reference
        self.vocab = vocab
        self.calls = 0
        self.finished: list[str] = []

    def propose(self, seqs: Seq[Sequence], limits: Seq[int]) -> list[Draft]:
        out = []
        for seq, k in zip(seqs, limits, strict=True):
            want = self.reference.get(tuple(seq.prompt_token_ids))
            done = len(seq.output_token_ids)
            if want is None or k == 0 or done >= len(want):
                out.append(NO_DRAFT)
                continue
            toks = list(want[done : done + k])
            self.calls += 1
            if self.calls % 2 == 0 and len(toks) > 1:
                toks[1] = (toks[1] + 1) % self.vocab  # rejected: the rest are rolled back
            out.append(Draft(toks))
        return out

    def finish(self, seq: Sequence) -> None:
        self.finished.append(seq.request_id)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp(f"spec-{request.param}")
    extra = {"head_dim": 16} if request.param == "qwen3" else {}
    model = make_random_model(
        root / "model", request.param, num_layers=2, seed=5, with_tokenizer=False,
        vocab_size=400, **extra,
    )  # fmt: skip
    adapters = {
        "std": make_random_adapter(model, root / "std", r=8, seed=1),
        "alora": make_random_adapter(
            model, root / "alora", r=8, target_modules=["q_proj", "k_proj", "v_proj"],
            alora_invocation_tokens=INV, seed=2,
        ),
        "c1": make_random_adapter(model, root / "c1", r=4, target_modules=["q_proj", "v_proj"], seed=3),
        "c2": make_random_adapter(model, root / "c2", r=8, target_modules=["gate_proj", "up_proj"], seed=4),
    }  # fmt: skip
    return dict(model=model, adapters=adapters)


def _jobs(adapters: dict[str, Path]) -> list[object]:
    """The mixed batch: base, a standard LoRA, an aLoRA, a composition, a scaled adapter."""

    def req(name: str, scale: float = 1.0) -> LoRARequest:
        return LoRARequest(name, str(adapters[name]), lora_scale=scale)

    return [None, req("std"), req("alora"), [req("c1"), req("c2", -0.7)], req("std", 0.5)]


def _llm(model: Path, spec: dict | None = None, **kw: object) -> LLM:
    return LLM(
        str(model), dtype="float32", skip_tokenizer_init=True, max_lora_rank=8, max_loras=4,
        enable_lora=True, block_size=4, speculative_config=spec, **kw,
    )  # fmt: skip


def _generate(llm: LLM, jobs: list[object], sp: SamplingParams) -> list:
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(jobs))]
    outs = llm.generate(prompts, sp, lora_request=jobs)
    assert llm.engine.is_idle()  # every KV block, slot and adapter reference given back
    return [o.outputs[0] for o in outs]


def _oracle_llm(
    model: Path,
    jobs: list[object],
    ref: list,
    monkeypatch: pytest.MonkeyPatch,
    k: int = 4,
    **llm_kw: object,
) -> tuple[LLM, OracleProposer]:
    """An engine whose drafts come from an oracle over ``ref`` (the completions of ``jobs``)."""
    oracle = OracleProposer({}, 400)
    monkeypatch.setitem(speculator_mod.PROPOSERS, "ngram", lambda *a: oracle)
    spec = {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}
    llm = _llm(model, spec, **llm_kw)
    for i, out in enumerate(ref):  # the jobs' prompts differ: the prompt is the key
        oracle.reference[tuple(PROMPTS[i % len(PROMPTS)])] = out.token_ids
    return llm, oracle


def _chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularized upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def _fit_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value (cells with an expectation)."""
    o, e = observed.double(), expected.double()
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    return _chi2_sf(stat, int(keep.sum()) - 1)


def _homogeneity_p(table: list[list[int]]) -> float:
    """Pearson's p-value that the two rows of counts come from one distribution."""
    t = torch.tensor(table, dtype=torch.float64)  # [2, cells]
    e = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = float(((t - e) ** 2 / e).sum())
    return _chi2_sf(stat, t.shape[1] - 1)


def test_greedy_with_drafts_equals_decoding_without_them_in_a_mixed_batch(
    family: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = _jobs(family["adapters"])
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    ref = _generate(_llm(family["model"]), jobs, sp)
    llm, oracle = _oracle_llm(family["model"], jobs, ref, monkeypatch)
    stats: list = []
    real_verify = llm.engine._verify

    def spy(*a):  # type: ignore[no-untyped-def]
        out = real_verify(*a)
        stats.append(llm.engine.last_step.spec)
        return out

    monkeypatch.setattr(llm.engine, "_verify", spy)
    control = llm.engine.spec.control  # type: ignore[union-attr]
    keys: list[str] = []
    real_observe = control.observe
    monkeypatch.setattr(
        control, "observe", lambda key, *a: (keys.append(key), real_observe(key, *a))
    )
    got = _generate(llm, jobs, sp)
    # adaptive k judged drafts after a draft kept whole apart from the others
    assert any(key.endswith(KEPT_SUFFIX) for key in keys)
    assert any(not key.endswith(KEPT_SUFFIX) for key in keys)
    for want, have in zip(ref, got, strict=True):
        assert have.token_ids == want.token_ids
        for a, b in zip(have.logprobs, want.logprobs, strict=True):
            assert a.token_id == b.token_id
            assert abs(a.logprob - b.logprob) < LP_TOL
            assert a.top.keys() == b.top.keys()
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    assert 0 < accepted < drafted  # both paths ran: accepted drafts and rolled-back ones
    # fewer steps than tokens: the accepted drafts were tokens decoded for free
    assert len(stats) < N_NEW - 1
    labels = {lbl for s in stats for lbl, *_ in s.by_adapter}
    assert labels == {"base", "std", "alora", "composed"}
    assert len(oracle.finished) == len(jobs)  # every sequence's end reached the proposer


def test_rejected_draft_kv_never_reaches_the_prefix_cache(
    family: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a run full of rejected drafts, a request whose prompt is an earlier prompt plus its
    output takes those blocks from the prefix cache: its output equals an engine's that never
    speculated (a block holding a rejected draft's KV would change it)."""
    jobs = _jobs(family["adapters"])[:2]
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    plain = _llm(family["model"])
    ref = _generate(plain, jobs, sp)
    llm, _ = _oracle_llm(family["model"], jobs, ref, monkeypatch)
    assert [o.token_ids for o in _generate(llm, jobs, sp)] == [o.token_ids for o in ref]
    follow = [{"prompt_token_ids": PROMPTS[i] + ref[i].token_ids} for i in range(len(jobs))]
    sp2 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.generate(follow, sp2, lora_request=jobs)
    want = plain.generate(follow, sp2, lora_request=jobs)
    assert all(g.num_cached_tokens > 0 for g in got)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]


@pytest.mark.parametrize(
    "params",
    [
        dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        dict(logit_bias={7: 3.0, 9: -2.0}),
        dict(min_tokens=8),
        dict(n=2, best_of=3),
    ],
    ids=["penalties", "logit_bias", "min_tokens", "best_of"],
)
def test_sampling_params_behave_as_without_speculation(
    family: dict, monkeypatch: pytest.MonkeyPatch, params: dict
) -> None:
    jobs = _jobs(family["adapters"])[:3]
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, logprobs=2, **params)
    prompts = [{"prompt_token_ids": PROMPTS[i]} for i in range(len(jobs))]
    plain = _llm(family["model"])
    ref = plain.generate(prompts, sp, lora_request=jobs)
    llm, _ = _oracle_llm(family["model"], jobs, [r.outputs[0] for r in ref], monkeypatch)
    got = llm.generate(prompts, sp, lora_request=jobs)
    assert llm.engine.is_idle()
    for g, w in zip(got, ref, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]


def test_stop_token_ends_inside_an_accepted_draft(
    family: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop token met inside a draft ends the sequence there: the draft's later tokens are
    dropped, as if decoded one at a time."""
    jobs = _jobs(family["adapters"])[:2]
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    ref = _generate(_llm(family["model"]), jobs, sp)
    stop = ref[0].token_ids[5]
    sp_stop = SamplingParams(temperature=0, max_tokens=N_NEW, stop_token_ids=[stop])
    want = _generate(_llm(family["model"]), jobs, sp_stop)
    llm, _ = _oracle_llm(family["model"], jobs, ref, monkeypatch, k=6)
    got = _generate(llm, jobs, sp_stop)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert got[0].token_ids[-1] == stop and got[0].finish_reason == "stop"


def test_sampled_tokens_keep_the_target_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling with drafts (the most likely continuation, accepted or not) draws tokens 2 and
    3 with the distribution of sampling without them: a chi-square test of the two samples'
    joint counts (fixed seeds: the test is deterministic; the threshold p > 1e-3)."""
    model = make_random_model(tmp_path / "m", "llama", num_layers=2, seed=11, with_tokenizer=False,
                              vocab_size=64)  # fmt: skip
    prompt = [3, 9, 27, 17, 51]
    sp = SamplingParams(temperature=0.8, top_k=4, max_tokens=3, ignore_eos=True, n=1)
    count = 3000
    greedy = _generate(_llm(model), [None], SamplingParams(temperature=0, max_tokens=3))[0]

    class Likely(Proposer):
        method = "ngram"

        def propose(self, seqs: Seq[Sequence], limits: Seq[int]) -> list[Draft]:
            # the greedy continuation when the sample so far follows it, else a fixed guess
            out = []
            for seq, k in zip(seqs, limits, strict=True):
                done = seq.output_token_ids
                follows = done == greedy.token_ids[: len(done)]
                toks = greedy.token_ids[len(done) : len(done) + k] if follows else [done[-1]] * k
                out.append(Draft(list(toks)) if toks else NO_DRAFT)
            return out

    def sample(spec: dict | None) -> list[tuple[int, ...]]:
        llm = _llm(model, spec, seed=1234)
        prompts = [{"prompt_token_ids": prompt}] * count
        return [tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]

    plain = sample(None)
    monkeypatch.setitem(speculator_mod.PROPOSERS, "ngram", lambda *a: Likely())
    spec = sample({"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    for picks in (lambda t: t[1:], lambda t: t[1], lambda t: t[2]):  # tokens 2-3, 2, 3
        a, b = [picks(t) for t in plain], [picks(t) for t in spec]
        cells = sorted(set(a) | set(b), key=lambda c: -(a.count(c) + b.count(c)))
        big = [c for c in cells if a.count(c) + b.count(c) >= 20]
        table = [[a.count(c) for c in big], [b.count(c) for c in big]]
        rest = [len(a) - sum(table[0]), len(b) - sum(table[1])]
        if min(rest) > 0:
            table[0].append(rest[0])
            table[1].append(rest[1])
        assert len(big) >= 3  # the test has something to compare
        assert _homogeneity_p(table) > 1e-3


def test_verify_keeps_the_target_distribution_for_any_draft_distribution() -> None:
    """Rejection sampling alone, on fixed target rows: whatever the draft (deterministic, or
    drawn from a distribution q far from p), the first token follows p and, given it, the
    second follows p's second row (chi-square goodness of fit, fixed seed)."""
    from loraplex.engine.spec.verify import verify

    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(3, vocab) * 1.5  # [k + 1, V]
    p = logits.softmax(-1)
    q = torch.tensor([[0.05, 0.05, 0.6, 0.1, 0.1, 0.1]] * 2)  # the draft's distribution
    gen = torch.Generator().manual_seed(7)
    trials = 20000
    for probs in (None, q):
        first = torch.zeros(vocab)
        second = torch.zeros(vocab)  # the token after a first token 2 (when there is one)
        for _ in range(trials):
            if probs is None:  # deterministic: the draft's favourite, twice
                draft = [2, 2]
            else:  # drawn from q, as a sampling draft model draws
                draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
            seq = Sequence("r", None, [1, 2], SamplingParams(temperature=1.0, max_tokens=8), 8)
            seq.spec_tokens, seq.spec_probs = list(draft), probs
            verify(seq, logits, gen, 0.0, set())
            first[seq.output_token_ids[0]] += 1
            if seq.output_token_ids[0] == 2 and len(seq.output_token_ids) > 1:
                second[seq.output_token_ids[1]] += 1
        assert _fit_p(first, p[0] * trials) > 1e-3
        n2 = float(second.sum())
        assert n2 > 1000
        assert _fit_p(second, p[1] * n2) > 1e-3


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_each_method_decodes_greedily_as_without_speculation(
    family: dict, method: str, tmp_path: Path
) -> None:
    """Each method's own drafts, base / LoRA / aLoRA / composed rows in one batch, twice
    (suffix drafts the second time from what the first produced, per adapter; the draft model
    is the target's base, so its greedy drafts for base rows are all accepted): the tokens of decoding
    without speculation. (k is fixed: on models this small, adaptive k rightly drafts little,
    see ``tests/engine/spec/test_control.py``.)"""
    spec: dict = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    if method == "draft_model":
        spec["model"] = str(family["model"])
    jobs = _jobs(family["adapters"])
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    ref = _generate(_llm(family["model"]), jobs, sp)
    llm = _llm(family["model"], spec)
    stats: list = []
    llm.engine.spec.verify = _spy(llm.engine.spec.verify, stats)  # type: ignore[union-attr]
    for _ in range(2):
        got = _generate(llm, jobs, sp)
        assert [g.token_ids for g in got] == [w.token_ids for w in ref]
    if method in ("suffix", "draft_model"):  # drafts worth verifying were made and kept
        assert sum(s.num_accepted_tokens for s in stats) > 0
    if method == "draft_model":  # the base drafting for itself: every greedy draft holds
        base = [row for s in stats for row in s.by_adapter if row[0] == "base"]
        assert base and all(tokens == kept for _, _, tokens, kept in base)


def _spy(verify, into: list):  # type: ignore[no-untyped-def]
    """``Speculator.verify`` recording each step's SpecStepStats into ``into``."""

    def spy(*a, **kw):  # type: ignore[no-untyped-def]
        out = verify(*a, **kw)
        into.append(out[-1])
        return out

    return spy


def test_a_draft_lora_drafts_for_its_adapter(family: dict) -> None:
    """``draft_lora_modules``: requests of adapter ``std`` draft with a LoRA of the draft model
    (here the same adapter on the same model, so every greedy draft holds); the others draft
    with the plain draft model; outputs are those of decoding without speculation."""
    ad = family["adapters"]
    spec = {
        "method": "draft_model", "model": str(family["model"]), "num_speculative_tokens": 4,
        "adaptive": False, "draft_lora_modules": {"std": str(ad["std"])},
    }  # fmt: skip
    jobs = _jobs(ad)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    ref = _generate(_llm(family["model"]), jobs, sp)
    llm = _llm(family["model"], spec)
    stats: list = []
    llm.engine.spec.verify = _spy(llm.engine.spec.verify, stats)  # type: ignore[union-attr]
    assert [g.token_ids for g in _generate(llm, jobs, sp)] == [w.token_ids for w in ref]
    rows = {lbl: (0, 0) for lbl in ("std", "alora", "composed")}
    for s in stats:
        for lbl, _, tokens, kept in s.by_adapter:
            if lbl in rows:
                rows[lbl] = (rows[lbl][0] + tokens, rows[lbl][1] + kept)
    assert rows["std"][0] > 0 and rows["std"][0] == rows["std"][1]
    assert rows["composed"][1] < rows["composed"][0]  # the plain draft model misses there


def test_tensor_parallel_speculation_equals_one_process_without_it(tmp_path: Path) -> None:
    """TP=2 with ngram drafts (rows of 1 + k tokens reach every rank) gives TP=1's tokens
    without speculation."""
    model = make_random_model(tmp_path / "m", "llama", num_layers=2, seed=6, with_tokenizer=False,
                              vocab_size=400)  # fmt: skip
    std = make_random_adapter(model, tmp_path / "std", r=8, seed=1)
    jobs = [None, LoRARequest("std", str(std)), None]
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False,
            "prompt_lookup_min": 1, "prompt_lookup_max": 2}  # fmt: skip
    ref = _generate(_llm(model), jobs, sp)
    llm = _llm(model, spec, tensor_parallel_size=2, num_threads=1)
    try:
        got = _generate(llm, jobs, sp)
    finally:
        llm.engine.shutdown()
    assert [g.token_ids for g in got] == [w.token_ids for w in ref]


def test_stop_strings_and_structured_outputs_as_without_speculation(tiny_model: Path) -> None:
    """With a tokenizer: stop strings (text held back, cut at the string) and a JSON-schema
    grammar (drafts the grammar forbids are rejected by the masked row) give the output of
    decoding without drafts."""
    from loraplex.requests import StructuredOutput

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3}  # fmt: skip
    prompts = ["one two three one two three one two", "Answer in JSON please:"]
    plain = LLM(str(tiny_model), dtype="float32")
    spec_llm = LLM(str(tiny_model), dtype="float32", speculative_config=spec)
    stats: list = []
    spec_llm.engine.spec.verify = _spy(spec_llm.engine.spec.verify, stats)  # type: ignore[union-attr]
    base = plain.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=24))[0]
    text = base.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3] if len(text) > 6 else "e"
    cases = [
        SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
        SamplingParams(
            temperature=0, max_tokens=40, structured=StructuredOutput(json_schema=schema)
        ),
    ]
    for prompt, sp in zip(prompts, cases, strict=True):
        want = plain.generate([prompt], sp)[0].outputs[0]
        got = spec_llm.generate([prompt], sp)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids, want.text, want.finish_reason,
        )  # fmt: skip
    assert spec_llm.engine.is_idle()
    assert sum(s.num_draft_tokens for s in stats) > 0  # drafts were verified on this path


@pytest.mark.parametrize("case", ["sliding-window", "layer-groups"])
def test_windowed_and_grouped_kv_verify_exactly(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafted rows on a model with sliding-window layers (the window's masks over the draft's
    decode queries; blocks released out of the window) and with the KV cut into two groups of
    layers (an adapter leaving layer 0 alone shares base-keyed blocks there): the tokens and
    logprobs of decoding without drafts."""
    if case == "sliding-window":
        model = make_random_model(
            tmp_path / "m", "gemma3_text", num_layers=2, seed=8, with_tokenizer=False,
            vocab_size=400, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
        kw: dict = {}
    else:
        model = make_random_model(tmp_path / "m", "llama", num_layers=2, seed=8,
                                  with_tokenizer=False, vocab_size=400)  # fmt: skip
        kw = {"kv_cache_layer_groups": 2}
    upper = make_random_adapter(model, tmp_path / "up", r=8, layers_to_transform=[1], seed=2,
                                target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])  # fmt: skip
    jobs = [None, LoRARequest("up", str(upper)), None]
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=2)
    ref = _generate(_llm(model, **kw), jobs, sp)
    llm, _ = _oracle_llm(model, jobs, ref, monkeypatch, **kw)
    got = _generate(llm, jobs, sp)
    for want, have in zip(ref, got, strict=True):
        assert have.token_ids == want.token_ids
        for a, b in zip(have.logprobs, want.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < LP_TOL
