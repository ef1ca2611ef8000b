"""Routing replayed against simulated replicas: the router's own decision code, no HTTP.

Each simulated replica keeps its adapters the way a loraplex replica with ``--max-loras D
--max-cpu-loras M`` does under an LRU policy: D device slots, M adapters in memory (device +
host), least recently used out first; an adapter outside memory is on local disk. The router
side is the real one: a :class:`~loraplex.router.homes.Picker` decides on the views of real
:class:`~loraplex.router.replicas.Replica` objects, which are updated exactly as the router
updates them (``note_dispatch`` / ``note_served`` / ``note_done`` per request, ``apply_poll``
with the replica's true residency and metrics every ``poll_interval_s`` simulated seconds,
``note_answered`` for the home sets). ``concurrency`` clients send in a closed loop (1: one
request at a time, the response before the next request); a replica serves ``lanes`` requests at
once and queues the rest, each taking ``service_s`` warm or ``cold_s`` cold, so queues, device
evictions per second and saturation play their part as on real replicas. Per request: cold =
the adapter was in neither a device slot nor host memory on arrival (the replica's
``x-loraplex-adapter-state: cold``).
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from loraplex.router.homes import HomeSettings, Picker
from loraplex.router.replicas import MetricsSnapshot, Replica
from loraplex.router.scoring import Thresholds, Weights


class SimReplica:
    """One replica: LRU device slots inside an LRU memory of ``memory`` adapters, and
    ``lanes`` requests served at once (the rest queue), each taking ``service_s`` seconds warm
    and ``cold_s`` cold."""

    def __init__(
        self, url: str, device_slots: int, memory: int, lanes: int, service_s: float, cold_s: float
    ) -> None:
        self.url = url
        self.device_slots = device_slots
        self.memory = max(memory, device_slots)
        self.device: OrderedDict[str, None] = OrderedDict()
        self.host: OrderedDict[str, None] = OrderedDict()
        self.lanes = [0.0] * lanes  # when each lane is free
        self.service_s = service_s
        self.cold_s = cold_s
        self.device_evictions = 0
        self.finishes: list[float] = []  # requests not finished yet (heap of finish times)

    def serve(self, adapter: str, now: float) -> tuple[bool, float]:
        """Take one request at ``now``: (cold on arrival, when its answer is complete)."""
        cold = adapter not in self.device and adapter not in self.host
        self.host.pop(adapter, None)
        self.device.pop(adapter, None)
        self.device[adapter] = None
        while len(self.device) > self.device_slots:
            old, _ = self.device.popitem(last=False)
            self.host[old] = None
            self.device_evictions += 1
        while self.host and len(self.device) + len(self.host) > self.memory:
            self.host.popitem(last=False)
        lane = min(range(len(self.lanes)), key=self.lanes.__getitem__)
        done = max(now, self.lanes[lane]) + (self.cold_s if cold else self.service_s)
        self.lanes[lane] = done
        heapq.heappush(self.finishes, done)
        return cold, done

    def metrics(self, now: float) -> MetricsSnapshot:
        """``/metrics`` at ``now``: running and waiting requests, device evictions so far."""
        while self.finishes and self.finishes[0] <= now:
            heapq.heappop(self.finishes)
        busy = len(self.finishes)
        running = min(busy, len(self.lanes))
        return MetricsSnapshot(
            waiting=busy - running,
            running=running,
            kv_usage=0.0,
            device_evictions=float(self.device_evictions),
        )

    def tiers(self, names: Sequence[str]) -> dict[str, str]:
        """``/v1/adapters`` as the replica reports it (every adapter is on its local disk)."""
        out = {a: "disk" for a in names if a not in self.device and a not in self.host}
        out.update({a: "host" for a in self.host})
        out.update({a: "device" for a in self.device})
        return out


@dataclass(frozen=True)
class FleetShape:
    """The simulated fleet: replicas and each one's adapter memory."""

    replicas: int
    device_slots: int = 1  # --max-loras
    memory: int = 4  # adapters in memory per replica (device + host), --max-cpu-loras

    @property
    def fleet_memory(self) -> int:
        return self.replicas * max(self.memory, self.device_slots)


@dataclass
class SimResult:
    """Cold starts of the measured requests, and where they went."""

    policy: str
    requests: int
    cold: int
    by_replica: dict[str, int] = field(default_factory=dict)
    replicas_per_adapter: float = 0.0  # mean over adapters of the replicas that served it
    decisions: dict[str, int] = field(default_factory=dict)
    makespan_s: float = 0.0  # simulated seconds of the measured requests

    @property
    def cold_rate(self) -> float:
        return self.cold / self.requests if self.requests else 0.0


def simulate_routing(
    trace: Sequence[str],
    shape: FleetShape,
    *,
    policy: str = "home",
    warmup: int = 0,
    concurrency: int = 1,
    lanes: int = 4,
    service_s: float = 0.05,
    cold_s: float = 0.15,
    poll_interval_s: float = 0.5,
    weights: Weights | None = None,
    thresholds: Thresholds | None = None,
    homes: HomeSettings | None = None,
) -> SimResult:
    """Replay ``trace`` (adapter names, in order) through a ``policy`` router over ``shape``,
    ``concurrency`` clients in a closed loop (1: one request at a time), the router polling
    every ``poll_interval_s`` simulated seconds; the first ``warmup`` requests are not
    counted. Deterministic."""
    names = sorted(set(trace))
    sims = [
        SimReplica(f"http://r{i}:8000", shape.device_slots, shape.memory, lanes, service_s, cold_s)
        for i in range(shape.replicas)
    ]
    reps = [Replica(s.url, kind="loraplex") for s in sims]
    picker = Picker(policy, weights, thresholds, homes)

    def poll(now: float) -> None:
        for s, r in zip(sims, reps, strict=True):
            r.apply_poll(now, s.tiers(names), shape.device_slots, s.metrics(now), s.memory)

    cold = measured = 0
    by_replica: Counter[str] = Counter()
    where: dict[str, set[str]] = {}
    decisions: Counter[str] = Counter()
    clients = [0.0] * concurrency  # when each client sends its next request
    # (done, seq, replica, adapter, pending key): answers the router has yet to see
    answers: list[tuple[float, int, int, str, str | None]] = []
    next_poll = 0.0
    t_measured = 0.0
    t_end = 0.0
    for n, adapter in enumerate(trace):
        c = min(range(concurrency), key=clients.__getitem__)
        now = clients[c]
        while True:  # answers and polls up to now, in time order
            done = answers[0][0] if answers else float("inf")
            if min(done, next_poll) > now:
                break
            if done <= next_poll:
                _, _, i, name, pending = heapq.heappop(answers)
                reps[i].note_served(name, done)  # a 2xx with its adapter state
                picker.note_answered(name, reps[i].url)
                reps[i].note_done(pending)
            else:
                poll(next_poll)
                next_poll += poll_interval_s
        d = picker.pick([r.view() for r in reps], adapter)
        assert d is not None  # every simulated replica is healthy
        rep, sim = reps[d.index], sims[d.index]
        pending = rep.note_dispatch(adapter)
        was_cold, done = sim.serve(adapter, now)
        heapq.heappush(answers, (done, n, d.index, adapter, pending))
        clients[c] = done
        t_end = max(t_end, done)
        if n == warmup:
            t_measured = now
        if n >= warmup:
            measured += 1
            cold += was_cold
            by_replica[sim.url] += 1
            where.setdefault(adapter, set()).add(sim.url)
            decisions[d.reason] += 1
    spread = sum(len(v) for v in where.values()) / len(where) if where else 0.0
    return SimResult(
        policy, measured, cold, dict(by_replica), spread, dict(decisions), t_end - t_measured
    )


def partition_bound(trace: Sequence[str], fleet_memory: int, warmup: int = 0) -> int:
    """Cold starts of a static partition of the adapters over the fleet's memory, in the
    measured part of ``trace`` (after ``warmup``): the ``fleet_memory`` most requested
    adapters (over the whole trace) are pinned in memory somewhere and cold only on their
    first request if the warm-up did not bring them; every request for any other adapter is
    cold. When the working set fits this is the compulsory misses alone."""
    freq = Counter(trace)
    pinned = {a for a, _ in sorted(freq.items(), key=lambda x: (-x[1], x[0]))[:fleet_memory]}
    seen = set(trace[:warmup])
    cold = 0
    for a in trace[warmup:]:
        if a not in pinned or a not in seen:
            cold += 1
        seen.add(a)
    return cold
