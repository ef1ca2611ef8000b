"""Rank 0's side of the group: the worker processes it starts (:class:`WorkerProcess`), its
handle on them and on the group (:class:`TPWorkers`, which carries every model call and slot
write), and the model the runner calls (:class:`DriverModel`, each call broadcast first)."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from loraplex.config import Rendezvous
from loraplex.engine.tensor_parallel.group import Group, TensorParallelError, join_group

if TYPE_CHECKING:
    from loraplex.config import EngineConfig
    from loraplex.kv.cache import PagedKVCache
    from loraplex.model.decoder import DecoderForCausalLM

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.25
"""How often rank 0 looks for exited worker processes."""

WORKER_MODULE = "loraplex.engine.tensor_parallel.worker"
"""What a worker process runs (``python -m``)."""


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
        here = rv.ranks_here
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

    @contextlib.contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """Rank 0's start-up after the group formed: if it raises, the group is closed (as
        failed, so the workers are not told to stop in step) before the error goes on."""
        try:
            yield
        except BaseException:
            self.failure = self.failure or "start-up failed"
            self.close()
            raise

    def _check_open(self, group: Any) -> None:
        """TensorParallelError once the group broke or closed (``group`` is None then)."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if group is None:
            raise TensorParallelError("the tensor-parallel group is closed")

    def cast(self, msg: Any) -> None:
        """Send ``msg`` to every worker's step loop; a broken group fails for good."""
        self._check_open(self.step_group)
        try:
            self.group.comm.broadcast(msg)
        except RuntimeError as e:
            self.fail(e)

    @property
    def local(self) -> bool:
        """Every rank on this host (slot writes' weights through shared memory)."""
        return self.group.local

    def send_slots(self, msg: Any) -> None:
        """Broadcast ``msg`` from rank 0 on the slot group; a broken group fails for good."""
        self._check_open(self.slot_group)
        try:
            dist.broadcast_object_list([msg], src=0, group=self.slot_group)
        except RuntimeError as e:
            self.fail(e)

    def slot_answers(self) -> list[Any]:
        """Each worker's answer to the last slot-group message (rank order, rank 0 left out)."""
        got: list[Any] = [None] * self.rv.size
        try:
            dist.gather_object(None, got, dst=0, group=self.slot_group)
        except RuntimeError as e:
            self.fail(e)
        return got[1:]

    def fail(self, e: BaseException) -> NoReturn:
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


class WorkerProcess:
    """One worker rank as a child process (``python -m`` :data:`WORKER_MODULE`; its config
    arrives pickled on stdin): a fresh interpreter, so neither the parent's threads nor its
    ``__main__`` module are inherited (a script calling ``LLM(tensor_parallel_size=2)`` needs
    no ``if __name__ == "__main__"`` guard)."""

    def __init__(self, proc: subprocess.Popen, rank: int, log_path: str) -> None:
        self.proc, self.rank, self.log_path = proc, rank, log_path
        self.name = f"loraplex-tp-{rank}"

    @classmethod
    def spawn(cls, config: EngineConfig, rv: Rendezvous, rank: int) -> WorkerProcess:
        fd, path = tempfile.mkstemp(prefix=f"loraplex-tp-{rank}-", suffix=".log")
        with os.fdopen(fd, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE],
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
