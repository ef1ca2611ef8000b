"""Triton LoRA kernels vs the torch reference, run by Triton's CPU interpreter (no GPU needed).

Not collected by the suite itself: Triton reads ``TRITON_INTERPRET`` when it is imported, so
``tests/lora/test_triton_kernels.py`` runs this file in its own pytest process with the variable set,
and no other test of the run sees it.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/lora/test_triton_kernels.py"
pytest.importorskip("triton")

from loraplex.lora.ops import TorchReferenceOps  # noqa: E402
from loraplex.lora.plan import plan_lora_batch  # noqa: E402
from loraplex.lora.triton_ops import TritonLoRAOps  # noqa: E402


def _seed(*parts: object) -> int:
    """A seed that is the same in every process (``hash()`` of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


CASES = {
    # name: (num_tokens, segments (tok_start, tok_end, row_start, row_end), capacity rows)
    "decode": (6, [(0, 1, 0, 8), (1, 2, 8, 24), (2, 3, 24, 28), (4, 5, 40, 104)], 128),
    "prefill": (70, [(3, 40, 0, 16), (40, 41, 16, 17), (45, 70, 64, 128)], 128),
    "base-only": (4, [], 32),
    "empty-segments": (8, [(0, 0, 0, 8), (2, 6, 8, 16), (6, 6, 16, 24)], 32),
    # one adapter's rows twice, base tokens between (an aLoRA's rows before its activation)
    "repeated-rows": (14, [(0, 3, 0, 8), (5, 9, 0, 8), (9, 12, 8, 24)], 32),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d_in,d_out", [(32, 48), (80, 20)])
def test_triton_matches_reference(case: str, dtype: torch.dtype, d_in: int, d_out: int) -> None:
    T, segs, cap = CASES[case]
    g = torch.Generator().manual_seed(_seed(case, d_in))
    x = torch.randn(T, d_in, generator=g).to(dtype)
    a = (0.3 * torch.randn(cap, d_in, generator=g)).to(dtype)
    bt = (0.3 * torch.randn(cap, d_out, generator=g)).to(dtype)
    base = torch.randn(T, 2 * d_out, generator=g).to(dtype)
    plan = plan_lora_batch(T, segs, dtype, "cpu")
    ops, ref = TritonLoRAOps(), TorchReferenceOps()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.03)
    torch.testing.assert_close(
        ops.shrink(x, a, plan).float(), ref.shrink(x, a, plan).float(), **tol
    )
    got, want = base.clone(), base.clone()
    ops.apply(x, a, bt, got[:, d_out:], plan)  # a column slice of a wider output, as in the model
    ref.apply(x, a, bt, want[:, d_out:], plan)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert torch.equal(got[:, :d_out], base[:, :d_out])  # the other columns are untouched
    untouched = [t for t in range(T) if not any(s <= t < e for s, e, _, _ in segs)]
    assert torch.equal(got[untouched], base[untouched])  # base-model tokens get no delta


def test_segment_table_is_built_once_per_plan() -> None:
    ops = TritonLoRAOps()
    plan = plan_lora_batch(2, [(0, 2, 0, 4)], torch.float32, "cpu")
    first = ops._segments(plan, torch.device("cpu"))[0]
    assert ops._segments(plan, torch.device("cpu"))[0] is first
    other = plan_lora_batch(2, [(0, 1, 0, 4)], torch.float32, "cpu")
    assert ops._segments(other, torch.device("cpu"))[0] is not first


def test_startup_self_check_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.lora import backends as ops_mod

    cpu = torch.device("cpu")
    assert isinstance(ops_mod._create_triton_ops(cpu), TritonLoRAOps)  # passes its self-check

    def broken(self, x, a, bt, out, plan) -> None:
        out.add_(1.0)  # wrong numbers: must not be served

    monkeypatch.setattr(TritonLoRAOps, "apply", broken)
    with pytest.warns(UserWarning, match="using the torch path"):
        fallback = ops_mod._create_triton_ops(cpu)
    assert not isinstance(fallback, TritonLoRAOps)
    # on CPU the default choice never picks Triton
    assert ops_mod.select_lora_ops(cpu).name in ("cpu-kernel", "torch-upcast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_embedding_lora_gathers_a_by_token_id(dtype: torch.dtype) -> None:
    """``embed``: the expand kernel reading y's rows at the token ids of a transposed table."""
    vocab, d, cap = 53, 40, 128
    T, segs, _ = CASES["prefill"]
    g = torch.Generator().manual_seed(_seed("embed", str(dtype)))
    ids = torch.randint(0, vocab, (T,), generator=g)  # [T]
    at = (0.3 * torch.randn(vocab, cap, generator=g)).to(dtype)  # [vocab, capacity]
    bt = (0.3 * torch.randn(cap, d, generator=g)).to(dtype)  # [capacity, d]
    base = torch.randn(T, d, generator=g).to(dtype)
    plan = plan_lora_batch(T, segs, dtype, "cpu")
    got, want = base.clone(), base.clone()
    TritonLoRAOps().embed(ids, at, bt, got, plan)
    TorchReferenceOps().embed(ids, at, bt, want, plan)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.03)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    untouched = [t for t in range(T) if not any(s <= t < e for s, e, _, _ in segs)]
    assert torch.equal(got[untouched], base[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lm_head_lora_over_the_logits_rows(dtype: torch.dtype) -> None:
    """The head's LoRA is ``apply`` over ``plan_rows`` of the step: a vocabulary-wide output in
    float32 (the logits) from rows of the model's dtype."""
    from loraplex.lora.plan import plan_rows

    vocab, d, cap = 300, 32, 128
    T, segs, _ = CASES["prefill"]
    g = torch.Generator().manual_seed(_seed("head", str(dtype)))
    rows = [0, 3, 39, 40, 44, 45, 69]
    x = torch.randn(len(rows), d, generator=g).to(dtype)
    a = (0.3 * torch.randn(cap, d, generator=g)).to(dtype)
    bt = (0.3 * torch.randn(cap, vocab, generator=g)).to(dtype)
    base = torch.randn(len(rows), vocab, generator=g)  # float32 logits
    plan = plan_rows(plan_lora_batch(T, segs, dtype, "cpu"), rows)
    got, want = base.clone(), base.clone()
    TritonLoRAOps().apply(x, a, bt, got, plan)
    TorchReferenceOps().apply(x, a, bt, want, plan)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.03)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[[0, 4]], base[[0, 4]])  # base rows (tokens 0 and 44)


def _families() -> dict[str, dict]:
    """The dense families and the MoE ones (their experts' grouped GEMMs on Triton too)."""
    from tests.engine.test_mixed_batch_architectures import FAMILIES
    from tests.engine.test_moe_experts import FAMILIES as MOE

    moe = {  # the interpreter is slow: the two MoE architectures, not every MoE variant
        n: {k: v for k, v in MOE[n].items() if k != "experts"} for n in ("qwen3_moe", "mixtral")
    }
    return {**FAMILIES, **moe}


def _family_params() -> list[str]:
    return list(_families())


@pytest.mark.parametrize("family", _family_params())
def test_every_architecture_serves_a_mixed_batch_on_the_triton_path(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each family of the mixed-batch and MoE tests, its LoRA (and a MoE's grouped expert
    GEMMs) run by the Triton kernels: the base, an
    adapter on every linear projection and one on lm_head + embed_tokens in one batch equal
    transformers + PEFT merged (greedy tokens and logprobs, float32)."""
    from loraplex import LLM, LoRARequest, SamplingParams
    from loraplex.model.moe_triton import TritonGroupedExperts
    from loraplex.testing import (
        load_merged_reference,
        logprob_gap,
        make_random_adapter,
        make_random_model,
        reference_greedy,
    )
    from tests.engine.test_mixed_batch_architectures import PROMPTS, SAMPLE_TOL

    root = tmp_path_factory.mktemp(family)
    spec = dict(_families()[family])
    params = spec.pop("proj", {}).get("params")  # packed experts PEFT reaches as parameters
    model = make_random_model(root / "model", spec.pop("arch"), num_layers=2, seed=9, **spec)
    adapters = {  # all-linear (and the packed experts where only target_parameters reach them)
        "linear": make_random_adapter(
            model, root / "linear", r=8, target_parameters=params, seed=1
        ),
        "vocab": make_random_adapter(
            model, root / "vocab", r=4, target_modules=["lm_head", "embed_tokens"], std=0.1, seed=2
        ),
    }
    # rank 16: PEFT's all-linear on a MoE base doubles the packed gate_up rank (rank_pattern)
    llm = LLM(str(model), max_loras=2, max_lora_rank=16, dtype="float32")
    assert llm.engine.model.lora is not None
    llm.engine.model.lora.ops = TritonLoRAOps()  # what a CUDA engine picks at start-up
    if hasattr(llm.engine.model, "moe"):  # the experts' GEMMs too (an expert LoRA: "linear")
        llm.engine.model.use_grouped_experts(TritonGroupedExperts())
    names = [None, "linear", "vocab"]
    loras = [LoRARequest(n, str(adapters[n])) if n else None for n in names]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS[: len(names)], sp, lora_request=loras)
    tok = llm.get_tokenizer()
    for name, prompt, out in zip(names, PROMPTS, outs, strict=False):
        ref = load_merged_reference(model, adapters.get(name) if name else None)
        want, ref_lp = reference_greedy(ref, tok(prompt).input_ids, 4)
        got = out.outputs[0]
        assert got.token_ids == want, (family, name)
        worst = logprob_gap(got.logprobs, ref_lp)
        assert worst < SAMPLE_TOL, (family, name, worst)


def test_activated_lora_in_a_mixed_batch_on_the_triton_path(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """An aLoRA beside a standard LoRA and the base, its rows before the activation point base
    rows inside its part of the step: equal to PEFT's unmerged forward with ``alora_offsets``."""
    from loraplex import LLM, LoRARequest, SamplingParams
    from loraplex.lora.peft.activation import activation_start
    from loraplex.testing import (
        load_merged_reference,
        logprob_gap,
        make_random_adapter,
        make_random_model,
        reference_greedy,
        reference_greedy_alora,
    )
    from tests.engine.test_mixed_batch_architectures import SAMPLE_TOL

    root = tmp_path_factory.mktemp("alora-triton")
    model = make_random_model(root / "model", "llama", num_layers=2, seed=9)
    inv = [21, 22]
    al = make_random_adapter(model, root / "al", r=8, seed=1, alora_invocation_tokens=inv)
    std = make_random_adapter(model, root / "std", r=4, seed=2)
    llm = LLM(str(model), max_loras=2, max_lora_rank=8, dtype="float32", block_size=4)
    assert llm.engine.model.lora is not None
    llm.engine.model.lora.ops = TritonLoRAOps()
    ctx = [40 + 7 * i % 300 for i in range(14)]
    jobs = [("al", ctx[:6] + inv + ctx[6:]), ("al", ctx[:9] + inv + ctx[9:12]), ("al", ctx),
            ("std", ctx[:10]), (None, ctx[:8])]  # fmt: skip
    loras = [LoRARequest(n, str({"al": al, "std": std}[n])) if n else None for n, _ in jobs]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids in jobs], sp, loras)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32), str(al)
    ).eval()
    for (name, ids), out in zip(jobs, outs, strict=True):
        if name == "al":
            want, ref_lp, _ = reference_greedy_alora(peft, ids, 4, activation_start(ids, inv))
        else:
            ref = load_merged_reference(model, std if name else None)
            want, ref_lp = reference_greedy(ref, ids, 4)
        got = out.outputs[0]
        assert got.token_ids == want, (name, ids)
        worst = logprob_gap(got.logprobs, ref_lp)
        assert worst < SAMPLE_TOL, (name, worst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_adds_each_composed_adapter_with_its_weight(dtype: torch.dtype) -> None:
    """A weighted plan in layers (composed requests, a scaled adapter, base tokens): the
    expand kernel scales each segment and runs one layer per launch."""
    from tests.lora.test_composed_ops import CAP, T, composed_plan, explicit

    g = torch.Generator().manual_seed(_seed("composed", dtype))
    x = torch.randn(T, 40, generator=g).to(dtype)
    a = (0.3 * torch.randn(CAP, 40, generator=g)).to(dtype)
    bt = (0.3 * torch.randn(CAP, 24, generator=g)).to(dtype)
    at = (0.3 * torch.randn(30, CAP, generator=g)).to(dtype)
    ids = torch.randint(0, 30, (T,), generator=g)
    base = torch.randn(T, 24, generator=g).to(dtype)
    plan = composed_plan(dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.03)
    got = base.clone()
    TritonLoRAOps().apply(x, a, bt, got, plan)
    torch.testing.assert_close(got.double(), explicit(x, a, bt, base), **tol)
    got = base.clone()
    TritonLoRAOps().embed(ids, at, bt, got, plan)
    onehot = torch.eye(30, dtype=torch.float64)[ids]
    want = explicit(onehot, at.T.contiguous(), bt, base)
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_compositions_in_a_mixed_batch_on_the_triton_path(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``tests/engine/test_composition.py``'s batch (ranks 4/8/32 on different modules,
    compositions of 2 and 3 with a negative and a zero scale, a scaled adapter, the base) on
    the Triton kernels (a MoE's grouped experts too): equal to the summed deltas."""
    from loraplex import LLM
    from loraplex.model.moe_triton import TritonGroupedExperts
    from loraplex.testing import make_random_model
    from tests.engine.test_composition import (
        JOBS,
        SummedReference,
        _llama_adapters,
        _moe_adapters,
        check_against,
        run_jobs,
    )

    root = tmp_path_factory.mktemp(f"compose-{family}")
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    model = make_random_model(
        root / "model", family, num_layers=2, seed=9, with_tokenizer=False,
        **(moe if family == "qwen3_moe" else {}),
    )  # fmt: skip
    adapters = (_moe_adapters if family == "qwen3_moe" else _llama_adapters)(model, root)
    llm = LLM(str(model), max_loras=3, max_lora_rank=32, dtype="float32", skip_tokenizer_init=True)
    assert llm.engine.model.lora is not None
    llm.engine.model.lora.ops = TritonLoRAOps()
    if hasattr(llm.engine.model, "moe"):
        llm.engine.model.use_grouped_experts(TritonGroupedExperts())
    outs = run_jobs(llm, adapters)
    check_against(SummedReference(model, adapters), JOBS, outs)
