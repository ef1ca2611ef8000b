"""The engine loop in its own thread, driven by asyncio callers (the HTTP server, through
:class:`~loraplex.engine.client.EngineClient`).

One thread owns the :class:`LLMEngine` and runs ``drain commands → step → deliver`` forever.
Callers never touch the engine's queues directly: they prepare a request in a worker pool
(validation, tokenization, adapter loads — nothing slow reaches the loop), then hand it over with
``generate()``, which yields :class:`RequestOutput` snapshots as the loop produces them. Leaving
the iterator early (client gone) aborts the request, which frees its KV blocks and slot.

The loop survives anything one request does: a failing step aborts the requests that were in
the engine at the time, each gets the error, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from loraplex.engine.llm_engine import LLMEngine, PreparedRequest, StepStats
from loraplex.outputs import RequestOutput
from loraplex.requests import LoRARequest, SamplingParams
from loraplex.types import AdapterSpec, LoraplexError

log = logging.getLogger(__name__)


class EngineDeadError(LoraplexError):
    """The engine loop is not running (shut down)."""


class EngineStepError(LoraplexError):
    """A step failed; the requests in the engine at the time were aborted."""


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass


class AsyncEngine:
    """Owns the engine thread; safe to call from any asyncio loop or thread."""

    def __init__(self, engine: LLMEngine, *, prepare_workers: int = 4) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # loop thread only
        self._pool = ThreadPoolExecutor(prepare_workers, thread_name_prefix="loraplex-prepare")
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pending = 0  # reserved or handed over, not yet in the engine
        self._pending_lock = threading.Lock()
        # called on the loop thread after every non-empty step
        self.step_observers: list[Callable[[StepStats], None]] = []
        self.num_step_errors = 0

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight get EngineDeadError."""
        self._stop.set()
        self._cmds.put(("wake", None, None))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    # -- requests --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests queued in the engine plus those admitted or handed over, not yet queued."""
        return self.engine.num_waiting + self._pending

    async def run_in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the preparation pool (tokenizing, templating, adapter loads)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def prepare(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_request: AdapterSpec | LoRARequest | None = None,
        arrival: float | None = None,
        *,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """Validate, tokenize and resolve the adapter in a worker thread (``cache_salt``: the
        prefix-cache salt, see :meth:`LLMEngine.prepare_request`)."""
        fn = self.engine.prepare_request
        return await self.run_in_pool(
            lambda: fn(
                request_id, prompt, params, lora_request, arrival=arrival, cache_salt=cache_salt
            )
        )

    def discard(self, prepared: PreparedRequest) -> None:
        self.engine.discard_prepared(prepared)

    def reserve(self, n: int = 1) -> None:
        """Count ``n`` admitted requests as waiting before they are prepared, so that admission
        control sees concurrent arrivals at once. Each reservation is used by one
        ``generate(..., reserved=True)`` or given back with :meth:`unreserve`."""
        with self._pending_lock:
            self._pending += n

    def unreserve(self, n: int = 1) -> None:
        with self._pending_lock:
            self._pending -= n

    async def generate(
        self, prepared: PreparedRequest, *, reserved: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Queue ``prepared`` and yield its outputs until it finishes.

        ``reserved``: the request already holds a place in the waiting count (:meth:`reserve`),
        which it uses now. Closing the iterator before the end aborts the request."""
        if not self.is_running:
            if reserved:
                self.unreserve()
            self.engine.discard_prepared(prepared)
            raise EngineDeadError("the engine is not running")
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        if not reserved:
            with self._pending_lock:
                self._pending += 1
        self._cmds.put(("add", prepared, sink))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(prepared.request_id)

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id, None))

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._drain(block=not eng.has_unfinished_requests())
            if self._stop.is_set():
                break
            if not eng.has_unfinished_requests():
                continue
            try:
                outputs = eng.step()
            except Exception as e:
                self._fail_all(e)
                continue
            if eng.last_step.num_seqs:
                for fn in self.step_observers:
                    fn(eng.last_step)
            for out in outputs:
                self._deliver(out)
        self._close()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, arg: Any, sink: _Sink | None) -> None:
        if kind == "add":
            with self._pending_lock:
                self._pending -= 1
            try:
                self.engine.add_prepared(arg)
            except Exception as e:  # a reused request id: tell that caller only
                sink.put(e)  # type: ignore[union-attr]
                return
            self._sinks[arg.request_id] = sink  # type: ignore[assignment]
        elif kind == "abort":
            if self.engine.abort_request(arg):
                self._sinks.pop(arg, None)

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        if out.finished:
            del self._sinks[out.request_id]
        sink.put(out)

    def _fail_all(self, error: Exception) -> None:
        self.num_step_errors += 1
        log.exception("engine step failed; aborting the %d requests in flight", len(self._sinks))
        err = EngineStepError(f"the engine failed while running this request: {error}")
        for rid in list(self.engine.requests):
            try:
                self.engine.abort_request(rid)
            except Exception:  # keep going: the loop must survive
                log.exception("abort of %s failed", rid)
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink.put(err)

    def _close(self) -> None:
        err = EngineDeadError("the engine was shut down")
        while True:  # requests handed over but never queued
            try:
                kind, arg, sink = self._cmds.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self.engine.discard_prepared(arg)
                sink.put(err)
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink.put(err)
