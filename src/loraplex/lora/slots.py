"""Device slot bank: stacked per-module LoRA A/B tables for ``max_loras`` resident adapters.

Every adapted module ``(layer, proj)`` owns two tables that share one row layout::

    a[(layer, proj)]:  [capacity, d_in]    rows = A of the owning adapter
    bt[(layer, proj)]: [capacity, d_out]   rows = (scale * B).T of the owning adapter

with ``capacity = max_loras * max_lora_rank`` *rank rows*. An occupied slot owns the contiguous
rows ``[row_start, row_start + rows)`` in every table, ``rows`` being the adapter's largest rank
over its modules, so a rank-8 adapter never pays for the largest supported rank. Rows nobody owns,
rows of modules an adapter does not target and rows past a module's own rank (``rank_pattern``)
are zero, so the gathered ops (``loraplex.lora.ops``) can read any row range without masking
them. The scale is folded into ``bt``, so ops never see it.

Row ranges move when ``set_lora`` compacts the layout: callers must read ``slot_rows`` again
after any ``set_lora``/``reset_lora`` (``layout_version`` changes on every layout change).

Staging off the engine thread: mutations take the bank's lock, and ``set_lora(...,
compact=False)`` never moves another slot's rows (it raises :class:`NeedsCompaction` instead), so
a background thread may fill a slot that no running batch reads while the engine keeps running
batches over the other slots' rows; only :meth:`compact` (engine thread, between steps) moves
rows of slots in use.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Protocol

import torch

ModuleKey = tuple[int, str]
"""``(layer index, projection name)``, e.g. ``(3, "q_proj")``."""


class LoRAModuleWeightsLike(Protocol):
    """The attributes of ``loraplex.lora.adapter.LoRAModuleWeights`` the bank reads."""

    @property
    def a(self) -> torch.Tensor: ...  # [r, d_in]

    @property
    def b(self) -> torch.Tensor: ...  # [d_out, r]

    @property
    def scale(self) -> float: ...


class NeedsCompaction(Exception):
    """``set_lora(..., compact=False)`` found enough free rows, but only fragmented."""


class LoRASlotBank:
    """Stacked per-module A/B tables for ``max_loras`` device slots with one shared row layout.

    Mutations are serialised by one lock (held across a whole ``set_lora``/``reset_lora``/
    ``compact``). Reads of ``slot_rows`` take no lock: a slot's range changes only by its own
    ``set_lora``/``reset_lora`` or by ``compact``, which the owner (the adapter cache) runs
    between engine steps.
    """

    def __init__(
        self,
        module_shapes: Mapping[ModuleKey, tuple[int, int]],
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """``module_shapes``: ``(layer, proj) -> (d_in, d_out)`` of every adaptable module."""
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.capacity = max_loras * max_lora_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.module_shapes: dict[ModuleKey, tuple[int, int]] = dict(module_shapes)
        self._a: dict[ModuleKey, torch.Tensor] = {}
        self._bt: dict[ModuleKey, torch.Tensor] = {}
        for key, (d_in, d_out) in self.module_shapes.items():
            # a: [capacity, d_in], bt: [capacity, d_out]
            self._a[key] = torch.zeros(self.capacity, d_in, dtype=dtype, device=self.device)
            self._bt[key] = torch.zeros(self.capacity, d_out, dtype=dtype, device=self.device)
        self._rows: dict[int, tuple[int, int]] = {}  # slot -> (row_start, row_end)
        self.layout_version = 0
        self._lock = threading.RLock()

    # ----------------------------------------------------------------------------- queries

    @property
    def occupied_slots(self) -> tuple[int, ...]:
        """Occupied slot indices, ascending."""
        return tuple(sorted(self._rows))

    @property
    def free_slots(self) -> tuple[int, ...]:
        """Free slot indices, ascending."""
        return tuple(s for s in range(self.max_loras) if s not in self._rows)

    @property
    def used_rows(self) -> int:
        """Rank rows owned by occupied slots."""
        return sum(end - start for start, end in self._rows.values())

    @property
    def nbytes(self) -> int:
        """Bytes of all tables (fixed at construction, whatever is resident)."""
        return sum(t.numel() * t.element_size() for t in (*self._a.values(), *self._bt.values()))

    def slot_rows(self, slot: int) -> tuple[int, int]:
        """``(row_start, row_end)`` of an occupied slot; ``KeyError`` if the slot is empty."""
        self._check_slot(slot)
        try:
            return self._rows[slot]
        except KeyError:
            raise KeyError(f"slot {slot} is empty") from None

    def tables(self, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a [capacity, d_in], bt [capacity, d_out])`` of one module; ``KeyError`` if unknown."""
        key = (layer, proj)
        if key not in self._a:
            raise KeyError(f"module {key} has no LoRA tables")
        return self._a[key], self._bt[key]

    def slot_modules(self, slot: int) -> frozenset[ModuleKey]:
        """Modules where the slot's A rows are not all zero: the only ones whose LoRA delta for
        this slot can be non-zero (scans the slot's rows; callers cache it per layout_version)."""
        start, end = self.slot_rows(slot)
        return frozenset(key for key, a in self._a.items() if bool(a[start:end].any()))

    # ----------------------------------------------------------------------------- mutation

    def set_lora(
        self,
        slot: int,
        weights: Mapping[ModuleKey, LoRAModuleWeightsLike],
        *,
        compact: bool = True,
    ) -> None:
        """Load one adapter into an empty slot.

        Validates everything before touching a table, so a bad adapter leaves the bank as it was.
        Allocates ``rows = max rank`` rows first fit; if enough rows are free but fragmented,
        compacts (moves other slots' rows down in every table and updates their ranges), or with
        ``compact=False`` raises :class:`NeedsCompaction` (nothing changed): other slots' rows
        never move, so a background thread may call it while batches read them.
        """
        with self._lock:
            self._check_slot(slot)
            if slot in self._rows:
                raise ValueError(f"slot {slot} is already occupied; reset_lora({slot}) first")
            rows = 0
            for key, w in weights.items():
                rows = max(rows, self._check_module(key, w))
            start = self._first_fit(rows)
            if start is None:
                if not compact:
                    raise NeedsCompaction(f"{rows} rank rows free only in fragments")
                start = self._allocate(rows)
            self._write(slot, start, rows, weights)

    def _write(
        self, slot: int, start: int, rows: int, weights: Mapping[ModuleKey, LoRAModuleWeightsLike]
    ) -> None:
        """Record ``slot`` at ``[start, start + rows)`` and copy its (validated) weights in."""
        self._rows[slot] = (start, start + rows)
        self.layout_version += 1
        # A few list-wide torch calls instead of ~5 per module: each torch call hands the GIL
        # over, and a background writer doing that hundreds of times per adapter makes the
        # engine thread wait at every one of its own calls.
        dst_a: list[torch.Tensor] = []
        dst_bt: list[torch.Tensor] = []
        src_a: list[torch.Tensor] = []
        b32: list[torch.Tensor] = []
        scales: list[float] = []
        pad: list[torch.Tensor] = []
        for key, w in weights.items():
            r = w.a.shape[0]
            a_tab, bt_tab = self._a[key], self._bt[key]
            dst_a.append(a_tab[start : start + r])  # [r, d_in]
            dst_bt.append(bt_tab[start : start + r])  # [r, d_out]
            src_a.append(w.a)
            b32.append(w.b if w.b.dtype == torch.float32 else w.b.to(torch.float32))
            scales.append(float(w.scale))
            if r < rows:  # rows past this module's rank are zero already; keep it explicit
                pad += [a_tab[start + r : start + rows], bt_tab[start + r : start + rows]]
        if not dst_a:
            return
        with torch.no_grad():
            torch._foreach_copy_(dst_a, src_a)
            # (scale * B).T in float32 first, so a low-precision table gets one rounding.
            scaled = torch._foreach_mul(b32, scales)  # [d_out, r] each
            torch._foreach_copy_(dst_bt, [b.t() for b in scaled])
            if pad:
                torch._foreach_zero_(pad)

    def reset_lora(self, slot: int) -> None:
        """Zero the slot's rows in every table and free them; ``KeyError`` if the slot is empty."""
        with self._lock:
            start, end = self.slot_rows(slot)
            with torch.no_grad():
                for tab in (*self._a.values(), *self._bt.values()):
                    tab[start:end].zero_()
            del self._rows[slot]
            self.layout_version += 1

    def compact(self) -> None:
        """Slide the occupied ranges down so the free rows form one tail (moves slots in use:
        only between engine steps). Waits for a ``set_lora``/``reset_lora`` in progress."""
        with self._lock:
            if self._rows:
                self._compact()

    # ----------------------------------------------------------------------------- internals

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be an int in [0, {self.max_loras}), got {slot!r}")

    def _check_module(self, key: ModuleKey, w: LoRAModuleWeightsLike) -> int:
        """Validate one module's weights against the bank; return its rank."""
        if key not in self.module_shapes:
            raise ValueError(f"adapter targets module {key}, which this model does not adapt")
        d_in, d_out = self.module_shapes[key]
        a, b = w.a, w.b
        if a.ndim != 2 or b.ndim != 2:
            raise ValueError(
                f"module {key}: A and B must be 2-D, got {tuple(a.shape)}, {tuple(b.shape)}"
            )
        r = a.shape[0]
        if a.shape != (r, d_in) or b.shape != (d_out, r):
            raise ValueError(
                f"module {key}: expected A [r, {d_in}] and B [{d_out}, r], "
                f"got A {tuple(a.shape)} and B {tuple(b.shape)}"
            )
        if not 1 <= r <= self.max_lora_rank:
            raise ValueError(
                f"module {key}: rank {r} not in [1, max_lora_rank={self.max_lora_rank}]"
            )
        return r

    def _first_fit(self, rows: int) -> int | None:
        """The first free range of ``rows`` rows, or None when none is contiguous."""
        pos = 0
        for start, end in sorted(self._rows.values()):
            if start - pos >= rows:
                return pos
            pos = end
        return pos if self.capacity - pos >= rows else None

    def _allocate(self, rows: int) -> int:
        """First-fit row allocation; compacts when the free rows are fragmented."""
        start = self._first_fit(rows)
        if start is not None:
            return start
        if self.capacity - self.used_rows < rows:  # cannot happen: every slot uses <= max rank
            raise ValueError(
                f"no room for {rows} rank rows ({self.capacity - self.used_rows} free)"
            )
        return self._compact()

    def _compact(self) -> int:
        """Slide occupied ranges down (order kept) so free rows form one tail; return its start."""
        old_end = max(end for _, end in self._rows.values())
        pos = 0
        with torch.no_grad():
            for slot, (start, end) in sorted(self._rows.items(), key=lambda item: item[1]):
                n = end - start
                if start != pos:
                    for tab in (*self._a.values(), *self._bt.values()):
                        src = tab[start:end]
                        # Overlapping ranges: copy through a temporary.
                        tab[pos : pos + n].copy_(src.clone() if start < pos + n else src)
                    self._rows[slot] = (pos, pos + n)
                pos += n
            for tab in (*self._a.values(), *self._bt.values()):
                tab[pos:old_end].zero_()
        self.layout_version += 1
        return pos
