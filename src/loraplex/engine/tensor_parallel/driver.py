"""Tensor-parallel execution: one engine core on rank 0, workers that only execute.

Rank 0 (the serving process) owns the scheduler, the adapter cache, sampling and its own
shard of the model; ranks 1.. are worker processes holding the other shards. They form one
``torch.distributed`` process group (gloo on CPU) with two communicators::

    step group   rank 0 broadcasts each model call (the step's ForwardBatch: token ids,
                 positions, slot mapping, block tables, LoRA plan); every rank runs its shard,
                 the layers' all-reduces and the logits' gather ride on the same group
    slot group   every slot-bank mutation (fill, reset, compaction) in rank 0's order, each
                 answered by every worker with its resulting layout before rank 0's returns

so a slot write has finished on all ranks before the engine can schedule a step that reads it
(rank 0's write returns only then), and the row layouts of all ranks stay equal (checked on
every mutation). Host, disk and store tiers exist once, on rank 0: it loads and verifies an
adapter, and each worker takes its cut of the whole weights (``TensorParallel.shard_lora``).
When every rank is on this host the weights travel through shared memory: rank 0 writes them
once into a private file in ``/dev/shm`` and the slot group carries only where each tensor
lies in it (:class:`SharedWeights`); ranks on other hosts receive them pickled through the
slot group. Workers never decide anything.

A worker that dies breaks the group: rank 0's next collective raises (gloo sees the closed
connection, or the group's timeout expires) and the step fails with that error; the engine
marks itself dead (``TPWorkers.failure``) and every later step fails at once.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loraplex.config import ENV_TP_SHM, Rendezvous, env_value
from loraplex.lora.slots import LoRAModuleWeightsLike, LoRASlotBank, ModuleKey, SlotSource
from loraplex.model.tensor_parallel.collectives import (
    Collectives,
    GlooCollectives,
    ShmCollectives,
)

if TYPE_CHECKING:
    from loraplex.config import EngineConfig
    from loraplex.kv.cache import PagedKVCache
    from loraplex.model.decoder import DecoderForCausalLM

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 120.0
"""How long a collective waits for a silent peer before the group counts as broken (a long
prompt chunk on a slow rank must fit in it)."""


WATCH_INTERVAL_S = 0.25
"""How often rank 0 looks for exited worker processes."""


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed (a worker died or disagreed); the engine cannot step."""


SHM_SLOT_BYTES = 4 << 20
"""Largest tensor the shared-memory all-reduce takes (a decode step's [tokens, hidden] and
prompt chunks up to ~1k tokens of a 2k-wide model); larger ones go through gloo."""


@dataclass
class Group:
    """A rank's communicators: the step group (gloo), the slot group (slot-bank writes, from
    the staging thread) and the step traffic's collectives (model calls, all-reduces, the
    logits' gather): shared memory when every rank is on this host
    (``model.tensor_parallel.collectives``; ``LORAPLEX_TP_SHM=0``: the step group's), else
    the step group's."""

    step: Any
    slots: Any
    comm: Collectives
    local: bool = False  # every rank on this host: slot writes' weights through shared memory

    def release(self) -> None:
        """Drop every reference this rank holds to its process groups (then destroy them)."""
        self.comm.release()
        self.step = self.slots = None


def join_group(rv: Rendezvous, rank: int, alive: Callable[[], bool]) -> Group:
    """Join the process group as ``rank``; ``alive()``: whether the rest of the group can
    still answer (a waiting all-reduce gives up once it says no)."""
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    dist.init_process_group(
        "gloo", init_method=rv.init_method, rank=rank, world_size=rv.size, timeout=timeout
    )
    step, slots = dist.group.WORLD, dist.new_group(backend="gloo", timeout=timeout)
    comm: Collectives = GlooCollectives(step, rank, rv.size)
    local = rv.size == (rv.local_ranks or rv.size)
    if local and env_value(ENV_TP_SHM) != "0":
        path = [ShmCollectives.create(rv.size, SHM_SLOT_BYTES) if rank == 0 else None]
        dist.broadcast_object_list(path, src=0, group=step)
        comm = ShmCollectives(path[0], rank, rv.size, SHM_SLOT_BYTES, step, alive, GROUP_TIMEOUT_S)
        dist.barrier(group=step)  # every rank has it mapped: the name can go
        if rank == 0:
            os.unlink(path[0])
    return Group(step, slots, comm, local)


def rank_threads(config: EngineConfig, ranks_here: int) -> int:
    """Intra-op threads of one rank: ``--num-threads``, else this node's cores shared out."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // max(1, ranks_here))


def agree(ok: str | None, group: Any) -> None:
    """Every rank reports its start-up outcome (None: fine, else why not); all raise if any
    failed, so no rank waits on a peer that is gone."""
    got: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, ok, group=group)
    bad = [f"rank {r}: {why}" for r, why in enumerate(got) if why is not None]
    if bad:
        raise TensorParallelError("tensor-parallel start failed: " + "; ".join(bad))


# -- rank 0 ----------------------------------------------------------------------------------


class TPWorkers:
    """Rank 0's handle on the group: the worker processes, the two communicators, the
    channel every model call and slot mutation goes through, and whether the group broke."""

    def __init__(self, rv: Rendezvous, group: Group) -> None:
        self.rv = rv
        self.group = group
        self.procs: list[Any] = []
        self.failure: str | None = None
        self._closed = False

    @property
    def step_group(self) -> Any:
        return self.group.step  # None once closed

    @property
    def slot_group(self) -> Any:
        return self.group.slots

    @classmethod
    def start(cls, config: EngineConfig, rv: Rendezvous) -> TPWorkers:
        """Start this node's workers (the node's ranks after its first) and join the group as
        its first rank; a worker that exits before the group forms fails the start at once,
        with its last output."""
        if dist.is_initialized():
            raise TensorParallelError(
                "this process already runs a tensor-parallel engine (one process group each)"
            )
        rv = rv.with_port()
        here = rv.local_ranks or rv.size
        procs = [WorkerProcess.spawn(config, rv, rv.first_rank + i) for i in range(1, here)]
        joined: dict[str, Any] = {}
        holder: list[TPWorkers] = []

        def alive() -> bool:  # read by a waiting all-reduce, once the workers exist
            return not holder or (holder[0].failure is None and not holder[0].dead_workers())

        def join() -> None:
            try:
                joined["groups"] = join_group(rv, rv.first_rank, alive)
            except BaseException as e:  # handed to the starting thread
                joined["error"] = e

        t = threading.Thread(target=join, name="tp-join", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            gone = [p for p in procs if not p.is_alive()]
            if gone and t.is_alive():
                for p in procs:
                    p.kill()
                raise TensorParallelError(
                    f"tensor-parallel worker {gone[0].name} exited before the group formed: "
                    f"{gone[0].last_words()}"
                )
        if "error" in joined:
            for p in procs:
                p.kill()
            raise joined["error"]
        workers = cls(rv, joined["groups"])
        workers.procs = procs
        holder.append(workers)
        threading.Thread(target=workers._watch, name="tp-watch", daemon=True).start()
        return workers

    def _watch(self) -> None:
        """Notice a worker that exits, even while no step runs (health checks read
        ``failure``): one log line, and the group counts as broken."""
        while not self._closed and self.failure is None:
            dead = self.dead_workers()
            if dead:
                self.failure = f"tensor-parallel worker {', '.join(dead)} exited"
                log.error("%s; this engine stops serving", self.failure)
                return
            time.sleep(WATCH_INTERVAL_S)

    def cast(self, msg: Any) -> None:
        """Send ``msg`` to every worker's step loop; a broken group fails for good."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self.step_group is None:
            raise TensorParallelError("the tensor-parallel group is closed")
        try:
            self.group.comm.broadcast(msg)
        except RuntimeError as e:
            self.fail(e)

    def send(self, group: Any, msg: Any) -> None:
        """Broadcast ``msg`` from rank 0 on ``group``; a broken group fails for good."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if group is None:
            raise TensorParallelError("the tensor-parallel group is closed")
        try:
            dist.broadcast_object_list([msg], src=0, group=group)
        except RuntimeError as e:
            self.fail(e)

    def answers(self, group: Any) -> list[Any]:
        """Each worker's answer to the last message on ``group`` (rank order, rank 0's None)."""
        got: list[Any] = [None] * self.rv.size
        try:
            dist.gather_object(None, got, dst=0, group=group)
        except RuntimeError as e:
            self.fail(e)
        return got[1:]

    def fail(self, e: BaseException) -> None:
        """Mark the group broken (one log line), then raise."""
        dead = [p.name for p in self.procs if not p.is_alive()]
        why = f"tensor-parallel group broken ({', '.join(dead) or 'a rank'} gone): {e}"
        if self.failure is None:
            log.error("%s", why)
            self.failure = why
        raise TensorParallelError(why) from e

    def dead_workers(self) -> list[str]:
        """Names of this node's worker processes that have exited."""
        return [p.name for p in self.procs if not p.is_alive()]

    def close(self) -> None:
        """Tell the workers to exit and wait for them a little; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:  # the step loop returns and the worker exits, slot thread and all
            with contextlib.suppress(TensorParallelError):
                self.cast(("stop",))
        for p in self.procs:
            p.join(5.0)
            p.kill()
            with contextlib.suppress(OSError):
                os.unlink(p.log_path)
        self.group.release()  # before the destroy: the groups' objects go with it
        if dist.is_initialized():
            dist.destroy_process_group()


class DriverModel:
    """Rank 0's model for the runner: each call is broadcast to the workers first (so every
    rank runs it on its shard), then run here. Everything else reads through to the shard."""

    def __init__(self, model: DecoderForCausalLM, workers: TPWorkers) -> None:
        self._model = model
        self._workers = workers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def _cast(self, *msg: Any) -> None:
        self._workers.cast(msg)

    def forward(self, batch: Any, cache: PagedKVCache) -> torch.Tensor:
        self._cast("forward", batch)
        return self._guard(self._model.forward, batch, cache)

    def hidden_states(self, batch: Any, cache: PagedKVCache) -> torch.Tensor:
        self._cast("hidden", batch)
        return self._guard(self._model.hidden_states, batch, cache)

    def logits_at(self, h: torch.Tensor, rows: torch.Tensor, plan: Any = None) -> torch.Tensor:
        self._cast("logits", rows, plan)
        return self._guard(self._model.logits_at, h, rows, plan)

    def _guard(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """``fn(*args)``. Any error inside breaks the group for good: the workers may sit in
        a collective rank 0 never reaches, so no later call could line up with theirs."""
        try:
            return fn(*args)
        except Exception as e:
            self._workers.fail(e)
            raise  # unreachable: fail raises


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

    workers: TPWorkers

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
            if ws.group.local:
                try:
                    shared = SharedWeights.write(plain)
                except OSError as e:  # /dev/shm full or missing: the process group carries it
                    log.warning("slot write through the process group (shared memory: %s)", e)
            sent = (args[0], shared if shared is not None else plain, args[2])
        try:
            ws.send(ws.slot_group, (op, *sent))
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
            for rank, theirs in enumerate(ws.answers(ws.slot_group), start=1):
                if theirs != mine:
                    ws.fail(
                        TensorParallelError(f"rank {rank} slot bank diverged: {theirs} != {mine}")
                    )
        finally:
            if shared is not None:
                shared.remove()
        if err is not None:
            raise err


def _outcome(bank: LoRASlotBank, err: BaseException | None) -> tuple:
    """What a mutation left: its error's class and the row layout (every rank must agree)."""
    rows = tuple(sorted((s, bank.slot_rows(s)) for s in bank.occupied_slots))
    return (type(err).__name__ if err is not None else None, rows)


# -- workers ---------------------------------------------------------------------------------


class WorkerProcess:
    """One worker rank as a child process (``python -m loraplex.engine.tensor_parallel.worker``; its
    config arrives pickled on stdin): a fresh interpreter, so neither the parent's threads nor
    its ``__main__`` module are inherited (a script calling ``LLM(tensor_parallel_size=2)``
    needs no ``if __name__ == "__main__"`` guard)."""

    def __init__(self, proc: subprocess.Popen, rank: int, log_path: str) -> None:
        self.proc, self.rank, self.log_path = proc, rank, log_path
        self.name = f"loraplex-tp-{rank}"

    @classmethod
    def spawn(cls, config: EngineConfig, rv: Rendezvous, rank: int) -> WorkerProcess:
        fd, path = tempfile.mkstemp(prefix=f"loraplex-tp-{rank}-", suffix=".log")
        with os.fdopen(fd, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "loraplex.engine.tensor_parallel.worker"],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps((config, rv, rank)))
        proc.stdin.close()
        return cls(proc, rank, path)

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.is_alive():
            self.proc.kill()

    def join(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)

    def last_words(self, limit: int = 2000) -> str:
        """The tail of the worker's output (its log file), for the error that reports it."""
        try:
            with open(self.log_path, "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no output)"
        return text[-limit:].strip() or f"(no output; exit code {self.proc.returncode})"


@dataclass(frozen=True)
class WorkerLayout:
    """What rank 0 decides at start and every worker builds the same way."""

    num_blocks: int
    lora_slots: int  # 0: no LoRA


def step_loop(model: DecoderForCausalLM, cache: PagedKVCache, comm: Collectives) -> None:
    """Run what rank 0 casts, call by call, until it says stop."""
    h: torch.Tensor | None = None
    while True:
        op, *args = comm.broadcast()
        if op == "forward":
            model.forward(args[0], cache)
        elif op == "hidden":
            h = model.hidden_states(args[0], cache)
        elif op == "logits":
            assert h is not None
            model.logits_at(h, *args)
        elif op == "stop":
            return


def slot_loop(bank: LoRASlotBank, group: Any) -> None:
    """Repeat rank 0's slot-bank mutations in its order; answer each with the outcome."""
    try:
        while True:
            msg: list[Any] = [None]
            dist.broadcast_object_list(msg, src=0, group=group)
            op, *args = msg[0]
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
            dist.gather_object(_outcome(bank, err), None, dst=0, group=group)
    except RuntimeError:
        return  # the group broke; the step loop sees it too
