"""The slot bank's expert tables: every expert's rows of a slot written, zeroed, replaced and
compacted together, at ``e * capacity + row`` (``loraplex.lora.slots``), beside ordinary modules."""

from __future__ import annotations

import pytest
import torch

from loraplex.lora.adapter import LoRAModuleWeights
from loraplex.lora.slots import LoRASlotBank

E, D, INTER = 3, 8, 6
ATTN, EXPERT = (0, "q_proj"), (0, "experts.down_proj")
SHAPES = {ATTN: (D, D), EXPERT: (INTER, D)}


def _weights(seed: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        ATTN: LoRAModuleWeights(
            torch.randn(rank, D, generator=g), torch.randn(D, rank, generator=g), 0.5
        ),
        EXPERT: LoRAModuleWeights(
            torch.randn(E, rank, INTER, generator=g), torch.randn(E, D, rank, generator=g), 1.0
        ),
    }


def _check(bank: LoRASlotBank, slot: int, w: dict) -> None:
    """The slot's rows hold ``w`` (B scaled and transposed), expert by expert."""
    rs, re = bank.slot_rows(slot)
    a, bt = bank.tables(*ATTN)
    r = w[ATTN].rank
    assert torch.equal(a[rs : rs + r], w[ATTN].a)
    assert torch.allclose(bt[rs : rs + r], (w[ATTN].b * 0.5).t())
    a, bt = bank.tables(*EXPERT)
    cap = bank.capacity
    for e in range(E):
        assert torch.equal(a[e * cap + rs : e * cap + rs + r], w[EXPERT].a[e])
        assert torch.equal(bt[e * cap + rs : e * cap + rs + r], w[EXPERT].b[e].t())
        assert not a[e * cap + rs + r : e * cap + re].any()  # rows past the rank stay zero


def test_expert_rows_follow_the_slot_layout_through_reset_and_compaction() -> None:
    bank = LoRASlotBank(SHAPES, 3, 4, torch.float32, "cpu", module_experts={EXPERT: E})
    a, bt = bank.tables(*EXPERT)
    assert a.shape == (E * bank.capacity, INTER) and bt.shape == (E * bank.capacity, D)
    ws = {0: _weights(1, 4), 1: _weights(2, 2), 2: _weights(3, 4)}
    for slot, w in ws.items():
        bank.set_lora(slot, w)
        _check(bank, slot, w)
    bank.reset_lora(1)  # two free rows in the middle, two at the end
    cap = bank.capacity
    for e in range(E):  # every expert's block of the freed rows is zero again
        assert not a[e * cap + 4 : e * cap + 6].any() and not bt[e * cap + 4 : e * cap + 6].any()
    big = _weights(4, 4)
    bank.set_lora(1, big)  # 4 rows fit only after compaction: slot 2 slides down
    for slot, w in ((0, ws[0]), (1, big), (2, ws[2])):
        _check(bank, slot, w)
    bank.replace_lora(0, ws[1])
    _check(bank, 0, ws[1])
    assert bank.used_rows == 2 + 4 + 4


def test_expert_weights_of_the_wrong_shape_are_refused_before_any_write() -> None:
    bank = LoRASlotBank(SHAPES, 2, 4, torch.float32, "cpu", module_experts={EXPERT: E})
    bad = _weights(1, 2)
    bad[EXPERT] = LoRAModuleWeights(torch.ones(E + 1, 2, INTER), torch.ones(E + 1, D, 2), 1.0)
    with pytest.raises(ValueError, match=r"expected A \[3, r, 6\]"):
        bank.set_lora(0, bad)
    assert bank.occupied_slots == () and not bank.tables(*ATTN)[0].any()
    with pytest.raises(ValueError, match="module_experts names modules without shapes"):
        LoRASlotBank(SHAPES, 2, 4, torch.float32, "cpu", module_experts={(1, "x"): 2})
