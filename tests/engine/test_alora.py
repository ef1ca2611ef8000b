"""Activated LoRA (aLoRA) served exactly, and the KV it shares.

PEFT's semantics are the reference (``peft/tuners/lora/variants.py``): an aLoRA adapter applies
from the first token of the *last* occurrence of its invocation sequence in the prompt onward
(generated tokens included); a prompt without it runs the base model throughout. The references
are PEFT's unmerged forward with ``alora_offsets`` passed explicitly.

Exactness: tiny random Llama, Qwen3, Gemma 3 and Qwen3.5 (hybrid) models; three aLoRA adapters (different ranks
and targets, one with LoRA on the LM head, two sharing one invocation sequence) in one mixed
batch with base rows and a standard LoRA, with the invocation at the start, in the middle, on a
block boundary, twice (the last one counts) and absent; once with whole-prompt prefills and once
with 8-token prefill chunks (the activation point then falls inside chunks, the invocation spans
two), on the C LoRA kernel and on the torch path. Sample and prompt logprobs within the float32
tolerances of the other exactness tests.

Sharing: a block wholly before the activation point is keyed as a base block (salted by the
tenant), so the base model and every aLoRA request on one context share it; the block holding
the activation point and every later one are keyed by the adapter's digest and the activation
point. A standard LoRA on the same context shares nothing.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.sequence import Sequence
from loraplex.kv.block_pool import hash_prefix_blocks
from loraplex.lora.peft.activation import activation_start
from loraplex.requests import GenerationRequest
from loraplex.testing import (
    ALL_PROJ,
    ATTN_PROJ,
    MLP_PROJ,
    load_merged_reference,
    logprob_gap,
    make_random_adapter,
    make_random_model,
    reference_greedy,
    reference_greedy_alora,
)

INV_A = [21, 22, 23]  # shared by two adapters
INV_B = [31, 32]
ADAPTERS: dict[str, dict] = {
    "al_all_r8": dict(r=8, lora_alpha=16, target_modules=ALL_PROJ, alora=INV_A, seed=1),
    "al_attn_head_r4": dict(
        r=4, lora_alpha=8, target_modules=[*ATTN_PROJ, "lm_head"], alora=INV_A, std=0.1, seed=2
    ),
    "al_mlp_r16": dict(r=16, lora_alpha=8, target_modules=MLP_PROJ, alora=INV_B, seed=3),
    "std_r8": dict(r=8, lora_alpha=16, target_modules=ALL_PROJ, seed=4),
}
FAMILIES: dict[str, dict] = {
    "llama": dict(arch="llama", tie_word_embeddings=False),
    "qwen3": dict(arch="qwen3", head_dim=24, tie_word_embeddings=True),
    "gemma3_text": dict(
        arch="gemma3_text", sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
    # a hybrid: the linear-attention layer's state is keyed like KV (base-aligned before the
    # activation point)
    "qwen3_5": dict(arch="qwen3_5"),
}
BLOCK = 4
N_NEW = 4
SAMPLE_TOL = 2e-4  # float32 logprobs, as the other mixed-batch exactness tests
PROMPT_TOL = 1e-4


def _context(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(40, 380) for _ in range(n)]


def prompts_for(inv: list[int]) -> dict[str, list[int]]:
    """Prompts placing ``inv`` at the start, mid-block, on a block boundary, twice, nowhere."""
    c = _context(7, 24)
    return {
        "start": inv + c[:9],
        "middle": c[:6] + inv + c[6:15],  # activation inside block 1
        "boundary": c[:8] + inv + c[8:12],  # activation on the first token of block 2
        "twice": c[:3] + inv + c[3:10] + inv + c[10:13],
        "absent": c[:17],
    }


def _adapter(model: Path, root: Path, name: str) -> Path:
    kw = dict(ADAPTERS[name])
    inv = kw.pop("alora", None)
    return make_random_adapter(model, root / name, alora_invocation_tokens=inv, **kw)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(request.param)
    spec = dict(FAMILIES[request.param])
    model = make_random_model(root / "model", spec.pop("arch"), num_layers=2, seed=5, **spec)
    adapters = {n: _adapter(model, root, n) for n in ADAPTERS}
    refs = {None: load_merged_reference(model, None), "std_r8": None}
    refs["std_r8"] = load_merged_reference(model, adapters["std_r8"])
    for name, path in adapters.items():
        if ADAPTERS[name].get("alora"):
            base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
            refs[name] = PeftModel.from_pretrained(base, str(path)).eval()
    return {"model": model, "adapters": adapters, "refs": refs}


@pytest.fixture(scope="module", params=["cpu-kernel", "torch"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def _llm(family: dict, backend: str, **kw: object) -> LLM:
    with pytest.MonkeyPatch.context() as mp:  # the backend is chosen once, at start-up
        mp.setenv("LORAPLEX_LORA_CPU_KERNEL", "1" if backend == "cpu-kernel" else "0")
        llm = LLM(
            str(family["model"]),
            max_loras=len(ADAPTERS),
            max_lora_rank=16,
            dtype="float32",
            block_size=BLOCK,
            **kw,
        )
    assert llm.engine.model.lora is not None
    assert llm.engine.model.lora.ops.name.startswith(backend)
    return llm


def _reference(family: dict, name: str | None, ids: list[int]) -> tuple[list[int], ...]:
    """(tokens, sample logprobs [n, V], prompt logprobs [len - 1, V]) of PEFT / transformers."""
    model = family["refs"][name]
    inv = ADAPTERS[name].get("alora") if name else None
    if inv is None:
        tokens, lp = reference_greedy(model, ids, N_NEW)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return tokens, lp, torch.log_softmax(logits[:-1], dim=-1)
    return reference_greedy_alora(model, ids, N_NEW, activation_start(ids, inv))


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prefill", "chunks-of-8"])
def test_mixed_batch_equals_peft(family: dict, backend: str, chunk: int | None) -> None:
    kw = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=8)
    llm = _llm(family, backend, **kw)
    jobs: list[tuple[str | None, str, list[int]]] = [(None, "base", _context(7, 24)[:13])]
    for name, spec in ADAPTERS.items():
        inv = spec.get("alora") or INV_A  # the standard LoRA gets a prompt with INV_A in it
        cases = prompts_for(inv)
        keep = cases if spec.get("alora") else {"middle": cases["middle"]}
        jobs += [(name, case, ids) for case, ids in keep.items()]
    sp = SamplingParams(
        temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    loras = [LoRARequest(n, str(family["adapters"][n])) if n else None for n, _, _ in jobs]
    outs = llm.generate([{"prompt_token_ids": ids} for _, _, ids in jobs], sp, loras)
    for (name, case, ids), out in zip(jobs, outs, strict=True):
        want, ref_lp, ref_prompt = _reference(family, name, ids)
        got = out.outputs[0]
        where = f"{name} / {case}"
        assert got.token_ids == want, where
        worst = logprob_gap(got.logprobs, ref_lp)
        assert worst < SAMPLE_TOL, f"{where}: logprob diff {worst}"
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        worst = max(
            abs(val - float(ref_prompt[i, tid]))
            for i, entry in enumerate(out.prompt_logprobs[1:])
            for tid, val in entry.items()  # type: ignore[union-attr]
        )
        assert worst < PROMPT_TOL, f"{where}: prompt logprob diff {worst}"
    # the adapters really act from their activation point (not silent no-ops, not earlier)
    base_run = llm.generate(
        [{"prompt_token_ids": ids} for _, _, ids in jobs], sp, [None] * len(jobs)
    )
    for (name, case, ids), out, base in zip(jobs, outs, base_run, strict=True):
        if name is None:
            continue
        start = (
            0 if not ADAPTERS[name].get("alora") else activation_start(ids, ADAPTERS[name]["alora"])
        )
        if start is None:
            assert out.outputs[0].token_ids == base.outputs[0].token_ids, (name, case)
            continue
        got_p, base_p = out.prompt_logprobs, base.prompt_logprobs
        assert got_p is not None and base_p is not None
        # positions before the activation point see only base KV and base rows
        for p in range(1, start + 1):
            tok = ids[p]
            assert got_p[p][tok] == pytest.approx(base_p[p][tok], abs=PROMPT_TOL), (name, case, p)
    assert llm.engine.is_idle()


def test_alora_is_never_merged(family: dict) -> None:
    llm = _llm(family, "torch", lora_merge_after_steps=1)
    ids = prompts_for(INV_A)["middle"]
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    lr = LoRARequest("al_all_r8", str(family["adapters"]["al_all_r8"]))
    out = llm.generate({"prompt_token_ids": ids}, sp, lr)[0]
    assert out.outputs[0].token_ids == _reference(family, "al_all_r8", ids)[0]
    assert llm.engine.runner.merged_slot is None


# -- the keys of shared blocks -------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("llama-sharing")
    model = make_random_model(root / "model", "llama", num_layers=2, seed=5)
    adapters = {n: _adapter(model, root, n) for n in ADAPTERS}
    return {"model": model, "adapters": adapters}


def _one(llm: LLM, ids: list[int], name: str | None, adapters: dict) -> object:
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    lr = LoRARequest(name, str(adapters[name])) if name else None
    return llm.generate({"prompt_token_ids": ids}, sp, lr)[0]


def test_blocks_before_the_activation_point_are_shared_with_the_base(llama: dict) -> None:
    llm = LLM(str(llama["model"]), max_loras=4, max_lora_rank=16, dtype="float32", block_size=BLOCK)
    ads = llama["adapters"]
    ctx = _context(11, 26)  # 6 full blocks and 2 tokens
    question = [50, 51, 52]
    base = _one(llm, [*ctx, 60, 61], None, ads)
    assert base.num_cached_tokens == 0
    # the activation point is at 26: the 6 blocks wholly before it come from the base's run
    a1 = _one(llm, ctx + INV_A + question, "al_all_r8", ads)
    assert a1.num_cached_tokens == 24
    a2 = _one(llm, ctx + INV_A + question, "al_attn_head_r4", ads)
    assert a2.num_cached_tokens == 24  # another aLoRA: the same base blocks, not a1's own
    again = _one(llm, ctx + INV_A + question, "al_all_r8", ads)
    n = len(ctx) + len(INV_A) + len(question)
    assert again.num_cached_tokens == (n - 1) // BLOCK * BLOCK  # its own adapted blocks too
    assert again.outputs[0].token_ids == a1.outputs[0].token_ids
    # a standard LoRA shapes every block from the first token: nothing to share
    assert _one(llm, ctx + INV_A + question, "std_r8", ads).num_cached_tokens == 0
    # an aLoRA whose invocation is absent runs the base model: base blocks, base tokens
    absent = _one(llm, [*ctx, 60, 61], "al_mlp_r16", ads)
    assert absent.num_cached_tokens == 24
    assert absent.outputs[0].token_ids == base.outputs[0].token_ids
    # the base model reads what an aLoRA request published before its activation point
    ctx2 = _context(12, 17)
    first = _one(llm, ctx2 + INV_B + question, "al_mlp_r16", ads)
    assert first.num_cached_tokens == 0
    assert _one(llm, [*ctx2, 60], None, ads).num_cached_tokens == 16
    assert llm.engine.is_idle()


def _seq(
    llm: LLM, ids: list[int], adapter: str | None, adapters: dict, salt: str | None
) -> Sequence:
    lr = LoRARequest(adapter, str(adapters[adapter])) if adapter else None
    req = GenerationRequest("x", ids, SamplingParams(max_tokens=1), adapter=lr, cache_salt=salt)
    prepared = llm.engine.prepare_request(req)
    seq = prepared.request.seqs[0]
    llm.engine.discard_prepared(prepared)
    return seq


def test_block_keys_follow_what_shaped_the_block(llama: dict) -> None:
    """Base-aligned keys before the activation block, adapter-and-point keys from it on, the
    tenant's salt on every block."""
    llm = LLM(str(llama["model"]), max_loras=4, max_lora_rank=16, dtype="float32", block_size=BLOCK)
    ads = llama["adapters"]
    ctx = _context(13, 10)
    ids = ctx + INV_A + [50, 51, 52, 53, 54, 55]  # activation at 10, inside block 2

    def keys(adapter: str | None, salt: str | None = None, tokens: list[int] = ids) -> list[bytes]:
        seq = _seq(llm, tokens, adapter, ads, salt)
        return hash_prefix_blocks(seq.namespaces(BLOCK), tokens, BLOCK)

    base, al, al2 = keys(None), keys("al_all_r8"), keys("al_attn_head_r4")
    assert al[:2] == base[:2] == al2[:2]  # blocks 0 and 1 end before position 10
    assert len({al[2], base[2], al2[2]}) == 3  # the activation block: each its own
    assert not set(keys("std_r8")) & set(base)
    assert not set(keys("al_all_r8", "tenant-b")) & set(al)  # salts never share
    assert keys("al_all_r8", "tenant-b")[:2] == keys(None, "tenant-b")[:2]
    # the same tokens up to block 2 with the last invocation elsewhere: different activation
    # point, so the activation block's key differs although its tokens are the same
    later = ids + INV_A
    assert keys("al_all_r8", tokens=later)[2] != al[2]
    assert keys("al_all_r8", tokens=later)[:2] == al[:2]


def test_a_hot_swapped_alora_keeps_the_base_blocks_and_drops_its_own(
    llama: dict, tmp_path: Path
) -> None:
    """A new revision at the same name and path: the context's base blocks still serve it (they
    never depended on the adapter), the blocks the old weights shaped never do."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    llm = LLM(str(llama["model"]), max_loras=2, max_lora_rank=16, dtype="float32", block_size=BLOCK)
    path = tmp_path / "swap"
    shutil.copytree(llama["adapters"]["al_all_r8"], path)
    ids = [*_context(21, 20), *INV_A, 50, 51, 52, 53, 54, 55, 56]  # activation at 20
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    lr = LoRARequest("swap", str(path))
    first = llm.generate({"prompt_token_ids": ids}, sp, lr)[0]
    assert first.num_cached_tokens == 0
    shutil.rmtree(path)
    new = make_random_adapter(llama["model"], tmp_path / "rev2", r=8, std=0.2, seed=9,
                              target_modules=ALL_PROJ, alora_invocation_tokens=INV_A)  # fmt: skip
    shutil.copytree(new, path)
    swapped = llm.generate({"prompt_token_ids": ids}, sp, lr)[0]
    assert swapped.num_cached_tokens == 20  # the base blocks; none of the old adapter's
    ref = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(llama["model"]), dtype=torch.float32), str(new)
    ).eval()
    assert swapped.outputs[0].token_ids == reference_greedy_alora(ref, ids, N_NEW, 20)[0]
    assert llm.engine.is_idle()


def test_an_invocation_spanning_two_prefill_chunks(llama: dict) -> None:
    """Alone with an 8-token budget, the prompt prefills in chunks [0, 8) and [8, 16); the
    invocation at positions 6-8 spans both (the activation point inside the first chunk)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    llm = LLM(str(llama["model"]), max_loras=1, max_lora_rank=16, dtype="float32",
              block_size=BLOCK, max_num_batched_tokens=8, max_num_seqs=1)  # fmt: skip
    ids = prompts_for(INV_A)["middle"]
    assert activation_start(ids, INV_A) == 6 and len(ids) > 16
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, prompt_logprobs=2)
    lr = LoRARequest("al", str(llama["adapters"]["al_all_r8"]))
    e = llm.engine
    e.add_request("span", ids, sp, lr)
    chunks, out = [], None
    while out is None:
        outs = e.step()
        if e.last_step.num_tokens:  # a step that ran (not one spent loading the adapter)
            chunks.append(e.last_step.num_tokens)
        out = next((o for o in outs if o.finished), None)
    assert chunks[:2] == [8, 8]  # the two prefill chunks the invocation spans
    ref = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(llama["model"]), dtype=torch.float32),
        str(llama["adapters"]["al_all_r8"]),
    ).eval()
    want, _, ref_prompt = reference_greedy_alora(ref, ids, N_NEW, 6)
    assert out.outputs[0].token_ids == want
    assert out.prompt_logprobs is not None
    worst = max(
        abs(v - float(ref_prompt[i, t]))
        for i, entry in enumerate(out.prompt_logprobs[1:])
        for t, v in entry.items()  # type: ignore[union-attr]
    )
    assert worst < PROMPT_TOL


def test_alora_with_layer_groups_shares_both_ways(tmp_path: Path) -> None:
    """An aLoRA on layers 2-3 of a 4-layer model with ``kv_cache_layer_groups=2``: its lower
    group is keyed as base blocks throughout (no adapted module acts below layer 2), its upper
    group as base blocks before the activation point only. Over a context the base ran, the
    context's blocks hit in both groups, and the outputs equal PEFT's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = make_random_model(tmp_path / "m", "llama", num_layers=4, seed=9)
    path = make_random_adapter(model, tmp_path / "al", r=8, seed=3, target_modules=ALL_PROJ,
                               layers_to_transform=[2, 3], alora_invocation_tokens=INV_A)  # fmt: skip
    llm = LLM(str(model), max_loras=1, max_lora_rank=8, dtype="float32", block_size=BLOCK,
              kv_cache_layer_groups=2)  # fmt: skip
    assert len(llm.engine.scheduler.kv.groups) == 2
    ctx = _context(31, 18)
    ids = [*ctx, *INV_A, 50, 51, 52, 53, 54]  # activation at 18, inside block 4
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    base = llm.generate({"prompt_token_ids": [*ctx, 60]}, sp)[0]
    assert base.num_cached_tokens == 0
    lr = LoRARequest("al", str(path))
    got = llm.generate({"prompt_token_ids": ids}, sp, lr)[0]
    assert got.num_cached_tokens == 16  # the 4 blocks wholly before position 18
    ref = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32), str(path)
    ).eval()
    assert got.outputs[0].token_ids == reference_greedy_alora(ref, ids, N_NEW, 18)[0]
    assert llm.engine.is_idle()
