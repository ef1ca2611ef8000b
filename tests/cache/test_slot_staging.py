"""Slot loads off the engine thread: a request whose adapter is still being copied waits while
the others keep running, and the outputs still equal the merged references."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.lora.slots import LoRASlotBank, NeedsCompaction
from loraplex.testing import load_merged_reference, reference_greedy
from loraplex.testing.sync import EVENT_TIMEOUT_S, wait_until

N_NEW = 8


class Gate:
    """Wraps the real bank's ``replace_lora``: copies made off the engine thread wait for ``open``."""

    def __init__(self, bank: LoRASlotBank, engine_thread: int) -> None:
        self.bank, self.engine_thread = bank, engine_thread
        self.real = bank.replace_lora
        self.open = threading.Event()
        self.started = threading.Event()
        self.threads: list[int] = []

    def __call__(self, slot, weights, **kw):  # type: ignore[no-untyped-def]
        self.threads.append(threading.get_ident())
        if threading.get_ident() != self.engine_thread:
            self.started.set()
            assert self.open.wait(EVENT_TIMEOUT_S), "the test never opened the gate"
        return self.real(slot, weights, **kw)


@pytest.fixture()
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), enable_lora=True, max_loras=2, max_lora_rank=64, dtype="float32")


def test_loading_request_waits_while_others_run(
    llm: LLM, tiny_model: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = llm.engine
    assert eng.adapters is not None
    gate = Gate(eng.adapters.bank, threading.get_ident())
    monkeypatch.setattr(eng.adapters.bank, "replace_lora", gate)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    a, b = "all_r8", "mlp_r16"
    gate.open.set()
    eng.add_request("a", "Once upon a time", params, LoRARequest(a, adapters[a]))
    wait_until(lambda: bool(eng.step()), what="request a ran a step")
    gate.open.clear()
    eng.add_request("b", "def add(a, b):", params, LoRARequest(b, adapters[b]))
    for _ in range(3):  # b's copy is held by the gate: a keeps running, b does not
        outs = eng.step()
        assert [o.request_id for o in outs] == ["a"]
    assert gate.started.is_set()  # b's copy began, on another thread
    assert eng.requests["b"].seqs[0].output_token_ids == []
    gate.open.set()
    results = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert set(results) == {"a", "b"}
    assert all(t != threading.get_ident() for t in gate.threads)  # no copy on the engine thread
    for rid, name, prompt in (("a", a, "Once upon a time"), ("b", b, "def add(a, b):")):
        ref = load_merged_reference(tiny_model, adapters[name])
        want, _ = reference_greedy(ref, tok(prompt).input_ids, N_NEW)
        assert results[rid] == want, rid
    assert eng.is_idle()
    eng.adapters.check_invariants()


def test_engine_with_only_loading_requests_waits_then_runs(
    llm: LLM, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = llm.engine
    assert eng.adapters is not None
    gate = Gate(eng.adapters.bank, threading.get_ident())
    monkeypatch.setattr(eng.adapters.bank, "replace_lora", gate)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    eng.add_request("c", "Hello", params, LoRARequest("patterns", adapters["patterns"]))
    assert eng.step() == [] and eng.last_step.num_seqs == 0  # nothing else to run: it waited
    assert gate.started.is_set() and eng.has_unfinished_requests()
    gate.open.set()
    done: list[str] = []
    wait_until(
        lambda: done.extend(o.request_id for o in eng.step() if o.finished) or done == ["c"],
        what="request c finished",
    )
    assert eng.is_idle()


def test_set_lora_without_compaction_leaves_the_bank_unchanged() -> None:
    shapes = {(0, "q_proj"): (8, 8)}
    bank = LoRASlotBank(shapes, 3, 4, torch.float32, "cpu")

    class W:
        def __init__(self, r: int, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            self.a, self.b, self.scale = torch.randn(r, 8, generator=g), torch.randn(8, r), 1.0

    bank.set_lora(0, {(0, "q_proj"): W(2, 0)})  # rows 0..2
    bank.set_lora(1, {(0, "q_proj"): W(4, 1)})  # 2..6
    bank.set_lora(2, {(0, "q_proj"): W(4, 2)})  # 6..10
    bank.reset_lora(0)  # free: 0..2 and 10..12, four rows in two fragments
    a, bt = bank.tables(0, "q_proj")
    before, version = (a.clone(), bt.clone()), bank.layout_version
    with pytest.raises(NeedsCompaction):
        bank.set_lora(0, {(0, "q_proj"): W(4, 3)}, compact=False)
    assert bank.layout_version == version and bank.occupied_slots == (1, 2)
    assert torch.equal(a, before[0]) and torch.equal(bt, before[1])
    bank.compact()  # the engine thread's part, between steps
    assert bank.slot_rows(1) == (0, 4) and bank.slot_rows(2) == (4, 8)
    assert torch.equal(a[:8], torch.cat([before[0][2:6], before[0][6:10]]))
    assert not a[8:].any() and not bt[8:].any()  # rows nobody owns are zero
    bank.set_lora(0, {(0, "q_proj"): W(4, 3)}, compact=False)
    assert bank.slot_rows(0) == (8, 12)


def test_a_failed_copy_over_an_occupied_slot_leaves_it_empty() -> None:
    """The stager writes a new adapter over a retired one's rows; one that fails validation is
    reported to the engine thread and leaves the slot empty (no stale rows), never half-written."""
    from loraplex.cache.staging import SlotStager

    shapes = {(0, "q_proj"): (8, 8), (0, "v_proj"): (8, 8)}
    bank = LoRASlotBank(shapes, 2, 4, torch.float32, "cpu")

    class W:
        def __init__(self, r: int, d_in: int = 8) -> None:
            self.a, self.b, self.scale = torch.ones(r, d_in), torch.ones(8, r), 1.0

    stager = SlotStager(bank)
    good = stager.submit(0, "a" * 64, {(0, "q_proj"): W(4), (0, "v_proj"): W(4)})
    assert good.done.wait(EVENT_TIMEOUT_S) and good.error is None and good.seconds > 0
    assert bank.slot_rows(0) == (0, 4)
    bad = stager.submit(0, "b" * 64, {(0, "q_proj"): W(4), (0, "v_proj"): W(4, d_in=7)})
    assert bad.done.wait(EVENT_TIMEOUT_S)
    assert isinstance(bad.error, ValueError) and "expected" in str(bad.error)
    assert bank.occupied_slots == ()
    for key in shapes:
        a, bt = bank.tables(*key)
        assert not a.any() and not bt.any()
    again = stager.submit(0, "c" * 64, {(0, "v_proj"): W(2)})  # over an empty slot
    assert again.done.wait(EVENT_TIMEOUT_S) and again.error is None
    assert bank.slot_rows(0) == (0, 2) and bank.slot_modules(0) == {(0, "v_proj")}


def test_loads_in_a_row_reuse_one_writer_thread_which_exits_when_idle() -> None:
    """A load at every step must not cost the engine thread a thread start each time: the
    writer waits for the next job, and exits only after ``idle_exit_s`` without one."""
    from loraplex.cache import staging

    shapes = {(0, "q_proj"): (8, 8)}
    threads: list[int] = []

    class Bank(LoRASlotBank):
        def replace_lora(self, slot, weights, **kw):  # type: ignore[no-untyped-def]
            threads.append(threading.get_ident())
            super().replace_lora(slot, weights, **kw)

    class W:
        def __init__(self, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            self.a, self.b, self.scale = torch.randn(2, 8, generator=g), torch.randn(8, 2), 1.0

    # the default 2 s idle wait: a loaded machine must not deschedule this thread between two
    # submits for longer than the writer waits (with 0.2 s it could, and the test would race)
    stager = staging.SlotStager(Bank(shapes, 2, 4, torch.float32, "cpu"))
    for i in range(5):
        job = stager.submit(i % 2, f"{i:064x}", {(0, "q_proj"): W(i)})
        assert job.done.wait(EVENT_TIMEOUT_S) and job.error is None
    assert len(set(threads)) == 1 and threading.get_ident() not in threads
    assert not stager.busy
    wait_until(
        lambda: not any(t.ident == threads[0] for t in threading.enumerate()),
        what="the idle writer thread exited",
    )
    job = stager.submit(0, "f" * 64, {(0, "q_proj"): W(9)})  # a new one starts for the next
    assert job.done.wait(EVENT_TIMEOUT_S) and job.error is None and len(threads) == 6


class Batch:
    """A step's slots as the engine hands them to ``stage``/``activate``."""

    def __init__(self, slots: dict) -> None:  # type: ignore[type-arg]
        self.slots = slots
        self.slot_rows: dict[int, tuple[int, int]] = {}

    def slot_adapters(self) -> dict:  # type: ignore[type-arg]
        return self.slots


def test_fragmented_rows_are_compacted_between_steps(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    from loraplex.testing import ALL_PROJ, make_random_adapter

    llm = LLM(str(tiny_model), enable_lora=True, max_loras=3, max_lora_rank=16, dtype="float32")
    eng = llm.engine
    cache, catalog = eng.adapters, eng.adapter_catalog
    assert cache is not None and catalog is not None
    r16 = make_random_adapter(tiny_model, tmp_path / "r16", r=16, target_modules=ALL_PROJ, seed=9)
    held = []

    def get(name: str, path: Path):  # type: ignore[no-untyped-def]
        a, _ = cache.acquire(catalog.spec(LoRARequest(name, path)))
        held.append(a)
        return a

    first = [get(n, adapters[n]) for n in ("all_r8", "mlp_r16", "alllinear_r12")]
    slots = [cache.reserve_slot(a) for a in first]
    assert None not in slots
    cache.activate(Batch(dict(zip(slots, first, strict=True))))
    assert [cache.bank.slot_rows(s) for s in slots] == [(0, 8), (8, 24), (24, 36)]
    cache.release_slot(slots[0])  # idle: its slot may be given to another adapter
    new = get("r16", r16)
    s = cache.reserve_slot(new)
    assert s == slots[0]
    batch = Batch({s: new})
    rounds = 0
    while cache.stage(batch):  # 16 rows free only as 8 + 12: the copy comes back, compaction
        rounds += 1
        cache.wait_staging(EVENT_TIMEOUT_S)
    assert rounds == 2  # the first copy found fragments; the second, after compaction, fitted
    assert cache.bank.slot_rows(slots[1]) == (0, 16) and cache.bank.slot_rows(slots[2]) == (16, 28)
    assert batch.slot_rows == {s: (28, 44)} == {s: cache.bank.slot_rows(s)}
    a_tab, _ = cache.bank.tables(0, "q_proj")
    w = new.weights[(0, "q_proj")]
    assert torch.equal(a_tab[28:44], w.a.to(a_tab.dtype))
    assert not a_tab[44:].any()  # rows nobody owns are zero
    moved = first[1].weights[(0, "down_proj")]  # mlp_r16's rows moved down intact
    assert torch.equal(cache.bank.tables(0, "down_proj")[0][0:16], moved.a)
    for slot in (s, slots[1], slots[2]):
        cache.release_slot(slot)
    for a in held:
        cache.release(a)
    cache.check_invariants()
