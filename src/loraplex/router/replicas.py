"""The router's replica set: where replicas are, whether they are up, and what they hold.

Replicas come from a static URL list, a file of URLs (re-read when it changes) and a DNS name
(re-resolved on every poll), in any combination. Each poll asks every replica for ``/health``,
``/v1/adapters`` (loraplex's residency: every adapter and its tier) and ``/metrics`` (queue,
running, KV usage, device evictions, and the Gateway API Inference Extension's
``vllm:lora_requests_info``), so vLLM replicas, which have no ``/v1/adapters``, are routed by
their metrics alone. Between polls the view is updated from the replicas' successful answers
only: a 2xx response carrying ``x-loraplex-adapter-state`` puts its adapter on that replica's
device (evicting the least recently used one beyond ``max_loras``), as the replica itself did,
and a push the replica took (201) puts the pushed revision in its host memory.
What a client asks for never enters the view: a name no replica has answered for (a bogus one,
or one refused with 401/404) cannot push a real adapter out of it. The one hint taken from
requests in flight: an adapter the replica itself reported (any tier) with a request
outstanding there counts as on its device in routing decisions (it is being served there), so
a burst for a cold adapter stays together; the hint evicts nothing and ends with the request.

A replica that refuses a connection is ejected at once (no requests); one whose health checks
fail or time out ``eject_after`` times in a row too; either is re-admitted after
``readmit_after`` consecutive good health checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraplex.router.scoring import TIERS, ReplicaView

log = logging.getLogger(__name__)

_TIER_RANK = {t: i for i, t in enumerate(TIERS)}  # device 0 (best) .. absent 3


# --------------------------------------------------------------------------- metrics parsing
@dataclass(frozen=True)
class MetricsSnapshot:
    """The routing-relevant part of a replica's ``/metrics`` (loraplex or vLLM)."""

    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    max_lora: int | None = None
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    device_evictions: float | None = None  # adapter_evictions_total{tier="device"} (loraplex)


def _names(text: str) -> tuple[str, ...]:
    return tuple(n for n in (s.strip() for s in text.split(",")) if n)


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse Prometheus text exposition into a :class:`MetricsSnapshot`.

    Gauges are summed over their label sets (vLLM labels them by model name and engine);
    ``vllm:kv_cache_usage_perc`` falls back to the older ``vllm:gpu_cache_usage_perc``; of the
    ``vllm:lora_requests_info`` samples (vLLM keeps one per label set, its value the time it was
    last set) the newest is the current one. Raises ValueError on text that is not exposition
    format."""
    sums: dict[str, float] = {}
    info: tuple[float, dict[str, str]] | None = None
    evictions: float | None = None
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises bare ValueErrors and others on garbage
        raise ValueError(f"not Prometheus text format: {e}") from e
    for fam in families:
        for s in fam.samples:
            if s.name == "vllm:lora_requests_info":
                if info is None or s.value >= info[0]:
                    info = (s.value, dict(s.labels))
            elif s.name == "adapter_evictions_total" and s.labels.get("tier") == "device":
                evictions = s.value
            elif s.name in (
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:kv_cache_usage_perc",
                "vllm:gpu_cache_usage_perc",
            ):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    kv = sums.get("vllm:kv_cache_usage_perc", sums.get("vllm:gpu_cache_usage_perc"))
    max_lora: int | None = None
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    if info is not None:
        labels = info[1]
        with contextlib.suppress(ValueError):
            max_lora = int(float(labels.get("max_lora", "")))
        running = _names(labels.get("running_lora_adapters", ""))
        waiting = _names(labels.get("waiting_lora_adapters", ""))
    w, r = sums.get("vllm:num_requests_waiting"), sums.get("vllm:num_requests_running")
    return MetricsSnapshot(
        waiting=int(w) if w is not None else None,
        running=int(r) if r is not None else None,
        kv_usage=kv,
        max_lora=max_lora,
        running_adapters=running,
        waiting_adapters=waiting,
        device_evictions=evictions,
    )


def parse_residency(body: Any) -> tuple[dict[str, str], int | None, int | None]:
    """``/v1/adapters`` of a loraplex replica -> ({adapter name: tier}, max_loras,
    max_cpu_loras), adapters ordered least recently used first. Raises ValueError on another
    shape."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ValueError("expected {'object': 'list', 'data': [...]} from /v1/adapters")
    rows = [r for r in body["data"] if isinstance(r, dict) and isinstance(r.get("name"), str)]
    rows.sort(key=lambda r: float(r.get("last_access") or 0.0))
    tiers: dict[str, str] = {}
    for r in rows:
        tier = r.get("tier") if r.get("tier") in _TIER_RANK else "absent"
        old = tiers.get(r["name"])
        if old is None or _TIER_RANK[tier] < _TIER_RANK[old]:
            tiers[r["name"]] = tier

    def positive(key: str) -> int | None:
        v = body.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    return tiers, positive("max_loras"), positive("max_cpu_loras")


def parse_revisions(body: Any) -> dict[str, str]:
    """``/v1/adapters`` of a loraplex replica -> {adapter name: its active revision} (rows
    without a string revision are left out)."""
    rows = body.get("data") if isinstance(body, dict) else None
    if not isinstance(rows, list):
        raise ValueError("expected {'object': 'list', 'data': [...]} from /v1/adapters")
    return {
        r["name"]: r["revision"]
        for r in rows
        if isinstance(r, dict) and isinstance(r.get("name"), str)
        and isinstance(r.get("revision"), str)
    }  # fmt: skip


def parse_base_models(body: Any) -> frozenset[str]:
    """``/v1/models`` -> the names of base models (entries whose ``parent`` is null, as in
    loraplex and vLLM); requests for them have no adapter to be near."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("expected {'object': 'list', 'data': [...]} from /v1/models")
    return frozenset(
        m["id"]
        for m in data
        if isinstance(m, dict) and isinstance(m.get("id"), str) and m.get("parent") is None
    )


# --------------------------------------------------------------------------- one replica
@dataclass
class Replica:
    """The router's mutable view of one replica (event-loop thread only)."""

    url: str
    kind: str = "unknown"  # loraplex | vllm | unknown (not polled yet)
    healthy: bool = True  # optimistic until the first health check says otherwise
    tiers: dict[str, str] = field(default_factory=dict)
    device_lru: OrderedDict[str, None] = field(default_factory=OrderedDict)
    host_lru: OrderedDict[str, None] = field(default_factory=OrderedDict)
    base_tiers: dict[str, str] = field(default_factory=dict)  # tier outside memory (disk/absent)
    max_loras: int | None = None
    max_cpu_loras: int | None = None  # adapters in memory (device + host) at most
    base_models: frozenset[str] = frozenset()  # /v1/models entries without a parent
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    evictions_per_s: float = 0.0
    in_flight: int = 0
    good_checks: int = 0
    failures: int = 0
    failed_polls: int = 0  # consecutive
    last_poll: float = 0.0
    last_error: str | None = None
    _evictions: tuple[float, float] | None = None  # (monotonic time, counter) at last poll
    _served: dict[str, float] = field(default_factory=dict)  # adapter -> when it was answered
    revisions: dict[str, str] = field(default_factory=dict)  # adapter -> its active revision
    _pushed: dict[str, tuple[float, str]] = field(default_factory=dict)  # -> (when, revision)
    pending: dict[str, int] = field(default_factory=dict)  # reported adapter -> requests here

    def view(self) -> ReplicaView:
        """The snapshot a decision uses: the residency view, plus the adapters with requests
        outstanding here counted as on the device (they are being served here)."""
        tiers = dict(self.tiers)
        for a in self.pending:
            tiers[a] = "device"
        return ReplicaView(
            url=self.url,
            healthy=self.healthy,
            tiers=tiers,
            waiting=self.waiting,
            running=self.running,
            kv_usage=self.kv_usage,
            evictions_per_s=self.evictions_per_s,
            in_flight=self.in_flight,
            memory=self.max_cpu_loras or self.max_loras,
        )

    # -- updates between polls ------------------------------------------------------------------
    def note_on_device(self, adapter: str) -> None:
        """``adapter`` was served from a device slot here: most recently used; the
        least recently used device adapter beyond ``max_loras`` drops to host memory, and the
        least recently used host adapter beyond ``max_cpu_loras`` out of memory, as the
        replica's LRU-like cache would do (the next poll corrects any guess)."""
        self.tiers[adapter] = "device"
        self.host_lru.pop(adapter, None)
        self.device_lru.pop(adapter, None)
        self.device_lru[adapter] = None
        if self.max_loras is not None:
            while len(self.device_lru) > self.max_loras:
                old, _ = self.device_lru.popitem(last=False)
                self.tiers[old] = "host"
                self.host_lru[old] = None
        if self.max_cpu_loras is not None:
            while self.host_lru and len(self.device_lru) + len(self.host_lru) > self.max_cpu_loras:
                old, _ = self.host_lru.popitem(last=False)
                self.tiers[old] = self.base_tiers.get(old, "absent")

    def note_dispatch(self, adapter: str | None) -> str | None:
        """A request naming ``adapter`` is sent here: one more in flight. Returns the pending
        key to give back to :meth:`note_done`: the adapter if this replica has reported it
        (so it counts as on the device here meanwhile), else None (a name no replica vouched
        for)."""
        self.in_flight += 1
        if adapter is None or adapter not in self.tiers:
            return None
        self.pending[adapter] = self.pending.get(adapter, 0) + 1
        return adapter

    def note_done(self, pending: str | None) -> None:
        """The request :meth:`note_dispatch` counted is over (answered, failed or retried)."""
        self.in_flight -= 1
        if pending is not None:
            left = self.pending.get(pending, 0) - 1
            if left > 0:
                self.pending[pending] = left
            else:
                self.pending.pop(pending, None)

    def note_served(self, adapter: str, now: float) -> None:
        """The replica answered a request for ``adapter`` with success (2xx and its adapter
        state): the adapter is on its device now. One of two updates between polls."""
        self._served[adapter] = now
        self.note_on_device(adapter)

    def note_pushed(self, adapter: str, revision: str, now: float) -> None:
        """The replica took a push of ``adapter`` (201) as its new active ``revision``, the
        other update between polls: the new revision's bytes are in its host memory, and no
        device slot holds them yet (the old revision's slot serves only requests already
        admitted), so the adapter is in the host tier, most recently used."""
        self._pushed[adapter] = (now, revision)
        self._apply_push(adapter, revision)

    def _apply_push(self, adapter: str, revision: str) -> None:
        self.revisions[adapter] = revision
        self.tiers[adapter] = "host"
        self.device_lru.pop(adapter, None)
        self.host_lru.pop(adapter, None)
        self.host_lru[adapter] = None
        if self.max_cpu_loras is not None:
            while len(self.host_lru) > 1 and (
                len(self.device_lru) + len(self.host_lru) > self.max_cpu_loras
            ):
                old, _ = self.host_lru.popitem(last=False)
                self.tiers[old] = self.base_tiers.get(old, "absent")

    # -- polls ----------------------------------------------------------------------------------
    def apply_poll(
        self,
        started: float,
        tiers: dict[str, str] | None,
        max_loras: int | None,
        m: MetricsSnapshot | None,
        max_cpu_loras: int | None = None,
        revisions: dict[str, str] | None = None,
    ) -> None:
        """Replace the view with what a poll begun at ``started`` saw; adapters served or
        pushed here since then stay as those answers left them (the poll could not see them
        yet), in the order they happened."""
        new: dict[str, str] = dict(tiers or {})
        device = [a for a, t in new.items() if t == "device"]
        if m is not None:
            for a in m.waiting_adapters:  # queued here: it will be loaded here
                if _TIER_RANK[new.get(a, "absent")] > _TIER_RANK["host"]:
                    new[a] = "host"
            for a in m.running_adapters:  # vLLM lists adapters with running requests
                new[a] = "device"
                if a not in device:
                    device.append(a)
            self.waiting = m.waiting if m.waiting is not None else self.waiting
            self.running = m.running if m.running is not None else self.running
            self.kv_usage = m.kv_usage if m.kv_usage is not None else self.kv_usage
            if m.device_evictions is not None:
                if self._evictions is not None and started > self._evictions[0]:
                    dt = started - self._evictions[0]
                    self.evictions_per_s = max(0.0, m.device_evictions - self._evictions[1]) / dt
                self._evictions = (started, m.device_evictions)
        self.max_loras = max_loras or (m.max_lora if m is not None else None) or self.max_loras
        self.max_cpu_loras = max_cpu_loras or self.max_cpu_loras
        self.tiers = new
        self.base_tiers = {a: t for a, t in new.items() if t in ("disk", "absent")}
        self.device_lru = OrderedDict((a, None) for a in device)
        self.host_lru = OrderedDict((a, None) for a, t in new.items() if t == "host")
        self.revisions = dict(revisions or {})
        self._served = {a: t for a, t in self._served.items() if t >= started}
        self._pushed = {a: p for a, p in self._pushed.items() if p[0] >= started}
        events = [(t, a, None) for a, t in self._served.items()]
        events += [(t, a, rev) for a, (t, rev) in self._pushed.items()]
        for _, a, rev in sorted(events, key=lambda e: e[0]):
            if rev is None:
                self.note_on_device(a)
            else:
                self._apply_push(a, rev)
        self.last_poll = started


def _dns_urls(spec: str, scheme: str = "http") -> list[str]:
    """``NAME:PORT`` -> one URL per address the name resolves to (a headless Service)."""
    host, _, port = spec.rpartition(":")
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    out = []
    for fam, *_, addr in infos:
        ip = addr[0]
        out.append(
            f"{scheme}://[{ip}]:{port}" if fam == socket.AF_INET6 else f"{scheme}://{ip}:{port}"
        )
    return sorted(set(out))


def read_replicas_file(path: Path) -> list[str]:
    """One URL per line; blank lines and ``#`` comments ignored."""
    urls = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            urls.append(normalize_url(line))
    return urls


def normalize_url(text: str) -> str:
    """``host:port`` or ``http(s)://host:port[/]`` -> ``http(s)://host:port``; ValueError else."""
    url = text.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    scheme, _, rest = url.partition("://")
    if scheme not in ("http", "https") or not rest or "/" in rest:
        raise ValueError(f"expected a replica URL like http://10.0.0.5:8000, got {text!r}")
    try:
        httpx.URL(url)
    except Exception as e:
        raise ValueError(f"invalid replica URL {text!r}: {e}") from None
    return url


# --------------------------------------------------------------------------- the set
class ReplicaSet:
    """All replicas, their discovery, polling, ejection and re-admission."""

    def __init__(
        self,
        *,
        static: Iterable[str] = (),
        replicas_file: str | None = None,
        dns: str | None = None,
        poll_interval_s: float = 1.0,
        poll_timeout_s: float = 2.0,
        readmit_after: int = 2,
        eject_after: int = 2,
        api_key: str | None = None,
        on_eject: Callable[[str], None] | None = None,
    ) -> None:
        self.static = [normalize_url(u) for u in static]
        self.replicas_file = Path(replicas_file) if replicas_file else None
        self.dns = dns
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.readmit_after = readmit_after
        self.eject_after = eject_after
        self.api_key = api_key
        self.on_eject = on_eject
        self.replicas: dict[str, Replica] = {}
        self._file_mtime: float | None = None
        self._file_urls: list[str] = []
        self._dns_urls: list[str] = []
        self._client: httpx.AsyncClient | None = None
        for u in self.static:
            self.replicas[u] = Replica(u)
        self._reload_file()

    # -- discovery ------------------------------------------------------------------------------
    def _reload_file(self) -> None:
        if self.replicas_file is None:
            return
        try:
            mtime = self.replicas_file.stat().st_mtime
        except OSError as e:
            log.warning("replicas file %s: %s (keeping the last list)", self.replicas_file, e)
            return
        if mtime == self._file_mtime:
            return
        try:
            self._file_urls = read_replicas_file(self.replicas_file)
        except (OSError, ValueError) as e:
            log.warning("replicas file %s: %s (keeping the last list)", self.replicas_file, e)
            return
        self._file_mtime = mtime
        self._sync()

    async def _resolve_dns(self) -> None:
        if self.dns is None:
            return
        try:
            self._dns_urls = await asyncio.to_thread(_dns_urls, self.dns)
        except OSError as e:
            log.warning("replicas DNS %s: %s (keeping the last list)", self.dns, e)
            return
        self._sync()

    def _sync(self) -> None:
        wanted = list(dict.fromkeys([*self.static, *self._file_urls, *self._dns_urls]))
        for u in wanted:
            if u not in self.replicas:
                log.info("replica added: %s", u)
                self.replicas[u] = Replica(u)
        for u in list(self.replicas):
            if u not in wanted:
                log.info("replica removed: %s", u)
                del self.replicas[u]

    def is_base_model(self, name: str) -> bool:
        return any(name in r.base_models for r in self.replicas.values())

    def ordered(self) -> list[Replica]:
        return [self.replicas[u] for u in sorted(self.replicas)]

    # -- health ---------------------------------------------------------------------------------
    def mark_failed(self, r: Replica, why: str) -> None:
        """A request or health check failed: eject now; re-admission needs good checks."""
        r.failures += 1
        r.good_checks = 0
        r.last_error = why
        if r.healthy:
            log.warning("replica %s ejected: %s", r.url, why)
            r.healthy = False
            if self.on_eject is not None:
                self.on_eject(r.url)

    def _poll_failed(self, r: Replica, why: str) -> None:
        """A refused connection ejects at once; a slow or failing health check only after
        ``eject_after`` in a row (one slow answer on a busy machine is not an outage)."""
        r.failed_polls += 1
        if r.failed_polls >= self.eject_after:
            self.mark_failed(r, why)
        else:
            r.last_error = why

    def _mark_good(self, r: Replica) -> None:
        r.failed_polls = 0
        r.good_checks += 1
        r.last_error = None
        if not r.healthy and r.good_checks >= self.readmit_after:
            log.info("replica %s re-admitted", r.url)
            r.healthy = True

    # -- polling --------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def poll_one(self, r: Replica, client: httpx.AsyncClient) -> None:
        started = time.monotonic()
        try:
            health = await client.get(f"{r.url}/health")
            if health.status_code != 200:
                raise RuntimeError(f"/health answered {health.status_code}")
            tiers: dict[str, str] | None = None
            revisions: dict[str, str] | None = None
            max_loras: int | None = None
            max_cpu: int | None = None
            if r.kind != "vllm":
                res = await client.get(f"{r.url}/v1/adapters", headers=self._headers())
                if res.status_code == 404:
                    r.kind = "vllm"
                elif res.status_code == 200:
                    listing = res.json()
                    tiers, max_loras, max_cpu = parse_residency(listing)
                    revisions = parse_revisions(listing)
                    r.kind = "loraplex"
                else:
                    log.warning("replica %s /v1/adapters: %s", r.url, res.status_code)
            models = await client.get(f"{r.url}/v1/models", headers=self._headers())
            if models.status_code == 200:
                r.base_models = parse_base_models(models.json())
            met = await client.get(f"{r.url}/metrics", headers=self._headers())
            m = parse_metrics(met.text) if met.status_code == 200 else None
        except httpx.ConnectError as e:
            self.mark_failed(r, f"{type(e).__name__}: {e}")
            return
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            self._poll_failed(r, f"{type(e).__name__}: {e}")
            return
        if r.url in self.replicas:
            r.apply_poll(started, tiers, max_loras, m, max_cpu, revisions)
            self._mark_good(r)

    async def poll(self) -> None:
        """One round: re-read the file and DNS name, then poll every replica concurrently."""
        self._reload_file()
        await self._resolve_dns()
        client = self._client
        if client is None:
            return
        await asyncio.gather(*(self.poll_one(r, client) for r in list(self.replicas.values())))

    async def run(self) -> None:
        """Poll forever (until cancelled)."""
        timeout = httpx.Timeout(self.poll_timeout_s)
        async with httpx.AsyncClient(timeout=timeout) as client:
            self._client = client
            try:
                while True:
                    t0 = time.monotonic()
                    try:
                        await self.poll()
                    except Exception:  # one bad round must not stop polling
                        log.exception("replica poll failed")
                    await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - t0)))
            finally:
                self._client = None

    def status(self) -> list[dict[str, Any]]:
        """The router's view of every replica (``GET /v1/replicas``)."""
        return [
            {
                "url": r.url,
                "kind": r.kind,
                "healthy": r.healthy,
                "in_flight": r.in_flight,
                "waiting": r.waiting,
                "running": r.running,
                "kv_usage": r.kv_usage,
                "evictions_per_s": r.evictions_per_s,
                "max_loras": r.max_loras,
                "max_cpu_loras": r.max_cpu_loras,
                "base_models": sorted(r.base_models),
                "device": list(r.device_lru),
                "tiers": dict(sorted(r.tiers.items())),
                "revisions": dict(sorted(r.revisions.items())),
                "last_error": r.last_error,
            }
            for r in self.ordered()
        ]
