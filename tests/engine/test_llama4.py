"""Llama 4 text against transformers + PEFT: chunked attention (chunks of 4 tokens, crossed by
every prompt, every chunked prefill and every decode here), NoPE layers with temperature
tuning, the interleaved rotary with its L2 q/k norm, and a top-1 sparse block with a shared
expert, in mixed batches of adapters on attention, the dense MLP and the shared expert, the
packed experts (PEFT's ``target_parameters`` on Llama 4's ``[E, in, out]`` parameters), the
router (PEFT's ``all-linear`` takes it), ``lm_head`` and ``embed_tokens``, on the C LoRA
kernel and the torch path; then the chunked KV-cache group: a prefix-cache hit across chunks
and blocks released once out of the current chunk.

The model: layer 0 chunked with rope and a dense MLP, layer 1 global NoPE with the sparse
block (``ARCH_DEFAULTS["llama4_text"]``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.checkpoint.modules import SHARED_EXPERT_PROJ_NAMES
from loraplex.kv.groups import NULL_BLOCK, Chunked, blocks_per_sequence
from loraplex.testing import (
    check_greedy,
    load_merged_reference,
    make_random_adapter,
    make_random_model,
)
from loraplex.types import AdapterError
from tests.engine.test_mixed_batch_architectures import SAMPLE_TOL, check_mixed_batch, llm_on
from tests.engine.test_tensor_parallel import _run, assert_same_outputs

CHUNK = 4  # ARCH_DEFAULTS["llama4_text"]["attention_chunk_size"]
BLOCK = 4
N_NEW = 9  # decodes across two chunk boundaries
PACKED = ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
ADAPTERS: dict[str, dict] = {
    "attn_r4_rslora": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        use_rslora=True, seed=2,
    ),
    # layer 0's dense MLP and layer 1's shared expert
    "mlp_shared_r8": dict(
        r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"], std=0.1, seed=3
    ),
    "experts_r16": dict(
        r=16, lora_alpha=16, target_modules=["q_proj"], target_parameters=PACKED, std=0.1, seed=4
    ),
    # attention, dense MLP, shared expert and router (PEFT's all-linear), experts, vocabulary
    "everything_r8": dict(
        r=8, lora_alpha=8, target_modules="all-linear", target_parameters=PACKED, std=0.1,
        seed=5,
    ),
    "vocab_r4": dict(r=4, target_modules=["lm_head", "embed_tokens"], std=0.1, seed=6),
}  # fmt: skip


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("llama4")
    model = make_random_model(root / "model", "llama4_text", num_layers=2, seed=5)
    adapters = {n: make_random_adapter(model, root / n, **kw) for n, kw in ADAPTERS.items()}
    refs = {n: load_merged_reference(model, adapters.get(n)) for n in [None, *adapters]}
    return {"model": model, "adapters": adapters, "refs": refs}


@pytest.fixture(scope="module", params=["cpu-kernel", "torch"])
def llm(request: pytest.FixtureRequest, family: dict) -> Iterator[LLM]:
    yield llm_on(request.param, family, max_lora_rank=16)


def test_the_layers_are_what_the_config_says(llm: LLM) -> None:
    model = llm.engine.model
    assert model.layer_windows() == [Chunked(CHUNK), None]
    assert [L.rope for L in model.layers] == [0, None]  # layer 1: NoPE
    assert model.cfg.sparse_layers == (1,) and hasattr(model.layers[1], "shared_gate_up")
    assert [g.window for g in llm.engine.cache.groups] == [None, Chunked(CHUNK)]


def test_mixed_batch_equals_peft(llm: LLM, family: dict) -> None:
    runs = check_mixed_batch(llm, family["adapters"], family["refs"], N_NEW)
    tok = llm.get_tokenizer()
    assert all(len(tok(p).input_ids) > CHUNK for p, _, _ in runs)  # prompts cross a chunk
    first = {p: o.outputs[0].logprobs[0].top for p, n, o in runs if n is None}
    for prompt, name, out in runs:
        if name is not None and prompt in first:  # every adapter moves its outputs
            top = out.outputs[0].logprobs[0].top
            shared = [t for t in top if t in first[prompt]]
            moved = max((abs(top[t] - first[prompt][t]) for t in shared), default=float("inf"))
            assert moved > 1e-3, (name, moved)
    bank = llm.engine.adapters.bank
    for proj in SHARED_EXPERT_PROJ_NAMES:  # the shared expert's own LoRA tables
        assert (1, proj) in bank.module_shapes and (0, proj) not in bank.module_shapes
    assert llm.engine.is_idle()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefix_cache_hit_across_chunks(family: dict) -> None:
    """Prompts prefilled 6 tokens at a time (each piece crossing a chunk); a second request
    sharing a 24-token prefix (6 chunks) hits all of it, and both equal transformers; with an
    adapter the hit stays within the adapter."""
    llm = LLM(
        str(family["model"]), max_loras=2, max_lora_rank=16, dtype="float32",
        block_size=BLOCK, max_num_batched_tokens=6,
    )  # fmt: skip
    shared = _ids(6 * CHUNK, seed=10)
    first, second = shared + _ids(3, seed=11), shared + _ids(5, seed=12)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    for name in (None, "experts_r16"):
        lora = LoRARequest(name, str(family["adapters"][name])) if name else None
        (a,) = llm.generate([first], sp, lora_request=lora)
        (b,) = llm.generate([second], sp, lora_request=lora)
        assert a.num_cached_tokens == 0 and b.num_cached_tokens == len(shared)
        check_greedy(a.outputs[0], family["refs"][name], first, SAMPLE_TOL)
        check_greedy(b.outputs[0], family["refs"][name], second, SAMPLE_TOL)
    assert llm.engine.is_idle()


def test_the_chunked_group_holds_only_the_current_chunk(family: dict) -> None:
    """One 30-token prompt in pieces of 6, then decodes: between steps the chunked group holds
    at most the blocks of the chunk the next token falls in (one block of 4 here, two while a
    chunk straddles blocks), the full group every block; the output equals transformers'."""
    llm = LLM(
        str(family["model"]), enable_lora=False, dtype="float32", block_size=BLOCK,
        max_num_batched_tokens=6,
    )  # fmt: skip
    e = llm.engine
    full, chunked = e.cache.groups
    ids = _ids(30, seed=20)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    e.add_request("long", ids, sp)
    peak, out = 0, None
    while e.has_unfinished_requests():
        for seq in e.scheduler.running:
            tables = seq.block_tables
            if tables:
                peak = max(peak, sum(b != NULL_BLOCK for b in tables[1]))
                assert NULL_BLOCK not in tables[0]
        for o in e.step():
            out = o if o.finished else out
    assert 0 < peak <= chunked.live_blocks(10**6, BLOCK) < -(-(len(ids) + N_NEW) // BLOCK)
    assert out is not None
    check_greedy(out.outputs[0], family["refs"][None], ids, SAMPLE_TOL)
    assert full.window is None and e.is_idle()


@pytest.mark.parametrize("layer_ops", ["cpu-kernel", "torch"])
def test_chunked_decode_on_both_layer_ops(family: dict, layer_ops: str) -> None:
    """The C layer ops read a chunked layer's decode rows themselves (a negative window: no
    torch fallback); the torch ones attend through the chunk masks; both equal transformers
    across chunk boundaries, with an adapter in the batch."""
    from loraplex.model.layer_ops import CLayerOps, TorchLayerOps

    llm = LLM(str(family["model"]), max_loras=1, max_lora_rank=16, dtype="float32")
    model = llm.engine.model
    if layer_ops == "torch":
        model.use_layer_ops(TorchLayerOps())
    elif not isinstance(model.ops, CLayerOps):
        pytest.skip("the C layer ops kernel does not build here")
    calls = []
    if isinstance(model.ops, CLayerOps):
        fallback = model.ops.fallback
        original = fallback.decode_attention
        fallback.decode_attention = lambda *a, **k: calls.append(1) or original(*a, **k)  # type: ignore[method-assign]
    name = "experts_r16"
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    prompts = [_ids(2 * CHUNK + k, seed=40 + k) for k in range(3)]
    loras = [None, LoRARequest(name, str(family["adapters"][name])), None]
    outs = llm.generate(prompts, sp, lora_request=loras)
    for ids, lora, out in zip(prompts, loras, outs, strict=True):
        check_greedy(out.outputs[0], family["refs"][lora and name], ids, SAMPLE_TOL)
    assert not calls  # every decode row of both layers on the kernel


def test_preemption_with_a_chunked_group(family: dict) -> None:
    """Three sequences with adapters in a pool that holds about one and a half of them:
    preempted and recomputed (their chunked tables rebuilt), every output equals PEFT's."""
    prompts = [_ids(5 * CHUNK + k, seed=50 + k) for k in range(3)]
    names = ["experts_r16", None, "everything_r8"]
    loras = [LoRARequest(n, str(family["adapters"][n])) if n else None for n in names]
    probe = LLM(str(family["model"]), enable_lora=False, dtype="float32", block_size=BLOCK)
    longest = max(map(len, prompts)) + N_NEW
    per_seq = blocks_per_sequence(probe.engine.cache.groups, longest, BLOCK, chunk=6)
    llm = LLM(
        str(family["model"]), max_loras=2, max_lora_rank=16, dtype="float32", block_size=BLOCK,
        max_num_batched_tokens=6, num_kv_blocks=per_seq * 3 // 2,
    )  # fmt: skip
    # both adapters in their slots first: a slot still being written would make its sequence
    # sit steps out (timing-dependent), and the schedule this test needs would vary with load
    warm = [loras[0], loras[2]]
    llm.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=1), lora_request=warm)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, sp, lora_request=loras)
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, name, out in zip(prompts, names, outs, strict=True):
        check_greedy(out.outputs[0], family["refs"][name], ids, SAMPLE_TOL)
    assert llm.engine.is_idle()


def test_a_shared_expert_lora_on_a_dense_layer_is_refused(family: dict, tmp_path: Path) -> None:
    """Layer 0 has a dense MLP and no shared expert: an adapter naming one there is refused in
    one line naming the module and the layer; the engine serves on."""
    llm = LLM(str(family["model"]), max_loras=1, max_lora_rank=16, dtype="float32")
    key = "base_model.model.model.layers.0.feed_forward.shared_expert.gate_proj"
    save_file(
        {f"{key}.lora_A.weight": torch.ones(4, 64), f"{key}.lora_B.weight": torch.ones(128, 4)},
        str(tmp_path / "adapter_model.safetensors"),
    )
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"]})
    )
    sp = SamplingParams(max_tokens=1)
    with pytest.raises(
        AdapterError, match=r"'shared_expert\.gate_proj' is not supported in layer 0"
    ):
        llm.generate("Hello", sp, lora_request=LoRARequest("odd", str(tmp_path)))
    assert llm.generate("Hello", sp)[0].outputs[0].token_ids


@pytest.mark.parametrize("fully_sharded", [False, True])
def test_tp2_equals_tp1(family: dict, fully_sharded: bool) -> None:
    """Over two ranks: each its heads (the NoPE layer's temperature and the rope layer's L2
    norm per head), its columns of the dense MLP, of every expert and of the shared expert
    (cut as the dense MLP), the router whole; chunked attention unchanged. The base and four
    adapters (attention, dense MLP + shared expert, packed experts, all-linear with the
    router) in one batch give one device's tokens, in both LoRA modes."""
    adapters = [family["adapters"][n] for n in list(ADAPTERS)[:4]]
    one = _run(family["model"], adapters, 1, max_lora_rank=16)
    kw = {"fully_sharded_loras": True} if fully_sharded else {}
    assert_same_outputs(one, _run(family["model"], adapters, 2, max_lora_rank=16, **kw))
