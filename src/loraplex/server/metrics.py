"""Prometheus metrics: request latency by adapter warmth, adapter tiers, the Gateway API
Inference Extension's model-server gauges, and vLLM's own metric names and labels
(``vllm:time_to_first_token_seconds{model_name=..., engine="0"}``, token counters, preemptions,
prefix cache, queue/prefill/decode times, ...) alongside ours, so vLLM's Grafana dashboard
works unchanged.

Each app owns its own :class:`CollectorRegistry` (no process-global state). Counters that the
engine already keeps (tier hits, loads, evictions, preemptions, prefix-cache lookups) are read
at scrape time by a collector rather than mirrored, so they can never drift. A request-level
observation (TTFT, end-to-end latency, finish reason) goes to our metric and its vLLM
twin at once (:class:`Twin`). The engine loop's step observer feeds the token counters
(``vllm:prompt_tokens``, ``vllm:generation_tokens``: every step, as vLLM counts them, so rates
show while requests run) and the per-token and per-phase times (inter-token latency, queue,
prefill, decode: :class:`SequenceTimes`).
Adapter names appear as label values in two places. ``vllm:lora_requests_info`` has lists of at
most :data:`MAX_ADAPTER_LABELS` names (the waiting ones: those with the most waiting sequences).
The residency gauges llm-d's ``lora-load-state-scorer`` reads (vLLM PRs #51433/#54830:
``vllm:lora_adapter_loaded``, ``vllm:num_gpu_loaded_lora_adapters``,
``vllm:num_cpu_loaded_lora_adapters``, ``vllm:max_gpu_lora_adapters``) have one series per
served name of each adapter in a device slot or host memory: their number is bounded by the host
copies (slotted adapters keep theirs) times :data:`MAX_NAMES_PER_ADAPTER`, never by the
registry's size (:meth:`_EngineCollector._residency`). ``vllm:lora_adapter_load_seconds`` times
the two transitions that scorer prices (:class:`_Transitions`).
With speculative decoding (``--speculative-config``), vLLM's ``vllm:spec_decode_*`` counters and
loraplex's per-adapter acceptance (:class:`SpecDecodeMetrics`); without it, none of them exist.
``model_name`` is the served base model's name (vLLM labels LoRA requests with it too; llm-d
reads it to recognise base-model requests). Who may read them is the route's business
(:mod:`~loraplex.server.auth`: operators and the metrics key, never a tenant key).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.config.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.spec.stats import SpecStepStats

if TYPE_CHECKING:
    from loraplex.engine.client import EngineClient, LoadedAdapter, PreparedRequest, StepStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
MAX_ADAPTER_LABELS = 64
"""Most adapter names listed in one label value (device-resident or waiting): top-K."""
MAX_NAMES_PER_ADAPTER = 8
"""Most served names (``adapter_name`` series) one resident adapter gets in
``vllm:lora_adapter_loaded`` (its current names first, sorted): bounds the series by host copies."""


VLLM_LABELS = ("model_name", "engine")
ENGINE = "0"  # vLLM's engine index: one engine per server


def _bounded(names: Iterable[str]) -> str:
    """Comma-joined distinct ``names`` in the given order, at most :data:`MAX_ADAPTER_LABELS`."""
    return ",".join(list(dict.fromkeys(names))[:MAX_ADAPTER_LABELS])


class BoundedLabels:
    """Label values for an unbounded set of names (adapters, compositions): the first
    ``limit`` distinct names keep their own, every later one reads ``other``. A name keeps its
    label for the process's life, so each series stays monotonic (thread-safe)."""

    def __init__(self, limit: int = MAX_ADAPTER_LABELS) -> None:
        self._limit = limit
        self._kept: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, name: str) -> str:
        with self._lock:
            if name not in self._kept and len(self._kept) < self._limit:
                self._kept.add(name)
            return name if name in self._kept else "other"


@dataclass
class SpecCounts:
    """Drafts, draft tokens and accepted tokens (cumulative)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, drafts: int, draft_tokens: int, accepted_tokens: int) -> None:
        self.drafts += drafts
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted_tokens


@dataclass(frozen=True)
class SpecSnapshot:
    """What :class:`SpecDecodeMetrics` counted since start-up (copies)."""

    method: str
    num_speculative_tokens: int
    total: SpecCounts
    accepted_per_pos: tuple[int, ...]  # [position]: drafts whose token there was accepted
    by_adapter: dict[str, SpecCounts]  # bounded label -> counts


class SpecDecodeMetrics(Collector):
    """Speculative decoding as seen from outside, registered only when the engine runs it.

    vLLM's v1 counters with vLLM's names and labels (``model_name``, ``engine``), so its
    Grafana panels work unchanged: ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
    ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos{position}`` (positions
    ``0 .. num_speculative_tokens - 1`` exist from start-up at 0, as vLLM's). Then loraplex's
    per adapter, ``loraplex_adapter_spec_decode_num_{drafts,draft_tokens,accepted_tokens}``
    ``{adapter}`` (the adapter's name, ``composed``, ``base``; bounded by
    :class:`BoundedLabels`), and ``loraplex_spec_decode_info{method, num_speculative_tokens}``.

    The step observer feeds :meth:`observe` (the loop's thread); scrapes and the dashboard read
    copies taken under one lock, so the totals of one read agree with each other."""

    def __init__(self, config: SpeculativeConfig, model_name: str) -> None:
        self.method = config.method
        self.num_speculative_tokens = config.num_speculative_tokens
        self._model = model_name
        self._labels = BoundedLabels()
        self._lock = threading.Lock()
        self._total = SpecCounts()
        self._per_pos = [0] * config.num_speculative_tokens
        self._by_adapter: dict[str, SpecCounts] = {}

    def observe(self, spec: SpecStepStats) -> None:
        """Count one step's drafts. Raises ValueError (counting nothing) for a negative count
        or more positions than any draft may have: counters never go down, series are
        bounded."""
        counts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        rows = [(label, (d, t, a)) for label, d, t, a in spec.by_adapter]
        if min((*counts, *spec.accepted_per_pos, *(n for _, c in rows for n in c)), default=0) < 0:
            raise ValueError(f"negative count in {spec!r}")
        if len(spec.accepted_per_pos) > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"{len(spec.accepted_per_pos)} draft positions in {spec!r}")
        labelled = [(self._labels(label), c) for label, c in rows]
        with self._lock:
            self._total.add(*counts)
            per_pos = self._per_pos
            per_pos.extend([0] * (len(spec.accepted_per_pos) - len(per_pos)))
            for i, n in enumerate(spec.accepted_per_pos):
                per_pos[i] += n
            for label, c in labelled:
                self._by_adapter.setdefault(label, SpecCounts()).add(*c)

    def snapshot(self) -> SpecSnapshot:
        with self._lock:
            t = self._total
            return SpecSnapshot(
                self.method,
                self.num_speculative_tokens,
                SpecCounts(t.drafts, t.draft_tokens, t.accepted_tokens),
                tuple(self._per_pos),
                {
                    k: SpecCounts(c.drafts, c.draft_tokens, c.accepted_tokens)
                    for k, c in self._by_adapter.items()
                },
            )

    def collect(self) -> Iterable[Metric]:
        s = self.snapshot()
        vl = [self._model, ENGINE]
        fields = (
            ("drafts", "drafts", "Number of spec decoding drafts."),
            ("draft_tokens", "draft tokens", "Number of draft tokens."),
            ("accepted_tokens", "accepted tokens", "Number of accepted tokens."),
        )
        for field, _, doc in fields:
            m = CounterMetricFamily(f"vllm:spec_decode_num_{field}", doc, labels=list(VLLM_LABELS))
            m.add_metric(vl, getattr(s.total, field))
            yield m
        pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*VLLM_LABELS, "position"],
        )
        for i, n in enumerate(s.accepted_per_pos):
            pos.add_metric([*vl, str(i)], n)
        yield pos
        for field, words, _ in fields:
            m = CounterMetricFamily(
                f"loraplex_adapter_spec_decode_num_{field}",
                f"Spec decoding {words} per adapter (its name, 'composed' for a composition, "
                "'base'): the first MAX_ADAPTER_LABELS distinct labels each, later ones under "
                "'other'.",
                labels=["adapter"],
            )
            for label, c in sorted(s.by_adapter.items()):
                m.add_metric([label], getattr(c, field))
            yield m
        info = GaugeMetricFamily(
            "loraplex_spec_decode_info",
            "Speculative decoding: the method and the most tokens drafted per sequence and step.",
            labels=["method", "num_speculative_tokens"],
        )
        info.add_metric([s.method, str(s.num_speculative_tokens)], 1)
        yield info


class _EngineCollector(Collector):
    """Gauges and tier counters computed from the engine's state at scrape time (through its
    client)."""

    def __init__(
        self,
        client: EngineClient,
        adapter_names: Callable[[str], list[str]],
        model_name: str,
        cache_info: dict[str, str],
    ) -> None:
        self._client = client
        self._names = adapter_names  # digest -> served names
        self._model = model_name
        self._cache_info = cache_info

    def _vllm(self, kind: type[Any], name: str, doc: str, value: float) -> Metric:
        """One of vLLM's engine-level metrics, labelled as vLLM does."""
        m = kind(name, doc, labels=list(VLLM_LABELS))
        m.add_metric([self._model, ENGINE], value)
        return m

    def collect(self) -> Iterable[Metric]:
        client = self._client
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._vllm(g, "vllm:num_requests_waiting", "Requests waiting.", client.num_waiting)
        yield self._vllm(
            g, "vllm:num_requests_running", "Requests in the running batch.", client.num_running
        )
        yield self._vllm(
            g,
            "vllm:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full).",
            client.kv_cache_usage(),
        )
        yield self._vllm(
            g,
            "vllm:gpu_cache_usage_perc",
            "The same as vllm:kv_cache_usage_perc (the name older dashboards read).",
            client.kv_cache_usage(),
        )
        yield self._vllm(
            c, "vllm:num_preemptions", "Sequences preempted (KV freed).", client.num_preemptions
        )
        queries, hits = client.prefix_cache_tokens()
        yield self._vllm(
            c, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries
        )
        yield self._vllm(c, "vllm:prefix_cache_hits", "Prompt tokens found there.", hits)
        yield from self._sharing(client.sharing_stats())
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "KV cache configuration.", labels=list(self._cache_info)
        )
        info.add_metric(list(self._cache_info.values()), 1)
        yield info
        lora = client.lora_enabled
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters resident on the device (idle or busy) and adapters of waiting requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        if lora:
            resident = sorted(n for d in client.device_adapter_digests() for n in self._names(d))
            counts = client.waiting_adapter_counts()
            most = sorted(counts, key=lambda d: -counts[d])
            waiting_names = [n for d in most for n in self._names(d)]
            info.add_metric(
                [str(client.max_loras), _bounded(resident), _bounded(waiting_names)],
                time.time(),
            )
        yield info
        if lora:
            yield from self._residency(client.loaded_adapters(), client.max_loras)
        yield CounterMetricFamily(
            "loraplex_streams_stalled",
            "Requests aborted because their client stopped reading the stream.",
            value=client.num_stalled,
        )
        if not lora:
            return
        st = client.cache_stats
        tiers = client.tier_counters()  # device, host (and disk when configured)
        hits = CounterMetricFamily(
            "adapter_cache_hits", "Adapter lookups served from a tier.", labels=["tier"]
        )
        ev = CounterMetricFamily(
            "adapter_evictions", "Adapters evicted from a tier.", labels=["tier"]
        )
        reload = CounterMetricFamily(
            "adapter_reload_after_eviction",
            "Adapters loaded again into a tier soon (thrash window) after being evicted from it.",
            labels=["tier"],
        )
        thrash = GaugeMetricFamily(
            "adapter_thrash_ratio",
            "Reloads within the window after an eviction / evictions, per tier.",
            labels=["tier"],
        )
        for tier, c in tiers.items():
            hits.add_metric([tier], c.hits)
            ev.add_metric([tier], c.evictions)
            reload.add_metric([tier], c.reload_after_eviction)
            thrash.add_metric([tier], c.thrash_ratio)
        yield hits
        yield ev
        yield reload
        yield thrash
        yield CounterMetricFamily(
            "adapter_cache_misses",
            "Adapter lookups that missed host memory (a load from disk or the object store).",
            value=tiers["host"].misses,
        )
        yield CounterMetricFamily(
            "adapter_remote_loads",
            "Adapters downloaded from the object store.",
            value=st.remote_loads,
        )
        yield CounterMetricFamily(
            "adapter_load_failures", "Adapter loads that failed.", value=st.load_failures
        )
        yield CounterMetricFamily(
            "cold_adapter_requests",
            "Requests whose adapter was not in device or host memory on arrival.",
            value=st.cold_requests,
        )
        count = GaugeMetricFamily(
            "adapter_resident_count", "Adapters resident in a tier.", labels=["tier"]
        )
        nbytes = GaugeMetricFamily(
            "adapter_resident_bytes",
            "Bytes of adapter weights resident in a tier.",
            labels=["tier"],
        )
        for tier, (n, b) in client.resident_bytes().items():
            count.add_metric([tier], n)
            nbytes.add_metric([tier], b)
        yield count
        yield nbytes
        yield GaugeMetricFamily("loraplex_max_loras", "Device LoRA slots.", value=client.max_loras)

    def _sharing(self, s: Any) -> Iterable[Metric]:
        """KV shared across adapters: per-adapter prefix-cache queries and hits (the top
        :data:`MAX_ADAPTER_LABELS` adapters by queries, each under its first served name; the
        base model under the served model name), tokens adapter requests took from base-keyed
        blocks, and activated-LoRA requests by whether their invocation was found."""
        q = CounterMetricFamily(
            "loraplex_adapter_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache, per adapter (top-K by queries).",
            labels=["adapter"],
        )
        h = CounterMetricFamily(
            "loraplex_adapter_prefix_cache_hits",
            "Prompt tokens found in the prefix cache, per adapter (top-K by queries).",
            labels=["adapter"],
        )
        for key, n in s.queries.most_common(MAX_ADAPTER_LABELS):
            names = self._names(key) if key not in ("", "other") else []
            label = self._model if key == "" else (names[0] if names else key[:16])
            q.add_metric([label], n)
            h.add_metric([label], s.hits[key])
        yield q
        yield h
        yield CounterMetricFamily(
            "loraplex_prefix_cache_base_aligned_hits",
            "Prompt tokens of adapter requests served from base-keyed KV blocks (before an "
            "activated LoRA's invocation, or of one whose invocation was absent).",
            value=s.base_aligned_hits,
        )
        al = CounterMetricFamily(
            "loraplex_alora_requests",
            "Activated-LoRA requests, by whether the prompt held the adapter's invocation "
            "(absent: the base model served it).",
            labels=["invocation"],
        )
        al.add_metric(["found"], s.alora_invoked)
        al.add_metric(["absent"], s.alora_not_invoked)
        yield al

    def _residency(self, loaded: list[LoadedAdapter], max_loras: int) -> Iterable[Metric]:
        """The residency gauges of llm-d's ``lora-load-state-scorer`` (vLLM PRs #51433/#54830),
        read by its metrics extractor as follows, so they are written to match:

        - ``vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}`` is 1 for each served
          name of a resident adapter; a name that is not resident has no series (the extractor
          also skips series at 0). ``level="gpu"``: in a device slot, ready to serve (the
          device tier, also on CPU builds); ``level="cpu"``: in host memory only. ``pinned`` is
          ``"true"``/``"false"``: pinned in that tier (a host pin alone leaves a slot
          evictable, which is what the scorer asks). ``rank``: the adapter's rank. A name
          served by several resident digests (a canary) gets one series, merged as the
          extractor merges: gpu over cpu, pinned if any is, the largest rank.
        - ``vllm:num_gpu_loaded_lora_adapters``: adapters in device slots (digests, not names:
          free slots are ``vllm:max_gpu_lora_adapters`` minus it). Present whenever LoRA is on,
          even at 0, which tells the extractor "nothing loaded" from "not reported"; its
          ``model_name`` is how it knows a base-model request.
        - ``vllm:num_cpu_loaded_lora_adapters``: adapters in host memory, the slotted ones
          included (their host copy stays, as in vLLM's CPU cache).
        """
        g = GaugeMetricFamily
        names: dict[str, tuple[bool, bool, int]] = {}  # served name -> (gpu, pinned, rank)
        for row in loaded:  # device rows first: a name's first row sets its level
            gpu = row.tier == "device"
            for name in self._names(row.digest)[:MAX_NAMES_PER_ADAPTER]:
                was = names.get(name)
                if was is None:
                    names[name] = (gpu, row.pinned, row.rank)
                elif was[0] == gpu:  # another digest of the name at the same level
                    names[name] = (gpu, row.pinned or was[1], max(row.rank, was[2]))
        series = g(
            "vllm:lora_adapter_loaded",
            "1 per served name of each adapter in a device slot (level=gpu) or only in host "
            "memory (level=cpu); no series once it leaves both.",
            labels=[*VLLM_LABELS, "adapter_name", "level", "pinned", "rank"],
        )
        for name, (gpu, pinned, rank) in names.items():
            level = "gpu" if gpu else "cpu"
            series.add_metric(
                [self._model, ENGINE, name, level, "true" if pinned else "false", str(rank)], 1
            )
        yield series
        on_device = sum(row.tier == "device" for row in loaded)
        yield self._vllm(
            g, "vllm:num_gpu_loaded_lora_adapters", "Adapters in device slots.", on_device
        )
        yield self._vllm(
            g,
            "vllm:num_cpu_loaded_lora_adapters",
            "Adapters in host memory (those in device slots included).",
            len(loaded),
        )
        yield self._vllm(g, "vllm:max_gpu_lora_adapters", "Device LoRA slots.", max_loras)


class _Transitions:
    """``vllm:lora_adapter_load_seconds{transition}`` from the cache's load stages, one
    observation per transition as llm-d's scorer prices them (the mean of each):

    - ``load``: an adapter made a verified host copy, from its local directory, the disk tier
      or the object store: ``disk_load`` (the verified read), plus the ``remote_download``
      just before it on the same thread when it came from the object store (the loader
      reports the two back to back). ``resolve`` is not a transition: it times every lookup,
      host hits and waits on another request's load included.
    - ``activate``: a host copy written into a device slot (``h2d`` on CUDA, ``activation``
      elsewhere).
    """

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        h = Histogram(
            "vllm:lora_adapter_load_seconds",
            "Seconds per adapter transition: load (store or disk -> host memory), activate "
            "(host memory -> device slot).",
            [*labels, "transition"],
            buckets=_LOAD_BUCKETS,
            registry=registry,
        )
        self.load = h.labels(**labels, transition="load")
        self.activate = h.labels(**labels, transition="activate")
        self._pending = threading.local()  # remote_download seconds waiting for its disk_load

    def on_stage(self, stage: str, seconds: float) -> None:
        """Fold one load stage (:meth:`EngineClient.add_load_observer`) into the transitions."""
        if stage == "remote_download":
            self._pending.seconds = seconds
        elif stage == "disk_load":
            self.load.observe(getattr(self._pending, "seconds", 0.0) + seconds)
            self._pending.seconds = 0.0
        elif stage in ("h2d", "activation"):
            self.activate.observe(seconds)


class Twin:
    """One of our metrics and its vLLM twins, observed together: ``labels(**kw)`` picks our
    child by ``kw`` and each twin's by ``fixed`` (``model_name``, ``engine``) plus the labels
    of ``kw`` named in ``shared`` (``finished_reason``); ``inc``/``observe`` feed all."""

    def __init__(
        self,
        ours: Any,
        theirs: list[Any],
        fixed: dict[str, str] | None,
        shared: tuple[str, ...] = (),
    ) -> None:
        self.ours = ours
        self.theirs = theirs
        self._fixed = fixed  # None: ``theirs`` are children already
        self._shared = shared

    def labels(self, **kw: str) -> Twin:
        mine = {k: v for k, v in kw.items() if k in self._shared}
        children = [t.labels(**(self._fixed or {}), **mine) for t in self.theirs]
        return Twin(self.ours.labels(**kw), children, None)

    def _children(self) -> list[Any]:
        if self._fixed is None:
            return self.theirs
        return [t.labels(**self._fixed) for t in self.theirs]

    def inc(self, amount: float = 1.0) -> None:
        self.ours.inc(amount)
        for t in self._children():
            t.inc(amount)

    def observe(self, value: float) -> None:
        self.ours.observe(value)
        for t in self._children():
            t.observe(value)


@dataclass
class _Timing:
    """What the step observer has seen of one sequence (monotonic seconds)."""

    queued: float  # handed to the engine
    tokens: int = 0  # output tokens seen
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class SequenceTimes:
    """vLLM's per-token and per-phase histograms from the engine loop: each sequence handed
    to the engine is tracked (:meth:`track`, event-loop thread); after every step
    (:meth:`on_step`, the loop's thread) the new tokens of each give inter-token latencies, its
    first scheduling its queue time (scheduled = the end of the step before, or its hand-over
    if later), and its end its prefill, decode and inference times and token counts."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            h = Histogram(name, doc, list(labels), buckets=buckets, registry=registry)
            return h.labels(**labels)

        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Seconds between output tokens.", _ITL_BUCKETS
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Seconds from hand-over to the engine to first scheduling.",
            _REQUEST_BUCKETS,
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Seconds from first scheduling to the first token.",
            _REQUEST_BUCKETS,
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds",
            "Seconds from the first token to the last.",
            _REQUEST_BUCKETS,
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Seconds from first scheduling to the last token.",
            _REQUEST_BUCKETS,
        )
        self.prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Prompt tokens per sequence.", _TOKEN_BUCKETS
        )
        self.generation_tokens = hist(
            "vllm:request_generation_tokens", "Generated tokens per sequence.", _TOKEN_BUCKETS
        )
        self._new: list[tuple[Sequence, float]] = []  # handed over, not yet seen by a step
        self._lock = threading.Lock()
        self._live: dict[Sequence, _Timing] = {}  # loop thread only
        self._last_step = 0.0

    def track(self, prepared: PreparedRequest, now: float | None = None) -> None:
        """Follow the sequences of a request handed to the engine now."""
        t = time.monotonic() if now is None else now
        with self._lock:
            self._new.extend((seq, t) for seq in prepared.request.seqs)

    def on_step(self, stats: object = None, now: float | None = None) -> None:
        """Observe what the last step did to every tracked sequence."""
        now = time.monotonic() if now is None else now
        with self._lock:
            new, self._new = self._new, []
        for seq, queued in new:
            self._live.setdefault(seq, _Timing(queued))
        for seq, t in list(self._live.items()):
            n = len(seq.output_token_ids)
            started = seq.status is not SequenceStatus.WAITING or n > t.tokens
            if t.scheduled is None and started and seq.num_computed_tokens + n > 0:
                t.scheduled = max(t.queued, self._last_step)
                self.queue.observe(t.scheduled - t.queued)
            if n > t.tokens and t.scheduled is not None:
                if t.last_token is None:  # the first token ends the prefill
                    t.first_token = now
                    self.prefill.observe(now - t.scheduled)
                else:  # k tokens since the last step: k equal gaps
                    k = n - t.tokens
                    for _ in range(k):
                        self.itl.observe((now - t.last_token) / k)
                t.last_token, t.tokens = now, n
            if seq.status is SequenceStatus.FINISHED:
                del self._live[seq]
                if t.first_token is not None and t.last_token is not None and t.scheduled:
                    self.decode.observe(t.last_token - t.first_token)
                    self.inference.observe(t.last_token - t.scheduled)
                    self.prompt_tokens.observe(len(seq.prompt_token_ids))
                    self.generation_tokens.observe(t.tokens)
        self._last_step = now

    @property
    def num_tracked(self) -> int:
        """Sequences handed over and not finished (a bounded number: admission's)."""
        with self._lock:
            return len(self._live) + len(self._new)


class ServerMetrics:
    """All metrics of one server instance; ``model_name`` labels vLLM's."""

    def __init__(
        self,
        client: EngineClient,
        adapter_names: Callable[[str], list[str]],
        model_name: str = "",
        cache_info: dict[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.model_name = model_name
        fixed = {"model_name": model_name, "engine": ENGINE}
        vl = list(VLLM_LABELS)

        def twin(ours: Any, name: str, doc: str, extra: tuple[str, ...] = (), **kw: Any) -> Twin:
            kind = Histogram if isinstance(ours, Histogram) else Counter
            names = name.split("|")  # several: the same observations under each name
            twins = [kind(n, doc, [*vl, *extra], registry=r, **kw) for n in names]
            return Twin(ours, twins, fixed, extra)

        self.ttft = twin(
            Histogram(
                "time_to_first_token_seconds",
                "Time from request arrival to its first output token.",
                ["adapter_state"],
                buckets=_TTFT_BUCKETS,
                registry=r,
            ),
            "vllm:time_to_first_token_seconds",
            "Seconds from arrival to the first token.",
            buckets=_TTFT_BUCKETS,
        )
        self.tpot = twin(
            Histogram(
                "time_per_output_token_seconds",
                "Mean time between output tokens after the first, per request.",
                ["adapter_state"],
                buckets=_TPOT_BUCKETS,
                registry=r,
            ),
            "vllm:request_time_per_output_token_seconds|vllm:time_per_output_token_seconds",
            "Mean seconds per output token after the first, per request (the second name is "
            "the one vLLM's older dashboards read).",
            buckets=_ITL_BUCKETS,
        )
        self.e2e = twin(
            Histogram(
                "e2e_request_latency_seconds",
                "Time from request arrival to its last token.",
                ["adapter_state"],
                buckets=_TTFT_BUCKETS,
                registry=r,
            ),
            "vllm:e2e_request_latency_seconds",
            "Seconds from arrival to the last token.",
            buckets=_REQUEST_BUCKETS,
        )
        self.requests = Counter(
            "loraplex_requests", "Finished HTTP requests by status.", ["status"], registry=r
        )
        self.finished = twin(
            Counter(
                "loraplex_request_success",
                "Completions finished by the engine, by finish reason.",
                ["finished_reason"],
                registry=r,
            ),
            "vllm:request_success",
            "Completions finished, by finish reason.",
            ("finished_reason",),
        )
        self.prompt_tokens = twin(
            Counter(
                "loraplex_prompt_tokens",
                "Prompt tokens processed (cached ones included), counted when a sequence's "
                "prefill completes.",
                registry=r,
            ),
            "vllm:prompt_tokens",
            "Prompt tokens processed (cached ones included), counted when a sequence's "
            "prefill completes.",
        )
        self.generation_tokens = twin(
            Counter(
                "loraplex_generation_tokens", "Tokens generated, counted each step.", registry=r
            ),
            "vllm:generation_tokens",
            "Tokens generated, counted each step.",
        )
        self.load_seconds = Histogram(
            "adapter_load_seconds",
            "Seconds spent per adapter load stage.",
            ["stage"],
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.distinct_adapters = Histogram(
            "distinct_adapters_per_step",
            "Distinct adapters in one engine step.",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.step_errors = Counter(
            "loraplex_engine_step_errors", "Engine steps that raised.", registry=r
        )
        self.canary_calls = Counter(
            "loraplex_canary_requests",
            "Calls served by a canary revision on this replica, by outcome (ok, error).",
            ["outcome"],
            registry=r,
        )
        self.canary_rollbacks = Counter(
            "loraplex_canary_rollbacks",
            "Canaries this replica rolled back for breaching their health policy, by the bound "
            "breached (error_rate, ttft, tpot, quality).",
            ["reason"],
            registry=r,
        )
        self.adapter_waits = Counter(
            "loraplex_adapter_concurrency_waits",
            "Calls that waited for a slot under an adapter's max_concurrent_requests.",
            registry=r,
        )
        self.adapter_rejections = Counter(
            "loraplex_adapter_concurrency_rejections",
            "Calls refused (429) at an adapter's max_concurrent_requests: queue full or wait "
            "timed out.",
            registry=r,
        )
        self.composed = Counter(
            "loraplex_composed_requests",
            "Calls admitted with a composition of adapters (or one adapter at a per-request "
            "scale), by its name (alpha*1+style*0.5): the first MAX_ADAPTER_LABELS distinct "
            "names each, later ones under 'other'.",
            ["composition"],
            registry=r,
        )
        self._composition_label = BoundedLabels()
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Tokens computed per engine step.",
            vl,
            buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
            registry=r,
        ).labels(**fixed)
        self.sequences = SequenceTimes(r, fixed)
        self.transitions = _Transitions(r, fixed) if client.lora_enabled else None
        r.register(_EngineCollector(client, adapter_names, model_name, cache_info or {}))
        spec = client.speculative
        self.spec = SpecDecodeMetrics(spec, model_name) if spec is not None else None
        if self.spec is not None:
            r.register(self.spec)
        client.add_step_observer(self._on_step)
        client.add_load_observer(self._on_load)

    def count_composition(self, name: str) -> None:
        """Count one call served by the composition ``name``. Its own series only for the
        first :data:`MAX_ADAPTER_LABELS` distinct names (compositions are combinations of the
        caller's adapters: unbounded), the rest under ``other``, so series are bounded and every
        series stays monotonic."""
        self.composed.labels(composition=self._composition_label(name)).inc()

    def _on_step(self, stats: StepStats) -> None:
        # the token counters move every step, as vLLM's do: prompt tokens when a prefill
        # completes, generated tokens as they are sampled (so rates show while requests run)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.distinct_adapters.observe(stats.distinct_adapters)
        self.iteration_tokens.observe(stats.num_tokens)
        self.sequences.on_step(stats)
        if self.spec is not None and stats.spec is not None:
            self.spec.observe(stats.spec)

    def _on_load(self, stage: str, seconds: float) -> None:
        self.load_seconds.labels(stage=stage).observe(seconds)
        if self.transitions is not None:
            self.transitions.on_stage(stage, seconds)

    def total(self, name: str, **labels: str) -> float:
        """The current value of one of our counters (``loraplex_prompt_tokens``), summed over
        label sets that include ``labels`` (0 when never observed): for the stats log line."""
        out = 0.0
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name == name + "_total" and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    out += sample.value
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)
