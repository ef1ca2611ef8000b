"""LoRA on the token embedding and the LM head, gathered per row in a mixed batch: the slot
tables (the embedding's A stored transposed) and every CPU ops backend against a dense
reference, built from the adapters' own A and B."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from loraplex.checkpoint.modules import EMBED_KEY, LM_HEAD_KEY
from loraplex.lora.ops import TorchLoRAOps, TorchReferenceOps
from loraplex.lora.plan import LoRAPlanCosts, plan_lora_batch, plan_rows
from loraplex.lora.slots import _GRAIN, LoRASlotBank, _split

VOCAB, D = 97, 24
SHAPES = {(0, "q_proj"): (D, D), EMBED_KEY: (VOCAB, D), LM_HEAD_KEY: (D, VOCAB)}
LOWP = (torch.bfloat16, torch.float16)
NEVER_MERGE = LoRAPlanCosts(run_overhead_us=0.0, mask_overhead_us=0.0)
ALWAYS_MERGE = LoRAPlanCosts(mac_ns=0.0, mask_overhead_us=0.0, bandwidth_gbs=1e12)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@dataclass
class W:
    """Stand-in for ``loraplex.lora.adapter.LoRAModuleWeights``."""

    a: torch.Tensor  # [r, d_in]
    b: torch.Tensor  # [d_out, r]
    scale: float


def adapter(seed: int, ranks: dict[tuple[int, str], int]) -> dict[tuple[int, str], W]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, r in ranks.items():
        d_in, d_out = SHAPES[key]
        a, b = torch.randn(r, d_in, generator=g), torch.randn(d_out, r, generator=g) / r
        out[key] = W(a, b, 0.5 + seed)
    return out


# slot -> adapter: both vocab modules, an ordinary one (their rows zero), the head only, the
# embedding only; ranks differ per module (rank_pattern)
ADAPTERS = {
    0: adapter(1, {EMBED_KEY: 3, LM_HEAD_KEY: 6, (0, "q_proj"): 2}),
    1: adapter(2, {(0, "q_proj"): 8}),
    2: adapter(3, {LM_HEAD_KEY: 8}),
    3: adapter(4, {EMBED_KEY: 7}),
}
FIRST_IN_SLOT_1 = adapter(5, {(0, "q_proj"): 4})


def dense(w: W | None) -> torch.Tensor | None:
    """The module's merged delta ``scale * B @ A`` in float64: [d_out, d_in]."""
    return None if w is None else w.scale * w.b.double() @ w.a.double()


def filled_bank(dtype: torch.dtype) -> LoRASlotBank:
    """Every adapter loaded, slot 1 first with a rank-4 one, then reset and reloaded with its
    rank-8 one: 11 rows are free, but as 4 + 7, so the bank compacts (slots 2 and 3 move, the
    transposed embedding table's columns too)."""
    bank = LoRASlotBank(SHAPES, 4, 8, dtype, "cpu")
    for slot, weights in ADAPTERS.items():
        bank.set_lora(slot, FIRST_IN_SLOT_1 if slot == 1 else weights)
    before = bank.slot_rows(3)
    bank.reset_lora(1)
    bank.set_lora(1, ADAPTERS[1])
    assert bank.slot_rows(3) != before  # compacted
    return bank


def step(bank: LoRASlotBank) -> tuple[list[int | None], list[tuple[int, int, int, int]]]:
    """A step's tokens in the runner's order (base first, then by row start): the slot of each
    token and the segments."""
    slots: list[int | None] = [None, None]
    order = sorted(ADAPTERS, key=lambda s: bank.slot_rows(s)[0])
    for i, slot in enumerate(order):
        slots += [slot] * (1 + 2 * i)  # 1, 3, 5, 7 tokens
    segs, t = [], 2
    for i, slot in enumerate(order):
        n = 1 + 2 * i
        segs.append((t, t + n, *bank.slot_rows(slot)))
        t += n
    return slots, segs


def cpu_kernel_ops():
    from loraplex.lora.cpu_ops import CPUKernelLoRAOps, load_kernel

    return CPUKernelLoRAOps(load_kernel(), TorchLoRAOps(upcast=LOWP, native_runs=LOWP))


OPS = {
    "reference": TorchReferenceOps,
    "torch": TorchLoRAOps,
    "torch-upcast": lambda: TorchLoRAOps(upcast=LOWP, native_runs=LOWP),
    "cpu-kernel": cpu_kernel_ops,
}


@pytest.mark.parametrize("costs", [NEVER_MERGE, ALWAYS_MERGE], ids=["runs", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(OPS))
def test_embedding_and_head_match_the_dense_reference(name, dtype, costs) -> None:
    ops = OPS[name]()
    bank = filled_bank(ops.table_dtype(dtype))
    slots, segs = step(bank)
    T = len(slots)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (T,), generator=g)  # [T]
    h0 = torch.randn(T, D, generator=g).to(dtype)  # [T, D] the looked-up embeddings
    plan = plan_lora_batch(T, segs, bank.dtype, "cpu", costs)

    # the embedding: h[t] += (scale * B @ A)[:, ids[t]] for its adapter, nothing for base tokens
    a, bt = bank.tables(*EMBED_KEY)
    assert a.t().is_contiguous() and a.t().shape == (VOCAB, bank.capacity)
    h = h0.clone()
    ops.embed(ids, a.t(), bt, h, plan)
    want = h0.double()
    for t, slot in enumerate(slots):
        delta = dense(ADAPTERS[slot].get(EMBED_KEY)) if slot is not None else None
        if delta is not None:
            want[t] += delta[:, ids[t]]
    torch.testing.assert_close(h, want.to(dtype), **TOL[dtype])
    untouched = [t for t, s in enumerate(slots) if s is None or EMBED_KEY not in ADAPTERS[s]]
    assert torch.equal(h[untouched], h0[untouched])  # zero rows: exactly no delta

    # the head, over the logits rows only: logits[i] += x[i] @ (scale * B @ A).T
    rows = [0, 2, 5, 6, 9, T - 1]  # a base row, the one-token segment, some rows of the others
    x = torch.randn(len(rows), D, generator=g).to(dtype)  # [N, D] the head's input
    logits0 = torch.randn(len(rows), VOCAB, generator=g)  # [N, vocab] float32, as the model's
    rows_plan = plan_rows(plan, rows)
    a, bt = bank.tables(*LM_HEAD_KEY)
    logits = logits0.clone()
    ops.apply_many(x, logits, ((a, bt, 0, VOCAB),), rows_plan)
    want = logits0.double()
    for i, t in enumerate(rows):
        slot = slots[t]
        delta = dense(ADAPTERS[slot].get(LM_HEAD_KEY)) if slot is not None else None
        if delta is not None:
            want[i] += delta @ x[i].double()
    torch.testing.assert_close(logits, want.float(), **TOL[dtype])
    assert torch.equal(logits[0], logits0[0])  # the base row


def test_plan_rows_keeps_each_rows_segment() -> None:
    plan = plan_lora_batch(12, [(2, 5, 0, 8), (5, 6, 8, 12), (9, 12, 12, 20)], torch.float32, "cpu")
    got = plan_rows(plan, [0, 3, 4, 7, 11])
    assert got.num_tokens == 5 and got.segments == ((1, 3, 0, 8), (4, 5, 12, 20))
    assert [(r.tok_start, r.tok_end, r.mask) for r in got.runs] == [(1, 3, None), (4, 5, None)]
    assert got.num_rows == 20 and got.modules == plan.modules
    assert plan_rows(plan, []).segments == ()
    with pytest.raises(ValueError, match="increasing"):
        plan_rows(plan, [3, 2])
    with pytest.raises(ValueError, match=r"\[0, 12\)"):
        plan_rows(plan, [4, 12])


def test_vocab_wide_tables_are_written_in_blocks_under_the_grain() -> None:
    """A slot write never starts an OpenMP team of its own (its blocks stay under ATen's grain),
    also for rows longer than the grain, and a transposed table splits as its source does."""
    wide = torch.zeros(8, 3 * _GRAIN + 5)
    blocks = _split(wide)
    assert len(blocks) > 1 and all(b.numel() < _GRAIN for b in blocks)
    assert sum(b.shape[1] for b in blocks) == wide.shape[1]
    transposed = torch.zeros(3 * _GRAIN + 5, 64).t()[:8]  # [8, 3 * grain + 5], strided
    assert [b.shape for b in _split(transposed)] == [b.shape for b in blocks]
    narrow = torch.zeros(100, 64)
    assert [b.shape for b in _split(narrow)] == [narrow.shape]  # as before: one block


def test_slot_without_vocab_modules_leaves_their_rows_zero() -> None:
    bank = filled_bank(torch.float32)
    rs, re = bank.slot_rows(1)
    for key in (EMBED_KEY, LM_HEAD_KEY):
        a, bt = bank.tables(*key)
        assert not a[rs:re].any() and not bt[rs:re].any()
    assert bank.slot_modules(1) == {(0, "q_proj")}
    assert bank.slot_modules(0) == {EMBED_KEY, LM_HEAD_KEY, (0, "q_proj")}
    rs, re = bank.slot_rows(3)
    a, _ = bank.tables(*EMBED_KEY)
    w = ADAPTERS[3][EMBED_KEY]
    assert torch.equal(a[rs : rs + w.a.shape[0]], w.a)  # the embedding's A, read back by rows
