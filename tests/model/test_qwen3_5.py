"""Qwen3.5's hybrid decoder through the engine, against transformers: the chunked gated delta
rule against the token-by-token recurrence; prefix caching on a hybrid (a hit resumes the
recurrence from the state snapshot at the hit's end, keyed like KV blocks); chunked prefill
across blocks; preemption and resume; the state pool's pages per sequence staying fixed
however long it runs; adapters on the linear-attention projections refused on a base
without them; tensor parallelism (2 ranks) equal to one device, the prefix cache under it,
and linear-attention heads that do not split refused; ``--quantization int8/int4`` on every
projection, the linear-attention ones included. The every-family tests
(``tests/engine/test_mixed_batch_architectures.py``) cover mixed adapter batches on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.kv.groups import state_pages_per_sequence
from loraplex.model.gated_delta_ops import chunked_rule, l2norm, recurrent_step
from loraplex.testing import (
    check_greedy,
    load_merged_reference,
    make_random_adapter,
    make_random_model,
)
from loraplex.testing.quant import write_dequantized, write_gptq
from loraplex.types import AdapterError, ModelLoadError
from tests.engine.test_moe_experts import adapters_for
from tests.engine.test_tensor_parallel import _generate, _run, assert_same_outputs
from tests.model.test_quantized_bases import ON_THE_FLY, _check_mixed_batch

BLOCK = 16
SAMPLE_TOL = 1e-3
"""float32 logprobs after a recurrence: the chunked rule and the token-by-token one round
differently, and the difference accumulates along the sequence (transformers' own cached
decode of this model is 3e-4 from its full forward after 20 tokens; attention models: 2e-4)."""
N_NEW = 8


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(("length", "chunk", "lead"), [(37, 8, 0), (37, 8, 5), (5, 16, 3)])
def test_chunked_rule_equals_the_recurrence(length: int, chunk: int, lead: int) -> None:
    """Chunks aligned to block ends (a ``lead`` of padding before the first token) give the
    recurrence's outputs and, after each chunk, its state at that position."""
    g = torch.Generator().manual_seed(length + lead)
    H, dk, dv = 3, 8, 6
    q = l2norm(torch.randn(length, H, dk, generator=g)) * dk**-0.5
    k = l2norm(torch.randn(length, H, dk, generator=g))
    v = torch.randn(length, H, dv, generator=g)
    decay = -torch.rand(length, H, generator=g) * 2
    beta = torch.rand(length, H, generator=g)
    state0 = torch.randn(H, dk, dv, generator=g)
    out, states = chunked_rule(q, k, v, decay, beta, state0, chunk, lead)
    s, want, want_states = state0[None], [], {}
    for t in range(length):
        o, s = recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1],
                              beta[t : t + 1], s)  # fmt: skip
        want.append(o[0])
        want_states[t + 1] = s[0]
    tol = 1e-4  # float32, a few dozen steps
    assert torch.allclose(out, torch.stack(want), atol=tol)
    ends = [min(chunk * (c + 1) - lead, length) for c in range(len(states))]
    assert ends[-1] == length
    for end, st in zip(ends, states, strict=True):
        assert torch.allclose(st, want_states[end], atol=tol), end


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Three Gated DeltaNet layers for each full-attention one, as the released models."""
    root = tmp_path_factory.mktemp("qwen3_5")
    d = make_random_model(root / "m", "qwen3_5", num_layers=4, full_attention_interval=4, seed=3)
    return {"dir": d, "ref": load_merged_reference(d, None), "root": root}


def _llm(d: Path, **kw: object) -> LLM:
    return LLM(str(d), enable_lora=False, dtype="float32", block_size=BLOCK, **kw)


def test_prefix_hit_resumes_from_the_state_snapshot(hybrid: dict) -> None:
    """A second request on a shared 300-token prefix reports the cached tokens (the full
    blocks of the prefix: attention KV and the recurrent state at their end) and gives the
    output of a cold run, which equals transformers'."""
    shared = _ids(300, seed=1)
    first, second = shared + _ids(20, seed=2), shared + _ids(12, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    llm = _llm(hybrid["dir"], max_num_batched_tokens=512)
    a = llm.generate([{"prompt_token_ids": first}], sp)[0]
    b = llm.generate([{"prompt_token_ids": second}], sp)[0]
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 300 // BLOCK * BLOCK
    cold = _llm(hybrid["dir"], enable_prefix_caching=False).generate(
        [{"prompt_token_ids": second}], sp
    )[0]
    assert b.outputs[0].token_ids == cold.outputs[0].token_ids
    check_greedy(b.outputs[0], hybrid["ref"], second, SAMPLE_TOL)
    check_greedy(a.outputs[0], hybrid["ref"], first, SAMPLE_TOL)
    # the same prompt again: everything but the last (partial) block's tokens is cached
    again = llm.generate([{"prompt_token_ids": second}], sp)[0]
    assert again.num_cached_tokens == (len(second) - 1) // BLOCK * BLOCK
    assert again.outputs[0].token_ids == b.outputs[0].token_ids
    assert llm.engine.is_idle()


def test_chunked_prefill_and_decode_across_blocks(hybrid: dict) -> None:
    """Prompts prefilled in chunks of 24 tokens (chunks that start and end inside blocks),
    decoded past several block ends, batched together: equal to transformers."""
    prompts = [_ids(n, seed=10 + n) for n in (70, 33, 5)]
    llm = _llm(hybrid["dir"], max_num_batched_tokens=24)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for ids, out in zip(prompts, outs, strict=True):
        check_greedy(out.outputs[0], hybrid["ref"], ids, SAMPLE_TOL)
    assert llm.engine.is_idle()
    assert (
        llm.engine.scheduler.kv.state_pool.num_free == llm.engine.scheduler.kv.state_pool.num_blocks
    )


def test_preemption_and_resume(hybrid: dict) -> None:
    """Three sequences in a KV pool that holds about one and a half of them: preempted and
    recomputed (their states rebuilt from position 0 or a snapshot), outputs unchanged."""
    prompts = [_ids(40 + k, seed=30 + k) for k in range(3)]
    per_seq = -(-(max(map(len, prompts)) + 12) // BLOCK)
    llm = _llm(hybrid["dir"], max_num_batched_tokens=16, num_kv_blocks=per_seq * 3 // 2)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs, strict=True):
        check_greedy(out.outputs[0], hybrid["ref"], ids, SAMPLE_TOL)
    assert llm.engine.is_idle()


def test_state_pages_per_sequence_stay_fixed(hybrid: dict) -> None:
    """However long a sequence runs, it holds at most two state pages per state group while
    decoding (the block being filled and, at a block end, the one before); the KV pool holds
    only the full-attention layers' blocks."""
    llm = _llm(hybrid["dir"], max_num_batched_tokens=64)
    eng = llm.engine
    groups = eng.cache.groups
    assert [g.state for g in groups] == [False, True]
    assert groups[1].layers == (0, 1, 2) and groups[0].layers == (3,)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    eng.add_request("r", _ids(150, seed=4), sp)
    seen = 0
    while eng.has_unfinished_requests():
        eng.step()
        for seq in eng.scheduler.running:
            live = [b for b in seq.block_tables[1] if b >= 0]
            seen = max(seen, len(live))
            if seq.num_computed_tokens > 150:  # decoding
                assert len(live) <= 2
    assert 0 < seen <= state_pages_per_sequence(groups, 210, BLOCK, 64)


def test_linear_attention_adapter_on_a_base_without_it(hybrid: dict, tmp_path: Path) -> None:
    """An adapter whose tensors name linear-attention projections in a full-attention layer
    is refused with one line naming the module; the engine serves on."""
    adapter = make_random_adapter(hybrid["dir"], tmp_path / "a", r=4, target_modules=["q_proj"])
    bad = tmp_path / "bad"
    bad.mkdir()
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    moved = {k.replace("layers.3.self_attn.q_proj", "layers.3.linear_attn.in_proj_z"): v
             for k, v in tensors.items()}  # fmt: skip
    save_file(moved, str(bad / "adapter_model.safetensors"))
    (bad / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    llm = LLM(str(hybrid["dir"]), dtype="float32", max_lora_rank=8)
    sp = SamplingParams(max_tokens=1)
    with pytest.raises(AdapterError, match="in_proj_z") as info:
        llm.generate("Hello", sp, lora_request=LoRARequest("bad", str(bad)))
    assert "\n" not in str(info.value)
    assert llm.generate("Hello", sp)[0].outputs[0].token_ids


def test_planner_counts_a_hybrid(hybrid: dict) -> None:
    """``loraplex plan``'s shape of a Qwen3.5 config: every parameter transformers holds (the
    linear-attention layers' own too), KV only for the full-attention layer, and the state
    pages a sequence holds, in the engine's bytes."""
    import json

    from loraplex.tools.plan.model_shape import load_model

    shape = load_model(str(hybrid["dir"]))
    ref = hybrid["ref"]
    assert shape.params() == sum(p.numel() for p in ref.parameters())
    assert shape.attention_layers == 1
    assert shape.kv_bytes_per_token(4) == 2 * 1 * shape.num_kv_heads * shape.hd * 4
    eng = _llm(hybrid["dir"]).engine
    page = eng.cache.conv[:, 0].nbytes + eng.cache.recurrent[:, 0].nbytes  # one state page
    state = shape.state_bytes_per_sequence(1000, 4, BLOCK)
    assert state == 2 * page  # decoding: the block being filled and the one before
    cfg = json.loads((hybrid["dir"] / "config.json").read_text())
    assert shape.state_bytes_per_sequence(8000, 4, BLOCK) == state  # whatever the length
    assert "in_proj_qkv" in shape.adapter_names and cfg["layer_types"].count("full_attention") == 1


def test_snapshots_only_where_the_state_pool_has_room(hybrid: dict) -> None:
    """With a state pool of a few pages (one sequence at a time), a 300-token prefill snapshots
    only its last blocks (the others' entries stay NULL, never costing a running sequence its
    page); a request sharing the prefix hits at the latest snapshot inside it, and every output
    still equals transformers'."""
    shared = _ids(300, seed=5)
    first, second = shared + _ids(20, seed=6), shared + _ids(12, seed=7)
    llm = _llm(hybrid["dir"], max_num_seqs=1, max_num_batched_tokens=512)
    pool = llm.engine.scheduler.kv.state_pool
    assert pool.num_blocks == 6  # two for the sequence, as many again for snapshots (and 2 more)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    a = llm.generate([{"prompt_token_ids": first}], sp)[0]
    b = llm.generate([{"prompt_token_ids": second}], sp)[0]
    assert 0 < b.num_cached_tokens <= 300 // BLOCK * BLOCK
    assert b.num_cached_tokens % BLOCK == 0
    for ids, out in ((first, a), (second, b)):
        check_greedy(out.outputs[0], hybrid["ref"], ids, SAMPLE_TOL)
    assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("arch", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_vision_language_checkpoints_serve_their_language_model(arch: str, tmp_path: Path) -> None:
    """``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` (a real
    vision tower in the checkpoint, skipped): the language model and an adapter on its
    linear-attention and attention projections equal transformers + PEFT."""
    model = make_random_model(tmp_path / "m", arch, num_layers=2, seed=4)
    adapter = make_random_adapter(
        model, tmp_path / "a", r=8, std=0.1, seed=9,
        target_modules=["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "o_proj"],
    )  # fmt: skip
    llm = LLM(str(model), dtype="float32", max_lora_rank=8, block_size=BLOCK)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    ids = _ids(40, seed=11)
    for lora in (None, adapter):
        req = LoRARequest("a", str(adapter)) if lora else None
        out = llm.generate([{"prompt_token_ids": ids}], sp, lora_request=req)[0]
        check_greedy(out.outputs[0], load_merged_reference(model, lora), ids, SAMPLE_TOL)
    assert llm.engine.is_idle()


# -- tensor parallelism (2 ranks over gloo, tests/engine/test_tensor_parallel.py's harness) ---

TP_LINEAR = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def _tp_family(root: Path, arch: str = "qwen3_5", **kw: object) -> tuple[Path, list[Path]]:
    """A full-attention layer, then a linear-attention one (2 key heads read by 4 value
    heads: one key head and its two value heads per rank), an odd vocabulary (uneven shards);
    adapters of three ranks: all-linear, and one on the linear attention, q/o and the vocab."""
    model = make_random_model(
        root / "model", arch, num_layers=2, seed=5, with_tokenizer=False, vocab_size=389,
        layer_types=["full_attention", "linear_attention"], **kw,
    )  # fmt: skip
    own = [*TP_LINEAR, "q_proj", "o_proj", "lm_head", "embed_tokens"]
    adapters = [
        make_random_adapter(model, root / "r4", r=4, seed=1),
        make_random_adapter(model, root / "r16", r=16, seed=2, std=0.08),
        make_random_adapter(model, root / "own", r=8, target_modules=own, std=0.1, seed=3),
    ]
    return model, adapters


@pytest.mark.parametrize("fully_sharded", [False, True])
def test_tp2_equals_tp1(fully_sharded: bool, tmp_path: Path) -> None:
    """TP=2 gives TP=1's greedy tokens and logprobs for a mixed batch of adapters on the
    gated attention, the linear attention's five projections, the MLP and the vocabulary,
    with LoRA's default split and ``--fully-sharded-loras``."""
    model, adapters = _tp_family(tmp_path)
    for a in adapters:  # every adapter adapts all five linear-attention projections
        with safe_open(str(a / "adapter_model.safetensors"), "pt") as f:
            assert all(any(f".{p}.lora_B" in k for k in f.keys()) for p in TP_LINEAR)
    one = _run(model, adapters, 1)
    two = _run(model, adapters, 2, fully_sharded_loras=fully_sharded)
    assert_same_outputs(one, two)


def test_tp2_prefix_hit_resumes_each_ranks_state(tmp_path: Path) -> None:
    """Under TP each rank's state pages hold its own heads' states, in as many pages as rank
    0's: a second request on a shared prefix of four blocks reports them cached (attention KV
    and the recurrent state snapshot at their end, on both ranks) and answers as a cold
    one-device run."""
    model, adapters = _tp_family(tmp_path)
    shared = _ids(4 * 4 + 2, seed=8)
    first, second = shared + _ids(5, seed=9), shared + _ids(3, seed=10)
    lora = LoRARequest("own", str(adapters[2]))

    def engine(tp: int, **kw: object) -> LLMEngine:
        cfg = EngineConfig(model=str(model), tensor_parallel_size=tp, dtype="float32",
                           num_threads=1, block_size=4, skip_tokenizer_init=True, **kw)  # fmt: skip
        return LLMEngine(cfg)

    e = engine(2)
    try:
        assert e.workers is not None
        assert e.cache.recurrent.shape[-3:] == (2, 16, 16)  # rank 0's 2 of the 4 value heads
        assert e.adapters is not None  # its key head's q and k, its value heads' v: 16+16+32
        assert e.adapters.bank.module_shapes[(1, "in_proj_qkv")] == (64, 64)
        a = _generate(e, "a", first, lora)
        b = _generate(e, "b", second, lora)
        assert e.is_idle()
    finally:
        e.shutdown()
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 16)
    cold = engine(1, enable_prefix_caching=False)
    try:
        want = _generate(cold, "c", second, lora)
    finally:
        cold.shutdown()
    assert b.outputs[0].token_ids == want.outputs[0].token_ids


def test_tp_refuses_linear_heads_that_do_not_split(tmp_path: Path) -> None:
    """One key head of the linear attention over two ranks: one line naming the field."""
    model = make_random_model(
        tmp_path / "m", "qwen3_5", linear_num_key_heads=1, linear_num_value_heads=2
    )
    with pytest.raises(
        ModelLoadError, match=r"linear_num_key_heads=1 is not a multiple of 2$"
    ) as e:
        LLMEngine(EngineConfig(model=str(model), tensor_parallel_size=2, num_threads=1))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fully_sharded", [False, True])
def test_moe_tp2_equals_tp1(fully_sharded: bool, tmp_path: Path) -> None:
    """Qwen3.5-MoE: each expert's and the shared expert's columns cut (its gate whole); a
    mixed batch of adapters on the packed experts, the router, the shared expert and its gate,
    and the linear attention gives TP=1's tokens and logprobs, in both LoRA splits."""
    model = make_random_model(
        tmp_path / "model", "qwen3_5_moe", num_layers=2, seed=5, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        layer_types=["full_attention", "linear_attention"],
    )  # fmt: skip
    kinds = adapters_for(None)
    shared = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"]
    specs = {
        "packed_r8": kinds["packed_r8"][1],  # q_proj and every expert's gate/up and down
        "down_router_r16": kinds["down_router_r16"][1],  # k/o, the experts' down, the router
        "gdn_shared_r4": dict(r=4, std=0.1, seed=8,
                              target_modules=[*TP_LINEAR, *shared, "shared_expert_gate"]),
    }  # fmt: skip
    adapters = [make_random_adapter(model, tmp_path / n, **kw) for n, kw in specs.items()]
    one = _run(model, adapters, 1, max_lora_rank=16)
    two = _run(model, adapters, 2, max_lora_rank=16, fully_sharded_loras=fully_sharded)
    assert_same_outputs(one, two)


def test_moe_tp_refuses_a_shared_expert_that_does_not_split(tmp_path: Path) -> None:
    model = make_random_model(tmp_path / "m", "qwen3_5_moe", shared_expert_intermediate_size=47)
    with pytest.raises(ModelLoadError, match="shared_expert_intermediate_size=47 is not a") as e:
        LLMEngine(EngineConfig(model=str(model), tensor_parallel_size=2, num_threads=1))
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------- quantized bases

QUANT_ADAPTERS = {  # all-linear (the linear-attention projections too), attention, linear only
    "all8": dict(r=8),
    "attn16": dict(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "linear4": dict(r=4, target_modules=["in_proj_qkv", "in_proj_z", "in_proj_a", "out_proj"]),
}


@pytest.mark.parametrize("mode", list(ON_THE_FLY))
def test_quantized_at_load(mode: str, tmp_path: Path) -> None:
    """``--quantization int8/int4``: the linear-attention projections (fused in_proj_*,
    out_proj) are quantized as q/k/v/o are; a mixed batch equals transformers + PEFT on the
    model whose every projection is its quantized-then-dequantized weight."""
    model = make_random_model(tmp_path / "m", "qwen3_5", num_layers=2, hidden_size=64, seed=5)
    gs = ON_THE_FLY[mode]
    ref = write_dequantized(model, tmp_path / "ref", bits=8 if mode == "int8" else 4, group_size=gs)
    llm, _ = _check_mixed_batch(
        model, ref, tmp_path, tol=SAMPLE_TOL, adapters=QUANT_ADAPTERS, quantization=mode,
        quantization_group_size=gs,
    )  # fmt: skip
    m = llm.engine.model
    L = m.layers[min(m.linear_layers)]
    float_bytes = 4 * sum(a * b for _, (a, b) in m.cfg.linear.shapes.items())
    assert L.lin_in.nbytes + L.lin_out.nbytes < float_bytes * (0.4 if mode == "int8" else 0.25)


def test_quantized_checkpoints_are_refused_in_one_line(tmp_path: Path) -> None:
    """No checkpoint format's reader knows the linear-attention projections: refused by name."""
    model = make_random_model(tmp_path / "m", "qwen3_5", num_layers=2, hidden_size=64, seed=5)
    qdir, _ = write_gptq(model, tmp_path / "q", tmp_path / "ref", bits=4, group_size=32)
    with pytest.raises(ModelLoadError, match=r"quantized checkpoints \(gptq") as e:
        LLM(str(qdir), dtype="float32", skip_tokenizer_init=True)
    assert "\n" not in str(e.value)


def test_moe_adapter_naming_the_shared_experts_projections(tmp_path: Path) -> None:
    """PEFT saves ``all-linear`` on Qwen3.5-MoE as the names it wrapped: ``gate_proj`` /
    ``up_proj`` / ``down_proj`` are the shared expert's (its experts are packed, in every
    transformers version): the adapter loads and equals transformers + PEFT, not refused for
    per-expert modules that never existed."""
    model = make_random_model(tmp_path / "m", "qwen3_5_moe", num_layers=2, seed=5)
    names = ["gate_proj", "up_proj", "down_proj", "q_proj", "in_proj_qkv"]
    adapter = make_random_adapter(model, tmp_path / "a", r=8, target_modules=names, std=0.1)
    llm = LLM(str(model), dtype="float32", block_size=BLOCK, max_lora_rank=8)
    ids = _ids(12, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=1)
    out = llm.generate([ids], sp, LoRARequest("a", str(adapter)))[0]
    check_greedy(out.outputs[0], load_merged_reference(model, adapter), ids, SAMPLE_TOL)
