"""Device slot bank: stacked per-module LoRA A/B tables for ``max_loras`` resident adapters.

Every adapted module ``(layer, proj)`` owns two tables that share one row layout::

    a[(layer, proj)]:  [capacity, d_in]    rows = A of the owning adapter
    bt[(layer, proj)]: [capacity, d_out]   rows = (scale * B).T of the owning adapter

with ``capacity = max_loras * max_lora_rank`` *rank rows*. The token embedding's A (d_in = the
vocabulary; :data:`GATHERED_MODULES`) is stored transposed, ``[vocab, capacity]``, and ``a`` is a
``[capacity, vocab]`` view of it: its op gathers one row per token id, so a token's rank-row
activations are contiguous. An occupied slot owns the contiguous
rows ``[row_start, row_start + rows)`` in every table, ``rows`` being the adapter's largest rank
over its modules, so a rank-8 adapter never pays for the largest supported rank. Rows nobody owns,
rows of modules an adapter does not target and rows past a module's own rank (``rank_pattern``)
are zero, so the gathered ops (``loraplex.lora.ops``) can read any row range without masking
them. The scale is folded into ``bt``, so ops never see it.

Row ranges move when ``set_lora`` compacts the layout: callers must read ``slot_rows`` again
after any ``set_lora``/``reset_lora`` (``layout_version`` changes on every layout change).

Staging off the engine thread: mutations take the bank's lock, and ``set_lora``/``replace_lora``
with ``compact=False`` never move another slot's rows (they raise :class:`NeedsCompaction`
instead), so a background thread may fill a slot that no running batch reads while the engine
keeps running batches over the other slots' rows; only :meth:`compact` (engine thread, between
steps) moves rows of slots in use. Such a writer shares the cores and the GIL with the engine
thread, so a write is a few list-wide calls over lists built once per host copy
(:class:`SlotSource`), in row blocks that never start a second OpenMP team, and the modules a
slot targets are recorded at the write (the engine never scans rows for them).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from loraplex.checkpoint.modules import EMBED_KEY

ModuleKey = tuple[int, str]
"""``(layer index, projection name)``, e.g. ``(3, "q_proj")``; ``(VOCAB_LAYER, "lm_head")`` and
``(VOCAB_LAYER, "embed_tokens")`` for the modules outside the layers."""

GATHERED_MODULES: frozenset[ModuleKey] = frozenset({EMBED_KEY})
"""Modules whose A is read by row gathers (token id -> A's column), stored ``[d_in, capacity]``."""


_GRAIN = 32768  # at::internal::GRAIN_SIZE: ATen runs smaller element-wise ops on one thread


def _minus(span: tuple[int, int], cut: tuple[int, int]) -> list[tuple[int, int]]:
    """The parts of row range ``span`` outside ``cut`` (0, 1 or 2 ranges)."""
    (lo, hi), (c0, c1) = span, cut
    parts = [(lo, min(hi, c0)), (max(lo, c1), hi)]
    return [(a, b) for a, b in parts if a < b]


class LoRAModuleWeightsLike(Protocol):
    """The attributes of ``loraplex.lora.adapter.LoRAModuleWeights`` the bank reads."""

    @property
    def a(self) -> torch.Tensor: ...  # [r, d_in]

    @property
    def b(self) -> torch.Tensor: ...  # [d_out, r]

    @property
    def scale(self) -> float: ...


def _split(view: torch.Tensor) -> list[torch.Tensor]:
    """``view`` (2-D) as blocks under ATen's parallel grain, so a background writer on CPU never
    starts an OpenMP team of its own (its threads would spin on the cores the engine's team
    computes on): row blocks, or for rows longer than the grain (vocabulary-wide tables) column
    blocks of every row. Views of one shape split alike whatever their strides (a transposed
    table and the weights copied into it)."""
    rows, cols = view.shape[0], view.shape[-1]
    if cols < _GRAIN or rows == 0:
        step = max(1, (_GRAIN - 1) // max(1, cols))
        return [view] if rows <= step else list(view.split(step))
    return list(view.split(max(1, (_GRAIN - 1) // rows), dim=-1))


ModuleShard = Callable[[ModuleKey, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``shard(key, a, b) -> (a_r, b_r)``: one tensor-parallel rank's part of a module's LoRA."""


@dataclass(frozen=True)
class _Cut:
    """One module's LoRA as a tensor-parallel rank holds it."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


class _Prepared:
    """What a slot write copies, per row block: A rows, (unscaled) B.T rows, the scale."""

    def __init__(self, weights: Mapping[ModuleKey, LoRAModuleWeightsLike]) -> None:
        self.rank_of: dict[ModuleKey, int] = {}
        self.a: list[torch.Tensor] = []  # [<= r, d_in] blocks
        self.bt: list[torch.Tensor] = []  # [<= r, d_out] blocks (views of B, transposed)
        self.scales: list[float] = []  # per bt block
        b_dtypes: set[torch.dtype] = set()
        for key, w in weights.items():
            self.rank_of[key] = w.a.shape[-2]
            if w.a.dim() == 3:  # an expert projection: every expert's rows, expert by expert
                self.a += [p for e in range(w.a.shape[0]) for p in _split(w.a[e])]
                bt = [p for e in range(w.b.shape[0]) for p in _split(w.b[e].t())]
            else:
                self.a += _split(w.a)
                bt = _split(w.b.t())
            self.bt += bt
            self.scales += [float(w.scale)] * len(bt)
            b_dtypes.add(w.b.dtype)
        self.signature = tuple(self.rank_of.items())
        self.modules = frozenset(self.rank_of)  # what slot_modules reports for the slot
        self.scaled = [i for i, c in enumerate(self.scales) if c != 1.0]  # bt blocks to scale
        self.b_dtype = b_dtypes.pop() if len(b_dtypes) == 1 else None  # None: mixed
        # B.T blocks as numpy arrays (bf16 as its bits, uint16): numpy's strided copy
        # transposes faster than ATen's (into tables of B's dtype on CPU; docs/benchmarks.md)
        self.bt_numpy = (
            [_bits(t) for t in self.bt]
            if self.b_dtype in _NUMPY_COPY and all(t.device.type == "cpu" for t in self.bt)
            else None
        )
        # the scales as float32 0-dim tensors: a list-wide in-place multiply of 16-bit blocks by
        # tensor scalars rounds once (by Python floats it rounds the scale to 16 bits first);
        # float32 blocks get the same products either way
        self.scale_tensors = [torch.tensor(c, dtype=torch.float32) for c in self.scales]


_Targets = tuple[list[torch.Tensor], list[torch.Tensor], list[np.ndarray]]

_NUMPY_COPY = (torch.float32, torch.bfloat16)
"""Dtypes whose strided copies go through numpy (bfloat16 as uint16 bits: an exact copy)."""


def _bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor of ``_NUMPY_COPY`` (bf16 as its uint16 bits), same strides."""
    t = t.detach()
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


class SlotSource:
    """An adapter's weights with the lists a slot write copies, built on first use and kept.

    A host copy loaded into device slots many times (``LoRAAdapter.slot_source``) then spends a
    load copying rather than in Python, where it would hold the GIL the engine thread needs.
    The weights must not change after the first use.
    """

    def __init__(self, weights: Mapping[ModuleKey, LoRAModuleWeightsLike]) -> None:
        self.weights = weights
        self._prepared: _Prepared | None = None

    def prepared(self) -> _Prepared:
        """The copy lists (call after validating ``weights``: building them reads the shapes)."""
        if self._prepared is None:  # two threads at once build the same lists: harmless
            self._prepared = _Prepared(self.weights)
        return self._prepared


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
        module_experts: Mapping[ModuleKey, int] | None = None,
        shard: ModuleShard | None = None,
    ) -> None:
        """``module_shapes``: ``(layer, proj) -> (d_in, d_out)`` of every adaptable module;
        ``shard``: this tensor-parallel rank's cut of a module's whole (A, B), applied to every
        adapter written (``module_shapes`` are then the cut's);
        ``module_experts``: the expert projections of a MoE base -> their expert count (their
        shapes are one expert's). An expert module's tables hold every expert's rows, expert
        ``e`` at ``[e * capacity, (e + 1) * capacity)`` with the slots' one row layout inside::

            a[(layer, "experts.gate_proj")]:  [E * capacity, d_in]
            bt[(layer, "experts.gate_proj")]: [E * capacity, d_out]

        so the rows of (expert ``e``, a slot's rows ``[rs, re)``) are one contiguous range,
        ``[e * capacity + rs, e * capacity + re)``, and the gathered ops read them as any
        module's (see ``loraplex.model.moe``)."""
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
        self.module_experts: dict[ModuleKey, int] = dict(module_experts or {})
        unknown = set(self.module_experts) - set(self.module_shapes)
        if unknown:
            raise ValueError(f"module_experts names modules without shapes: {sorted(unknown)}")
        self._a: dict[ModuleKey, torch.Tensor] = {}
        self._bt: dict[ModuleKey, torch.Tensor] = {}
        for key, (d_in, d_out) in self.module_shapes.items():
            # a: [capacity, d_in] (gathered: a view of [d_in, capacity]), bt: [capacity, d_out];
            # an expert module: [E * capacity, d] each
            rows = self.capacity * self.module_experts.get(key, 1)
            if key in GATHERED_MODULES:
                at = torch.zeros(d_in, rows, dtype=dtype, device=self.device)
                self._a[key] = at.t()
            else:
                self._a[key] = torch.zeros(rows, d_in, dtype=dtype, device=self.device)
            self._bt[key] = torch.zeros(rows, d_out, dtype=dtype, device=self.device)
        self._rows: dict[int, tuple[int, int]] = {}  # slot -> (row_start, row_end)
        self._modules: dict[int, frozenset[ModuleKey]] = {}  # slot -> modules its adapter targets
        self._targets_cache: dict[tuple, _Targets] = {}
        self.layout_version = 0
        self._lock = threading.RLock()
        self._shard = shard
        self._shards: weakref.WeakKeyDictionary[SlotSource, SlotSource] = (
            weakref.WeakKeyDictionary()
        )  # a host copy's cut, built once (as its SlotSource's lists are)

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
        """``(a [capacity, d_in], bt [capacity, d_out])`` of one module; ``KeyError`` if unknown.
        For :data:`GATHERED_MODULES` ``a`` is a transposed view: ``a.t()`` is the contiguous
        ``[d_in, capacity]`` table; an expert module's are ``[E * capacity, d]``."""
        key = (layer, proj)
        if key not in self._a:
            raise KeyError(f"module {key} has no LoRA tables")
        return self._a[key], self._bt[key]

    def slot_modules(self, slot: int) -> frozenset[ModuleKey]:
        """Modules the slot's adapter targets: every other module's rows of the slot are zero,
        so its LoRA delta there is zero. Recorded when the slot was filled (nothing scans rows);
        ``KeyError`` if the slot is empty."""
        self.slot_rows(slot)
        return self._modules[slot]

    # ----------------------------------------------------------------------------- mutation

    def set_lora(
        self,
        slot: int,
        weights: Mapping[ModuleKey, LoRAModuleWeightsLike] | SlotSource,
        *,
        compact: bool = True,
    ) -> None:
        """Load one adapter (its weights, or a :class:`SlotSource` of them) into an empty slot.

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
            self._fill(slot, weights, compact=compact)

    def replace_lora(
        self,
        slot: int,
        weights: Mapping[ModuleKey, LoRAModuleWeightsLike] | SlotSource,
        *,
        compact: bool = True,
    ) -> None:
        """Load one adapter into a slot, empty or not: the tables end as after ``reset_lora``
        then ``set_lora``, but the old rows the new weights overwrite are not zeroed first.

        A bad adapter raises before anything changes (the old adapter stays). With
        ``compact=False`` and only fragmented free rows, raises :class:`NeedsCompaction` with
        the slot reset (empty).
        """
        with self._lock:
            self._check_slot(slot)
            self._fill(slot, weights, compact=compact, replacing=True)

    def _fill(
        self,
        slot: int,
        weights: Mapping[ModuleKey, LoRAModuleWeightsLike] | SlotSource,
        *,
        compact: bool,
        replacing: bool = False,
    ) -> None:
        source = weights if isinstance(weights, SlotSource) else SlotSource(weights)
        if self._shard is not None:
            source = self._cut(source)
        rows = 0
        for key, w in source.weights.items():
            rows = max(rows, self._check_module(key, w))
        prep = source.prepared()
        old = self._rows.pop(slot, None) if replacing else None
        self._modules.pop(slot, None)
        start = self._first_fit(rows)  # the old rows count as free
        if start is None:
            if old is not None:
                self._zero({key: [old] for key in self.module_shapes})
                self.layout_version += 1
            if not compact:
                raise NeedsCompaction(f"{rows} rank rows free only in fragments")
            start = self._allocate(rows)
        elif old is not None:
            # Rows nobody owns are zero; of the old rows, zero those the new weights leave alone.
            stale: dict[ModuleKey, list[tuple[int, int]]] = {}
            for key in self.module_shapes:
                end = start + prep.rank_of.get(key, 0)
                if not (start <= old[0] and old[1] <= end):  # else all overwritten
                    stale[key] = _minus(old, (start, end))
            self._zero(stale)
        self._write(slot, start, rows, prep)

    def _rows_of(self, table: torch.Tensor, key: ModuleKey, lo: int, hi: int) -> list[torch.Tensor]:
        """The views of slot rows ``[lo, hi)`` in one of ``key``'s tables: one, or one per
        expert of an expert module."""
        n = self.module_experts.get(key)
        if n is None:
            return [table[lo:hi]]
        cap = self.capacity
        return [table[e * cap + lo : e * cap + hi] for e in range(n)]

    def _zero(self, ranges: Mapping[ModuleKey, list[tuple[int, int]]]) -> None:
        """Zero ``[start, end)`` row ranges of both tables of each module, in list-wide calls."""
        views = [
            piece
            for key, spans in ranges.items()
            for lo, hi in spans
            for t in (self._a[key], self._bt[key])
            for view in self._rows_of(t, key, lo, hi)
            for piece in _split(view)
        ]
        if views:
            with torch.no_grad():
                torch._foreach_zero_(views)

    def _targets(self, start: int, prep: _Prepared) -> _Targets:
        """The table row blocks ``prep``'s blocks go to when its slot starts at ``start``: A
        blocks, B.T blocks, and those as numpy arrays for float32 tables on CPU (views of the
        fixed tables: kept, so a reload into the same rows builds none)."""
        key = (start, prep.signature)
        got = self._targets_cache.get(key)
        if got is None:
            if len(self._targets_cache) >= 4 * self.max_loras:
                self._targets_cache.clear()
            dst_a: list[torch.Tensor] = []
            dst_bt: list[torch.Tensor] = []
            for mod, r in prep.signature:
                for view in self._rows_of(self._a[mod], mod, start, start + r):
                    dst_a += _split(view)
                for view in self._rows_of(self._bt[mod], mod, start, start + r):
                    dst_bt += _split(view)
            dst_np = (
                [_bits(t) for t in dst_bt]
                if self.device.type == "cpu" and self.dtype in _NUMPY_COPY
                else []
            )
            got = self._targets_cache[key] = (dst_a, dst_bt, dst_np)
        return got

    def _write(self, slot: int, start: int, rows: int, prep: _Prepared) -> None:
        """Record ``slot`` at ``[start, start + rows)`` and copy its (validated) weights in
        (rows past a module's rank, and modules the adapter leaves alone, are zero already).

        A few list-wide torch calls instead of several per module: each torch call hands the GIL
        over, and a background writer doing that hundreds of times per adapter makes the engine
        thread wait at every one of its own calls. ``B`` is copied transposed into the table and
        scaled there in place.
        """
        self._rows[slot] = (start, start + rows)
        self.layout_version += 1
        self._modules[slot] = prep.modules
        if not prep.a:
            return
        dst_a, dst_bt, dst_np = self._targets(start, prep)
        with torch.no_grad():
            torch._foreach_copy_(dst_a, prep.a)
            same = prep.b_dtype == self.dtype
            if self.dtype != torch.float32 and not same:
                # B of another dtype into 16-bit tables: scale in float32, round once
                wide = [t.to(torch.float32) for t in prep.bt]
                torch._foreach_copy_(dst_bt, torch._foreach_mul(wide, prep.scales))
                return
            if same and prep.bt_numpy is not None and dst_np:  # B copied exactly
                for d, src in zip(dst_np, prep.bt_numpy, strict=True):
                    np.copyto(d, src)
            else:  # exact, or widened into float32 tables: one rounding
                torch._foreach_copy_(dst_bt, prep.bt)
            # scaled in place by float32 tensor scalars: one rounding of B * scale in any table
            # dtype (as scaling in float32 then casting)
            scales = prep.scale_tensors
            if len(prep.scaled) == len(dst_bt):
                torch._foreach_mul_(dst_bt, scales)
            elif prep.scaled:  # blocks of scale 1 (alpha == r, PEFT's default) need no pass
                torch._foreach_mul_(
                    [dst_bt[i] for i in prep.scaled], [scales[i] for i in prep.scaled]
                )

    def reset_lora(self, slot: int) -> None:
        """Zero the slot's rows in every table and free them; ``KeyError`` if the slot is empty."""
        with self._lock:
            start, end = self.slot_rows(slot)
            self._zero({key: [(start, end)] for key in self.module_shapes})
            del self._rows[slot]
            self._modules.pop(slot, None)
            self.layout_version += 1

    def compact(self) -> None:
        """Slide the occupied ranges down so the free rows form one tail (moves slots in use:
        only between engine steps). Waits for a ``set_lora``/``reset_lora`` in progress."""
        with self._lock:
            if self._rows:
                self._compact()

    # ----------------------------------------------------------------------------- internals

    def _cut(self, source: SlotSource) -> SlotSource:
        """``source``'s weights as this rank holds them (see ``shard``)."""
        got = self._shards.get(source)
        if got is None:
            assert self._shard is not None
            cut = {k: _Cut(*self._shard(k, w.a, w.b), w.scale) for k, w in source.weights.items()}
            got = self._shards[source] = SlotSource(cut)
        return got

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be an int in [0, {self.max_loras}), got {slot!r}")

    def _check_module(self, key: ModuleKey, w: LoRAModuleWeightsLike) -> int:
        """Validate one module's weights against the bank; return its rank."""
        if key not in self.module_shapes:
            raise ValueError(f"adapter targets module {key}, which this model does not adapt")
        d_in, d_out = self.module_shapes[key]
        a, b = w.a, w.b
        n = self.module_experts.get(key)
        if n is not None:
            r = a.shape[-2] if a.ndim == 3 else 0
            if a.shape != (n, r, d_in) or b.shape != (n, d_out, r):
                raise ValueError(
                    f"module {key}: expected A [{n}, r, {d_in}] and B [{n}, {d_out}, r] "
                    f"({n} experts), got A {tuple(a.shape)} and B {tuple(b.shape)}"
                )
            if not 1 <= r <= self.max_lora_rank:
                raise ValueError(
                    f"module {key}: rank {r} not in [1, max_lora_rank={self.max_lora_rank}]"
                )
            return r
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
        tables = [(key, tab) for key in self.module_shapes for tab in (self._a[key], self._bt[key])]
        with torch.no_grad():
            for slot, (start, end) in sorted(self._rows.items(), key=lambda item: item[1]):
                n = end - start
                if start != pos:
                    for key, tab in tables:
                        dsts = self._rows_of(tab, key, pos, pos + n)
                        for dst, src in zip(dsts, self._rows_of(tab, key, start, end), strict=True):
                            # Overlapping ranges: copy through a temporary.
                            dst.copy_(src.clone() if start < pos + n else src)
                    self._rows[slot] = (pos, pos + n)
                pos += n
            for key, tab in tables:
                for view in self._rows_of(tab, key, pos, old_end):
                    view.zero_()
        self.layout_version += 1
        return pos
