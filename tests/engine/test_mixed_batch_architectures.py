"""Invariant 2 on every architecture family: a mixed batch of the base and adapters of different
ranks and targets (all projections, attention only, ``layers_to_transform``, ``lm_head``,
``embed_tokens``, both beside every projection) equals transformers + PEFT with each adapter
merged (greedy tokens, sample and prompt logprobs), on the CPU LoRA kernel and on the torch path;
the single-adapter merged fast path equals the same references and keeps the vocabulary LoRAs
gathered; ``modules_to_save`` is refused at load.

A tied head's LoRA reaches the logits only, never the lookup (PEFT's unmerged forward is then the
reference: merging would write the one shared matrix; see ``load_merged_reference``).

``FAMILIES`` holds one tiny model per family, shaped to hit what the family does differently;
adding a family here runs it through every test of this file. A family whose checkpoint names
its projections otherwise gives its target lists in ``proj`` (and a MoE's packed experts, PEFT's
``target_parameters``, in ``proj["params"]``: the "all" adapters target them too).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.checkpoint.modules import EMBED_KEY, LINEAR_ATTN_PROJ_NAMES, LM_HEAD_KEY
from loraplex.outputs import RequestOutput
from loraplex.testing import (
    ALL_PROJ,
    ATTN_PROJ,
    MLP_PROJ,
    load_merged_reference,
    logprob_gap,
    make_random_adapter,
    make_random_model,
    reference_greedy,
)
from loraplex.testing.sync import EVENT_TIMEOUT_S
from loraplex.types import AdapterError

GEMMA4_PER_LAYER_PROJ = [
    "per_layer_input_gate",
    "per_layer_projection",
    "per_layer_model_projection",
]
LLAMA_PROJ = {"all": ALL_PROJ, "attn": ATTN_PROJ, "mlp": MLP_PROJ, "qv": ["q_proj", "v_proj"]}

FAMILIES: dict[str, dict] = {
    "llama": dict(arch="llama", tie_word_embeddings=False),
    "llama_tied": dict(arch="llama", tie_word_embeddings=True),
    # head_dim 24 != hidden 64 / 4 heads (q is 96 wide, o_proj 96 -> 64), tied embeddings,
    # per-head q/k norms with non-trivial weights (make_random_model perturbs every norm)
    "qwen3": dict(arch="qwen3", head_dim=24, tie_word_embeddings=True),
    # a window of 4 tokens, crossed by every prompt: Gemma 2's sliding layer 0 and global
    # layer 1, attention and final soft-caps that bite, query_pre_attn_scalar != head_dim
    "gemma2": dict(
        arch="gemma2",
        sliding_window=4,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
        query_pre_attn_scalar=24,
    ),
    # q/k norms, the local rope base on the sliding layer, the global one linear-scaled
    "gemma3_text": dict(
        arch="gemma3_text",
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=10.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
        },
    ),
    # the language model of a vision-language checkpoint (its vision tower is skipped)
    "gemma3": dict(
        arch="gemma3", sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
    # fused qkv_proj / gate_up_proj in the checkpoint and in the adapters (one A/B pair over
    # q, k and v under GQA); Phi3Config's pad_token_id 32000 lies outside the tiny vocabulary
    "phi3": dict(
        arch="phi3",
        pad_token_id=None,
        proj={
            "all": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
            "attn": ["qkv_proj", "o_proj"],
            "mlp": ["gate_up_proj", "down_proj"],
            "qv": ["qkv_proj"],
        },
    ),
    # SmolLM3: Llama's layers, the second of each pair without rotary (NoPE), a tied head
    "smollm3": dict(arch="smollm3", no_rope_layer_interval=2, tie_word_embeddings=True),
    # Qwen3.5: a Gated DeltaNet layer (its state in the cache's state pages) before a gated
    # full-attention one with a quarter-width rotary; adapters on the linear-attention
    # projections beside attention and MLP
    "qwen3_5": dict(
        arch="qwen3_5",
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        proj={
            "all": [*ALL_PROJ, *LINEAR_ATTN_PROJ_NAMES],
            "attn": [*ATTN_PROJ, *LINEAR_ATTN_PROJ_NAMES],
            "mlp": MLP_PROJ,
            "qv": ["q_proj", "v_proj", "in_proj_qkv", "in_proj_z"],
        },
    ),
    # Gemma 4: a sliding layer (window 4) and a full one on the proportional rope, per-layer
    # inputs whose three modules the every-projection adapters adapt too, a soft-cap that bites,
    # small weights (unscaled attention over unit-norm heads saturates at the default 0.2);
    # KV-sharing layers and the multimodal wrapper: tests/model/test_gemma4.py
    "gemma4_text": dict(
        arch="gemma4_text",
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=3.0,
        init_std=0.05,
        proj={**LLAMA_PROJ, "all": [*ALL_PROJ, *GEMMA4_PER_LAYER_PROJ]},
    ),
    # ... with the MoE block beside each MLP (8 experts, top 2): the "all" adapters also on the
    # router and, through target_parameters, the packed experts (tests/model/test_gemma4_moe.py)
    "gemma4_moe_text": dict(
        arch="gemma4_moe_text",
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=3.0,
        init_std=0.05,
        proj={
            **LLAMA_PROJ,
            "all": [*ALL_PROJ, *GEMMA4_PER_LAYER_PROJ, "router.proj"],
            "params": ["experts.gate_up_proj", "experts.down_proj"],
        },
    ),
    # Llama 4: layer 0 chunked (4 tokens: every prompt and decode crosses chunks), rope in
    # the interleaved form, L2 q/k norm, a dense MLP; layer 1 NoPE with temperature tuning,
    # global, a top-1 sparse block whose shared expert the MLP targets adapt (its packed
    # experts through target_parameters: tests/engine/test_llama4.py)
    "llama4_text": dict(arch="llama4_text"),
    # the language model of a Llama 4 vision-language checkpoint (its vision tower skipped)
    "llama4": dict(arch="llama4"),
    # GPT-OSS: attention sinks, biases on q/k/v/o, YaRN, a sliding layer (window 4) before a
    # full one; every MLP a sparse block (8 experts, top-4, biases, clamped SwiGLU) whose packed
    # experts the "all" adapters target through target_parameters (gate/up interleaved)
    "gpt_oss": dict(
        arch="gpt_oss",
        intermediate_size=32,
        proj={
            "all": ATTN_PROJ,
            "attn": ["q_proj", "k_proj"],
            "mlp": ["v_proj", "o_proj"],
            "qv": ["q_proj", "v_proj"],
            "params": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        },
    ),
    # Phi-4-mini's shape: rotary on 3/4 of each head, LongRoPE with an original length (6)
    # every prompt passes (its long factors and attention factor from the prefill on; a
    # sequence crossing it while decoding is tests/model/test_phi3.py's)
    "phi3_longrope": dict(
        arch="phi3",
        pad_token_id=None,
        tie_word_embeddings=True,
        original_max_position_embeddings=6,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(6)],
            "long_factor": [2.0 + 0.75 * i for i in range(6)],
        },
        proj={
            "all": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
            "attn": ["qkv_proj", "o_proj"],
            "mlp": ["gate_up_proj", "down_proj"],
            "qv": ["qkv_proj"],
        },
    ),
}


def adapters_for(proj: dict[str, list[str]]) -> dict[str, dict]:
    """The adapters every family is tested with, over its projection names."""
    params = proj.get("params")
    return {
        "all_r8": dict(
            r=8, lora_alpha=16, target_modules=proj["all"], target_parameters=params, seed=1
        ),
        "attn_r4_rslora": dict(
            r=4, lora_alpha=8, target_modules=proj["attn"], use_rslora=True, seed=2
        ),
        "mlp_r16_layer1": dict(
            r=16, lora_alpha=8, target_modules=proj["mlp"], layers_to_transform=[1], seed=3
        ),
        "head_r8": dict(r=8, lora_alpha=16, target_modules=["lm_head"], std=0.1, seed=4),
        "embed_r4_rslora": dict(
            r=4, lora_alpha=8, target_modules=["embed_tokens"], use_rslora=True, std=0.1, seed=5
        ),
        "both_all_r16": dict(
            r=16,
            lora_alpha=16,
            target_modules=[*proj["all"], "lm_head", "embed_tokens"],
            target_parameters=params,
            rank_pattern={"lm_head": 4},
            alpha_pattern={"embed_tokens": 24},
            std=0.1,
            seed=6,
        ),
        "qv_r32": dict(r=32, lora_alpha=64, target_modules=proj["qv"], seed=7),
    }


PROMPTS = [
    "What is the capital of France?",
    "def add(a, b):",
    "SELECT name FROM users WHERE id = 42",
    "Once upon a time there was",
    "Hello world! How are you",
]
N_NEW = 8
SAMPLE_TOL = 2e-4  # float32 logprobs, as the Llama mixed-batch test
PROMPT_TOL = 1e-4  # float32 prompt logprobs, as the Llama prompt-logprob test


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One family's tiny model, its adapters and their merged references."""
    root = tmp_path_factory.mktemp(request.param)
    spec = dict(FAMILIES[request.param])
    proj = spec.pop("proj", LLAMA_PROJ)
    model = make_random_model(root / "model", spec.pop("arch"), num_layers=2, seed=5, **spec)
    adapters = {
        n: make_random_adapter(model, root / n, **kw) for n, kw in adapters_for(proj).items()
    }
    refs = {n: load_merged_reference(model, adapters.get(n)) for n in [None, *adapters]}
    return {"model": model, "adapters": adapters, "refs": refs}


def llm_on(backend: str, family: dict, max_lora_rank: int) -> LLM:
    """A float32 engine on ``family``'s model with a slot per adapter, its LoRA on the C
    kernel (``cpu-kernel``, the CPU default) or on the torch path (``torch``)."""
    with pytest.MonkeyPatch.context() as mp:  # the backend is chosen once, at start-up
        mp.setenv("LORAPLEX_LORA_CPU_KERNEL", "1" if backend == "cpu-kernel" else "0")
        llm = LLM(
            str(family["model"]),
            max_loras=len(family["adapters"]),
            max_lora_rank=max_lora_rank,
            dtype="float32",
        )
    assert llm.engine.model.lora is not None
    assert llm.engine.model.lora.ops.name.startswith(backend)
    return llm


@pytest.fixture(scope="module", params=["cpu-kernel", "torch"])
def llm(request: pytest.FixtureRequest, family: dict) -> Iterator[LLM]:
    """An engine on the C LoRA kernel (the CPU default) or on the torch path."""
    yield llm_on(request.param, family, max_lora_rank=32)


@torch.no_grad()
def _prompt_reference(model: object, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) rows: [len(ids) - 1, vocab]."""
    logits = model(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_mixed_batch(
    llm: LLM,
    adapters: dict[str, Path],
    refs: dict,
    n_new: int,
    tol: float = SAMPLE_TOL,
    texts: list[str] = PROMPTS,
) -> list[tuple[str, str | None, RequestOutput]]:
    """The base and each adapter twice (different prompts of ``texts``) in one batch: greedy
    tokens, sample logprobs (within ``tol``) and prompt logprobs equal ``refs``' (transformers
    + PEFT, by adapter name; None: the base). Returns (prompt, adapter name, output) per
    request."""
    names = [None, *adapters]
    prompts, loras, expect = [], [], []
    for i, name in enumerate(names):  # each adapter twice, with different prompts
        for j in range(2):
            prompts.append(texts[(i + j) % len(texts)])
            loras.append(LoRARequest(name, str(adapters[name])) if name else None)
            expect.append(name)
    sp = SamplingParams(
        temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    outs = llm.generate(prompts, sp, lora_request=loras)
    tok = llm.get_tokenizer()
    for prompt, name, out in zip(prompts, expect, outs, strict=True):
        ids = tok(prompt).input_ids
        want, ref_lp = reference_greedy(refs[name], ids, n_new)
        got = out.outputs[0]
        assert got.token_ids == want, f"adapter {name} prompt {prompt!r}"
        worst = logprob_gap(got.logprobs, ref_lp)
        assert worst < tol, f"adapter {name}: logprob diff {worst}"
        want_prompt = _prompt_reference(refs[name], ids)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        worst = max(
            abs(val - float(want_prompt[i, tid]))
            for i, entry in enumerate(out.prompt_logprobs[1:])
            for tid, val in entry.items()  # type: ignore[union-attr]
        )
        assert worst < PROMPT_TOL, f"adapter {name}: prompt logprob diff {worst}"
    return list(zip(prompts, expect, outs, strict=True))


def test_mixed_batch_equals_merged_references(llm: LLM, family: dict) -> None:
    runs = check_mixed_batch(llm, family["adapters"], family["refs"], N_NEW)
    prompts, expect, outs = (list(x) for x in zip(*runs, strict=True))
    base = {p: o.outputs[0].token_ids for p, n, o in runs if n is None}
    changed = sum(  # the adapters really change outputs (non-zero B)
        out.outputs[0].token_ids != base[p]
        for p, n, out in zip(prompts, expect, outs, strict=True)
        if n is not None and p in base
    )
    assert changed >= 1
    # the vocabulary LoRAs really move the outputs (non-zero B): not silent no-ops
    first = {
        p: o.outputs[0].logprobs[0].top
        for p, n, o in zip(prompts, expect, outs, strict=True)
        if n is None
    }
    for prompt, name, out in zip(prompts, expect, outs, strict=True):
        if name in ("head_r8", "embed_r4_rslora") and prompt in first:
            top = out.outputs[0].logprobs[0].top
            shared = [t for t in top if t in first[prompt]]  # none shared: moved all the more
            moved = max((abs(top[t] - first[prompt][t]) for t in shared), default=float("inf"))
            assert moved > 1e-2, (name, moved)
    # the bank holds embed_tokens / lm_head rows for every slot
    assert {EMBED_KEY, LM_HEAD_KEY} <= set(llm.engine.adapters.bank.module_shapes)
    assert llm.engine.is_idle()


def test_merged_single_adapter_equals_merged_reference(family: dict) -> None:
    """One adapter (every projection, lm_head and embed_tokens) alone for a few steps runs its
    layers merged into the fused weights and its embedding / head LoRA gathered; a base request
    afterwards runs on the untouched base Linears, embedding and head again."""
    llm = LLM(
        str(family["model"]),
        max_loras=2,
        max_lora_rank=32,
        dtype="float32",
        lora_merge_after_steps=2,
    )
    eng, tok = llm.engine, llm.get_tokenizer()
    assert eng.merger is not None
    name = "both_all_r16"
    adapter = family["adapters"][name]
    slots = ("qkv", "o", "gate_up", "down", "lin_in", "lin_out")  # layers differ by family
    base_linears = [tuple(getattr(L, a, None) for a in slots) for L in eng.model.layers]
    head, embed = eng.model.head, eng.model.embed_tokens.clone()
    sp = SamplingParams(temperature=0, max_tokens=N_NEW + 4, ignore_eos=True, logprobs=3)
    for i, p in enumerate(PROMPTS[:2]):
        eng.add_request(f"r{i}", p, sp, LoRARequest(name, str(adapter)))
    results: dict = {}
    merged_steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
        merged_steps += eng.runner.merged_slot is not None
        assert eng.merger.wait_build(EVENT_TIMEOUT_S)
    assert eng.merger.merges == 1 and merged_steps >= 3
    assert eng.model.head is head and torch.equal(eng.model.embed_tokens, embed)  # never merged
    eng.add_request("base", PROMPTS[2], sp)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
    assert eng.merger.merged_digest is None
    now = [tuple(getattr(L, a, None) for a in slots) for L in eng.model.layers]
    assert all(
        a is b
        for old, new in zip(base_linears, now, strict=True)
        for a, b in zip(old, new, strict=True)
    )
    for rid, prompt, ref_name in (
        ("r0", PROMPTS[0], name),
        ("r1", PROMPTS[1], name),
        ("base", PROMPTS[2], None),
    ):
        got = results[rid]
        want, ref_lp = reference_greedy(
            family["refs"][ref_name], tok(prompt).input_ids, len(got.token_ids)
        )
        assert got.token_ids == want, (rid, prompt)
        worst = logprob_gap(got.logprobs, ref_lp)
        assert worst < SAMPLE_TOL, (rid, worst)
    assert eng.is_idle()


def test_modules_to_save_is_refused_at_load(llm: LLM, family: dict, tmp_path: Path) -> None:
    full = tmp_path / "full"
    shutil.copytree(family["adapters"]["head_r8"], full)
    cfg = json.loads((full / "adapter_config.json").read_text())
    (full / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": ["lm_head"]}))
    sp = SamplingParams(max_tokens=1)
    with pytest.raises(AdapterError, match="full replacement weights for lm_head") as info:
        llm.generate("Hello", sp, lora_request=LoRARequest("full", str(full)))
    assert "\n" not in str(info.value)
    assert llm.generate("Hello", sp)[0].outputs[0].token_ids  # the engine serves on
