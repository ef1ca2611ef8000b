"""The slot bank under tensor parallelism: rank 0's bank, whose every mutation every worker's
bank repeats, and the messages that carry it.

Rank 0 loads and verifies an adapter once; each mutation (fill, reset, compaction) goes to the
workers with the adapter's whole weights, and each worker's bank keeps its own cut of them
(the bank's ``shard``, ``model.tensor_parallel``'s split). When every rank is on this host the
weights travel through shared memory: rank 0 writes them once into a private file in
``/dev/shm`` and the message carries only where each tensor lies in it
(:class:`SharedWeights`); ranks on other hosts receive them pickled.

The transport is the engine's (``engine.tensor_parallel``): rank 0's bank talks to the workers
through :class:`SlotWorkers`, and a worker's slot loop hands each message it receives to
:func:`repeat`. This module knows the messages, not the process group.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch

from loraplex.lora.slots import LoRAModuleWeightsLike, LoRASlotBank, ModuleKey, SlotSource

log = logging.getLogger(__name__)


class SlotBankDiverged(RuntimeError):
    """A worker's bank came out of a mutation different from rank 0's (error or row layout)."""


class SlotWorkers(Protocol):
    """The worker ranks as rank 0's bank reaches them (``engine.tensor_parallel``'s
    ``TPWorkers``): one slot-group message out, every worker's answer back, in order."""

    @property
    def local(self) -> bool:
        """Every rank on this host: the weights can go through shared memory."""
        ...

    def send_slots(self, msg: Any) -> None:
        """``msg`` to every worker's slot loop (raises once the group is broken)."""
        ...

    def slot_answers(self) -> list[Any]:
        """Each worker's answer to the last message (rank order, rank 0 left out)."""
        ...

    def fail(self, e: BaseException) -> NoReturn:
        """Mark the group broken for good and raise (the engine's error, from ``e``)."""
        ...


def _plain(weights: Mapping[ModuleKey, LoRAModuleWeightsLike] | SlotSource) -> dict:
    """An adapter's whole weights as picklable tuples ``key -> (A, B, scale)``."""
    items = weights.weights if isinstance(weights, SlotSource) else weights
    return {k: (w.a, w.b, float(w.scale)) for k, w in items.items()}


@dataclass(frozen=True)
class _Weights:
    a: torch.Tensor
    b: torch.Tensor
    scale: float


_ALIGN = 64  # bytes: every tensor in a shared file starts on a cache line (any dtype's view)


@dataclass(frozen=True)
class SharedWeights:
    """An adapter's whole weights in a shared-memory file (one slot write's): ``layout`` maps
    each module key to (A's and B's byte offset, shape, dtype name, scale). Rank 0 writes it
    and removes the file once every worker has answered; a worker maps it, cuts its shard and
    drops the mapping, so the bytes cross processes once, unpickled."""

    path: str
    nbytes: int
    layout: dict[Any, tuple[int, tuple[int, ...], int, tuple[int, ...], str, float]]

    @classmethod
    def write(cls, plain: Mapping[Any, tuple[torch.Tensor, torch.Tensor, float]]) -> SharedWeights:
        """``plain`` (``key -> (A, B, scale)``, one dtype per pair) into a new file readable by
        this user only (in /dev/shm where there is one); OSError when it cannot be written
        (the caller falls back to the process group)."""
        layout, end = {}, 0
        for key, (a, b, scale) in plain.items():
            a_off = end
            b_off = -(-(a_off + a.numel() * a.element_size()) // _ALIGN) * _ALIGN
            end = -(-(b_off + b.numel() * b.element_size()) // _ALIGN) * _ALIGN
            dtype = str(a.dtype).removeprefix("torch.")
            layout[key] = (a_off, tuple(a.shape), b_off, tuple(b.shape), dtype, float(scale))
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="loraplex-slot-", suffix=".shm", dir=root)
        shared = cls(path, max(end, 1), layout)
        try:
            try:
                os.ftruncate(fd, shared.nbytes)
            finally:
                os.close(fd)
            views = shared.read()
            for key, (a, b, _) in plain.items():
                views[key].a.copy_(a)
                views[key].b.copy_(b)
        except BaseException:
            shared.remove()
            raise
        return shared

    def read(self) -> dict[Any, _Weights]:
        """The weights as views of the mapped file (kept mapped while a view lives)."""
        buf = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
        out = {}
        for key, (a_off, a_shape, b_off, b_shape, dtype, scale) in self.layout.items():
            dt = getattr(torch, dtype)
            out[key] = _Weights(
                _view(buf, a_off, a_shape, dt), _view(buf, b_off, b_shape, dt), scale
            )
        return out

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _view(
    buf: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    n = math.prod(shape) * dtype.itemsize
    return buf[offset : offset + n].view(dtype).view(shape)


class MirroredSlotBank(LoRASlotBank):
    """Rank 0's slot bank: every mutation is repeated by every worker's bank (through the slot
    group, under this bank's lock, so in this bank's order) before it returns, and the
    workers' layouts must come out equal to this one's."""

    workers: SlotWorkers

    def set_lora(self, slot: int, weights: Any, *, compact: bool = True) -> None:
        with self._lock:
            self._mirrored("set_lora", super().set_lora, slot, weights, compact)

    def replace_lora(self, slot: int, weights: Any, *, compact: bool = True) -> None:
        with self._lock:
            self._mirrored("replace_lora", super().replace_lora, slot, weights, compact)

    def reset_lora(self, slot: int) -> None:
        with self._lock:
            self._mirrored("reset_lora", super().reset_lora, slot)

    def compact(self) -> None:
        with self._lock:
            self._mirrored("compact", super().compact)

    def _mirrored(self, op: str, here: Callable[..., None], *args: Any) -> None:
        """Send ``op`` to every worker with the same arguments (whole weights), run it here
        while they do, then require the same outcome (error class, row layout) of all."""
        sent: tuple = args
        shared: SharedWeights | None = None
        ws = self.workers
        if op in ("set_lora", "replace_lora"):
            plain = _plain(args[1])
            if ws.local:
                try:
                    shared = SharedWeights.write(plain)
                except OSError as e:  # /dev/shm full or missing: the process group carries it
                    log.warning("slot write through the process group (shared memory: %s)", e)
            sent = (args[0], shared if shared is not None else plain, args[2])
        try:
            ws.send_slots((op, *sent))
            err: BaseException | None = None
            try:
                if op in ("set_lora", "replace_lora"):
                    slot, weights, compact = args
                    here(slot, weights, compact=compact)
                else:
                    here(*args)
            except Exception as e:  # the same error is expected of the workers
                err = e
            mine = _outcome(self, err)
            for rank, theirs in enumerate(ws.slot_answers(), start=1):
                if theirs != mine:
                    ws.fail(SlotBankDiverged(f"rank {rank} slot bank diverged: {theirs} != {mine}"))
        finally:
            if shared is not None:
                shared.remove()
        if err is not None:
            raise err


def repeat(bank: LoRASlotBank, msg: tuple) -> tuple:
    """A worker's side of one mutation: ``msg`` (what rank 0's :class:`MirroredSlotBank`
    sent) applied to ``bank``; returns the outcome that answers it."""
    op, *args = msg
    err: BaseException | None = None
    try:
        if op in ("set_lora", "replace_lora"):
            slot, sent, compact = args
            if isinstance(sent, SharedWeights):
                weights = sent.read()  # views of rank 0's file; the bank copies its cut
            else:
                weights = {k: _Weights(*v) for k, v in sent.items()}
            getattr(bank, op)(slot, weights, compact=compact)
            del weights
        else:
            getattr(bank, op)(*args)
    except Exception as e:
        err = e
    return _outcome(bank, err)


def _outcome(bank: LoRASlotBank, err: BaseException | None) -> tuple:
    """What a mutation left: its error's class and the row layout (every rank must agree)."""
    rows = tuple(sorted((s, bank.slot_rows(s)) for s in bank.occupied_slots))
    return (type(err).__name__ if err is not None else None, rows)
