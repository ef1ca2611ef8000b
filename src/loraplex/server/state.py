"""What one app instance owns (:class:`ServerState`): config, the engine client, the registry and
its in-memory view, metrics and tenant limits; which adapter revision serves a request
(:meth:`ServerState.resolve_model`); and the loop that follows registry changes and retires
replaced revisions' cached copies.

Anything that touches the database or the file system runs in the state's own small I/O pool
(:meth:`ServerState.run_io`), never on the event loop and never in the engine's preparation
pools. Routes reach the state of their app through the :func:`get_state` dependency.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request

from loraplex.config import ServerConfig
from loraplex.engine.client import AsyncEngine, EngineClient, LLMEngine
from loraplex.paths import contained
from loraplex.registry import (
    Manifest,
    Principal,
    Registry,
    RegistryPolicy,
    Release,
    Tenant,
    base_model_info,
)
from loraplex.server.adapter_limits import ConcurrencyLimiter, canary_full
from loraplex.server.adapters import check_allowed_path
from loraplex.server.canary import CanaryMonitor
from loraplex.server.catalog import Catalog, Servable, digests_of, local_source, retired_digests
from loraplex.server.errors import APIError, scrub
from loraplex.server.limits import TenantLimits
from loraplex.server.metrics import ServerMetrics
from loraplex.server.protocol import UnknownFields
from loraplex.types import AdapterError, AdapterInUseError, AdapterSpec
from loraplex.warm import WarmSchedule

log = logging.getLogger("loraplex.server.app")  # the server's log lines keep one logger name

LOAD_AHEAD_S = 15.0  # how often the server loads ahead of its cache policy's demand forecast


@dataclass(frozen=True)
class ServedAdapter:
    """The adapter revision one call is served with, and how it was chosen: ``route`` is
    ``active`` or ``canary`` (the server's business: response header and usage log only)."""

    spec: AdapterSpec
    route: str


def server_policy(config: ServerConfig) -> RegistryPolicy:
    """The registry policy of ``config``'s flags (``--trusted-key`` files are read now)."""
    keys = []
    for f in config.trusted_keys:
        try:
            keys.append(Path(f).read_text())
        except OSError as e:
            raise AdapterError(f"--trusted-key {f!r}: {e.strerror or e}") from e
    return RegistryPolicy(
        require_signatures=config.require_signatures,
        trusted_keys=tuple(keys),
        max_rank=config.engine.max_lora_rank,
        allowed_roots=tuple(config.allowed_lora_roots),
        allowed_prefixes=tuple(config.allowed_store_prefixes),
    )


def open_registry(config: ServerConfig) -> Registry:
    """The registry a server with ``config`` uses: ``--registry-url`` (or
    ``$LORAPLEX_REGISTRY_URL``), else a private in-memory one; its policy from the flags."""
    return Registry.open(config.registry_url or "sqlite://", policy=server_policy(config))


class ServerState:
    """Everything one app instance owns: engine client, registry view, metrics, config."""

    def __init__(
        self, config: ServerConfig, client: EngineClient, registry: Registry | None = None
    ) -> None:
        self.config = config
        self.client = client
        self.started = int(time.time())
        self.base_names = config.model_names
        self.owns_registry = registry is None
        self.merge_lock = threading.Lock()  # one adapter merge at a time (CPU and memory heavy)
        self.registry = registry if registry is not None else open_registry(config)
        self.base = base_model_info(
            config.engine.model, name=self.base_names[0], quantization=config.engine.quantization
        )
        # the flags' signature policy, or the shared registry's own if only it requires them
        signatures = server_policy(config)
        if not signatures.require_signatures:
            signatures = self.registry.policy
        self.catalog = Catalog(
            self.registry,
            self.base,
            poll_s=config.registry_poll_s,
            on_change=self._on_catalog_change,
            signatures=signatures,
        )
        # registry queries, catalog rebuilds, key lookups and file-system checks: off the event
        # loop, and apart from the engine's preparation pools
        self._io = ThreadPoolExecutor(2, thread_name_prefix="loraplex-registry")
        blocks, block_size = client.kv_cache_shape()
        engine = config.engine
        self.metrics = ServerMetrics(
            client,
            self.catalog.names_of,
            model_name=self.base_names[0],
            cache_info={
                "block_size": str(block_size),
                "num_gpu_blocks": str(blocks),
                "cache_dtype": "auto",
                "enable_prefix_caching": str(engine.enable_prefix_caching),
                "gpu_memory_utilization": str(engine.gpu_memory_utilization),
            },
        )
        self.limits = TenantLimits()
        self.adapter_limits = ConcurrencyLimiter()  # max_concurrent_requests, canary caps
        self.canary = CanaryMonitor(self.registry, self.run_io, on_rollback=self._rolled_back)
        self.unknown_fields = UnknownFields()  # request fields no API defines, logged once
        self._retiring: dict[str, float] = {}  # digest -> when its cached copies go
        # digests of pushed revisions (POST .../push): retired as soon as no request holds
        # them, and from the device and host tiers only (a disk copy is their only source)
        self.pushed_digests: set[str] = set()
        self.push_lock = threading.Lock()  # one push at a time: the swap and prune in order
        self._rng = random.Random()
        self._static_names = self._register_static_adapters()
        self.catalog.refresh(force=True)
        # adapters whose ``warm`` is a window schedule (--lora-modules, whose flag wins, and
        # registry revisions' warm_schedule): pinned ahead of each window by the prewarm
        # scheduler, ticked from the retire loop (prewarm_due); warm_windows is what it follows
        self._static_windows = {
            m.name: m.warm for m in config.lora_modules if isinstance(m.warm, WarmSchedule)
        }
        self.warm_windows: dict[str, WarmSchedule] = dict(self._static_windows)
        self.prewarm = client.window_prewarmer() if client.lora_enabled else None
        self._prewarm_due_at = 0.0  # time.monotonic() of the next scheduler tick
        self._load_ahead_due_at = 0.0  # time.monotonic() of the next forecast load-ahead

    # -- white-box access (tests, benchmarks); the server itself goes through ``client`` -------
    @property
    def engine(self) -> LLMEngine:
        return self.client.engine

    @property
    def aengine(self) -> AsyncEngine:
        return self.client.aengine

    # -- start-up and shut-down -----------------------------------------------------------------
    def _register_static_adapters(self) -> list[str]:
        """Register (validated) and activate every ``--lora-modules`` adapter; fail fast."""
        names = []
        for m in self.config.lora_modules:
            actor = "serve --lora-modules"
            with self.client.staged_source(m.name, m.path) as (local, uri):
                manifest = self.registry.register(
                    local,
                    m.name,
                    base=self.base,
                    source_uri=uri,
                    warm_policy=m.warm if isinstance(m.warm, str) else "on-demand",
                    warm=m.warm if isinstance(m.warm, WarmSchedule) else None,
                    actor=actor,
                    allow_any_source=True,
                )
            if self.registry.release(m.name).active_revision != manifest.revision:
                self.registry.activate(m.name, manifest.revision, actor=actor)
            names.append(m.name)
        if names and not self.client.lora_enabled:  # config.validate() refuses this: stay loud
            raise AdapterError("--lora-modules needs --enable-lora")
        return names

    def preload_adapters(self) -> None:
        """Load and verify every ``--lora-modules`` adapter, and pre-warm registered ones whose
        warm policy asks for it (fail fast on anything unloadable)."""
        if not self.client.lora_enabled:
            return
        todo = []
        for s in self.catalog.servables().values():
            m = s.active
            if s.name in self._static_names or m.warm_policy != "on-demand":
                if self.catalog.compatible(m):
                    todo.append(self.adapter_spec(m))
        self.client.prewarm(todo)
        self.prewarm_due()  # adapters inside their window (or its lead) now: warm at once

    def close(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)
        if self.owns_registry:
            self.registry.close()

    async def run_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the I/O pool (database, file system): never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    # -- registry changes ------------------------------------------------------------------------
    def _on_catalog_change(
        self,
        old: dict[str, Servable],
        new: dict[str, Servable],
        tenants: dict[str, Tenant],
    ) -> None:
        """Schedule the replaced revisions' cached copies for eviction (after the swap delay,
        so a quick rollback is still warm), and apply tenants' host-memory budgets."""
        now = time.monotonic()
        serving = digests_of(new.values())
        for d in retired_digests(old, new):
            pushed = d in self.pushed_digests
            if pushed and self.client.lora_enabled:
                self.client.release_push(d)  # evictable now; dropped once no request holds it
            delay = 0.0 if pushed else self.config.swap_eviction_delay_s
            self._retiring.setdefault(d, now + delay)
        for d in serving:
            self._retiring.pop(d, None)
        self._prewarm_due_at = 0.0  # revisions or schedules may have changed: follow them now
        if self.client.lora_enabled:
            for t in tenants.values():
                self.client.set_tenant_budget(t.name, t.host_bytes_budget)

    def _rolled_back(self, name: str, revision: str, kind: str, rel: Release | None) -> None:
        """After an automatic canary rollback (I/O pool): count it if this replica wrote it, and
        stop serving the canary here at once."""
        if rel is not None:
            self.metrics.canary_rollbacks.labels(reason=kind).inc()
        self.catalog.refresh(force=True)

    def retire_due(self) -> list[str]:
        """Evict the cached copies of retired revisions whose delay is over; ones still in use
        are retried later. Returns the digests evicted (worker thread)."""
        client = self.client
        self.catalog.refresh()
        now = time.monotonic()
        done = []
        for d, due in list(self._retiring.items()):
            if due > now:
                continue
            if not client.lora_enabled:
                self._retiring.pop(d, None)
                continue
            try:
                client.unpin(d)
                client.evict(d, tiers=("device", "host") if d in self.pushed_digests else None)
            except AdapterInUseError:
                self._retiring[d] = now + 1.0  # requests still run on it
                continue
            except AdapterError:
                pass  # never loaded here
            self._retiring.pop(d, None)
            done.append(d)
            log.info("evicted the cached copies of replaced adapter revision %s", d[:12])
        return done

    def prewarm_due(self) -> None:
        """Hand the warm-window adapters' active revisions to the prewarm scheduler and tick
        it when due (worker thread: it loads adapters). A name whose active revision changed
        is rescheduled (the old revision's window pin goes); one that is gone, incompatible
        or no longer has a schedule is unscheduled."""
        if self.prewarm is None or time.monotonic() < self._prewarm_due_at:
            return
        servables = self.catalog.servables()
        windows: dict[str, WarmSchedule] = {}
        for name, s in servables.items():
            schedule = self._static_windows.get(name) or s.active.warm_schedule
            if schedule is not None and self.catalog.compatible(s.active):
                windows[name] = schedule
        for name in [n for n in self.prewarm.adapters if n not in windows]:
            self.prewarm.unschedule(name)
        for name, schedule in windows.items():
            self.prewarm.schedule(self.adapter_spec(servables[name].active), schedule)
        self.warm_windows = windows
        self._prewarm_due_at = time.monotonic() + self.prewarm.tick()

    def load_ahead_due(self) -> list[str]:
        """Every ``LOAD_AHEAD_S``: give the cache policy the scheduler's waiting queue and load
        the servable revisions its demand forecast expects soon into host memory
        (``hybrid-forecast``; other policies load nothing). The digests loaded (worker
        thread: it loads)."""
        now = time.monotonic()
        if not self.client.lora_enabled or now < self._load_ahead_due_at:
            return []
        self._load_ahead_due_at = now + LOAD_AHEAD_S
        specs = {}
        for s in self.catalog.servables().values():
            for m in (s.active, s.canary):
                if m is not None and self.catalog.compatible(m):
                    specs[m.sha256] = self.adapter_spec(m)
        loaded = self.client.load_ahead(specs, limit=self.config.engine.max_cpu_loras)
        for d in loaded:
            log.info("loaded adapter %s ahead of its forecast demand", d[:12])
        return loaded

    # -- which revision serves a request ---------------------------------------------------------
    def resolve_model(self, name: str, principal: Principal) -> ServedAdapter | None:
        """The base model (None) or the adapter revision that serves this request: the active
        one, or the canary with its traffic weight. 404 for names the caller may not see.
        Checks the adapter's files: call it in the I/O pool (:meth:`run_io`)."""
        if name in self.base_names:
            return None
        return self.resolve_adapter(name, principal)

    def resolve_adapter(
        self, name: str, principal: Principal, *, param: str | None = None
    ) -> ServedAdapter:
        """The revision of adapter ``name`` that serves a call: the active one, or the canary
        with its traffic weight (unless the canary is at its cap here), checked to be for this
        server's base model and to lie under the allowed roots. ``param`` None: the call's
        ``model`` (404 for a name the caller may not see, 409 for another base model); else
        the request field naming one component of a composition (400 for both, naming
        ``param``; an unknown name and another tenant's read the same). I/O pool only."""
        component = param is not None
        where = f"{param}: " if component else ""
        if component and name in self.base_names:
            raise APIError(
                400,
                f"{where}`{name}` is the base model, not an adapter; compose adapters only",
                param=param,
                code="adapter_not_found",
            )
        s = self.catalog.lookup(name, principal)
        if s is None:
            raise APIError(
                400 if component else 404,
                f"{where}The {'adapter' if component else 'model'} `{name}` does not exist.",
                "invalid_request_error" if component else "NotFoundError",
                param=param or "model",
                code="adapter_not_found" if component else "model_not_found",
            )
        manifest, via = s.choose(self._rng.random())
        if via == "canary" and canary_full(self.adapter_limits, s):
            manifest, via = s.active, "active"  # the canary has its share in flight
        if not self.catalog.compatible(manifest):
            raise APIError(
                400 if component else 409,
                f"{where}adapter {name!r} revision {manifest.revision} was registered for base "
                f"model {manifest.base_model_name!r} (digest {manifest.base_model_digest[:12]}"
                f"...), not the one this server runs ({self.base.name!r}, "
                f"{self.base.digest[:12]}...)",
                "invalid_request_error" if component else "conflict_error",
                param=param or "model",
                code="adapter_incompatible_base",
            )
        local = local_source(manifest)
        roots = self.config.allowed_lora_roots
        if local is not None and roots and contained(local, roots, resolve=False):
            try:  # its files may have been replaced by links out of the roots since
                check_allowed_path(str(local), roots)
            except AdapterError as e:
                log.warning("adapter %r refused: %s", name, e)
                raise APIError(
                    403,
                    f"{where}adapter {name!r}: {scrub(str(e), {str(local): name})}",
                    "permission_error",
                    code="adapter_path_refused",
                ) from e
        if not self.client.lora_enabled:
            raise APIError(400, "LoRA is disabled on this server; start it with --enable-lora")
        return ServedAdapter(self.adapter_spec(manifest), via)

    @staticmethod
    def adapter_spec(m: Manifest) -> AdapterSpec:
        """What the engine serves for one registry revision: its digest is the cache key and is
        verified against the files read."""
        return AdapterSpec(
            m.ref, m.source_uri, m.tenant, m.priority, m.warm_policy, slo_class=m.slo_class
        )


async def get_state(request: Request) -> ServerState:
    """Dependency: the state of the app serving ``request``."""
    state: ServerState = request.app.state.loraplex
    return state


async def retire_loop(state: ServerState) -> None:
    """Follow registry changes made elsewhere and evict replaced revisions when due (runs for
    the app's lifetime; a failing round is logged and the loop goes on)."""
    config = state.config
    tick = min(1.0, config.registry_poll_s, max(config.swap_eviction_delay_s, 0.05))
    while True:
        await asyncio.sleep(tick)
        try:
            await state.run_io(state.retire_due)
        except Exception:  # a registry hiccup must not end the loop
            log.exception("registry refresh / eviction of replaced revisions failed")
        try:
            await state.run_io(state.prewarm_due)
        except Exception:  # nor a failing prewarm round
            log.exception("prewarming adapters ahead of their warm windows failed")
        try:
            await state.run_io(state.load_ahead_due)
        except Exception:  # nor a failing forecast load-ahead
            log.exception("loading adapters ahead of their forecast demand failed")
