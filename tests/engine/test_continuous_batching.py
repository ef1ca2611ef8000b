"""Continuous batching: late arrivals, preemption, abort, slot limits, and no leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import LoRARequest, SamplingParams
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(model: Path, **kw) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(model), **kw))


def _run(engine: LLMEngine, hook=None) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        if hook:
            hook(step)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return done


def _solo(model: Path, prompt: str, lora: LoRARequest | None = None) -> list[int]:
    e = _engine(model, max_loras=2)
    e.add_request("solo", prompt, GREEDY, lora)
    return _run(e)["solo"]


def test_requests_join_mid_run(tiny_model: Path, adapters: dict[str, Path]) -> None:
    e = _engine(tiny_model, max_loras=4)
    lora = LoRARequest("a", adapters["all_r8"])
    e.add_request("r0", "Hello world!", GREEDY)

    def hook(step: int) -> None:
        if step == 3:
            e.add_request("r1", "What is the capital of France?", GREEDY, lora)
        if step == 6:
            e.add_request("r2", "def add(a, b):", GREEDY)

    done = _run(e, hook)
    assert done["r0"] == _solo(tiny_model, "Hello world!")
    assert done["r1"] == _solo(tiny_model, "What is the capital of France?", lora)
    assert done["r2"] == _solo(tiny_model, "def add(a, b):")
    assert e.is_idle()


def test_the_scheduler_reserves_slots_and_the_engine_fills_them(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    e = _engine(tiny_model, max_loras=2)
    lora = LoRARequest("a", adapters["all_r8"])
    e.add_request("r", "Hello world!", GREEDY, lora)
    assert e.adapters is not None
    batch = e.scheduler.schedule()
    ((seq, _),) = batch.items
    assert seq.slot is not None and e.adapters.slot_digest[seq.slot] == seq.adapter.ref.sha256
    assert e.adapters.bank.occupied_slots == () and batch.slot_rows == {}  # nothing copied
    e.adapters.activate(batch)
    assert e.adapters.bank.occupied_slots == (seq.slot,)
    assert batch.slot_rows == {seq.slot: e.adapters.bank.slot_rows(seq.slot)}
    assert _run(e)["r"] == _solo(tiny_model, "Hello world!", lora)  # the step is redone
    assert e.is_idle()


def test_preemption_under_tiny_block_budget(tiny_model: Path) -> None:
    """6 blocks of 4 tokens cannot hold 4 growing sequences: some are preempted and recomputed."""
    e = _engine(
        tiny_model, num_kv_blocks=12, block_size=4, max_model_len=24, enable_prefix_caching=False
    )
    prompts = ["Hello world! How", "What is the capital", "def add(a, b):", "Once upon a time"]
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", p, GREEDY)
    done = _run(e)
    assert e.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == _solo(tiny_model, p), p
    assert e.is_idle() and e.num_free_blocks == 12


def test_abort_frees_blocks_and_slot(tiny_model: Path, adapters: dict[str, Path]) -> None:
    e = _engine(tiny_model, max_loras=1)
    lora = LoRARequest("a", adapters["mlp_r16"])
    e.add_request("keep", "Hello world!", GREEDY)
    e.add_request("drop", "What is the capital of France?", SamplingParams(max_tokens=200), lora)
    e.step()
    e.step()
    assert e.num_free_blocks < e.pool.num_blocks
    assert e.abort_request("drop")
    assert not e.abort_request("drop")
    done = _run(e)
    assert "drop" not in done and "keep" in done
    assert e.is_idle()
    assert e.num_free_blocks == e.pool.num_blocks


def test_step_never_exceeds_max_loras_and_others_proceed(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """With one slot, requests for a second adapter wait while base requests keep running."""
    e = _engine(tiny_model, max_loras=1)
    a = LoRARequest("a", adapters["all_r8"])
    b = LoRARequest("b", adapters["mlp_r16"])
    e.add_request("a0", "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), a)
    e.add_request("b0", "Hello", GREEDY, b)  # must wait for the slot
    e.add_request("base", "Hello", GREEDY)  # behind b0 in the queue, must not wait for it
    seen_base_before_b = False
    while e.has_unfinished_requests():
        batch_adapters = set()
        outs = e.step()
        for seq in e.running_sequences():
            if seq.adapter is not None:
                batch_adapters.add(seq.adapter.ref.sha256)
        assert len(batch_adapters) <= 1
        ids = {o.request_id for o in outs}
        if "base" in ids and not any(s.request_id == "b0" for s in e.running_sequences()):
            seen_base_before_b = True
    assert seen_base_before_b
    assert e.is_idle()


def test_prompt_longer_than_budget_is_chunked(tiny_model: Path) -> None:
    e = _engine(tiny_model, max_num_batched_tokens=4)
    prompt = "Multi-LoRA serving runs many adapters on one base model at once."
    e.add_request("long", prompt, GREEDY)
    steps_before_first = 0
    while True:
        outs = e.step()
        steps_before_first += 1
        if outs:
            break
    n_prompt = len(e.tokenize(prompt))
    assert steps_before_first == -(-n_prompt // 4)
    done = _run(e)
    assert done["long"] == _solo(tiny_model, prompt)


@pytest.mark.parametrize("n", [1, 3])
def test_n_completions_and_seeds(tiny_model: Path, n: int) -> None:
    e = _engine(tiny_model)
    sp = SamplingParams(
        n=n, temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=8, ignore_eos=True
    )
    e.add_request("s", "Hello", sp)
    outs = []
    while e.has_unfinished_requests():
        outs += [o for o in e.step() if o.finished]
    assert len(outs[0].outputs) == n
    e.add_request("s2", "Hello", sp)
    again = []
    while e.has_unfinished_requests():
        again += [o for o in e.step() if o.finished]
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in outs[0].outputs]
    assert e.is_idle()


def _check_accounting(e: LLMEngine) -> None:
    """Block refcounts and slot users equal what the live sequences hold."""
    refs = [0] * e.pool.num_blocks
    users = [0] * e.config.max_loras
    for seq in e.scheduler.running + list(e.scheduler.waiting):
        for b in seq.block_ids:
            refs[b] += 1
        if seq.slot is not None:
            users[seq.slot] += 1
            # in-flight adapters stay in their slot: the slot still holds this adapter's digest
            assert e.adapters.slot_digest[seq.slot] == seq.adapter.ref.sha256
    assert refs == e.pool.ref_counts
    assert users == e.adapters.slot_users
    assert e.pool.num_free == sum(1 for r in refs if r == 0)


def test_random_arrivals_aborts_preemption_no_leaks(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """A storm of arrivals and aborts under a tight KV budget and 2 slots for 4 adapters."""
    import random

    rng = random.Random(0)
    e = _engine(
        tiny_model, max_loras=2, num_kv_blocks=14, block_size=4, max_model_len=48, max_num_seqs=6
    )
    loras = [None] + [
        LoRARequest(n, adapters[n]) for n in ("all_r8", "mlp_r16", "attn_r4_rslora", "patterns")
    ]
    prompts = [
        "Hello world! How",
        "What is the capital",
        "def add(a, b):",
        "Once upon a time",
        "Hi",
    ]
    live: list[str] = []
    finished = 0
    spec: dict[str, tuple] = {}
    results: dict[str, list[int]] = {}
    for step in range(120):
        if step < 80 and rng.random() < 0.5:
            rid = f"r{step}"
            sp = SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True)
            spec[rid] = (rng.choice(prompts) * rng.randint(1, 2), sp, rng.choice(loras))
            e.add_request(rid, *spec[rid])
            live.append(rid)
        if live and rng.random() < 0.1:
            victim = live.pop(rng.randrange(len(live)))
            e.abort_request(victim)
        for out in e.step():
            if out.finished:
                finished += 1
                live.remove(out.request_id)
                results[out.request_id] = out.outputs[0].token_ids
        _check_accounting(e)
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                finished += 1
                results[out.request_id] = out.outputs[0].token_ids
        _check_accounting(e)
    assert finished > 15
    assert e.scheduler.num_preemptions > 0
    assert e.is_idle() and e.num_free_blocks == e.pool.num_blocks
    # preempted and recomputed requests still produce what they produce alone
    solo = _engine(tiny_model, max_loras=1)
    for rid, tokens in results.items():
        solo.add_request(rid, *spec[rid])
        while solo.has_unfinished_requests():
            for out in solo.step():
                if out.finished:
                    assert out.outputs[0].token_ids == tokens, rid
