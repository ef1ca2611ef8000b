"""A tensor-parallel worker process: ``python -m loraplex.engine.tensor_parallel.worker``
(started by rank 0's :class:`~loraplex.engine.tensor_parallel.driver.WorkerProcess`, its config
pickled on stdin), and a headless node's ranks (``loraplex serve ... --node-rank N`` for N > 0).

A worker builds its shard, KV cache and slot bank as rank 0 says, then runs two loops until the
group ends: the step loop (each model call rank 0 casts) and the slot loop (each slot-bank
mutation, in rank 0's order, answered with its outcome)."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

from loraplex.config import EngineConfig, Rendezvous
from loraplex.engine.builder import (
    MemoryBudget,
    load_base,
    model_kv_groups,
    set_threads,
    slot_bank,
)
from loraplex.engine.tensor_parallel.driver import WorkerProcess
from loraplex.engine.tensor_parallel.group import (
    Group,
    WorkerLayout,
    join_group,
    on_every_rank,
    rank_threads,
)
from loraplex.kv.cache import PagedKVCache
from loraplex.lora.slots import LoRASlotBank
from loraplex.lora.tensor_parallel import repeat
from loraplex.model.decoder import DecoderForCausalLM
from loraplex.model.tensor_parallel.collectives import Collectives

log = logging.getLogger(__name__)


def worker_parts(
    config: EngineConfig, rv: Rendezvous, rank: int, group: Group
) -> tuple[DecoderForCausalLM, PagedKVCache, LoRASlotBank | None]:
    """A tensor-parallel worker's shard, KV cache and slot bank, sized as rank 0 decided."""
    set_threads(rank_threads(config, rv))
    _, device, dtype, model = on_every_rank(lambda: load_base(config, None, group, rank), group)
    layout: WorkerLayout = group.comm.broadcast()
    mc = model.cfg
    groups = model_kv_groups(model, config)  # as rank 0's
    budget = MemoryBudget(config, mc, device, dtype, groups)
    bank = slot_bank(config, model, budget, layout.lora_slots) if layout.lora_slots else None
    cache = PagedKVCache(
        mc.num_layers, layout.num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
        dtype, device, groups, mc.kv_layer_shapes(), model.state_shape(), layout.state_pages,
    )  # fmt: skip
    return model, cache, bank


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
            dist.gather_object(repeat(bank, msg[0]), None, dst=0, group=group)
    except RuntimeError:
        return  # the group broke; the step loop sees it too


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
    here = rv.ranks_here
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
