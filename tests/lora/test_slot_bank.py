"""Device slot bank: layout, compaction, errors, and end-to-end math with the gathered ops."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from loraplex.lora.backends import select_lora_ops
from loraplex.lora.ops import TorchLoRAOps
from loraplex.lora.plan import plan_lora_batch
from loraplex.lora.slots import LoRASlotBank

LAYERS = 2
PROJ = {"q_proj": (32, 32), "k_proj": (32, 16), "down_proj": (48, 32)}
SHAPES = {(layer, p): s for layer in range(LAYERS) for p, s in PROJ.items()}


@dataclass
class W:
    """Stand-in for ``loraplex.lora.adapter.LoRAModuleWeights``."""

    a: torch.Tensor  # [r, d_in]
    b: torch.Tensor  # [d_out, r]
    scale: float


def make_adapter(
    seed: int, rank: int | dict[tuple[int, str], int], modules=None, scale: float = 2.0
) -> dict[tuple[int, str], W]:
    """Random adapter over ``modules`` (default: all); ``rank`` per module for rank_pattern."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key in modules or SHAPES:
        d_in, d_out = SHAPES[key]
        r = rank[key] if isinstance(rank, dict) else rank
        out[key] = W(torch.randn(r, d_in, generator=g), torch.randn(d_out, r, generator=g), scale)
    return out


def make_bank(max_loras: int = 4, max_rank: int = 16, dtype=torch.float32) -> LoRASlotBank:
    return LoRASlotBank(SHAPES, max_loras, max_rank, dtype, "cpu")


def merged_delta(x: torch.Tensor, w: W | None) -> torch.Tensor:
    """Reference: x @ (scale * B @ A).T in float64 (zero when the module is not targeted)."""
    if w is None:
        return torch.zeros(x.shape[0], 0, dtype=torch.float64)
    return x.double() @ (w.scale * w.b.double() @ w.a.double()).T


def check_slot_math(bank: LoRASlotBank, slot: int, adapter: dict, atol: float = 1e-4) -> None:
    """Every module of ``slot`` computes exactly its adapter's merged delta (zero if untargeted)."""
    rs, re = bank.slot_rows(slot)
    ops = select_lora_ops("cpu")
    torch.manual_seed(slot)
    for key, (d_in, d_out) in SHAPES.items():
        x = torch.randn(5, d_in)  # x: [T, d_in]
        out = torch.zeros(5, d_out, dtype=torch.float32)  # out: [T, d_out]
        plan = plan_lora_batch(5, [(0, 5, rs, re)], bank.dtype, "cpu")
        ops.apply(x, *bank.tables(*key), out, plan)
        w = adapter.get(key)
        expected = (
            merged_delta(x, w) if w is not None else torch.zeros(5, d_out, dtype=torch.float64)
        )
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=1e-4)


def test_set_reset_reuse_and_properties():
    bank = make_bank()
    assert bank.free_slots == (0, 1, 2, 3) and bank.occupied_slots == ()
    assert bank.nbytes == sum(64 * (i + o) * 4 for i, o in SHAPES.values())
    a8, a16 = make_adapter(1, 8), make_adapter(2, 16)
    bank.set_lora(2, a8)
    bank.set_lora(0, a16)
    assert bank.slot_rows(2) == (0, 8) and bank.slot_rows(0) == (8, 24)
    assert bank.occupied_slots == (0, 2) and bank.free_slots == (1, 3)
    check_slot_math(bank, 2, a8)
    check_slot_math(bank, 0, a16)

    bank.reset_lora(2)
    for key in SHAPES:
        a, bt = bank.tables(*key)
        assert not a[0:8].any() and not bt[0:8].any()  # rows zeroed after reset
    with pytest.raises(KeyError):
        bank.slot_rows(2)
    a4 = make_adapter(3, 4)
    bank.set_lora(2, a4)  # reuse: first fit into the freed hole
    assert bank.slot_rows(2) == (0, 4)
    check_slot_math(bank, 2, a4)
    check_slot_math(bank, 0, a16)
    # Only owned rows are non-zero.
    a, bt = bank.tables(0, "q_proj")
    assert not a[4:8].any() and not a[24:].any() and not bt[4:8].any()


def test_fragmentation_compacts_and_keeps_other_slots_math():
    bank = make_bank(max_loras=4, max_rank=16)  # 64 rows
    adapters = {s: make_adapter(10 + s, r) for s, r in ((0, 16), (1, 12), (2, 16), (3, 12))}
    for s, w in adapters.items():
        bank.set_lora(s, w)
    bank.reset_lora(1)  # hole of 12 rows at 16..28
    bank.reset_lora(3)  # 20 free rows at the end (44..64): 32 free, largest hole 20
    v0 = bank.layout_version
    big = make_adapter(99, 16)
    bank.set_lora(3, big)  # fits in the tail without compaction
    assert bank.slot_rows(3) == (44, 60) and bank.layout_version == v0 + 1
    bank.reset_lora(0)  # free: 0..28 (slot 0's rows + the old hole) and 60..64
    front = make_adapter(5, 16)
    bank.set_lora(0, front)  # first fit at 0..16, leaving 16..28 (12) and 60..64 (4)
    assert bank.slot_rows(0) == (0, 16)
    last = make_adapter(6, 14)
    bank.set_lora(1, last)  # 16 rows free in total but split 12 + 4: compaction needed
    assert bank.slot_rows(0) == (0, 16)
    assert bank.slot_rows(2) == (16, 32)  # moved down from 28..44
    assert bank.slot_rows(3) == (32, 48)  # moved down from 44..60
    assert bank.slot_rows(1) == (48, 62)
    for s, w in ((0, front), (1, last), (2, adapters[2]), (3, big)):
        check_slot_math(bank, s, w)
    a, bt = bank.tables(1, "down_proj")
    assert not a[62:].any() and not bt[62:].any()


def test_rank_pattern_and_untargeted_modules():
    bank = make_bank()
    ranks = {key: (4 if key[1] == "k_proj" else 12) for key in SHAPES}
    partial = {k: r for k, r in ranks.items() if k[0] == 0}  # layer 1 untargeted
    adapter = make_adapter(7, partial, modules=list(partial))
    bank.set_lora(1, adapter)
    assert bank.slot_rows(1) == (0, 12)  # rows = max rank over modules
    check_slot_math(bank, 1, adapter)  # untargeted modules: zero delta
    a, bt = bank.tables(0, "k_proj")
    assert a[0:4].any() and not a[4:12].any() and not bt[4:12].any()  # past its own rank: zero
    a, bt = bank.tables(1, "q_proj")
    assert not a.any() and not bt.any()


def test_scale_folded_into_bt():
    bank = make_bank()
    w = make_adapter(8, 4, modules=[(0, "q_proj")], scale=0.5)
    bank.set_lora(0, w)
    a, bt = bank.tables(0, "q_proj")
    torch.testing.assert_close(a[0:4], w[(0, "q_proj")].a)
    torch.testing.assert_close(bt[0:4], 0.5 * w[(0, "q_proj")].b.T)


@pytest.mark.parametrize(
    "slot, weights, match",
    [
        (4, make_adapter(0, 4), "slot"),
        (-1, make_adapter(0, 4), "slot"),
        (0, {(5, "q_proj"): W(torch.zeros(4, 32), torch.zeros(32, 4), 1.0)}, "does not adapt"),
        (0, {(0, "q_proj"): W(torch.zeros(4, 31), torch.zeros(32, 4), 1.0)}, "expected"),
        (0, {(0, "q_proj"): W(torch.zeros(4, 32), torch.zeros(32, 3), 1.0)}, "expected"),
        (0, {(0, "q_proj"): W(torch.zeros(32), torch.zeros(32, 4), 1.0)}, "2-D"),
        (0, make_adapter(0, 17), "rank"),
    ],
)
def test_set_lora_errors_leave_bank_unchanged(slot, weights, match):
    bank = make_bank()
    good = make_adapter(1, 8)
    bank.set_lora(1, good)
    version = bank.layout_version
    with pytest.raises(ValueError, match=match):
        bank.set_lora(slot, weights)
    assert bank.occupied_slots == (1,) and bank.layout_version == version
    check_slot_math(bank, 1, good)


def test_occupied_slot_and_empty_slot_errors():
    bank = make_bank()
    bank.set_lora(0, make_adapter(1, 8))
    with pytest.raises(ValueError, match="occupied"):
        bank.set_lora(0, make_adapter(2, 8))
    with pytest.raises(KeyError):
        bank.reset_lora(3)
    with pytest.raises(ValueError):
        bank.reset_lora(9)
    with pytest.raises(KeyError):
        bank.tables(0, "o_proj")


def test_end_to_end_mixed_batch_matches_merged_weights():
    """Several adapters in one batch (with base tokens): apply() == x @ (scale * B @ A).T."""
    bank = make_bank(max_loras=4, max_rank=16)
    adapters = {0: make_adapter(20, 16), 2: make_adapter(21, 3), 3: make_adapter(22, 9)}
    for s, w in adapters.items():
        bank.set_lora(s, w)
    # Token order: 2 base, slot 0 x3, slot 2 x1, 1 base, slot 3 x4 (slots by row order).
    order = sorted(adapters, key=lambda s: bank.slot_rows(s)[0])
    counts = {order[0]: 3, order[1]: 1, order[2]: 4}
    token_slot: list[int | None] = [None, None]
    segs = []
    for i, s in enumerate(order):
        if i == 2:
            token_slot.append(None)
        start = len(token_slot)
        token_slot += [s] * counts[s]
        segs.append((start, len(token_slot), *bank.slot_rows(s)))
    T = len(token_slot)
    torch.manual_seed(0)
    # bf16: products of ~50 in magnitude cancel, so the bound is relative to the largest delta.
    for dtype, rel in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for ops in (select_lora_ops("cpu"), TorchLoRAOps()):
            table_dtype = ops.table_dtype(dtype)
            typed = LoRASlotBank(SHAPES, 4, 16, table_dtype, "cpu")
            for s, w in adapters.items():
                typed.set_lora(s, w)
            plan = plan_lora_batch(T, segs, table_dtype, "cpu")
            for key, (d_in, d_out) in SHAPES.items():
                x = torch.randn(T, d_in).to(dtype)  # x: [T, d_in]
                out = torch.zeros(T, d_out, dtype=dtype)  # out: [T, d_out]
                ops.apply(x, *typed.tables(*key), out, plan)
                expected = torch.cat(
                    [
                        merged_delta(x[t : t + 1], adapters[s][key])
                        if s is not None
                        else torch.zeros(1, d_out, dtype=torch.float64)
                        for t, s in enumerate(token_slot)
                    ]
                )  # [T, d_out], token by token
                atol = rel * expected.abs().max().item()
                torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
                assert not out[[t for t, s in enumerate(token_slot) if s is None]].any()


def _tables(bank: LoRASlotBank) -> dict:
    return {key: tuple(t.clone() for t in bank.tables(*key)) for key in SHAPES}


def _same_tables(got: dict, want: dict) -> bool:
    return all(
        torch.equal(g, w) for key in SHAPES for g, w in zip(got[key], want[key], strict=True)
    )


@pytest.mark.parametrize(
    "old, new",
    [
        (make_adapter(30, 8), make_adapter(31, 8)),  # same rows, all overwritten
        (make_adapter(32, 12), make_adapter(33, 4)),  # narrower: old rows past 4 zeroed
        (make_adapter(34, 4), make_adapter(35, 12)),  # wider
        (make_adapter(36, 8), make_adapter(37, 8, modules=[(0, "q_proj"), (1, "k_proj")])),
        (
            make_adapter(38, {k: (3 if k[1] == "k_proj" else 9) for k in SHAPES}),
            make_adapter(39, 6),
        ),
    ],
)
def test_replace_lora_leaves_the_tables_of_reset_then_set(old, new):
    """A replace writes over the old rows and zeroes only what the new adapter leaves alone:
    bit for bit the tables reset_lora + set_lora leave, with the other slots untouched."""
    tables = {}
    for how in ("replace", "reset+set"):
        bank = make_bank()
        bank.set_lora(0, make_adapter(40, 5))
        bank.set_lora(1, old)
        bank.set_lora(2, make_adapter(41, 7))
        if how == "replace":
            bank.replace_lora(1, new)
        else:
            bank.reset_lora(1)
            bank.set_lora(1, new)
        tables[how] = (_tables(bank), bank.slot_rows(1), bank.slot_modules(1))
        check_slot_math(bank, 1, new)
    assert tables["replace"][1:] == tables["reset+set"][1:]
    assert _same_tables(tables["replace"][0], tables["reset+set"][0])


def test_replace_lora_errors_keep_the_old_adapter_and_fragments_reset_it():
    from loraplex.lora.slots import NeedsCompaction

    bank = make_bank(max_loras=4, max_rank=16)
    old = make_adapter(42, 8)
    bank.set_lora(0, old)
    with pytest.raises(ValueError, match="rank"):
        bank.replace_lora(0, make_adapter(43, 17))
    check_slot_math(bank, 0, old)  # validation comes first: the old adapter still serves
    bank.replace_lora(1, make_adapter(44, 16))  # an empty slot: as set_lora
    assert bank.slot_rows(1) == (8, 24)
    for s, r in ((2, 16), (3, 16)):
        bank.set_lora(s, make_adapter(45 + s, r))  # rows 24..56 used, 56..64 free
    with pytest.raises(NeedsCompaction):  # 8 old rows + 8 at the end: 16 free, in two pieces
        bank.replace_lora(0, make_adapter(48, 16), compact=False)
    assert 0 not in bank.occupied_slots
    for key in SHAPES:
        a, bt = bank.tables(*key)
        assert not a[0:8].any() and not bt[0:8].any()  # reset: no stale rows


def test_slot_modules_are_recorded_at_load_and_kept_through_compaction():
    bank = make_bank(max_loras=2, max_rank=12)  # 24 rows
    qk = make_adapter(50, 8, modules=[(0, "q_proj"), (1, "k_proj")])
    bank.set_lora(0, make_adapter(51, 8))
    bank.set_lora(1, qk)
    assert bank.slot_modules(1) == {(0, "q_proj"), (1, "k_proj")}
    assert bank.slot_modules(0) == frozenset(SHAPES)
    bank.reset_lora(0)
    with pytest.raises(KeyError):
        bank.slot_modules(0)
    bank.set_lora(0, make_adapter(52, 12))  # 8 free at the front and 8 at the end: compacts
    assert bank.slot_rows(1) == (0, 8) and bank.slot_modules(1) == {(0, "q_proj"), (1, "k_proj")}
    assert bank.slot_rows(0) == (8, 20) and bank.slot_modules(0) == frozenset(SHAPES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_slot_source_reloads_write_the_scaled_rows_exactly(dtype):
    """Host copies in the table dtype (numpy's transposing copy for float32 and bf16, ATen's for fp16),
    reloaded through a kept SlotSource into the same and other rows: bt is exactly
    round(scale * B).T computed in float32, as one rounding, every time."""
    from loraplex.lora.slots import SlotSource

    bank = LoRASlotBank(SHAPES, 4, 16, dtype, "cpu")
    g = torch.Generator().manual_seed(53)
    host = {
        key: W(
            torch.randn(8, d_in, generator=g).to(dtype),
            torch.randn(d_out, 8, generator=g).to(dtype),
            0.37,
        )
        for key, (d_in, d_out) in SHAPES.items()
    }
    source = SlotSource(host)
    for slot in (0, 0, 1, 0):  # a reload into the same rows, then into others
        bank.replace_lora(slot, source)
        rs, re = bank.slot_rows(slot)
        for key, w in host.items():
            a, bt = bank.tables(*key)
            assert torch.equal(a[rs:re], w.a)
            assert torch.equal(bt[rs:re], (w.b.float() * w.scale).t().to(dtype))
        if slot == 1:
            bank.reset_lora(1)


def test_a_float32_host_copy_into_a_bf16_table_rounds_once():
    bank = LoRASlotBank(SHAPES, 2, 16, torch.bfloat16, "cpu")
    w = make_adapter(54, 8, scale=0.3)
    bank.set_lora(0, w)
    for key, m in w.items():
        a, bt = bank.tables(*key)
        assert torch.equal(bt[0:8], (m.b * m.scale).t().to(torch.bfloat16))
        assert torch.equal(a[0:8], m.a.to(torch.bfloat16))


def test_modules_past_the_parallel_grain_are_written_in_blocks():
    """A module whose slot rows exceed ATen's parallel grain is copied in row blocks (a writer
    thread must not start an OpenMP team); the rows are the same as one copy's."""
    from loraplex.lora.slots import _GRAIN, SlotSource, _split

    shapes = {(0, "up_proj"): (64, 4100), (0, "down_proj"): (4100, 64)}
    bank = LoRASlotBank(shapes, 2, 16, torch.float32, "cpu")
    g = torch.Generator().manual_seed(55)
    w = {
        k: W(torch.randn(16, i, generator=g), torch.randn(o, 16, generator=g), 2.0)
        for k, (i, o) in shapes.items()
    }
    prep = SlotSource(w).prepared()
    assert len(prep.bt) > len(w) and all(t.numel() < _GRAIN for t in prep.a + prep.bt)
    assert [t.shape[0] for t in _split(torch.zeros(16, 4100))] == [7, 7, 2]  # 7 * 4100 < grain
    bank.set_lora(1, w)
    for key, m in w.items():
        a, bt = bank.tables(*key)
        assert torch.equal(a[0:16], m.a) and torch.equal(bt[0:16], (m.b * 2.0).t())


def test_scale_one_modules_are_copied_as_they_are():
    """alpha == r gives scale 1: those B rows are plain copies; other modules are still scaled."""
    bank = make_bank()
    w = make_adapter(56, 8, scale=1.0)
    w[(1, "k_proj")] = W(w[(1, "k_proj")].a, w[(1, "k_proj")].b, 0.25)
    bank.set_lora(0, w)
    for key, m in w.items():
        _, bt = bank.tables(*key)
        assert torch.equal(bt[0:8], (m.b * m.scale).t())
