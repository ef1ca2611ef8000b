"""Slot activation off the engine thread: a background writer fills device slots' rows.

A newly reserved slot's weights are written over a retired adapter's stale rows by one
background thread (it waits a little for the next job before it exits, so loads at every step
never make the engine thread wait for a thread start) while the engine keeps running batches
over the other slots' rows. The write never moves another slot's rows
(``LoRASlotBank.replace_lora(..., compact=False)``); when the free rows are fragmented the job
comes back with ``needs_compaction`` and the owner compacts between steps and submits it again.

Jobs run one at a time in submission order, so a later job for the same slot always sees the
earlier one's rows (and resets them). The owner (``TieredAdapterCache``, engine thread) decides
when a finished job's slot becomes usable; this module only writes and reports.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from loraplex.lora.slots import (
    LoRAModuleWeightsLike,
    LoRASlotBank,
    ModuleKey,
    NeedsCompaction,
    SlotSource,
)
from loraplex.workers import IDLE_EXIT_S, IdleWorker


@dataclass(eq=False)
class StagingJob:
    """One slot fill: ``digest``'s ``weights`` into ``slot``; the result once ``done`` is set."""

    slot: int
    digest: str
    weights: Mapping[ModuleKey, LoRAModuleWeightsLike] | SlotSource
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0  # the write's duration (reset + copy, synchronised on CUDA)
    error: BaseException | None = None  # validation or copy failure (the slot is then empty)
    needs_compaction: bool = False  # nothing written: the free rows were fragmented


class SlotStager:
    """Writes slot rows on one background thread (an :class:`~loraplex.workers.IdleWorker`:
    started by the first job, gone after a while without one)."""

    def __init__(self, bank: LoRASlotBank, *, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self.bank = bank
        self._cond = threading.Condition()
        self._worker = IdleWorker("loraplex-slot-staging", idle_exit_s=idle_exit_s)
        self._pending = 0  # jobs submitted and not yet done
        self._stream = torch.cuda.Stream(bank.device) if bank.device.type == "cuda" else None

    def submit(
        self,
        slot: int,
        digest: str,
        weights: Mapping[ModuleKey, LoRAModuleWeightsLike] | SlotSource,
    ) -> StagingJob:
        """Queue a fill of ``slot``; returns at once (a worker already waiting takes it, else
        one is started: the engine thread does not wait for a thread start per load)."""
        job = StagingJob(slot, digest, weights)
        with self._cond:
            self._pending += 1
        self._worker.submit(lambda: self._run(job))
        return job

    def wait_any(self, jobs: list[StagingJob], timeout: float) -> None:
        """Block until one of ``jobs`` is done (or ``timeout`` seconds pass)."""
        with self._cond:
            if jobs and not any(j.done.is_set() for j in jobs):
                self._cond.wait(timeout)

    @property
    def busy(self) -> bool:
        """A job is queued or being written."""
        with self._cond:
            return self._pending > 0

    def _run(self, job: StagingJob) -> None:
        """Write one job (jobs run in submission order), then wake whoever waits on it."""
        self._write(job)
        with self._cond:
            job.done.set()
            self._pending -= 1
            self._cond.notify_all()

    def _write(self, job: StagingJob) -> None:
        t0 = time.perf_counter()
        try:
            with self._on_stream():
                try:
                    # over a retired adapter's stale rows; validates first
                    self.bank.replace_lora(job.slot, job.weights, compact=False)
                except NeedsCompaction:
                    raise
                except BaseException:
                    if job.slot in self.bank.occupied_slots:  # all or nothing: the slot is empty
                        self.bank.reset_lora(job.slot)
                    raise
                if self._stream is not None:
                    self._stream.synchronize()  # the rows are complete before anyone reads them
        except NeedsCompaction:
            job.needs_compaction = True
        except BaseException as e:  # handed to the engine thread, which raises it
            job.error = e
        job.seconds = time.perf_counter() - t0

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
        else:
            with torch.cuda.stream(self._stream):
                yield
