"""Sliding-window layers through the engine, against transformers: prompts three windows long,
prefills chunked across the window by a small token budget, decodes past it, prefix-cache
hits that reach beyond the window, and preemption. Windowed layers sit in KV-cache groups of
their own (``loraplex.kv.groups``) that keep only the blocks inside the window: the blocks one
long sequence holds there stay bounded by the window, and a prefix hit needs only the blocks
the window still sees.

Mistral's ``sliding_window`` (every layer) no longer caps the context: it is exact past it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.kv.cache import PagedKVCache
from loraplex.kv.groups import NULL_BLOCK, blocks_per_sequence, layers_per_group, max_tokens
from loraplex.testing import check_greedy, load_merged_reference, make_random_model

WINDOW = 8
BLOCK = 4
N_NEW = 12  # decodes from 3 windows to 4.5 windows past the start
SAMPLE_TOL = 2e-4  # float32 logprobs, as the Llama mixed-batch test
PROMPT_TOL = 1e-4  # float32 prompt logprobs, as the Llama prompt-logprob test
ALTERNATE = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
S, F = "sliding_attention", "full_attention"

FAMILIES: dict[str, dict] = {
    "gemma2": dict(
        arch="gemma2",
        layer_types=ALTERNATE,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=24,
    ),
    "gemma3_text": dict(arch="gemma3_text", layer_types=ALTERNATE, final_logit_softcapping=3.0),
    "gemma3": dict(arch="gemma3", layer_types=ALTERNATE),
    "mistral": dict(arch="mistral"),  # every layer windowed: one windowed group
    # 5 sliding : 2 full layers -> groups of 2 layers, the last sliding group padded
    "gemma3_5to2": dict(arch="gemma3_text", num_layers=7, layer_types=[S, S, S, F, S, S, F]),
    # Qwen2: full layer 0, windowed from max_window_layers on -> 4 groups of one layer
    "qwen2": dict(arch="qwen2", use_sliding_window=True, max_window_layers=1),
    # GPT-OSS: sliding / full alternate, attention sinks on both kinds (decode: torch)
    "gpt_oss": dict(arch="gpt_oss", layer_types=ALTERNATE, intermediate_size=32),
}
GROUPS = {
    "gemma2": 2,
    "gemma3_text": 2,
    "gemma3": 2,
    "mistral": 1,
    "gemma3_5to2": 4,
    "qwen2": 4,
    "gpt_oss": 2,
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    spec = dict(FAMILIES[request.param])
    spec.setdefault("num_layers", 4)
    d = make_random_model(
        tmp_path_factory.mktemp(request.param),
        spec.pop("arch"),
        head_dim=16,
        sliding_window=WINDOW,
        seed=3,
        **spec,
    )
    return {"dir": d, "ref": load_merged_reference(d, None), "name": request.param}


def _llm(d: Path, **kw: object) -> LLM:
    """An engine on ``d`` without LoRA, in float32, with ``BLOCK``-token blocks."""
    return LLM(str(d), enable_lora=False, dtype="float32", block_size=BLOCK, **kw)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _prompt_reference(model: object, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) rows: [len(ids) - 1, vocab]."""
    logits = model(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check(out: object, ids: list[int], ref: object, prompt_logprobs: bool) -> None:
    """Greedy tokens, sample logprobs and (if asked) prompt logprobs equal the reference's."""
    check_greedy(out.outputs[0], ref, ids, SAMPLE_TOL)  # type: ignore[attr-defined]
    if prompt_logprobs:
        want_prompt = _prompt_reference(ref, ids)
        worst = max(
            abs(val - float(want_prompt[i, tid]))
            for i, entry in enumerate(out.prompt_logprobs[1:])  # type: ignore[attr-defined]
            for tid, val in entry.items()
        )
        assert worst < PROMPT_TOL, worst


def test_chunked_prefill_and_decode_past_the_window(family: dict) -> None:
    """Three prompts of 3 windows in chunks of at most 6 tokens (each chunk's context crosses
    the window), then decodes past it, all in one batch."""
    llm = _llm(family["dir"], max_num_batched_tokens=6)
    assert llm.engine.max_model_len > WINDOW  # the window caps nothing
    prompts = [_ids(3 * WINDOW + k, seed=k) for k in range(3)]
    sp = SamplingParams(
        temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    outs = llm.generate(prompts, sp)
    for ids, out in zip(prompts, outs, strict=True):
        _check(out, ids, family["ref"], prompt_logprobs=True)
    assert llm.engine.is_idle()


def test_prefix_cache_hit_crossing_the_window(family: dict) -> None:
    """A second request sharing a 6-block prefix (3 windows) hits the prefix cache for all of
    it and still equals the reference; a fresh prompt of the same length hits nothing."""
    llm = _llm(family["dir"])
    pool = llm.engine.pool
    shared = _ids(3 * WINDOW, seed=10)
    first, second = shared + _ids(3, seed=11), shared + _ids(5, seed=12)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    (a,) = llm.generate([first], sp)
    hits = pool.hit_tokens
    (b,) = llm.generate([second], sp)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == len(shared) > WINDOW
    assert pool.hit_tokens - hits == len(shared)
    _check(a, first, family["ref"], prompt_logprobs=False)
    _check(b, second, family["ref"], prompt_logprobs=False)
    (c,) = llm.generate([_ids(len(second), seed=13)], sp)
    assert c.num_cached_tokens == 0
    assert llm.engine.is_idle()


def test_mistral_window_shorter_than_the_context_is_exact(tmp_path: Path) -> None:
    """Mistral's window used to cap max_model_len at the window; now it is masked, so a
    context of many windows serves and equals transformers (its window on every layer)."""
    d = make_random_model(tmp_path / "mistral", "mistral", sliding_window=WINDOW, seed=4)
    llm = _llm(d)
    assert llm.engine.max_model_len == 512  # max_position_embeddings, not the window
    assert [L.window for L in llm.engine.model.layers] == [0, 0]
    ids = _ids(5 * WINDOW, seed=5)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    (out,) = llm.generate([ids], sp)
    _check(out, ids, load_merged_reference(d, None), prompt_logprobs=False)


def _windowed_live(tables: list[list[int]], groups: list) -> list[int]:
    """Blocks held by each windowed group's table."""
    return [
        sum(b != NULL_BLOCK for b in t)
        for t, g in zip(tables, groups, strict=True)
        if g.window is not None
    ]


def test_windowed_groups_hold_only_the_window(family: dict) -> None:
    """One sequence of 6.5 windows (prompt in chunks of 6, then decodes): between steps every
    windowed group holds at most ``ceil((window - 1) / block) + 1`` blocks (those a query at
    the next position sees) while the full groups hold the whole context, and the outputs
    equal transformers'."""
    chunk = 6
    llm = _llm(family["dir"], max_num_batched_tokens=chunk)
    e = llm.engine
    groups = e.cache.groups
    assert len(groups) == GROUPS[family["name"]]
    bound = -(-(WINDOW - 1) // BLOCK) + 1
    ids = _ids(5 * WINDOW, seed=20)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    e.add_request("long", ids, sp)
    peak, out = 0, None
    while e.has_unfinished_requests():
        for seq in e.scheduler.running:  # what it holds between steps
            peak = max(peak, *_windowed_live(seq.block_tables, groups))
            assert len(seq.block_ids) == e.pool.num_blocks - e.pool.num_free
            for t, g in zip(seq.block_tables, groups, strict=True):
                if g.window is None:
                    assert NULL_BLOCK not in t and len(t) == -(-seq.num_computed_tokens // BLOCK)
        for o in e.step():
            out = o if o.finished else out
    assert 0 < peak <= bound < -(-(len(ids) + N_NEW) // BLOCK)
    assert out is not None
    _check(out, ids, family["ref"], prompt_logprobs=False)
    assert e.is_idle()


def test_preemption_with_windowed_groups(family: dict) -> None:
    """Three sequences in a pool that holds about one and a half of them: preempted and
    recomputed (their windowed tables rebuilt), every output still equals transformers'."""
    prompts = [_ids(3 * WINDOW + k, seed=30 + k) for k in range(3)]
    probe = _llm(family["dir"])
    longest = max(map(len, prompts)) + N_NEW
    per_seq = blocks_per_sequence(probe.engine.cache.groups, longest, BLOCK, chunk=6)
    llm = _llm(family["dir"], max_num_batched_tokens=6, num_kv_blocks=per_seq * 3 // 2)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, sp)
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs, strict=True):
        _check(out, ids, family["ref"], prompt_logprobs=False)
    assert llm.engine.is_idle()


def test_the_kv_budget_buys_pages_of_a_group(family: dict) -> None:
    """A KV budget of 20 pages holds 20 blocks of one group's layers (not of every layer; one
    of them the trash page where several groups are), and
    max_model_len is the longest sequence those blocks hold alone: a windowed group needs only
    its window's blocks (every layer windowed: the KV caps no length)."""
    probe = _llm(family["dir"])
    groups, mc = probe.engine.cache.groups, probe.engine.model_config
    page = PagedKVCache.bytes_per_block(
        layers_per_group(groups), BLOCK, mc.num_kv_heads, mc.head_dim, torch.float32
    )
    llm = _llm(family["dir"], max_num_batched_tokens=6, kv_cache_memory_bytes=20 * page)
    e = llm.engine
    trash = len(groups) > 1  # one page of the budget is the cache's trash page
    assert e.pool.num_blocks == 20 - trash and e.cache.nbytes == 20 * page
    limit = mc.max_position_embeddings
    assert e.max_model_len == max_tokens(groups, 20 - trash, BLOCK, 6, limit)
    if any(g.window is None for g in groups):  # full groups: 20 blocks shared among them
        full = sum(g.window is None for g in groups)
        assert e.max_model_len <= (20 - trash) // full * BLOCK
    else:
        assert e.max_model_len == limit
    if len(groups) > 1:  # a flat cache of every layer would hold fewer blocks
        flat = PagedKVCache.bytes_per_block(
            mc.num_layers, BLOCK, mc.num_kv_heads, mc.head_dim, torch.float32
        )
        assert flat > page
