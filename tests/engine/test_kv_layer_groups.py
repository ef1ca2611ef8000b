"""KV-cache groups cut at layer boundaries (``kv_cache_layer_groups``): an adapter that leaves
the first layers alone keys those layers' blocks as base blocks (``loraplex.lora.kv_reach``),
so it shares them with the base model's requests of the same salt, and outputs still equal
transformers + PEFT; an adapter that touches layer 0, or another salt, shares nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex import LoRARequest, SamplingParams
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.sequence import Sequence
from loraplex.kv.block_pool import hash_prefix_blocks, salted_namespace
from loraplex.kv.groups import group_block_key
from loraplex.requests import GenerationRequest
from loraplex.testing import (
    check_greedy,
    load_merged_reference,
    make_random_adapter,
    make_random_model,
)
from loraplex.types import BASE_NAMESPACE

BLOCK = 4
N_NEW = 6
SAMPLE_TOL = 2e-4  # float32 logprobs, as the Llama mixed-batch test
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = torch.randint(3, 250, (22,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("layer_groups")
    base = make_random_model(root / "base", "llama", num_layers=4, seed=9)
    upper = make_random_adapter(  # layers 2, 3 only: layers 0, 1 keep the base's KV
        base, root / "upper", r=4, seed=1, target_modules=ALL, layers_to_transform=[2, 3]
    )
    lower = make_random_adapter(base, root / "lower", r=4, seed=2, target_modules=ALL)
    return {
        "base": base,
        "adapters": {"upper": upper, "lower": lower},
        "refs": {
            None: load_merged_reference(base, None),
            "upper": load_merged_reference(base, upper),
            "lower": load_merged_reference(base, lower),
        },
    }


def _engine(setup: dict) -> LLMEngine:
    cfg = EngineConfig(
        model=str(setup["base"]),
        dtype="float32",
        block_size=BLOCK,
        kv_cache_layer_groups=2,
        max_loras=2,
    )
    e = LLMEngine(cfg)
    assert [g.layers for g in e.cache.groups] == [(0, 1), (2, 3)]
    return e


def _run(e: LLMEngine, setup: dict, name: str | None, salt: str | None = None):
    """Run one request to the end; returns (output, its group tables after admission)."""
    lora = LoRARequest(name, setup["adapters"][name]) if name else None
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    req = GenerationRequest(f"{name}-{salt}-{e.pool.query_tokens}", PROMPT, sp, lora, None, salt)
    e.add_prepared(e.prepare_request(req))
    tables: list[list[int]] | None = None
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                return out, tables
        seq: Sequence = e.scheduler.running[0]
        tables = tables or [list(t) for t in seq.block_tables]
    raise AssertionError("no output")


def _check(out: object, setup: dict, name: str | None) -> None:
    check_greedy(out.outputs[0], setup["refs"][name], PROMPT, SAMPLE_TOL)  # type: ignore[attr-defined]


def _base_blocks(e: LLMEngine, salt: str | None) -> list[int | None]:
    """The cached group-0 blocks of PROMPT's full blocks under the (salted) base namespace."""
    chain = hash_prefix_blocks(salted_namespace(BASE_NAMESPACE, salt), PROMPT, BLOCK)
    return [e.pool.cached.get(group_block_key(h, 0)) for h in chain[: (len(PROMPT) - 1) // BLOCK]]


def test_lower_layers_shared_with_the_base(setup: dict) -> None:
    e = _engine(setup)
    base, _ = _run(e, setup, None)
    _check(base, setup, None)
    shared = _base_blocks(e, None)
    assert None not in shared and len(shared) == 5
    writes: list[torch.Tensor] = []  # group 0's slot mapping of each step
    prepare = e.runner.prepare

    def spy(*args: object) -> object:
        fb, *rest = prepare(*args)  # type: ignore[arg-type]
        writes.append(fb.attn.kv_groups[0].slot_mapping.clone())
        return (fb, *rest)

    e.runner.prepare = spy  # type: ignore[method-assign]
    up, tables = _run(e, setup, "upper")
    e.runner.prepare = prepare  # type: ignore[method-assign]
    assert up.num_cached_tokens == 0  # its upper layers are its own: all recomputed
    # its recomputed lower-layer KV goes to the trash page, never into the shared blocks
    first = torch.cat(writes)[: 5 * BLOCK]
    assert (first // BLOCK == e.cache.trash_block).all()
    assert not (torch.cat(writes)[5 * BLOCK :] // BLOCK == e.cache.trash_block).any()
    assert tables is not None and tables[0][:5] == shared  # its lower layers' blocks: the base's
    assert not set(tables[1]) & set(shared)
    _check(up, setup, "upper")
    again, tables = _run(e, setup, "upper")  # its own upper blocks now cached: a full hit
    assert again.num_cached_tokens == 5 * BLOCK and tables[0][:5] == shared
    _check(again, setup, "upper")
    low, tables = _run(e, setup, "lower")  # touches layer 0: nothing shared
    assert low.num_cached_tokens == 0 and not set(tables[0]) & set(shared)
    _check(low, setup, "lower")
    salted, tables = _run(e, setup, "upper", salt="other-tenant")  # never across salts
    assert not set(tables[0]) & set(shared)
    _check(salted, setup, "upper")
    assert e.is_idle()


def test_mixed_batch_with_layer_groups_is_exact(setup: dict) -> None:
    """Base, upper and lower on one prompt in one batch (nothing cached yet), then again
    (upper's lower-layer blocks from the base's): every output equals its reference."""
    e = _engine(setup)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    for round_ in range(2):
        names = [None, "upper", "lower"]
        for name in names:
            lora = LoRARequest(name, setup["adapters"][name]) if name else None
            e.add_request(f"{name}-{round_}", PROMPT, sp, lora)
        outs = {}
        while e.has_unfinished_requests():
            outs.update({o.request_id: o for o in e.step() if o.finished})
        for name in names:
            _check(outs[f"{name}-{round_}"], setup, name)
    assert e.is_idle()


def test_windowed_model_shares_its_lower_groups(tmp_path: Path) -> None:
    """Gemma 3 (window 8, sliding and global layers alternating, 8 layers) in 4 groups: an
    adapter on layers 4-7 keys the global and the sliding group of layers 0-3 as base blocks.
    After a base request it takes the base's blocks in both (the sliding one only those its
    window still sees), its own in the others, and equals transformers + PEFT."""
    types = ["sliding_attention", "full_attention"] * 4
    base = make_random_model(
        tmp_path / "g3", "gemma3_text", num_layers=8, head_dim=16, sliding_window=8,
        layer_types=types, seed=4,
    )  # fmt: skip
    upper = make_random_adapter(
        base, tmp_path / "up", r=4, seed=3, target_modules=ALL, layers_to_transform=[4, 5, 6, 7]
    )
    e = LLMEngine(
        EngineConfig(
            model=str(base), dtype="float32", block_size=BLOCK, kv_cache_layer_groups=4,
            max_loras=1,
        )
    )  # fmt: skip
    groups = e.cache.groups
    assert [(g.layers, g.window) for g in groups] == [
        ((1, 3), None),
        ((5, 7), None),
        ((0, 2), 8),
        ((4, 6), 8),
    ]
    setup = {"adapters": {"upper": upper}}
    base_out, _ = _run(e, setup, None)
    check_greedy(base_out.outputs[0], load_merged_reference(base, None), PROMPT, SAMPLE_TOL)
    up, tables = _run(e, setup, "upper")
    check_greedy(up.outputs[0], load_merged_reference(base, upper), PROMPT, SAMPLE_TOL)
    chain = hash_prefix_blocks(BASE_NAMESPACE, PROMPT, BLOCK)[: (len(PROMPT) - 1) // BLOCK]
    for g in (0, 2):  # base-keyed: the blocks the base request published (still cached)
        cached = [e.pool.cached.get(group_block_key(h, g)) for h in chain]
        assert None not in cached and tables[g][: len(chain)] == cached, g
    base_blocks = {
        b for h in chain for g in (0, 2) if (b := e.pool.cached.get(group_block_key(h, g)))
    }
    assert not (set(tables[1]) | set(tables[3])) & base_blocks
    assert e.is_idle()
