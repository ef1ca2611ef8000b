"""The process group every rank joins, and what all ranks agree on at start: whether each
loaded, how many threads each runs, which shard each holds, and the sizes rank 0 decides."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from loraplex.config import ENV_TP_SHM, Rendezvous, env_value
from loraplex.model.tensor_parallel.collectives import (
    Collectives,
    GlooCollectives,
    ShmCollectives,
)
from loraplex.model.tensor_parallel.sharding import ShardLayout, TensorParallel

if TYPE_CHECKING:
    from loraplex.config import EngineConfig
    from loraplex.model.spec import ModelConfig

T = TypeVar("T")

GROUP_TIMEOUT_S = 120.0
"""How long a collective waits for a silent peer before the group counts as broken (a long
prompt chunk on a slow rank must fit in it)."""

SHM_SLOT_BYTES = 4 << 20
"""Largest tensor the shared-memory all-reduce takes (a decode step's [tokens, hidden] and
prompt chunks up to ~1k tokens of a 2k-wide model); larger ones go through gloo."""


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed (a worker died or disagreed); the engine cannot step."""


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
    local = rv.size == rv.ranks_here
    if local and env_value(ENV_TP_SHM) != "0":
        path = [ShmCollectives.create(rv.size, SHM_SLOT_BYTES) if rank == 0 else None]
        dist.broadcast_object_list(path, src=0, group=step)
        comm = ShmCollectives(path[0], rank, rv.size, SHM_SLOT_BYTES, step, alive, GROUP_TIMEOUT_S)
        dist.barrier(group=step)  # every rank has it mapped: the name can go
        if rank == 0:
            os.unlink(path[0])
    return Group(step, slots, comm, local)


def rank_threads(config: EngineConfig, rv: Rendezvous) -> int:
    """Intra-op threads of one rank: ``--num-threads``, else this node's cores shared out."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // max(1, rv.ranks_here))


def model_shard(config: EngineConfig, mc: ModelConfig, group: Group, rank: int) -> TensorParallel:
    """``rank``'s shard plan of the model ``mc`` describes, its collectives on ``group``;
    ModelLoadError when the model (or ``--fully-sharded-loras``) does not split."""
    layout = ShardLayout.of(mc, rank, config.tensor_parallel_size)
    tp = TensorParallel(layout, None, config.fully_sharded_loras, group.comm)  # comm: the group
    tp.check_lora_split(mc)
    return tp


def agree(ok: str | None, group: Any) -> None:
    """Every rank reports its start-up outcome (None: fine, else why not); all raise if any
    failed, so no rank waits on a peer that is gone."""
    got: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, ok, group=group)
    bad = [f"rank {r}: {why}" for r, why in enumerate(got) if why is not None]
    if bad:
        raise TensorParallelError("tensor-parallel start failed: " + "; ".join(bad))


def on_every_rank(load: Callable[[], T], group: Group | None) -> T:
    """``load()`` as one rank of ``group`` (None: no group, just ``load()``); every rank
    learns whether all loaded, and raises the first failure's reason if one did not (this
    rank's own error if it failed)."""
    if group is None:
        return load()
    try:
        got = load()
    except Exception as e:  # this rank's own error is the one to raise
        with contextlib.suppress(TensorParallelError):
            agree(f"{type(e).__name__}: {e}", group.step)
        raise
    agree(None, group.step)
    return got


@dataclass(frozen=True)
class WorkerLayout:
    """What rank 0 decides at start and every worker builds the same way."""

    num_blocks: int
    lora_slots: int  # 0: no LoRA
    state_pages: int = 0  # the state pool's pages (0: no recurrent layers)
