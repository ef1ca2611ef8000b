"""The one interface through which the HTTP server reaches the engine: :class:`EngineClient`.

It wraps the engine loop (:class:`~loraplex.engine.async_engine.AsyncEngine`, which owns the
thread running one :class:`~loraplex.engine.llm_engine.LLMEngine`) and that engine's tiered
adapter cache, and offers what a server needs:

    requests   prepare (a pool for warm requests, one for cold loads; bounded in time) ->
               reserve/unreserve waiting places (sequences) -> generate (a RequestStream of
               RequestOutput snapshots, the latest unread one kept) -> abort / discard;
               run_in_pool;
               chat template, tokenize, decode, vocab (token pieces and bytes),
               vocab_size, max_model_len
    life cycle start, shutdown, is_running
    gauges     num_waiting, num_running, kv_cache_usage, waiting / device adapter digests,
               step observers, speculative (the speculative decoding it runs, if any)
    adapters   lora_enabled, max_loras, max_cpu_loras, policy_name, check_loadable,
               pin / unpin / evict / has_copy / prewarm, push / release_push /
               has_disk_tier (pushed adapters), tier_of, residency, loaded_adapters,
               resident_bytes, tier_counters, tier_budgets, cache_stats, set_tenant_budget,
               is_local_source, staged_source, load observers

The loop's semantics are :class:`AsyncEngine`'s (read its docstring): nothing slow reaches the
loop, a request leaves the engine when its iterator is closed, a failing step fails only the
requests it ran. The adapter members need LoRA enabled (``lora_enabled``); without it they raise
:class:`AdapterError`. The value types they return (:class:`AdapterResidency`,
:class:`TierCounters`, :class:`CacheStats`) and the loop's errors are re-exported here, so a
caller names them without importing the cache.

``engine`` (the LLMEngine) and ``aengine`` (the AsyncEngine) stay reachable for white-box tests
and benchmarks; a server goes through the methods only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.cache.adapters import PIN_PUSH, AdapterResidency, TieredAdapterCache
from loraplex.cache.prewarm import PrewarmScheduler
from loraplex.cache.stats import CacheStats, TierCounters
from loraplex.config import EngineConfig
from loraplex.config.speculative import SpeculativeConfig
from loraplex.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    PrepareTimeoutError,
    RequestStream,
    StreamBounds,
    StreamStalledError,
)
from loraplex.engine.intake import PreparedRequest
from loraplex.engine.llm_engine import LLMEngine, StepStats
from loraplex.engine.vocab import TokenVocab
from loraplex.kv.stats import SharingStats
from loraplex.lora.adapter import AdapterRead
from loraplex.requests import GenerationRequest
from loraplex.types import AdapterError, AdapterRef, AdapterSpec, InvalidRequestError

__all__ = [
    "AdapterResidency",
    "AsyncEngine",
    "CacheStats",
    "EngineClient",
    "EngineDeadError",
    "EngineStepError",
    "LLMEngine",
    "LoadedAdapter",
    "PrepareTimeoutError",
    "PreparedRequest",
    "RequestStream",
    "StepStats",
    "StreamBounds",
    "StreamStalledError",
    "TierCounters",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedAdapter:
    """One adapter resident in a device slot or in host memory (a snapshot): what a router
    needs to tell warm replicas from cold ones."""

    digest: str
    tier: str  # "device" (in a slot; its host copy too: residency is inclusive) or "host" only
    pinned: bool  # pinned in that tier (a host-only pin leaves a slotted adapter's slot evictable)
    rank: int  # the largest rank of its modules (what its slot holds)


class EngineClient:
    """One engine (its loop, worker pool and adapter cache) as seen by a server. The async
    members and ``generate`` run on the caller's event loop; the others may be called from any
    thread (the loop's and the cache's own locking)."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        prepare_workers: int = 4,
        load_workers: int = 4,
        prepare_timeout_s: float | None = None,
        stream_bounds: StreamBounds | None = None,
    ) -> None:
        """``prepare_workers`` threads prepare requests whose adapter is in memory (or none),
        ``load_workers`` those that must load it first; ``prepare_timeout_s`` bounds one
        preparation; ``stream_bounds`` say when a reader that fell behind loses its request
        (see :class:`AsyncEngine`)."""
        self.engine = engine
        self.aengine = AsyncEngine(
            engine,
            prepare_workers=prepare_workers,
            load_workers=load_workers,
            prepare_timeout_s=prepare_timeout_s,
            stream_bounds=stream_bounds,
        )
        self.num_observer_errors = 0  # load observers that raised (logged, nothing else)
        self._vocab: TokenVocab | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, **options: Any) -> EngineClient:
        """Build the engine of ``config`` (loads the model) and its client (``options``: the
        constructor's keywords)."""
        return cls(LLMEngine(config), **options)

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop (idempotent)."""
        self.aengine.start()

    def shutdown(self) -> None:
        """Stop the loop; requests still in flight get :class:`EngineDeadError`."""
        self.aengine.shutdown()

    @property
    def is_running(self) -> bool:
        return self.aengine.is_running

    # -- requests --------------------------------------------------------------------------------
    async def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validate, tokenize and load ``request.adapter`` in a worker thread (never on the
        loop)."""
        return await self.aengine.prepare(request)

    def reserve(self, n: int = 1) -> None:
        """Count ``n`` admitted requests as waiting before they are prepared (admission sees
        concurrent arrivals at once); each is used by ``generate(..., reserved=True)`` or
        given back with :meth:`unreserve`."""
        self.aengine.reserve(n)

    def unreserve(self, n: int = 1) -> None:
        self.aengine.unreserve(n)

    def generate(
        self,
        prepared: PreparedRequest,
        *,
        reserved: bool = False,
        on_stall: Callable[[], None] | None = None,
    ) -> RequestStream:
        """Hand ``prepared`` to the loop; its outputs until it finishes (only the latest
        snapshot not yet read is kept). Closing the stream early aborts the request (KV blocks
        and slot freed); so does a reader that falls behind the stream bounds, after which
        ``on_stall`` runs on this event loop."""
        return self.aengine.generate(prepared, reserved=reserved, on_stall=on_stall)

    def abort(self, request_id: str) -> None:
        self.aengine.abort(request_id)

    def discard(self, prepared: PreparedRequest) -> None:
        """Drop a prepared request never handed to :meth:`generate` (its adapter reference)."""
        self.aengine.discard(prepared)

    async def run_in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the preparation pool (anything slow: never the event loop)."""
        return await self.aengine.run_in_pool(fn, *args)

    async def chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **options: Any,
    ) -> list[int]:
        """Token ids of a conversation under a chat template, in the worker pool; ``options``:
        :meth:`LLMEngine.apply_chat_template`'s keywords (continue_final_message,
        chat_template, chat_template_kwargs, tools, documents, add_special_tokens)."""
        return await self.run_in_pool(
            functools.partial(self.engine.apply_chat_template, **options),
            messages,
            add_generation_prompt,
        )

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens, e.g. BOS, unless
        ``add_special_tokens`` is false), in the worker pool."""
        if add_special_tokens:
            return await self.run_in_pool(self.engine.tokenize, text)
        return await self.run_in_pool(self._encode_plain, text)

    def _encode_plain(self, text: str) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequestError(
                "text prompts need a tokenizer (skip_tokenizer_init=True was set)"
            )
        # the engine's lock: HF tokenizers are not shareable
        with self.engine.intake.tokenizer_lock:
            return [int(t) for t in tok(text, add_special_tokens=False).input_ids]

    @property
    def has_tokenizer(self) -> bool:
        """False when the engine runs without one (``skip_tokenizer_init``: token ids only)."""
        return self.engine.tokenizer is not None

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (needs :attr:`has_tokenizer`)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise RuntimeError("this engine has no tokenizer")
        return str(tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    @property
    def vocab(self) -> TokenVocab:
        """Each token's own piece, bytes and logprob name (needs :attr:`has_tokenizer`)."""
        if self._vocab is None:
            tok = self.engine.tokenizer
            if tok is None:
                raise RuntimeError("this engine has no tokenizer")
            self._vocab = TokenVocab(tok)
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The model's default sampling parameters (generation_config.json under
        ``--generation-config``, with ``--override-generation-config`` over it), by
        SamplingParams field name: for the fields a request leaves out (a copy)."""
        return dict(self.engine.model_config.generation_defaults)

    # -- gauges ----------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests queued in the engine plus those admitted or handed over, not yet queued."""
        return self.aengine.num_waiting

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_stalled(self) -> int:
        """Requests aborted because their reader fell behind the stream bounds."""
        return self.aengine.num_stalled

    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks in use (1 = full)."""
        return self.engine.kv_cache_usage()

    def waiting_adapter_digests(self) -> set[str]:
        """Digests of the adapters of requests waiting in the scheduler."""
        return self.engine.waiting_adapter_digests()

    def waiting_adapter_counts(self) -> dict[str, int]:
        """Digest -> sequences waiting in the scheduler with that adapter (a composition
        counts for each of its adapters)."""
        waiting = self.engine.scheduler.waiting_sequences()  # the loading queue too
        return dict(Counter(a.ref.sha256 for s in waiting for a in s.adapters))

    def device_adapter_digests(self) -> list[str]:
        """Digests of the adapters whose weights are in a device slot (idle or busy)."""
        return list(self._adapters.slot_of)

    # -- engine counters behind vLLM's metric names (read at scrape time) ---------------------
    @property
    def num_preemptions(self) -> int:
        """Sequences preempted (their KV freed, recomputed later) since start-up."""
        return self.engine.scheduler.num_preemptions

    def prefix_cache_tokens(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found) since start-up."""
        pool = self.engine.pool
        return pool.query_tokens, pool.hit_tokens

    def sharing_stats(self) -> SharingStats:
        """Per-adapter prefix-cache counters, base-aligned hits and aLoRA invocations (a
        copy: read at scrape time off the loop thread)."""
        s = self.engine.scheduler.sharing
        return SharingStats(
            Counter(s.queries), Counter(s.hits), s.base_aligned_hits,
            s.alora_invoked, s.alora_not_invoked,
        )  # fmt: skip

    def kv_cache_shape(self) -> tuple[int, int]:
        """(KV blocks, tokens per block)."""
        return self.engine.pool.num_blocks, self.engine.pool.block_size

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The engine's speculative decoding (``--speculative-config``: method, draft tokens,
        ...), None when it runs without: steps may then carry :attr:`StepStats.spec`."""
        return self.engine.config.speculative()

    def add_step_observer(self, fn: Callable[[StepStats], None]) -> None:
        """Call ``fn`` on the loop thread after every step that ran sequences (one that raises
        is logged and counted; no request notices)."""
        self.aengine.step_observers.append(fn)

    # -- adapters --------------------------------------------------------------------------------
    @property
    def lora_enabled(self) -> bool:
        return self.engine.adapters is not None

    @property
    def _adapters(self) -> TieredAdapterCache:
        mgr = self.engine.adapters
        if mgr is None:
            raise AdapterError("LoRA is disabled on this engine (--enable-lora)")
        return mgr

    @property
    def max_loras(self) -> int:
        """Device slots."""
        return self._adapters.max_loras

    @property
    def max_cpu_loras(self) -> int:
        """Adapters host memory may hold."""
        return self._adapters.max_cpu_loras

    @property
    def policy_name(self) -> str:
        """The eviction policy every tier uses."""
        return self._adapters.policy.name

    def check_loadable(self, spec: AdapterSpec) -> AdapterRef:
        """Load and verify ``spec`` (uncounted: not a request), then let it go; its ref.
        Raises the cache's AdapterError subclasses."""
        mgr = self._adapters
        adapter, _ = mgr.acquire(spec, count=False)
        mgr.release(adapter)
        return adapter.ref

    def _pin_with(self, spec: AdapterSpec, pin: Callable[[str], str]) -> str:
        """Load ``spec`` if needed (uncounted) and apply ``pin`` to its digest."""
        mgr = self._adapters
        adapter, _ = mgr.acquire(spec, count=False)
        try:
            return pin(adapter.ref.sha256)
        finally:
            mgr.release(adapter)

    def pin(self, spec: AdapterSpec, *, device: bool = False) -> str:
        """Load ``spec`` if needed and pin it in host memory and disk (and its device slot with
        ``device``); returns the digest pinned."""
        return self._pin_with(spec, lambda d: self._adapters.pin(d, device=device))

    def push(self, spec: AdapterSpec, read: AdapterRead, *, persist_disk: bool = False) -> bool:
        """Admit pushed bytes into host memory (and the disk tier with ``persist_disk``),
        validated against the base and pinned while their revision may be served (see
        :meth:`TieredAdapterCache.push`); whether host memory held them already. AdapterError:
        nothing changed."""
        return self._adapters.push(spec, read, persist_disk=persist_disk)

    def release_push(self, digest: str) -> None:
        """Lift the push pin of a replaced pushed revision: its copies become evictable (the
        retirement of replaced revisions drops them once no request holds them)."""
        self._adapters.unpin(digest, PIN_PUSH)

    @property
    def has_disk_tier(self) -> bool:
        return self._adapters.disk is not None

    def unpin(self, digest: str) -> str:
        """Remove every pin of the adapter ``digest``; returns the digest."""
        return self._adapters.unpin(digest)

    def pin_window(self, spec: AdapterSpec, *, device: bool = False) -> str:
        """As :meth:`pin`, as a warm window's pin: :meth:`unpin_window` releases it and leaves
        pins set by hand alone."""
        return self._pin_with(spec, lambda d: self._adapters.pin_window(d, device=device))

    def load_ahead(self, specs: Mapping[str, AdapterSpec], *, limit: int) -> list[str]:
        """Forecast load-ahead into host memory (``hybrid-forecast``): the policy sees the
        scheduler's waiting queue, then the adapters among ``specs`` (digest -> spec) it expects
        soon are loaded; the digests loaded (worker thread: it loads)."""
        return self._adapters.load_ahead(specs, self.waiting_adapter_counts(), limit)

    def unpin_window(self, digest: str) -> str:
        """Release the warm window's pin of ``digest`` (other pins stay); returns the digest."""
        return self._adapters.unpin_window(digest)

    def evict(self, digest: str, *, tiers: Iterable[str] | None = None) -> list[str]:
        """Drop the adapter's copies from ``tiers`` (default: every tier); the tiers it left.
        :class:`~loraplex.types.AdapterInUseError` (nothing changes) while it is used or
        pinned."""
        mgr = self._adapters
        return mgr.evict(digest) if tiers is None else mgr.evict(digest, tiers=tiers)

    def has_copy(self, digest: str) -> bool:
        """Whether any tier (device, host, the disk index or the disk directory) holds a copy."""
        mgr = self._adapters
        return mgr.tier_of(digest) is not None or (
            mgr.disk is not None and digest in mgr.disk.entries()
        )

    def prewarm(self, specs: Iterable[AdapterSpec]) -> list[AdapterRef]:
        """Start-up warming by each spec's warm policy (before the loop runs: it fills slots)."""
        return self._adapters.prewarm(specs)

    def window_prewarmer(self, **options: Any) -> PrewarmScheduler:
        """A scheduler that pins adapters through this client ahead of their warm windows and
        unpins them after (``options``: its clock, lead, ...; its owner ticks it)."""
        return PrewarmScheduler(self, **options)

    def tier_of(self, digest: str) -> str | None:
        """``device``, ``host``, ``disk`` or None (in no tier)."""
        return self._adapters.tier_of(digest)

    def residency(self) -> list[AdapterResidency]:
        """A snapshot of every adapter loaded since start-up, most recently used first."""
        return self._adapters.residency()

    def loaded_adapters(self) -> list[LoadedAdapter]:
        """The adapters in a device slot, then those only in host memory (a snapshot taken
        under the cache's lock): at most slots + host copies rows, whatever the registry holds
        (unlike :meth:`residency`, which lists every adapter loaded since start-up)."""
        return [LoadedAdapter(*row) for row in self._adapters.loaded()]

    def resident_bytes(self) -> dict[str, tuple[int, int]]:
        """tier -> (count, bytes) for every tier (``disk`` only when configured)."""
        return self._adapters.resident_bytes()

    def resident_bytes_of(self, digests: Iterable[str]) -> dict[str, tuple[int, int]]:
        """tier -> (count, bytes) over the adapters ``digests`` alone, for every tier: the
        share of :meth:`resident_bytes` that a caller who may see only those adapters sees."""
        tiers = self._adapters.tiers
        indexes = [i for i in (tiers.device, tiers.host, tiers.disk) if i is not None]
        wanted = set(digests)
        out = {}
        for idx in indexes:
            n = b = 0
            for d in wanted:
                entry = idx.peek(d)
                if entry is not None:
                    n, b = n + 1, b + entry.info.size_bytes
            out[idx.name] = (n, b)
        return out

    def tier_budgets(self) -> dict[str, tuple[int | None, int | None]]:
        """tier -> (count limit, byte limit), None where unlimited (device: its slots)."""
        tiers = self._adapters.tiers
        indexes = [i for i in (tiers.device, tiers.host, tiers.disk) if i is not None]
        return {i.name: (i.capacity_count, i.capacity_bytes) for i in indexes}

    def tier_counters(self) -> dict[str, TierCounters]:
        """tier -> a copy of its counters (device, host, and disk when configured)."""
        return self._adapters.tier_counters()

    @property
    def cache_stats(self) -> CacheStats:
        """The cache's live counters (remote loads, load failures, cold requests, ...)."""
        return self._adapters.stats

    def set_tenant_budget(self, tenant: str, host_bytes: int | None) -> None:
        """Cap ``tenant``'s bytes in host memory (None: no cap) for later admissions."""
        self._adapters.set_tenant_budget(tenant, host_bytes)

    def is_local_source(self, spec: AdapterSpec) -> bool:
        """True when ``spec`` is read from a local directory (not through the object store)."""
        return self._adapters.is_local_source(spec)

    @contextlib.contextmanager
    def staged_source(self, name: str, source: str) -> Iterator[tuple[str, str | None]]:
        """A readable local directory of adapter ``name``'s ``source`` and the URI to record
        for it (None: the local path itself). Local paths and ``file://`` URIs are used in
        place; object-store URIs are fetched into a temporary directory, removed on exit."""
        if "://" not in source or source.startswith("file://"):
            yield source.removeprefix("file://"), None
            return
        store = self.engine.adapters.store if self.engine.adapters is not None else None
        if store is None:
            raise AdapterError(
                f"adapter {name!r}: {source!r} is an object-store URI but no object store is "
                "configured (--adapter-store-url)"
            )
        uri = store.uri(source)
        with tempfile.TemporaryDirectory(prefix="loraplex-register-") as tmp:
            store.fetch(uri, Path(tmp) / "a")
            yield str(Path(tmp) / "a"), uri

    def add_load_observer(self, fn: Callable[[str, float], None]) -> None:
        """Call ``fn(stage, seconds)`` for every adapter load stage (resolve, remote_download,
        disk_load, h2d / activation); nothing when LoRA is disabled (nothing loads). An observer
        that raises is logged and counted; the load it observed goes on."""
        if self.engine.adapters is None:
            return

        def guarded(stage: str, seconds: float) -> None:
            try:
                fn(stage, seconds)
            except Exception:
                self.num_observer_errors += 1
                if self.num_observer_errors <= 10 or self.num_observer_errors % 1000 == 0:
                    log.exception("load observer %r raised", fn)

        self.engine.adapters.load_observers.append(guarded)
