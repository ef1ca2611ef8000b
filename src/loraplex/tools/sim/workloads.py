"""Request traces for the cache simulator: the JSON-lines format and seeded workload generators.

Trace format, one JSON object per line::

    {"time": 0.013, "adapter": "z0042", "tenant": "t2", "size": 16777216, "rank": 16,
     "priority": 0}

``adapter`` is the cache key (a content digest in the server; any string in a trace).

Workload specs (``--workload``): ``KIND:key=value,key=value,...``, every key optional:

``zipf:s=1,n=256``              Zipf(s) popularity over n adapters (rank 1 most popular)
``uniform:n=64``                every adapter equally popular
``tiered:5x12%,5x6%,5x2%,n=256`` groups of adapters with a share of traffic each
                                 (5 adapters at 12% each, ...); the rest, if the shares sum to
                                 less than 100%, uniform over the remaining n - 15 adapters
``hotburst``                    a hot set + long-tail burst, below
``diurnal``                     tenants with office hours in different time zones, below

Common keys: ``requests`` (20000), ``rate`` (req/s, 50), ``arrivals`` (``poisson`` or ``gamma``;
gamma uses ``cv``, the coefficient of variation of the gaps, 2 = bursty), ``seed`` (0),
``tenants`` (4; adapter i belongs to tenant ``t{i % tenants}``), ``rank`` (16), or ``ranks``
(e.g. ``8/16/64``: adapter i gets ``ranks[i % 3]``), ``bytes_per_rank`` (1MiB; an adapter's size
is rank x bytes_per_rank), ``priority`` (0), ``shift`` (0 = never: every ``shift`` seconds the
popularity ranks move to a fresh random permutation of the adapters — yesterday's hot adapters
go cold, which is where decayed frequencies beat plain LFU).

``hotburst`` models interactive tenants with a few steady adapters while a batch tenant sweeps a
long tail of cold adapters in periodic bursts. Keys and defaults:

- ``hot_tenants=3``, ``hot_per_tenant=2``: 6 hot adapters ``hot{t}-{j}``, tenants ``hot{t}``;
- ``hot_rate=20``: Poisson req/s over the hot adapters (uniform among them), all the time;
- ``cold=2000``: the batch tenant's adapters ``cold{i}``, swept in order, wrapping around;
- ``burst_rate=200``: Poisson req/s of the sweep while a burst is on;
- ``period=20``, ``duty=0.5``: a burst runs for the first ``duty`` fraction of every ``period``
  seconds (10 s on, 10 s off);
- ``sweep_repeat=1``: consecutive requests per cold adapter in a sweep;
- ``hot_priority=0``, ``cold_priority=0``: equal by default, so any protection of the hot set
  comes from recency/frequency alone;
- ``requests=20000`` in all (about 3,300 hot).

During a burst ~66 requests separate two requests for the same hot adapter, so an 8-slot LRU
loses the hot set in every burst (hot-set hit ratio ~0.55), while a frequency-aware policy keeps
it and cycles the cold adapters through the remaining slots.

``diurnal`` models office-hours tenants around the world over several days of simulated time
(``t = 0`` is ``start`` 00:00 UTC; local times, weekdays and DST come from ``zoneinfo``):

- ``tz=Europe/Berlin+America/New_York+Asia/Tokyo``: one tenant ``office{i}`` per zone;
- ``adapters=6``: each tenant's own adapters ``office{i}-{j}``, Zipf(``s=1``) among them;
- ``hours=08:00-18:00`` on ``weekdays=mon-fri``, local time: the tenant's office window;
- ``rate=0.1``: Poisson req/s of each tenant while its window is open, none outside it;
- ``background=400``, ``background_rate=0.05``: a batch tenant's long tail of adapters
  ``bg{i}`` requested uniformly all day (what evicts idle office adapters overnight);
- ``days=7``, ``start=2026-03-23`` (a Monday; Europe's DST starts that Sunday), ``seed=0``,
  ``rank``, ``bytes_per_rank``.

The workload records each tenant's window openings (``Workload.windows``) so the simulator can
report the cold-start rate in the first minutes after each opening.
"""

from __future__ import annotations

import bisect
import datetime as dt
import itertools
import json
import math
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from loraplex.config import parse_byte_size

__all__ = [
    "WORKLOAD_KINDS",
    "Request",
    "Workload",
    "WorkloadSpecError",
    "diurnal_workload",
    "generate_workload",
    "hotburst_workload",
    "parse_size",
    "parse_workload_spec",
    "read_trace",
    "tiered_workload",
    "uniform_workload",
    "write_trace",
    "zipf_workload",
]


class WorkloadSpecError(ValueError):
    """A workload spec or trace is malformed; the message names the problem."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace."""

    time: float
    adapter: str
    tenant: str
    size: int
    rank: int = 0
    priority: int = 0


@dataclass
class Workload:
    """A trace plus what the generator knows about it (the hot set, if it has one)."""

    spec: str
    requests: list[Request]
    hot_adapters: frozenset[str] | None = None
    windows: dict[str, list[tuple[float, float]]] | None = None
    """Per tenant: its office windows as ``(open, close)`` trace times (diurnal only)."""
    epoch_s: float = 0.0
    """The Unix time of trace time 0 (diurnal: ``start`` 00:00 UTC)."""

    @property
    def duration(self) -> float:
        return self.requests[-1].time - self.requests[0].time if self.requests else 0.0

    @property
    def n_adapters(self) -> int:
        return len({r.adapter for r in self.requests})


# ------------------------------------------------------------------------------- trace I/O

_FIELDS = {"time": (int, float), "adapter": str, "tenant": str, "size": int}
_OPTIONAL = {"rank": int, "priority": int}


def write_trace(path: str | Path, requests: Iterable[Request]) -> int:
    """Write ``requests`` as JSON lines; returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")
            n += 1
    return n


def read_trace(path: str | Path) -> list[Request]:
    """Read a JSON-lines trace, sorted by time. Raises WorkloadSpecError naming the bad line."""
    out: list[Request] = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise WorkloadSpecError(f"cannot read trace {path}: {e.strerror or e}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadSpecError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            out.append(_request_from(obj, f"{path}:{lineno}"))
    out.sort(key=lambda r: r.time)
    return out


def _request_from(obj: object, where: str) -> Request:
    if not isinstance(obj, dict):
        raise WorkloadSpecError(f"{where}: expected a JSON object")
    for name, typ in _FIELDS.items():
        v = obj.get(name)
        if v is None:
            raise WorkloadSpecError(f"{where}: missing field {name!r}")
        if isinstance(v, bool) or not isinstance(v, typ):
            raise WorkloadSpecError(f"{where}: field {name!r} has the wrong type ({v!r})")
    for name, typ in _OPTIONAL.items():
        v = obj.get(name, 0)
        if isinstance(v, bool) or not isinstance(v, typ):
            raise WorkloadSpecError(f"{where}: field {name!r} has the wrong type ({v!r})")
    if not math.isfinite(obj["time"]) or obj["size"] < 0 or not obj["adapter"]:
        raise WorkloadSpecError(f"{where}: time must be finite, size >= 0, adapter non-empty")
    return Request(
        time=float(obj["time"]),
        adapter=obj["adapter"],
        tenant=obj["tenant"],
        size=obj["size"],
        rank=obj.get("rank", 0),
        priority=obj.get("priority", 0),
    )


# ------------------------------------------------------------------------------ helpers


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"``, ``"4096"`` -> bytes (:func:`loraplex.config.parse_byte_size`)."""
    try:
        return parse_byte_size(text)
    except ValueError:
        raise WorkloadSpecError(
            f"bad size {text!r} (examples: 4096, 512MiB, 2GiB, 1.5GB)"
        ) from None


def _arrival_times(
    rng: random.Random, n: int, rate: float, arrivals: str, cv: float, start: float = 0.0
) -> list[float]:
    """``n`` arrival times with mean rate ``rate``: Poisson, or gamma gaps with the given cv."""
    if arrivals == "poisson":
        gap: Callable[[], float] = lambda: rng.expovariate(rate)  # noqa: E731
    else:
        shape = 1.0 / (cv * cv)
        gap = lambda: rng.gammavariate(shape, 1.0 / (rate * shape))  # noqa: E731
    t = start
    out = []
    for _ in range(n):
        t += gap()
        out.append(t)
    return out


def _sample(rng: random.Random, cum: Sequence[float], k: int) -> list[int]:
    total = cum[-1]
    return [bisect.bisect_right(cum, rng.random() * total) for _ in range(k)]


@dataclass(frozen=True)
class _Common:
    requests: int = 20000
    rate: float = 50.0
    arrivals: str = "poisson"
    cv: float = 2.0
    seed: int = 0
    tenants: int = 4
    rank: int = 16
    ranks: tuple[int, ...] = ()
    bytes_per_rank: int = 1 << 20
    priority: int = 0
    shift: float = 0.0

    def check(self) -> None:
        if self.requests < 1:
            raise WorkloadSpecError(f"requests must be >= 1, got {self.requests}")
        if self.rate <= 0:
            raise WorkloadSpecError(f"rate must be > 0, got {self.rate}")
        if self.arrivals not in ("poisson", "gamma"):
            raise WorkloadSpecError(f"arrivals must be poisson or gamma, got {self.arrivals!r}")
        if self.shift < 0:
            raise WorkloadSpecError(f"shift must be >= 0 seconds, got {self.shift}")
        if self.cv <= 0:
            raise WorkloadSpecError(f"cv must be > 0, got {self.cv}")
        if self.tenants < 1 or min(self.rank, *self.ranks, self.bytes_per_rank) < 0:
            raise WorkloadSpecError("tenants must be >= 1, ranks and bytes_per_rank >= 0")

    def rank_of(self, i: int) -> int:
        return self.ranks[i % len(self.ranks)] if self.ranks else self.rank


def _popularity_trace(
    name: str, prefix: str, weights: Sequence[float], c: _Common, hot: frozenset[str] | None
) -> Workload:
    c.check()
    rng = random.Random(c.seed)
    cum = list(itertools.accumulate(weights))
    idx = _sample(rng, cum, c.requests)
    times = _arrival_times(rng, c.requests, c.rate, c.arrivals, c.cv)
    width = len(str(len(weights) - 1))
    perm = list(range(len(weights)))  # popularity rank -> adapter
    epoch = 0
    reqs = []
    for t, r in zip(times, idx, strict=True):
        if c.shift > 0 and t // c.shift > epoch:  # popularity moves to other adapters
            epoch = int(t // c.shift)
            perm = random.Random(c.seed * 1_000_003 + epoch).sample(
                range(len(weights)), len(weights)
            )
        i = perm[r]
        reqs.append(
            Request(
                time=t,
                adapter=f"{prefix}{i:0{width}d}",
                tenant=f"t{i % c.tenants}",
                size=c.rank_of(i) * c.bytes_per_rank,
                rank=c.rank_of(i),
                priority=c.priority,
            )
        )
    return Workload(spec=name, requests=reqs, hot_adapters=hot if c.shift <= 0 else None)


# ----------------------------------------------------------------------------- generators


def zipf_workload(*, s: float = 1.0, n: int = 256, spec: str = "", **common: object) -> Workload:
    """Zipf(s) popularity over ``n`` adapters ``z000..``: P(rank i) ∝ 1 / i**s."""
    if n < 1 or s < 0:
        raise WorkloadSpecError(f"zipf needs n >= 1 and s >= 0, got n={n}, s={s}")
    c = _Common(**common)  # type: ignore[arg-type]
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    return _popularity_trace(spec or f"zipf:s={s},n={n}", "z", weights, c, None)


def uniform_workload(*, n: int = 64, spec: str = "", **common: object) -> Workload:
    """Every one of ``n`` adapters ``u00..`` equally popular."""
    if n < 1:
        raise WorkloadSpecError(f"uniform needs n >= 1, got {n}")
    c = _Common(**common)  # type: ignore[arg-type]
    return _popularity_trace(spec or f"uniform:n={n}", "u", [1.0] * n, c, None)


def tiered_workload(
    *,
    groups: Sequence[tuple[int, float]] = ((5, 12.0), (5, 6.0), (5, 2.0)),
    n: int = 256,
    spec: str = "",
    **common: object,
) -> Workload:
    """``groups`` of (count, percent of traffic each); the rest uniform over the tail adapters.

    The hot set reported is the first group.
    """
    n_grouped = sum(cnt for cnt, _ in groups)
    share = sum(cnt * pct for cnt, pct in groups)
    if any(cnt < 1 or pct < 0 for cnt, pct in groups) or not groups:
        raise WorkloadSpecError("tiered groups look like 5x12% (count >= 1, percent >= 0)")
    if share > 100.0 + 1e-9:
        raise WorkloadSpecError(f"tiered groups take {share:g}% of traffic, more than 100%")
    tail = n - n_grouped
    if tail < 0:
        raise WorkloadSpecError(f"tiered groups name {n_grouped} adapters but n={n}")
    rest = 100.0 - share
    if rest > 1e-9 and tail == 0:
        raise WorkloadSpecError(f"tiered groups take {share:g}% but there is no tail (n={n})")
    weights = [pct for cnt, pct in groups for _ in range(cnt)]
    weights += [rest / tail] * tail if tail else []
    c = _Common(**common)  # type: ignore[arg-type]
    width = len(str(n - 1))
    hot = frozenset(f"g{i:0{width}d}" for i in range(groups[0][0]))
    return _popularity_trace(spec or "tiered", "g", weights, c, hot)


def hotburst_workload(
    *,
    hot_tenants: int = 3,
    hot_per_tenant: int = 2,
    hot_rate: float = 20.0,
    cold: int = 2000,
    burst_rate: float = 200.0,
    period: float = 20.0,
    duty: float = 0.5,
    sweep_repeat: int = 1,
    hot_priority: int = 0,
    cold_priority: int = 0,
    requests: int = 20000,
    seed: int = 0,
    rank: int = 16,
    bytes_per_rank: int = 1 << 20,
    spec: str = "",
) -> Workload:
    """Steady traffic on a few tenants' adapters + a batch tenant sweeping cold ones in bursts."""
    if hot_tenants < 1 or hot_per_tenant < 1 or cold < 1 or sweep_repeat < 1 or requests < 1:
        raise WorkloadSpecError(
            "hotburst needs hot_tenants, hot_per_tenant, cold, sweep_repeat, requests >= 1"
        )
    if hot_rate <= 0 or burst_rate <= 0 or period <= 0 or not 0 < duty <= 1:
        raise WorkloadSpecError("hotburst needs hot_rate, burst_rate, period > 0 and 0 < duty <= 1")
    rng = random.Random(seed)
    size = rank * bytes_per_rank
    hot = [(f"hot{t}-{j}", f"hot{t}") for t in range(hot_tenants) for j in range(hot_per_tenant)]
    on = period * duty

    def hot_stream() -> Iterator[Request]:
        t = 0.0
        while True:
            t += rng.expovariate(hot_rate)
            name, tenant = hot[rng.randrange(len(hot))]
            yield Request(t, name, tenant, size, rank, hot_priority)

    def cold_stream() -> Iterator[Request]:
        t = 0.0
        i = 0
        width = len(str(cold - 1))
        while True:
            t += rng.expovariate(burst_rate)
            while t % period >= on:  # off: continue from the start of the next burst
                t = (t // period + 1) * period + rng.expovariate(burst_rate)
            name = f"cold{(i // sweep_repeat) % cold:0{width}d}"
            i += 1
            yield Request(t, name, "batch", size, rank, cold_priority)

    # two independent streams merged by time (each stream draws from its own generator state
    # in order, so the trace depends only on the seed)
    hs, cs = hot_stream(), cold_stream()
    h, c = next(hs), next(cs)
    reqs: list[Request] = []
    while len(reqs) < requests:
        if h.time <= c.time:
            reqs.append(h)
            h = next(hs)
        else:
            reqs.append(c)
            c = next(cs)
    return Workload(
        spec=spec or "hotburst", requests=reqs, hot_adapters=frozenset(n for n, _ in hot)
    )


_WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_HHMM = re.compile(r"([01]\d|2[0-3]):([0-5]\d)")


def _hours(text: str) -> tuple[dt.time, dt.time]:
    start, sep, end = text.partition("-")
    a, b = _HHMM.fullmatch(start.strip()), _HHMM.fullmatch(end.strip())
    if not sep or a is None or b is None:
        raise WorkloadSpecError(f"diurnal hours look like 08:00-18:00, got {text!r}")
    t0, t1 = dt.time(int(a[1]), int(a[2])), dt.time(int(b[1]), int(b[2]))
    if t1 <= t0:
        raise WorkloadSpecError(f"diurnal hours must end after they start, got {text!r}")
    return t0, t1


def _weekdays(text: str) -> frozenset[int]:
    first, sep, last = text.lower().partition("-")
    try:
        if not sep:
            return frozenset({_WEEKDAYS.index(first.strip())})
        i, j = _WEEKDAYS.index(first.strip()), _WEEKDAYS.index(last.strip())
    except ValueError:
        raise WorkloadSpecError(f"diurnal weekdays look like mon-fri, got {text!r}") from None
    return frozenset((i + k) % 7 for k in range((j - i) % 7 + 1))


def diurnal_workload(
    *,
    tz: str = "Europe/Berlin+America/New_York+Asia/Tokyo",
    adapters: int = 6,
    s: float = 1.0,
    hours: str = "08:00-18:00",
    weekdays: str = "mon-fri",
    rate: float = 0.1,
    background: int = 400,
    background_rate: float = 0.05,
    days: int = 7,
    start: str = "2026-03-23",
    seed: int = 0,
    rank: int = 16,
    bytes_per_rank: int = 1 << 20,
    spec: str = "",
) -> Workload:
    """Office-hours tenants in several time zones plus an all-day long tail; see the module
    docstring."""
    zones = [z.strip() for z in tz.split("+") if z.strip()]
    if not zones or len(zones) > 64:
        raise WorkloadSpecError("diurnal tz names 1 to 64 zones joined by '+'")
    try:
        infos = [ZoneInfo(z) for z in zones]
    except (ZoneInfoNotFoundError, ValueError) as e:
        raise WorkloadSpecError(f"diurnal tz: unknown time zone in {tz!r} ({e})") from None
    if adapters < 1 or background < 0 or not 1 <= days <= 366 or s < 0:
        raise WorkloadSpecError("diurnal needs adapters >= 1, background >= 0, 1 <= days <= 366")
    if rate <= 0 or background_rate < 0 or (background and background_rate <= 0):
        raise WorkloadSpecError("diurnal needs rate > 0 and background_rate > 0 with background")
    try:
        day0 = dt.date.fromisoformat(start)
    except ValueError:
        raise WorkloadSpecError(f"diurnal start is a date like 2026-03-23, got {start!r}") from None
    t_open, t_close = _hours(hours)
    days_on = _weekdays(weekdays)
    epoch = dt.datetime.combine(day0, dt.time(), dt.UTC)
    end = days * 86400.0
    rng = random.Random(seed)
    size = rank * bytes_per_rank
    cum = list(itertools.accumulate(1.0 / (j + 1) ** s for j in range(adapters)))
    reqs: list[Request] = []
    windows: dict[str, list[tuple[float, float]]] = {}
    for i, zone in enumerate(infos):
        tenant = f"office{i}"
        wins = windows.setdefault(tenant, [])
        for d in range(-1, days + 1):  # local dates around the trace (zones ahead of UTC)
            day = day0 + dt.timedelta(days=d)
            if day.weekday() not in days_on:
                continue
            lo = (dt.datetime.combine(day, t_open, zone) - epoch).total_seconds()
            hi = (dt.datetime.combine(day, t_close, zone) - epoch).total_seconds()
            if min(hi, end) <= max(lo, 0.0):
                continue
            wins.append((lo, hi))  # as scheduled (it may start before the trace)
            t, hi = max(lo, 0.0), min(hi, end)
            while True:
                t += rng.expovariate(rate)
                if t >= hi:
                    break
                j = bisect.bisect_right(cum, rng.random() * cum[-1])
                reqs.append(Request(t, f"office{i}-{j}", tenant, size, rank, 0))
    t = 0.0
    width = len(str(max(background - 1, 0)))
    while background:
        t += rng.expovariate(background_rate)
        if t >= end:
            break
        reqs.append(Request(t, f"bg{rng.randrange(background):0{width}d}", "batch", size, rank))
    reqs.sort(key=lambda r: r.time)
    if not reqs:
        raise WorkloadSpecError("diurnal generated no requests (no window in the simulated days)")
    hot = frozenset(r.adapter for r in reqs if r.tenant != "batch")  # the office adapters
    return Workload(
        spec=spec or "diurnal",
        requests=reqs,
        hot_adapters=hot,
        windows=windows,
        epoch_s=epoch.timestamp(),
    )


# --------------------------------------------------------------------------------- specs

WORKLOAD_KINDS: dict[str, Callable[..., Workload]] = {
    "zipf": zipf_workload,
    "uniform": uniform_workload,
    "tiered": tiered_workload,
    "hotburst": hotburst_workload,
    "diurnal": diurnal_workload,
}

_INT_KEYS = {
    "n", "requests", "seed", "tenants", "rank", "priority", "hot_tenants", "hot_per_tenant",
    "cold", "sweep_repeat", "hot_priority", "cold_priority", "adapters", "background", "days",
}  # fmt: skip
_FLOAT_KEYS = {
    "s", "rate", "cv", "hot_rate", "burst_rate", "period", "duty", "shift", "background_rate",
}  # fmt: skip
_SIZE_KEYS = {"bytes_per_rank"}
_STR_KEYS = {"arrivals", "hours", "weekdays", "start"}
_CASE_KEYS = {"tz"}  # strings kept as written (zone names are case-sensitive)
_INT_LIST_KEYS = {"ranks"}
_GROUP = re.compile(r"(\d+)x([0-9]*\.?[0-9]+)%")
_ALLOWED: dict[str, set[str]] = {
    "zipf": {"s", "n", *_Common.__dataclass_fields__},
    "uniform": {"n", *_Common.__dataclass_fields__},
    "tiered": {"groups", "n", *_Common.__dataclass_fields__},
    "hotburst": {
        "hot_tenants", "hot_per_tenant", "hot_rate", "cold", "burst_rate", "period", "duty",
        "sweep_repeat", "hot_priority", "cold_priority", "requests", "seed", "rank",
        "bytes_per_rank",
    },
    "diurnal": {
        "tz", "adapters", "s", "hours", "weekdays", "rate", "background", "background_rate",
        "days", "start", "seed", "rank", "bytes_per_rank",
    },
}  # fmt: skip


def parse_workload_spec(spec: str) -> tuple[str, dict[str, object]]:
    """``"zipf:s=1,n=256"`` -> ``("zipf", {"s": 1.0, "n": 256})``; WorkloadSpecError if bad."""
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in WORKLOAD_KINDS:
        raise WorkloadSpecError(
            f"unknown workload kind {kind!r} in {spec!r}; valid: {', '.join(WORKLOAD_KINDS)}"
        )
    params: dict[str, object] = {}
    groups: list[tuple[int, float]] = []
    for token in filter(None, (t.strip() for t in rest.split(","))):
        key, eq, value = token.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq:  # a bare tiered group: 5x6%
            key, value = "groups", token
        if key == "groups" and kind == "tiered":
            m = _GROUP.fullmatch(value)
            if not m:
                raise WorkloadSpecError(f"bad tiered group {value!r} (expected e.g. 5x12%)")
            groups.append((int(m.group(1)), float(m.group(2))))
            continue
        if key not in _ALLOWED[kind]:
            valid = ", ".join(sorted(_ALLOWED[kind]))
            raise WorkloadSpecError(f"unknown key {key!r} for workload {kind!r}; valid: {valid}")
        try:
            if key in _INT_KEYS:
                params[key] = int(value)
            elif key in _FLOAT_KEYS:
                params[key] = float(value)
                if not math.isfinite(params[key]):  # type: ignore[arg-type]
                    raise ValueError
            elif key in _SIZE_KEYS:
                params[key] = parse_size(value)
            elif key in _STR_KEYS:
                params[key] = value.lower()
            elif key in _CASE_KEYS:
                params[key] = value
            elif key in _INT_LIST_KEYS:
                params[key] = tuple(int(v) for v in value.split("/"))
            else:  # pragma: no cover - every allowed key has a type above
                raise ValueError
        except (ValueError, WorkloadSpecError):
            raise WorkloadSpecError(f"bad value {value!r} for {key!r} in {spec!r}") from None
    if groups:
        params["groups"] = tuple(groups)
    return kind, params


def generate_workload(spec: str) -> Workload:
    """Parse ``spec`` and generate its (deterministic, seeded) trace."""
    kind, params = parse_workload_spec(spec)
    return WORKLOAD_KINDS[kind](spec=spec, **params)
