"""A tensor-parallel worker process: ``python -m loraplex.engine.tensor_parallel.worker`` (started by rank 0's
:class:`~loraplex.engine.tensor_parallel.driver.WorkerProcess`, its config pickled on stdin), and a
headless node's ranks (``loraplex serve ... --node-rank N`` for N > 0)."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading

from loraplex.config import EngineConfig, Rendezvous
from loraplex.engine.builder import worker_parts
from loraplex.engine.tensor_parallel.driver import WorkerProcess, join_group, slot_loop, step_loop

log = logging.getLogger(__name__)


def worker_main(config: EngineConfig, rv: Rendezvous, rank: int) -> None:
    """A worker process: join, load its shard, build its KV cache and slot bank as rank 0
    says, then execute what rank 0 broadcasts until told to stop or the group breaks."""
    logging.basicConfig(level=logging.WARNING, format=f"tp-{rank} %(levelname)s %(message)s")
    parent = os.getppid()
    group = join_group(rv, rank, lambda: os.getppid() == parent)  # rank 0 is this one's parent
    try:
        model, cache, bank = worker_parts(config, rv, rank, group)
    except Exception:
        return  # worker_parts has reported the failure to every rank
    if bank is not None:
        threading.Thread(
            target=slot_loop, args=(bank, group.slots), name="tp-slots", daemon=True
        ).start()
    try:
        step_loop(model, cache, group.comm)
    except RuntimeError as e:  # the group broke: rank 0 is gone
        log.warning("tensor-parallel rank %d stops: %s", rank, e)
    os._exit(0)  # daemon threads may sit in a collective; nothing is left to flush


def run_headless(config: EngineConfig) -> int:
    """A node after the first (``--node-rank > 0``): run its ranks (the first in this process,
    the others as child processes) until rank 0 stops the group or it breaks; no HTTP."""
    rv = config.rendezvous()
    here = rv.local_ranks or rv.size
    log.warning(
        "headless node %d: ranks %d..%d of %d, rendezvous at %s:%d",
        config.node_rank, rv.first_rank, rv.first_rank + here - 1, rv.size,
        rv.master_addr, rv.master_port,
    )  # fmt: skip
    for i in range(1, here):
        WorkerProcess.spawn(config, rv, rv.first_rank + i)
    worker_main(config, rv, rv.first_rank)  # exits the process when the group ends
    return 0


def _main() -> None:
    """Entry of a worker process: its (config, rendezvous, rank) come pickled on stdin from
    rank 0's process (a trusted parent; nothing else writes that pipe)."""
    config, rv, rank = pickle.loads(sys.stdin.buffer.read())
    worker_main(config, rv, rank)


if __name__ == "__main__":
    _main()
