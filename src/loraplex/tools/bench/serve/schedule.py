"""The schedule: what to send and when. Workload adapter ids mapped onto served model names,
prompts of seeded random tokens or words, forced output lengths, and send times (Poisson or gamma
arrivals at a rate, or a trace's own times)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.tools.sim.workloads import Request as TraceRequest

_WORDS = (
    "the of and to in is that it was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how "
    "their if will up other about out many then them these so some her would make like him into "
    "time has look two more write go see number no way could people my than first water been call"
).split()


class BenchError(ValueError):
    """Bad benchmark input (spec, lengths, names, server answers); the message says which."""


# -- schedule --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthDist:
    """A token-count distribution: ``64`` (fixed) or ``64:256`` (uniform, inclusive)."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        a, sep, b = str(text).partition(":")
        try:
            lo = int(a)
            hi = int(b) if sep else lo
        except ValueError:
            raise BenchError(
                f"bad length {text!r} (expected N or LO:HI, e.g. 64 or 32:256)"
            ) from None
        if lo < 1 or hi < lo:
            raise BenchError(f"bad length {text!r}: need 1 <= LO <= HI")
        return cls(lo, hi)

    def sample(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: the model name, its prompt, forced output length, and its send time
    (seconds after the start; ignored in closed loop). ``workload_adapter`` is the id the
    workload gave it (before mapping onto served names)."""

    model: str
    prompt: str | list[int]
    max_tokens: int
    time: float = 0.0
    workload_adapter: str = ""

    @property
    def prompt_tokens(self) -> int | None:
        return len(self.prompt) if isinstance(self.prompt, list) else None


def map_adapters(trace: Sequence[TraceRequest], names: Sequence[str]) -> dict[str, str]:
    """Workload adapter id -> served model name: the i-th most requested id (ties by id) onto
    ``names[i]``; with more ids than names they wrap around (``names[i % len(names)]``)."""
    if not names:
        raise BenchError("no model names to send requests to")
    counts = Counter(r.adapter for r in trace)
    order = sorted(counts, key=lambda a: (-counts[a], a))
    return {a: names[i % len(names)] for i, a in enumerate(order)}


def _prompt(rng: random.Random, n: int, kind: str, token_range: tuple[int, int]) -> str | list[int]:
    if kind == "tokens":
        return [rng.randrange(*token_range) for _ in range(n)]
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _gaps(rng: random.Random, n: int, rate: float, arrivals: str, cv: float) -> list[float]:
    """``n`` arrival times at mean ``rate``: Poisson, or gamma gaps with coefficient ``cv``."""
    t, out = 0.0, []
    shape = 1.0 / (cv * cv)
    for _ in range(n):
        if arrivals == "poisson":
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
        out.append(t)
    return out


def build_requests(
    trace: Sequence[TraceRequest],
    names: Sequence[str],
    *,
    prompt_len: LengthDist = LengthDist(64, 64),
    output_len: LengthDist = LengthDist(32, 32),
    rate: float | None = None,
    arrivals: str = "poisson",
    cv: float = 2.0,
    seed: int = 0,
    prompt_kind: str = "tokens",
    token_range: tuple[int, int] = (100, 300),
) -> list[BenchRequest]:
    """The schedule: one BenchRequest per trace entry, adapters mapped with ``map_adapters``.

    Send times: ``arrivals`` ``poisson``/``gamma`` draw fresh gaps at ``rate`` (req/s);
    ``trace`` keeps the trace's own times (shifted to start at 0), rescaled to ``rate`` if given.
    Prompts are ``prompt_kind`` ``tokens`` (random ids in ``token_range``: exact lengths, any
    tokenizer) or ``text`` (random common words, about one token each; for chat).
    """
    if arrivals not in ("poisson", "gamma", "trace"):
        raise BenchError(f"arrivals must be poisson, gamma or trace, got {arrivals!r}")
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise BenchError(f"rate must be a finite number > 0, got {rate}")
    if arrivals != "trace" and rate is None:
        raise BenchError(f"{arrivals} arrivals need a rate")
    if cv <= 0:
        raise BenchError(f"cv must be > 0, got {cv}")
    if prompt_kind not in ("tokens", "text"):
        raise BenchError(f"prompt kind must be tokens or text, got {prompt_kind!r}")
    if not 0 <= token_range[0] < token_range[1]:
        raise BenchError(f"bad token id range {token_range} (need 0 <= LO < HI)")
    mapping = map_adapters(trace, names)
    rng = random.Random(seed)
    n = len(trace)
    if arrivals == "trace":
        t0 = trace[0].time if trace else 0.0
        times = [r.time - t0 for r in trace]
        span = times[-1] if times else 0.0
        if rate is not None and span > 0:
            scale = (n - 1) / rate / span if n > 1 else 1.0
            times = [t * scale for t in times]
    else:
        times = _gaps(random.Random(seed + 1), n, rate or 1.0, arrivals, cv)
    return [
        BenchRequest(
            model=mapping[r.adapter],
            prompt=_prompt(rng, prompt_len.sample(rng), prompt_kind, token_range),
            max_tokens=output_len.sample(rng),
            time=t,
            workload_adapter=r.adapter,
        )
        for r, t in zip(trace, times, strict=True)
    ]
