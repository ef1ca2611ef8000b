"""The engine loop in its own thread, driven by asyncio callers (the HTTP server, through
:class:`~loraplex.engine.client.EngineClient`).

One thread owns the :class:`LLMEngine` and runs ``drain commands → step → deliver`` forever.
Callers never touch the engine's queues directly: they prepare a request in a worker pool
(validation, tokenization, adapter loads — nothing slow reaches the loop), then hand it over with
``generate()``, whose :class:`RequestStream` yields :class:`RequestOutput` snapshots as the loop
produces them. Closing the stream early (client gone) aborts the request, which frees its KV
blocks and slot.

Two pools prepare requests: one for requests whose adapter is already in memory (or none), one
for those that must load it first, so cold loads never hold up warm requests; a preparation
that takes longer than ``prepare_timeout_s`` is a :class:`PrepareTimeoutError` (its late result
is discarded, never leaked).

Outputs are cumulative snapshots, so each request keeps only the latest one its reader has not
taken (coalescing): memory per request is one snapshot however slowly it is read. A request
whose reader falls behind by more than :class:`StreamBounds` allow while the engine keeps
producing is aborted (KV blocks and slot freed) and its reader gets :class:`StreamStalledError`.

The loop survives anything: a failing step (or delivery, or command) fails the requests in the
engine at the time, each gets the error, and the loop goes on. Step observers are isolated: one
that raises is logged and counted, and no request notices.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from loraplex.engine.intake import PreparedRequest
from loraplex.engine.llm_engine import LLMEngine, StepStats
from loraplex.outputs import RequestOutput
from loraplex.requests import GenerationRequest, LoRARequest
from loraplex.types import AdapterSpec, LoraplexError

log = logging.getLogger(__name__)

_IN_MEMORY = ("device", "host")  # tiers from which an adapter is served without a load


class EngineDeadError(LoraplexError):
    """The engine loop is not running (shut down)."""


class EngineStepError(LoraplexError):
    """A step failed; the requests in the engine at the time were aborted."""


class StreamStalledError(LoraplexError):
    """The request's reader stopped taking its outputs; the request was aborted."""


class PrepareTimeoutError(LoraplexError):
    """A request's preparation (adapter load included) did not finish in time."""


@dataclass(frozen=True)
class StreamBounds:
    """How far a request's reader may fall behind the engine before the request is aborted:
    ``max_unread_tokens`` produced and not taken (0: no count bound), or ``stall_timeout_s``
    seconds since the oldest untaken output (0: no time bound). Checked on the loop thread each
    time the request produces output."""

    max_unread_tokens: int = 0
    stall_timeout_s: float = 0.0


def _num_tokens(out: RequestOutput) -> int:
    return sum(len(o.token_ids) for o in out.outputs)


class _Sink:
    """One request's outputs on their way to its reader, a task on ``loop``.

    The loop thread puts; the reader takes. Only the latest untaken snapshot is kept (a new one
    replaces an untaken one), and an error replaces both. ``behind()`` says how far the reader
    is behind, for :class:`StreamBounds`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_stall: Callable[[], None] | None):
        self.loop = loop
        self.on_stall = on_stall
        self._lock = threading.Lock()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._wake = asyncio.Event()
        self._notified = False  # a wake-up is on its way to the loop
        self._taken_tokens = 0  # tokens in the last snapshot the reader took
        self._untaken_since = 0.0  # when the oldest untaken snapshot was put

    # -- loop thread -------------------------------------------------------------------------
    def put(self, out: RequestOutput, now: float) -> bool:
        """Keep ``out`` for the reader; True when the reader must be woken (no wake-up is on
        its way yet): the caller wakes it, batched with the step's other readers
        (:func:`_wake_all`), so a step costs one hop to each event loop, not one per request."""
        with self._lock:
            if self._latest is None:
                self._untaken_since = now
            self._latest = out
            notify, self._notified = not self._notified, True
        return notify

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._error, self._latest = error, None
            self._notified = True
        self._call(self._wake.set)

    def behind(self, out: RequestOutput, now: float) -> tuple[int, float]:
        """(tokens of ``out`` the reader has not taken, seconds since the oldest untaken
        snapshot); (0, 0.0) when the reader has taken everything put so far."""
        with self._lock:
            if self._latest is None:
                return 0, 0.0
            return _num_tokens(out) - self._taken_tokens, now - self._untaken_since

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the reader's event loop is closed: nobody is listening
            pass

    # -- the reader's event loop ---------------------------------------------------------------
    async def take(self) -> RequestOutput:
        """The latest snapshot (waiting for one), or the request's error."""
        while True:
            with self._lock:
                if self._error is not None:
                    raise self._error
                out = self._latest
                if out is not None:
                    self._latest = None
                    self._taken_tokens = _num_tokens(out)
                    return out
                self._notified = False
                self._wake.clear()
            await self._wake.wait()


def _wake_all(sinks: list[_Sink]) -> None:
    """Wake the readers of ``sinks`` (on their event loop: one callback for a whole step)."""
    for sink in sinks:
        sink._wake.set()


class RequestStream:
    """The outputs of one request handed to the loop, as an async iterator of cumulative
    snapshots (the latest one not yet taken). Leaving before the end: :meth:`aclose` (or
    cancelling a pending ``__anext__``) aborts the request."""

    def __init__(
        self,
        aengine: AsyncEngine,
        request_id: str,
        sink: _Sink | None,
        error: BaseException | None = None,
    ) -> None:
        self._aengine = aengine
        self.request_id = request_id
        self._sink = sink
        self._error = error  # raised by the first __anext__ (the request never reached the loop)
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if self._sink is None:
            self._done = True
            assert self._error is not None
            raise self._error
        try:
            out = await self._sink.take()
        except asyncio.CancelledError:
            self._abort()
            raise
        except BaseException:
            self._done = True  # the loop has already dropped it (failed, stalled, shut down)
            raise
        if out.finished:
            self._done = True
        return out

    async def aclose(self) -> None:
        self._abort()

    def _abort(self) -> None:
        if not self._done:
            self._done = True
            self._aengine.abort(self.request_id)

    def __del__(self) -> None:  # a reader that just dropped the stream
        if not getattr(self, "_done", True):
            self._abort()


class AsyncEngine:
    """Owns the engine thread and the preparation pools; safe to call from any asyncio loop
    or thread."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        prepare_workers: int = 4,
        load_workers: int = 4,
        prepare_timeout_s: float | None = None,
        stream_bounds: StreamBounds | None = None,
    ) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # loop thread only
        # readers to wake once the step's outputs are delivered, by event loop (loop thread only)
        self._to_wake: dict[asyncio.AbstractEventLoop, list[_Sink]] = {}
        self._pool = ThreadPoolExecutor(prepare_workers, thread_name_prefix="loraplex-prepare")
        self._load_pool = ThreadPoolExecutor(load_workers, thread_name_prefix="loraplex-load")
        self.prepare_timeout_s = prepare_timeout_s
        self.stream_bounds = stream_bounds or StreamBounds()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pending = 0  # sequences reserved or handed over, not yet in the engine
        self._pending_lock = threading.Lock()
        # called on the loop thread after every non-empty step
        self.step_observers: list[Callable[[StepStats], None]] = []
        self.num_step_errors = 0  # loop iterations that failed (their requests got the error)
        self.num_observer_errors = 0  # step observers that raised (logged, nothing else)
        self.num_stalled = 0  # requests aborted because their reader fell behind

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
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        """The loop runs and can step (false once a tensor-parallel rank has died)."""
        alive = self._thread is not None and self._thread.is_alive() and not self._stop.is_set()
        return alive and self.engine.failure is None

    # -- requests --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences queued in the engine plus those admitted or handed over, not yet queued."""
        return self.engine.num_waiting + self._pending

    async def run_in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the preparation pool (tokenizing, templating)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validate, tokenize and resolve the adapter in a worker thread (see
        :meth:`LLMEngine.prepare_request`): the load pool when the adapter is not in memory, else
        the preparation pool."""
        call = functools.partial(self.engine.prepare_request, request)
        return await self._prepare_in(self._pool_for(request.adapter), call)

    def _pool_for(self, adapter: AdapterSpec | LoRARequest | None) -> ThreadPoolExecutor:
        """The load pool for a request that may have to load its adapter (not in device or host
        memory, or an offline LoRARequest whose files are hashed first), else the preparation
        pool."""
        cache = self.engine.adapters
        if adapter is None or cache is None:
            return self._pool
        if isinstance(adapter, AdapterSpec) and cache.tier_of(adapter.sha256) in _IN_MEMORY:
            return self._pool
        return self._load_pool

    async def _prepare_in(
        self, pool: ThreadPoolExecutor, call: Callable[[], PreparedRequest]
    ) -> PreparedRequest:
        """``call()`` in ``pool``, bounded by ``prepare_timeout_s``. A result that arrives after
        its caller gave up (timed out or cancelled) is discarded, so no adapter reference leaks."""
        fut = asyncio.get_running_loop().run_in_executor(pool, call)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.prepare_timeout_s)
        except TimeoutError:
            fut.add_done_callback(self._discard_late)
            raise PrepareTimeoutError(
                f"the request was not ready within {self.prepare_timeout_s:g}s "
                "(its adapter is still loading); retry later"
            ) from None
        except asyncio.CancelledError:
            fut.add_done_callback(self._discard_late)
            raise

    def _discard_late(self, fut: asyncio.Future[PreparedRequest]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.engine.discard_prepared(fut.result())

    def discard(self, prepared: PreparedRequest) -> None:
        self.engine.discard_prepared(prepared)

    def reserve(self, n: int = 1) -> None:
        """Count ``n`` admitted sequences as waiting before they are prepared, so that admission
        control sees concurrent arrivals at once. A request's sequences are used by
        ``generate(..., reserved=True)``, or given back with :meth:`unreserve`."""
        with self._pending_lock:
            self._pending += n

    def unreserve(self, n: int = 1) -> None:
        with self._pending_lock:
            self._pending -= n

    def generate(
        self,
        prepared: PreparedRequest,
        *,
        reserved: bool = False,
        on_stall: Callable[[], None] | None = None,
    ) -> RequestStream:
        """Queue ``prepared`` now; its stream yields its outputs until it finishes.

        ``reserved``: the request's sequences already hold places in the waiting count
        (:meth:`reserve`), which they use now. ``on_stall`` runs on the caller's event loop if
        the request is aborted because its reader fell behind (:class:`StreamBounds`). Closing
        the stream before the end aborts the request."""
        n = len(prepared.request.seqs)
        if not self.is_running:
            if reserved:
                self.unreserve(n)
            self.engine.discard_prepared(prepared)
            return RequestStream(
                self, prepared.request_id, None, EngineDeadError("the engine is not running")
            )
        sink = _Sink(asyncio.get_running_loop(), on_stall)
        if not reserved:
            self.reserve(n)
        self._cmds.put(("add", prepared, sink))
        return RequestStream(self, prepared.request_id, sink)

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id, None))

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                self._drain(block=not eng.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if eng.has_unfinished_requests():
                    self._step()
            except Exception as e:  # anything: fail what was in flight, keep serving
                try:
                    self._fail_all(e)
                except Exception:
                    log.exception("failing the requests in flight failed too")
                if eng.failure is not None:  # a tensor-parallel rank is gone: no step can run
                    break
        self._close()

    def _step(self) -> None:
        outputs = self.engine.step()
        stats = self.engine.last_step
        if stats.num_seqs:
            for fn in self.step_observers:
                self._observe(fn, stats)
        now = time.monotonic()
        try:
            for out in outputs:
                self._deliver(out, now)
        finally:  # even when a delivery failed: the outputs already put must reach their readers
            self._wake_pending()

    def _wake_pending(self) -> None:
        """One ``call_soon_threadsafe`` per event loop for every reader that got output."""
        wakes, self._to_wake = self._to_wake, {}
        for loop, sinks in wakes.items():
            try:
                loop.call_soon_threadsafe(_wake_all, sinks)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _observe(self, fn: Callable[[StepStats], None], stats: StepStats) -> None:
        """Run one step observer; one that raises is logged and counted, nothing else."""
        try:
            fn(stats)
        except Exception:
            self.num_observer_errors += 1
            if self.num_observer_errors <= 10 or self.num_observer_errors % 1000 == 0:
                log.exception("step observer %r raised (%d so far)", fn, self.num_observer_errors)

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
            self.unreserve(len(arg.request.seqs))
            try:
                self.engine.add_prepared(arg)
            except Exception as e:  # a reused request id: tell that caller only
                sink.fail(e)  # type: ignore[union-attr]
                return
            self._sinks[arg.request_id] = sink  # type: ignore[assignment]
        elif kind == "abort":
            if self.engine.abort_request(arg):
                self._sinks.pop(arg, None)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        rid = out.request_id
        sink = self._sinks.get(rid)
        if sink is None:
            return
        if out.finished:
            del self._sinks[rid]
            self._put(sink, out, now)
            return
        bounds = self.stream_bounds
        tokens, seconds = sink.behind(out, now)
        if (bounds.max_unread_tokens and tokens > bounds.max_unread_tokens) or (
            bounds.stall_timeout_s and seconds > bounds.stall_timeout_s
        ):
            self._stall(rid, sink, tokens, seconds)
            return
        self._put(sink, out, now)

    def _put(self, sink: _Sink, out: RequestOutput, now: float) -> None:
        if sink.put(out, now):
            self._to_wake.setdefault(sink.loop, []).append(sink)

    def _stall(self, rid: str, sink: _Sink, tokens: int, seconds: float) -> None:
        """Abort a request whose reader fell behind (its KV blocks and slot are freed now)."""
        self.num_stalled += 1
        self.engine.abort_request(rid)
        del self._sinks[rid]
        log.warning(
            "request %s aborted: its reader has not taken %d tokens for %.1fs", rid, tokens, seconds
        )
        sink.fail(
            StreamStalledError(
                f"the client stopped reading ({tokens} tokens unread for {seconds:.1f}s); "
                "the request was aborted"
            )
        )
        if sink.on_stall is not None:
            sink._call(sink.on_stall)

    def _fail_all(self, error: Exception) -> None:
        """Abort every request in the engine and fail every reader with ``error``."""
        self.num_step_errors += 1
        log.exception("engine loop failed; aborting the %d requests in flight", len(self._sinks))
        err = EngineStepError(f"the engine failed while running this request: {error}")
        for rid in list(self.engine.requests):
            try:
                self.engine.abort_request(rid)
            except Exception:  # keep going: the loop must survive
                log.exception("abort of %s failed", rid)
        # every reader, including those whose request finished in the failed iteration before
        # its last output was delivered
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.fail(err)

    def _close(self) -> None:
        err = EngineDeadError("the engine was shut down")
        while True:  # requests handed over but never queued
            try:
                kind, arg, sink = self._cmds.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self.unreserve(len(arg.request.seqs))
                self.engine.discard_prepared(arg)
                sink.fail(err)
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.fail(err)
