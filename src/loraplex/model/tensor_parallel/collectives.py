"""The collectives of tensor-parallel ranks on one host, through shared memory.

gloo's all-reduce costs 0.6-0.9 ms a call on loopback here (docs/benchmarks.md, "Tensor
parallelism"): a decode step makes two per layer, so on a 1B model that alone is tens of
milliseconds. Ranks on one host instead meet in a shared-memory file::

    flags   int64 per rank (64 bytes apart): the number of the rank's last published call
    data    [2 parities][ranks][slot bytes]: each rank's input of call c in parity c % 2

    every call c, rank r:  wait until every flags[q] >= c - 1   # parity c % 2 is read out
    all_reduce(x):   data[c % 2][r] = x;  flags[r] = c        # publish (x86 keeps store order)
                     wait until every flags[q] >= c
                     x = sum over q = 0..N-1 of data[c % 2][q]  # same order: same bits on all
    gather(x):       publish; rank 0 waits for every rank and concatenates
    broadcast(msg):  rank 0 publishes the pickled bytes (length first); the others wait for it

Every rank makes the same calls in the same order (the step group's), so ``c`` agrees. Two
parities suffice: a rank rewrites parity ``c % 2`` at call ``c + 2`` only after every rank
published ``c + 1``, which each did only after it had read call ``c``. A tensor or message
larger than a slot goes through the process group instead (all ranks decide alike: the same
shapes; a broadcast's length is published first). A waiting rank spins briefly, then yields
its core, then (waiting for the next step's broadcast, which may come hours later) sleeps in
short naps; it gives up with a RuntimeError when ``alive()`` says the group is gone (a peer
process exited), or, inside a step, after ``timeout_s``.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

_FLAG_STRIDE = 8  # int64s between two ranks' flags: one 64-byte cache line each
SPIN = 200
"""Polls of the flags before a waiting rank starts yielding its core."""
IDLE_SPIN = 20000
"""Yields before a worker waiting for the next step starts napping (``NAP_S`` each)."""
NAP_S = 0.0005


class ShmCollectives:
    """All-reduce (SUM), gather to rank 0 and broadcast from rank 0 over the ranks of one
    host, through a shared-memory file (module docstring); what does not fit a slot goes
    through ``group`` (gloo)."""

    def __init__(
        self,
        path: str,
        rank: int,
        size: int,
        slot_bytes: int,
        group: object,
        alive: Callable[[], bool],
        timeout_s: float,
    ) -> None:
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.group, self.alive, self.timeout_s = group, alive, timeout_s
        header = size * _FLAG_STRIDE * 8
        buf = torch.from_file(path, shared=True, size=_total(size, slot_bytes), dtype=torch.uint8)
        self._flags = buf[:header].view(torch.int64)[::_FLAG_STRIDE]  # [size]
        self._flags_np = self._flags.numpy()
        self._data = buf[header:].view(2, size, slot_bytes)  # [parity, rank, bytes]
        self._calls = 0

    @staticmethod
    def create(size: int, slot_bytes: int) -> str:
        """A zeroed shared-memory file for ``size`` ranks (in /dev/shm where there is one),
        readable by this user only."""
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="loraplex-tp-", suffix=".shm", dir=root)
        os.close(fd)
        ShmCollectives.create_at(path, size, slot_bytes)
        return path

    @staticmethod
    def create_at(path: str, size: int, slot_bytes: int) -> None:
        """Size (and zero) the file at ``path`` for ``size`` ranks."""
        with open(path, "wb") as f:
            f.truncate(_total(size, slot_bytes))

    # -- the three collectives -------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place (every rank gets the same bits)."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes or not x.is_contiguous():
            dist.all_reduce(x, group=self.group)
            return x
        c, p = self._begin()
        flat = x.view(-1)
        slots = self._data[p, :, :nbytes].view(x.dtype)  # [size, numel]
        slots[self.rank].copy_(flat)
        self._flags_np[self.rank] = c
        self._wait(c)
        if self.size == 2:
            torch.add(slots[0], slots[1], out=flat)
        else:
            torch.sum(slots, dim=0, out=flat)  # in rank order
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (one shape on all) on rank 0, in rank order; None elsewhere."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes:
            parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(x.contiguous(), parts, dst=0, group=self.group)
            return parts
        c, p = self._begin()
        slots = self._data[p, :, :nbytes].view(x.dtype)  # [size, numel]
        slots[self.rank].copy_(x.reshape(-1))
        self._flags_np[self.rank] = c
        if self.rank != 0:
            return None
        self._wait(c)
        return [slots[q].view(x.shape).clone() for q in range(self.size)]

    def broadcast(self, msg: Any = None) -> Any:
        """Rank 0's ``msg`` (any picklable object) on every rank; rank 0 gets it back."""
        c, p = self._begin()
        slot = self._data[p, 0]
        if self.rank == 0:
            data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
            fits = len(data) + 8 <= self.slot_bytes
            slot[:8].view(torch.int64)[0] = len(data) if fits else -1
            if fits:
                slot[8 : 8 + len(data)].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
            self._flags_np[0] = c
            if not fits:  # too large for the slot: the process group carries it
                dist.broadcast_object_list([msg], src=0, group=self.group)
            return msg
        self._wait(c, root_only=True, idle=True)
        n = int(slot[:8].view(torch.int64)[0])
        data = slot[8 : 8 + n].numpy().tobytes() if n >= 0 else b""
        self._flags_np[self.rank] = c  # read out
        if n < 0:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            return box[0]
        return pickle.loads(data)

    def release(self) -> None:
        """Drop the process group (see :meth:`GlooCollectives.release`)."""
        self.group = None

    # -- internals ---------------------------------------------------------------------------
    def _begin(self) -> tuple[int, int]:
        """The next call's number and parity, once every rank has read that parity's last
        use (call ``c - 2``: all have published ``c - 1``)."""
        self._calls += 1
        c = self._calls
        self._wait(c - 1)
        return c, c & 1

    def _wait(self, c: int, *, root_only: bool = False, idle: bool = False) -> None:
        """Until every rank (``root_only``: rank 0) has published call ``c``. ``idle``: a
        worker waiting for the next step, however long that takes (naps, never times out)."""
        flags = self._flags_np
        n = 0
        deadline = 0.0
        while (flags[0] if root_only else flags.min()) < c:
            n += 1
            if n < SPIN:
                continue
            if n == SPIN:
                deadline = time.monotonic() + self.timeout_s
            elif n % 256 == 0:
                if not self.alive():
                    raise RuntimeError(f"tensor-parallel peer gone (shared-memory call {c})")
                if not idle and time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensor-parallel peer silent for {self.timeout_s:.0f} s "
                        f"(shared-memory call {c})"
                    )
            if idle and n > IDLE_SPIN:
                time.sleep(NAP_S)
            else:
                os.sched_yield()  # a peer may need this core


def _total(size: int, slot_bytes: int) -> int:
    return size * _FLAG_STRIDE * 8 + 2 * size * slot_bytes


class GlooCollectives:
    """The same three collectives through the process group (ranks on several hosts, or
    ``LORAPLEX_TP_SHM=0``)."""

    def __init__(self, group: object, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0, group=self.group)
        return parts

    def broadcast(self, msg: Any = None) -> Any:
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def release(self) -> None:
        """Drop this reference to the process group, so that once the group is destroyed its
        C++ object (and gloo's threads) go now, not in the interpreter's teardown, where they
        can abort the process ("terminate called without an active exception")."""
        self.group = None


Collectives = ShmCollectives | GlooCollectives
"""What a tensor-parallel rank's step traffic goes through (chosen once, when it joins)."""
