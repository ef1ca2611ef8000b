"""Several adapters per request, each with a scale (issue 49), served exactly in mixed batches.

``y = W x + sum_i scale_i * (alpha_i / r_i) * B_i A_i x``: adapters of ranks 4, 8 and 32 on
different modules (attention, MLP, and k/o + embed_tokens + lm_head), composed by 2 and 3 with
scales including a negative one and 0, in ONE batch with single-adapter (one of them scaled)
and base rows, on a tiny Llama and a tiny Qwen3-MoE (expert adapters), on the C kernel and the
torch path (Triton under the interpreter: ``tests/lora/interpreted_triton_kernels.py``), equal
to transformers with the components' scaled deltas merged into the weights (each delta from
PEFT's own merge, summed in float64) and, for one composition, to PEFT's
``add_weighted_adapter(combination_type="cat")`` unmerged. TP=2 equals TP=1. The prefix-cache
key is the set of (digest, scale); every component is held while the request runs and let go
when it ends, aborts or fails; bad compositions fail alone with a clear error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.kv.block_pool import composition_namespace, salted_namespace
from loraplex.requests import GenerationRequest
from loraplex.testing import (
    load_merged_reference,
    logprob_gap,
    make_per_expert_adapter,
    make_random_adapter,
    make_random_model,
    reference_greedy,
    reference_greedy_alora,
)
from loraplex.testing.sync import EVENT_TIMEOUT_S
from loraplex.types import (
    BASE_NAMESPACE,
    AdapterComposition,
    AdapterError,
    InvalidRequestError,
    ScaledAdapter,
)
from tests.engine.test_mixed_batch_architectures import SAMPLE_TOL

N_NEW = 5
PROMPTS = [[1, 5, 9, 13, 7, 2, 11], [3, 4, 5, 6], [8, 8, 8, 2, 1, 17, 30, 31], [20, 21, 22]]

# The batch: (adapters with scales; () is the base model). Ranks 4 / 8 / 32 on different
# modules; a scaled single adapter; compositions of 2 and 3 with a negative scale and a 0.
JOBS: list[tuple[tuple[str, float], ...]] = [
    (),
    (("r4", 1.0),),
    (("r8", 0.5),),  # one adapter at lora_scale 0.5
    (("r4", 1.0), ("r32", -0.7)),
    (("r4", 0.6), ("r8", 1.3), ("r32", 0.0)),  # a zero scale: that component adds nothing
    (("r8", -0.5), ("r32", 0.8), ("r4", 1.0)),
]


def _llama_adapters(model: Path, root: Path) -> dict[str, Path]:
    return {
        "r4": make_random_adapter(model, root / "r4", r=4, target_modules=["q_proj", "v_proj"], seed=1),
        "r8": make_random_adapter(
            model, root / "r8", r=8, target_modules=["gate_proj", "up_proj", "down_proj"], seed=2
        ),
        "r32": make_random_adapter(
            model, root / "r32", r=32, lora_alpha=16,
            target_modules=["k_proj", "o_proj", "embed_tokens", "lm_head"], seed=3, std=0.03,
        ),
    }  # fmt: skip


def _moe_adapters(model: Path, root: Path) -> dict[str, Path]:
    """Expert adapters (per-expert layout) of rank 8, attention-only of rank 4, and rank 32 on
    the experts' down projection through PEFT's ``target_parameters`` beside k/o."""
    experts = ["gate_proj", "up_proj", "down_proj"]
    return {
        "r4": make_random_adapter(model, root / "r4", r=4, target_modules=["q_proj", "v_proj"], seed=1),
        "r8": make_per_expert_adapter(model, root / "r8", r=8, target_modules=experts, seed=2),
        "r32": make_random_adapter(
            model, root / "r32", r=32, lora_alpha=16, target_modules=["k_proj", "o_proj"],
            target_parameters=["mlp.experts.down_proj"], seed=3, std=0.03,
        ),
    }  # fmt: skip


class SummedReference:
    """transformers models with the scaled deltas of several adapters merged into the weights:
    each adapter's delta is PEFT's merge minus the base (float64), the scaled deltas are summed
    in float64 and added to the base once, then cast to float32."""

    def __init__(self, model: Path, adapters: dict[str, Path]) -> None:
        self.model = model
        self.base = load_merged_reference(model, None)
        self.base_sd = {k: v.double() for k, v in self.base.state_dict().items()}
        self.deltas = {}
        for name, path in adapters.items():
            merged = load_merged_reference(model, path).state_dict()
            self.deltas[name] = {
                k: merged[k].double() - v for k, v in self.base_sd.items() if k in merged
            }
        self._models: dict[tuple, torch.nn.Module] = {}

    def __call__(self, parts: tuple[tuple[str, float], ...]) -> torch.nn.Module:
        key = tuple(sorted(p for p in parts if p[1] != 0.0))
        if key not in self._models:
            sd = {k: v.clone() for k, v in self.base_sd.items()}
            for name, scale in key:
                for k, d in self.deltas[name].items():
                    sd[k] += scale * d
            m = load_merged_reference(self.model, None)
            m.load_state_dict({k: v.float() for k, v in sd.items()})
            self._models[key] = m.eval()
        return self._models[key]


def _lora(adapters: dict[str, Path], parts: tuple[tuple[str, float], ...]) -> object:
    """What ``LLM.generate`` takes for one prompt: None, one LoRARequest (maybe scaled) or a
    list of them (a composition)."""
    reqs = [LoRARequest(n, str(adapters[n]), lora_scale=s) for n, s in parts]
    return None if not reqs else reqs[0] if len(reqs) == 1 else reqs


def run_jobs(llm: LLM, adapters: dict[str, Path], jobs=JOBS) -> list:
    """Every job in one ``generate`` call (one mixed batch): the completions, job order."""
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=4)
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(jobs))]
    outs = llm.generate(prompts, sp, lora_request=[_lora(adapters, j) for j in jobs])
    assert llm.engine.is_idle()  # every slot, host reference and KV block given back
    return [o.outputs[0] for o in outs]


def check_against(ref: SummedReference, jobs, outs, tol: float = SAMPLE_TOL) -> None:
    for i, (parts, got) in enumerate(zip(jobs, outs, strict=True)):
        want, ref_lp = reference_greedy(ref(parts), PROMPTS[i % len(PROMPTS)], N_NEW)
        assert got.token_ids == want, parts
        worst = logprob_gap(got.logprobs, ref_lp)
        assert worst < tol, (parts, worst)


def _engine(model: Path, backend: str, **kw: object) -> LLM:
    with pytest.MonkeyPatch.context() as mp:  # the backend is chosen once, at start-up
        mp.setenv("LORAPLEX_LORA_CPU_KERNEL", "1" if backend == "cpu-kernel" else "0")
        llm = LLM(
            str(model), max_lora_rank=32, dtype="float32", skip_tokenizer_init=True,
            **{"max_loras": 3, **kw},
        )  # fmt: skip
    assert llm.engine.model.lora is not None
    assert llm.engine.model.lora.ops.name.startswith(backend)
    return llm


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("compose-llama")
    model = make_random_model(root / "model", "llama", num_layers=2, seed=9, with_tokenizer=False)
    adapters = _llama_adapters(model, root)
    return dict(model=model, adapters=adapters, ref=SummedReference(model, adapters))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("compose-moe")
    model = make_random_model(
        root / "model", "qwen3_moe", num_layers=2, seed=9, with_tokenizer=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    )  # fmt: skip
    adapters = _moe_adapters(model, root)
    return dict(model=model, adapters=adapters, ref=SummedReference(model, adapters))


@pytest.fixture(scope="module", params=["cpu-kernel", "torch"])
def llama_llm(request: pytest.FixtureRequest, llama: dict) -> Iterator[LLM]:
    yield _engine(llama["model"], request.param)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("backend", ["cpu-kernel", "torch"])
def test_compositions_in_one_mixed_batch_equal_the_summed_deltas(
    family: str, backend: str, request: pytest.FixtureRequest
) -> None:
    fam = request.getfixturevalue(family)
    llm = _engine(fam["model"], backend)
    outs = run_jobs(llm, fam["adapters"])
    check_against(fam["ref"], JOBS, outs)
    # the compositions really differ from their parts (non-zero B, scales that matter)
    assert outs[3].logprobs[0].top != outs[1].logprobs[0].top
    # the step ran every component from its own slot: three slots, no slot per composition
    assert len(llm.engine.adapters.bank.occupied_slots) == 3


def test_an_unchanged_decode_batch_reuses_its_plan(
    llama: dict, llama_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner plans a step once per distinct batch: decode steps whose sequences, adapters
    and scales are the last step's take the last plan (and head plan) again; a changed batch
    (a sequence done, one joining) gets a new one; the outputs are still the summed deltas'."""
    from loraplex.engine import runner

    built = []

    def counting(*args, **kwargs):
        built.append(runner_plan(*args, **kwargs))
        return built[-1]

    runner_plan = runner.plan_lora_batch
    monkeypatch.setattr(runner, "plan_lora_batch", counting)
    jobs = [JOBS[3], JOBS[5], JOBS[1]]
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=4)
    engine = llama_llm.engine
    for i, parts in enumerate(jobs):
        sp_i = sp if i else dataclasses.replace(sp, max_tokens=2)  # ends early
        engine.add_request(f"memo-{i}", PROMPTS[i], sp_i, llama_llm.adapters_of(
            _lora(llama["adapters"], parts)
        ))  # fmt: skip
    plans = []  # the plan of each step that ran the model
    while engine.has_unfinished_requests():
        before = len(built)
        engine.step()
        memo = engine.runner._plan_memo
        if memo is not None and (len(built) > before or plans):
            plans.append(memo[1])
    assert len(plans) >= N_NEW and len(built) < len(plans)  # decode steps reuse their plan
    assert len({id(p) for p in plans}) == len(built) >= 3  # a new plan for each new batch
    outs = run_jobs(llama_llm, llama["adapters"], jobs)  # reused plans: still exact
    check_against(llama["ref"], jobs, outs)


def test_a_composition_equals_peft_cat_weighted_adapter(llama: dict, llama_llm: LLM) -> None:
    """PEFT's ``add_weighted_adapter(combination_type="cat")`` (ranks 4 + 32 concatenated, the
    weights and each adapter's alpha / r folded into A), run unmerged by PEFT, is the same
    model as the composition."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ad = llama["adapters"]
    base = AutoModelForCausalLM.from_pretrained(str(llama["model"]), dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(ad["r4"]), adapter_name="r4")
    peft.load_adapter(str(ad["r32"]), adapter_name="r32")
    peft.add_weighted_adapter(["r4", "r32"], [1.0, -0.7], "both", combination_type="cat")
    peft.set_adapter("both")
    peft.eval()
    job = (("r4", 1.0), ("r32", -0.7))
    (got,) = run_jobs(llama_llm, ad, [job])
    want, ref_lp = reference_greedy(peft, PROMPTS[0], N_NEW)
    assert got.token_ids == want
    assert logprob_gap(got.logprobs, ref_lp) < SAMPLE_TOL


def test_components_stay_resident_while_a_composition_runs(llama: dict) -> None:
    """Two slots for three adapters: a composition of two holds both while it runs (never
    evicted mid-request), the third adapter's request waits for a slot, and every output is
    exact; then all is given back."""
    llm = _engine(llama["model"], "cpu-kernel", max_loras=2)
    jobs = [(("r4", 1.0), ("r8", -0.5)), (("r32", 1.0),), (("r8", 2.0),), ()]
    outs = run_jobs(llm, llama["adapters"], jobs)
    check_against(llama["ref"], jobs, outs)


def test_abort_and_errors_give_every_component_back(llama: dict, tmp_path: Path) -> None:
    llm = _engine(llama["model"], "cpu-kernel")
    engine, ad = llm.engine, llama["adapters"]
    comp = [LoRARequest("r4", str(ad["r4"])), LoRARequest("r8", str(ad["r8"]), lora_scale=0.3)]
    llm_sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], llm_sp, llm.adapters_of(comp))
    engine.step()
    running = engine.running_sequences()
    assert len(running) == 1 and len(running[0].slots) == 2
    cache = engine.adapters
    digests = [a.ref.sha256 for a in running[0].adapters]
    assert all(cache.request_refs.get(d) for d in digests)  # counted in flight: not evictable
    assert engine.abort_request("a")
    assert engine.is_idle() and not any(cache.request_refs.get(d) for d in digests)
    # a component built for another base model fails that request alone, naming it
    other = make_random_model(tmp_path / "other", "llama", hidden_size=32, with_tokenizer=False)
    wrong = make_random_adapter(other, tmp_path / "wrong", r=4, seed=5)
    bad = [LoRARequest("r4", str(ad["r4"])), LoRARequest("wrong", str(wrong), lora_scale=0.5)]
    with pytest.raises(AdapterError, match="component 'wrong'"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], lora_request=[bad])
    assert engine.is_idle() and not cache.request_refs.get(digests[0])
    # the engine goes on serving compositions
    outs = run_jobs(llm, ad, [JOBS[3]])
    check_against(llama["ref"], [JOBS[3]], outs)


def test_bad_compositions_are_refused_clearly(llama: dict, tmp_path: Path) -> None:
    llm = _engine(llama["model"], "cpu-kernel")
    ad = llama["adapters"]
    r4, r8 = str(ad["r4"]), str(ad["r8"])
    p = [{"prompt_token_ids": PROMPTS[0]}]
    for scale in (float("nan"), float("inf"), 101.0, -1e9, "0.5", True):
        with pytest.raises(InvalidRequestError, match="lora_scale"):
            LoRARequest("r4", r4, lora_scale=scale)  # type: ignore[arg-type]
    five = [LoRARequest(f"x{i}", r4) for i in range(5)]
    with pytest.raises(InvalidRequestError, match="at most 4"):
        llm.generate(p, lora_request=[five])
    with pytest.raises(InvalidRequestError, match="twice"):
        llm.generate(p, lora_request=[[LoRARequest("a", r4), LoRARequest("b", r4)]])
    with pytest.raises(InvalidRequestError, match="empty list"):
        llm.generate(p, lora_request=[[]])
    with pytest.raises(InvalidRequestError, match="not a LoRARequest"):
        llm.generate(p, lora_request=[[LoRARequest("a", r4), "r8"]])
    # the engine checks a composition it is handed too (the server builds them)
    spec = llm.engine.intake.adapter_spec(LoRARequest("r8", r8))
    too_many = object.__new__(AdapterComposition)  # bypasses its own check, as a bug might
    object.__setattr__(too_many, "components", (ScaledAdapter(spec, 1.0),) * 5)
    with pytest.raises(InvalidRequestError, match="1 to 4"):
        llm.engine.add_request("x", PROMPTS[0], None, too_many)
    assert llm.engine.is_idle()


def test_an_activated_lora_composes_from_its_own_activation_point(
    llama: dict, tmp_path: Path
) -> None:
    """An aLoRA in a composition applies from its invocation on, its partner from the first
    token: equal to PEFT's aLoRA (unmerged, ``alora_offsets``) over the base with the partner
    merged; not invoked, it adds nothing (the partner alone); the prefix-cache key carries its
    activation point; in one mixed batch with the plain aLoRA and the partner alone."""
    from peft import PeftModel

    inv = [3, 4]
    model, ad = llama["model"], llama["adapters"]
    al = make_random_adapter(model, tmp_path / "al", r=8, alora_invocation_tokens=inv, seed=11,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    llm = _engine(model, "cpu-kernel")
    mid = [20, 21, 22, 23, 24, *inv, 25, 26, 27]  # activation at position 5
    absent = [20, 21, 22, 23, 24, 25, 26, 27]
    comp = [LoRARequest("al", str(al)), LoRARequest("r8", str(ad["r8"]))]
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=4)
    outs = llm.generate(
        [{"prompt_token_ids": mid}, {"prompt_token_ids": absent}, {"prompt_token_ids": mid},
         {"prompt_token_ids": absent}],
        sp, lora_request=[comp, comp, comp[0], comp[1]],
    )  # fmt: skip
    assert llm.engine.is_idle()
    ref = PeftModel.from_pretrained(load_merged_reference(model, ad["r8"]), str(al)).eval()
    want, ref_lp, _ = reference_greedy_alora(ref, mid, N_NEW, 5)
    got = outs[0].outputs[0]
    assert got.token_ids == want
    assert logprob_gap(got.logprobs, ref_lp) < SAMPLE_TOL
    # not invoked: the partner alone (the same tokens and logprobs as requesting it alone)
    assert outs[1].outputs[0].token_ids == outs[3].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids != got.token_ids  # the partner really contributes

    def seq_of(lora: object, prompt: list[int]):  # type: ignore[no-untyped-def]
        prepared = llm.engine.prepare_request(
            GenerationRequest("k", prompt, adapter=llm.adapters_of(lora))  # type: ignore[arg-type]
        )
        try:
            s = prepared.request.seqs[0]
            return s.namespace, s.component_starts, s.lora_start
        finally:
            llm.engine.discard_prepared(prepared)

    ns_mid, starts, first = seq_of(comp, mid)
    assert starts == (5, 0) and first == 0
    moved = [20, 21, *inv, 22, 23, 24, 25, 26, 27]  # the same adapters, activated elsewhere
    assert seq_of(comp, moved)[0] != ns_mid
    ns_absent, starts, _ = seq_of(comp, absent)
    assert starts == (None, 0) and ns_absent == seq_of([comp[1]], absent)[0]


def test_prefix_cache_key_is_the_set_of_digests_and_scales(llama: dict) -> None:
    llm = _engine(llama["model"], "cpu-kernel")
    ad = llama["adapters"]

    def namespace(lora: object, salt: str | None = None) -> bytes:
        if isinstance(lora, list):
            lora = llm.adapters_of(lora)
        prepared = llm.engine.prepare_request(
            GenerationRequest("k", PROMPTS[0], adapter=lora, cache_salt=salt)  # type: ignore[arg-type]
        )
        try:
            return prepared.request.seqs[0].namespace
        finally:
            llm.engine.discard_prepared(prepared)

    def lr(name: str, scale: float = 1.0) -> LoRARequest:
        return LoRARequest(name, str(ad[name]), lora_scale=scale)

    plain = namespace(lr("r4"))
    assert plain == llm.engine.intake.adapter_spec(lr("r4")).ref.namespace
    assert namespace(lr("r4", 0.5)) not in (plain, namespace(lr("r4", 0.7)))
    assert namespace([lr("r4"), lr("r8", 0.5)]) == namespace([lr("r8", 0.5), lr("r4")])
    assert namespace([lr("r4"), lr("r8", 0.5)]) != namespace([lr("r4"), lr("r8", 0.25)])
    assert namespace([lr("r4"), lr("r8", 0.5)]) != namespace([lr("r4"), lr("r32", 0.5)])
    assert namespace([lr("r4")]) == plain  # a composition of one at 1.0 is the adapter
    assert namespace([lr("r4"), lr("r8", 0.0)]) == plain  # zero scales leave the key
    assert namespace([lr("r4", 0.0), lr("r8", 0.0)]) == BASE_NAMESPACE
    assert namespace(lr("r4", 0.0)) == namespace(None) == BASE_NAMESPACE
    salted = namespace([lr("r4"), lr("r8", 0.5)], salt="tenant-a")
    assert salted == salted_namespace(namespace([lr("r4"), lr("r8", 0.5)]), "tenant-a")
    assert salted != namespace([lr("r4"), lr("r8", 0.5)], salt="tenant-b")
    d4 = llm.engine.intake.adapter_spec(lr("r4")).sha256
    assert composition_namespace([(d4, 1.0)]) == bytes.fromhex(d4)
    # every scale 0: the base model ran, and the output says so (the composition names them)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), [[lr("r4", 0.0), lr("r8", 0.0)]])
    assert out[0].adapter is None
    half = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), [[lr("r4", 0.0), lr("r8", 0.5)]])
    assert half[0].adapter is not None and half[0].adapter.name == "r8"  # the first applied
    assert llm.engine.is_idle()


def test_prefix_cache_hits_only_within_one_composition(llama: dict) -> None:
    """The same prompt twice under one composition hits the prefix cache; under the same
    adapters at another scale it does not (and its output is still exact)."""
    llm = _engine(llama["model"], "cpu-kernel", block_size=4)
    ad = llama["adapters"]
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=2)
    prompt = [{"prompt_token_ids": list(range(3, 15))}]

    def cached(scale: float) -> int:
        comp = [
            LoRARequest("r4", str(ad["r4"])),
            LoRARequest("r8", str(ad["r8"]), lora_scale=scale),
        ]
        (out,) = llm.generate(prompt, sp, lora_request=[comp])
        return out.num_cached_tokens

    assert cached(0.5) == 0
    assert cached(0.5) == 8  # two full blocks of the first run
    assert cached(-0.5) == 0


@pytest.mark.parametrize(
    ("family", "sharded"), [("llama", False), ("llama", True), ("qwen3_moe", False)]
)
def test_compositions_under_tensor_parallelism_equal_one_device(
    family: str, sharded: bool, request: pytest.FixtureRequest
) -> None:
    """TP=2 (gloo, one worker process; ``--fully-sharded-loras`` too): the same greedy tokens
    and logprobs as one device for the whole mixed batch, and equal to the summed deltas."""
    from tests.engine.test_tensor_parallel import assert_same_outputs

    fam = request.getfixturevalue(family)
    runs = []
    for tp in (1, 2):
        llm = LLM(
            str(fam["model"]), tensor_parallel_size=tp, dtype="float32", num_threads=1,
            max_loras=3, max_lora_rank=32, skip_tokenizer_init=True,
            fully_sharded_loras=sharded and tp > 1,
        )  # fmt: skip
        try:
            runs.append(run_jobs(llm, fam["adapters"]))
        finally:
            llm.engine.shutdown()
    assert_same_outputs(runs[0], runs[1])
    check_against(fam["ref"], JOBS, runs[1])


def test_the_merger_never_takes_a_composition_for_its_lone_adapter(llama: dict) -> None:
    """dLoRA merging (``lora_merge_after_steps``): steps of only a composition, or only one
    adapter at a scale, never merge (the merged weights would hold the adapter at 1.0), and
    stay exact; the adapter alone at 1.0 still merges."""
    llm = _engine(llama["model"], "cpu-kernel", lora_merge_after_steps=1)
    ad, eng = llama["adapters"], llm.engine
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=4)
    for job in ((("r4", 1.0), ("r8", 0.5)), (("r4", 0.5),)):
        prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
        eng_outs: list = []
        for i, prompt in enumerate(prompts):
            eng.add_request(
                f"{job}-{i}",
                prompt["prompt_token_ids"],
                sp,
                llm.adapters_of(list(_as_list(ad, job))),
            )
        while eng.has_unfinished_requests():
            eng_outs += [o for o in eng.step() if o.finished]
            assert eng.runner.merged_slot is None and eng.merger.merges == 0
        eng_outs.sort(key=lambda o: o.request_id)
        check_against(llama["ref"], [job, job], [o.outputs[0] for o in eng_outs])
    lone = llm.adapters_of([LoRARequest("r4", str(ad["r4"]))])
    for i in range(2):
        eng.add_request(f"lone-{i}", PROMPTS[0], sp, lone)
    outs = []
    while eng.has_unfinished_requests():  # the build runs on a thread: wait on it, not the clock
        outs += [o for o in eng.step() if o.finished]
        assert eng.merger.wait_build(EVENT_TIMEOUT_S)
    assert eng.merger.merges == 1  # a composition of one at 1.0 is the adapter: it may merge
    outs.sort(key=lambda o: o.request_id)
    check_against(llama["ref"], [(("r4", 1.0),)], [outs[0].outputs[0]])


def _as_list(adapters: dict[str, Path], parts: tuple[tuple[str, float], ...]) -> list[LoRARequest]:
    return [LoRARequest(n, str(adapters[n]), lora_scale=s) for n, s in parts]
