"""Canary health, judged by each replica on its own calls: per canary revision, a sliding window
of call outcomes (failed or not, time to first token, time per output token, an optional quality
score), checked after every call against the bounds of the release's
:class:`~loraplex.registry.CanaryPolicy`. A breach rolls the canary back through the registry's
idempotent :meth:`~loraplex.registry.Registry.rollback_canary` (actor
:data:`HEALTH_ACTOR`, the breach as the reason), so replicas that judge the same canary at once
stop it exactly once and never touch the active revision.

Quality comes from a scorer named by the policy (a hook: ``scorers`` maps names to functions of
the completion text; :func:`json_validity` is built in) and from user feedback
(:meth:`CanaryMonitor.feedback`). Windows follow an injectable clock.

Event-loop thread: :meth:`CanaryMonitor.observe`, :meth:`~CanaryMonitor.feedback`; the rollback
itself runs in the server's I/O pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from loraplex.registry import CanaryPolicy, Registry, Release

log = logging.getLogger("loraplex.server.app")

HEALTH_ACTOR = "system:canary-health"
"""The audit actor of automatic canary rollbacks."""

BREACHES = ("error_rate", "ttft", "tpot", "quality")
"""What a canary can breach (the ``reason`` label of ``loraplex_canary_rollbacks_total``)."""

MAX_OUTCOMES = 10_000
"""Most call outcomes (and feedback scores) kept per canary revision: older ones drop out of
the window first, so a flood cannot grow memory."""

MAX_WINDOWS = 1_000
"""Most canary revisions with a window on one replica (the oldest window is dropped)."""

Scorer = Callable[[str], float | None]
"""A quality hook: a completion's text -> a score in [0, 1] (None: no opinion)."""


def json_validity(text: str) -> float:
    """1.0 when ``text`` (stripped) parses as JSON, else 0.0."""
    try:
        json.loads(text)
    except ValueError:
        return 0.0
    return 1.0


BUILTIN_SCORERS: dict[str, Scorer] = {"json": json_validity}


@dataclass(frozen=True)
class CallOutcome:
    """One finished call served by a canary revision: ``failed`` on the server's side (not the
    client's), its worst TTFT / mean TPOT over its completions (None: no token), its score."""

    failed: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    score: float | None = None


@dataclass(frozen=True)
class HealthStats:
    """A canary revision's window on this replica: calls, failures, latency p95s, quality."""

    requests: int
    errors: int
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    scored: int
    quality: float | None  # mean score of the scored calls and feedback

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 4),
            "ttft_p95_s": self.ttft_p95_s,
            "tpot_p95_s": self.tpot_p95_s,
            "scored": self.scored,
            "quality": self.quality,
        }


def p95(values: list[float]) -> float | None:
    """The 95th percentile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class RevisionWindow:
    """The timed outcomes and scores of one canary revision (bounded by :data:`MAX_OUTCOMES`)."""

    def __init__(self) -> None:
        self.outcomes: deque[tuple[float, CallOutcome]] = deque(maxlen=MAX_OUTCOMES)
        self.scores: deque[tuple[float, float]] = deque(maxlen=MAX_OUTCOMES)

    def prune(self, now: float, window_s: float) -> None:
        """Drop what has left the window (event-loop thread: the only writer)."""
        start = now - window_s
        while self.outcomes and self.outcomes[0][0] < start:
            self.outcomes.popleft()
        while self.scores and self.scores[0][0] < start:
            self.scores.popleft()

    def stats(self, now: float, window_s: float) -> HealthStats:
        """The window ending ``now``; reads copies, so any thread may ask."""
        start = now - window_s
        calls = [o for t, o in list(self.outcomes) if t >= start]
        scores = [s for t, s in list(self.scores) if t >= start]
        return HealthStats(
            requests=len(calls),
            errors=sum(o.failed for o in calls),
            ttft_p95_s=p95([o.ttft_s for o in calls if o.ttft_s is not None]),
            tpot_p95_s=p95([o.tpot_s for o in calls if o.tpot_s is not None]),
            scored=len(scores),
            quality=sum(scores) / len(scores) if scores else None,
        )


def breach(policy: CanaryPolicy, stats: HealthStats) -> tuple[str, str] | None:
    """(kind, reason) of the first bound of ``policy`` that ``stats`` breaches, or None.
    Latency and error bounds need ``min_requests`` calls in the window, quality as many
    scores."""
    window = f"over {stats.requests} calls in the last {policy.window_s:g}s"
    if stats.requests >= policy.min_requests:
        if policy.max_error_rate is not None and stats.error_rate > policy.max_error_rate:
            return "error_rate", (
                f"error rate {stats.error_rate:.3f} > {policy.max_error_rate:g} {window}"
            )
        t = stats.ttft_p95_s
        if policy.max_ttft_p95_s is not None and t is not None and t > policy.max_ttft_p95_s:
            return "ttft", f"TTFT p95 {t:.3f}s > {policy.max_ttft_p95_s:g}s {window}"
        t = stats.tpot_p95_s
        if policy.max_tpot_p95_s is not None and t is not None and t > policy.max_tpot_p95_s:
            return "tpot", f"TPOT p95 {t:.4f}s > {policy.max_tpot_p95_s:g}s {window}"
    q = stats.quality
    if (
        policy.min_quality is not None
        and q is not None
        and stats.scored >= policy.min_requests
        and q < policy.min_quality
    ):
        return "quality", (
            f"quality {q:.3f} < {policy.min_quality:g} over {stats.scored} scores in the last "
            f"{policy.window_s:g}s"
        )
    return None


class CanaryMonitor:
    """Per-replica canary health: windows per (name, revision), the breach check after each call,
    and the automatic rollback.

    ``run_io(fn, *args)`` runs ``fn`` off the event loop (the server's I/O pool);
    ``on_rollback(name, revision, kind, release)`` runs (in the I/O pool) after the registry
    was asked, with the release it wrote, or None when another replica (or an operator) had
    already stopped the canary. ``scorers`` extends :data:`BUILTIN_SCORERS`.
    """

    def __init__(
        self,
        registry: Registry,
        run_io: Callable[..., Awaitable[object]],
        *,
        on_rollback: Callable[[str, str, str, Release | None], None] | None = None,
        scorers: dict[str, Scorer] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.scorers: dict[str, Scorer] = {**BUILTIN_SCORERS, **(scorers or {})}
        self._run_io = run_io
        self._on_rollback = on_rollback
        self._clock = clock
        self._windows: dict[tuple[str, str], RevisionWindow] = {}
        self._stopping: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._warned: set[str] = set()

    def score(self, policy: CanaryPolicy, texts: list[str]) -> float | None:
        """The policy's scorer over a call's completion texts (their mean), None without one."""
        if policy.scorer is None or not texts:
            return None
        scorer = self.scorers.get(policy.scorer)
        if scorer is None:
            if policy.scorer not in self._warned:
                self._warned.add(policy.scorer)
                log.warning("canary scorer %r is not installed here; calls are not scored",
                            policy.scorer)  # fmt: skip
            return None
        scores = [s for s in map(scorer, texts) if s is not None]
        return sum(scores) / len(scores) if scores else None

    def observe(self, name: str, revision: str, policy: CanaryPolicy, outcome: CallOutcome) -> None:
        """Record one finished call of the canary ``name@revision``; roll it back on a breach."""
        w = self._window(name, revision)
        now = self._clock()
        w.outcomes.append((now, outcome))
        if outcome.score is not None:
            w.scores.append((now, min(1.0, max(0.0, outcome.score))))
        self._check(name, revision, policy, w, now)

    def feedback(self, name: str, revision: str, policy: CanaryPolicy, score: float) -> None:
        """A user's score in [0, 1] of a response by the canary ``name@revision``."""
        w = self._window(name, revision)
        now = self._clock()
        w.scores.append((now, min(1.0, max(0.0, score))))
        self._check(name, revision, policy, w, now)

    def stats(self, name: str, revision: str, policy: CanaryPolicy) -> HealthStats:
        """The canary's current window here (empty if it has served nothing here); any
        thread."""
        w = self._windows.get((name, revision))
        if w is None:
            return HealthStats(0, 0, None, None, 0, None)
        return w.stats(self._clock(), policy.window_s)

    async def settled(self) -> None:
        """Wait for the rollbacks in progress (tests, shutdown)."""
        while self._stopping:
            await asyncio.gather(*self._stopping.values(), return_exceptions=True)

    def _window(self, name: str, revision: str) -> RevisionWindow:
        key = (name, revision)
        w = self._windows.get(key)
        if w is None:
            if len(self._windows) >= MAX_WINDOWS:  # the oldest canary's window goes first
                del self._windows[next(iter(self._windows))]
            w = self._windows[key] = RevisionWindow()
        return w

    def _check(
        self, name: str, revision: str, policy: CanaryPolicy, w: RevisionWindow, now: float
    ) -> None:
        key = (name, revision)
        w.prune(now, policy.window_s)
        if key in self._stopping:
            return
        found = breach(policy, w.stats(now, policy.window_s))
        if found is None:
            return
        kind, reason = found
        log.warning("canary %s@%s is unhealthy (%s): rolling it back", name, revision, reason)
        task = asyncio.get_running_loop().create_task(self._stop(name, revision, kind, reason))
        self._stopping[key] = task

    async def _stop(self, name: str, revision: str, kind: str, reason: str) -> None:
        try:
            await self._run_io(self._rollback, name, revision, kind, reason)
        except Exception:  # the registry is unreachable: the next breached call tries again
            log.exception("automatic rollback of canary %s@%s failed", name, revision)
        else:  # a fresh start if this revision is made a canary again
            self._windows.pop((name, revision), None)
        finally:
            self._stopping.pop((name, revision), None)

    def _rollback(self, name: str, revision: str, kind: str, reason: str) -> None:
        rel = self.registry.rollback_canary(name, revision, actor=HEALTH_ACTOR, reason=reason)
        if rel is None:
            log.info("canary %s@%s was already stopped", name, revision)
        if self._on_rollback is not None:
            self._on_rollback(name, revision, kind, rel)
