"""Token timestamps of the requests in flight, for ``bench_spec_decode.py`` and
``bench_spec_vllm.py`` (no loraplex or vLLM import: each runs in its own venv).

Both engines' ``step()`` return vLLM-shaped ``RequestOutput`` s (``request_id``,
``outputs[0].token_ids`` cumulative, ``finished``); every token that appears in a step gets that
step's end time, and a finished request's TPOT is ``(last - first) / (tokens - 1)``.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any


class InFlight:
    """Keeps ``conc`` of ``n`` requests in flight and timestamps their tokens."""

    def __init__(self, n: int, conc: int) -> None:
        self.pending = deque(range(n))
        self.conc = conc
        self.running: dict[str, tuple[int, list[float]]] = {}
        self.tpots: list[float] = []
        self.spans: list[tuple[float, int]] = []  # (last - first token time, tokens - 1)
        self.outputs: dict[int, list[int]] = {}
        self.tpot_of: dict[int, float] = {}  # item index -> its TPOT (seconds)
        self.out_tokens = 0

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.running)

    def fill(self, add: Callable[[int], str]) -> None:
        """Start requests (``add(i)`` submits item ``i`` and returns its id) up to ``conc``."""
        while self.pending and len(self.running) < self.conc:
            i = self.pending.popleft()
            self.running[add(i)] = (i, [])

    def observe(self, outs: Iterable[Any], now: float) -> None:
        """One step's outputs, all ending at ``now``."""
        for out in outs:
            if out.request_id not in self.running:
                continue
            i, stamps = self.running[out.request_id]
            toks = out.outputs[0].token_ids
            stamps.extend([now] * (len(toks) - len(stamps)))
            if out.finished:
                del self.running[out.request_id]
                self.outputs[i] = list(toks)
                self.out_tokens += len(toks)
                if len(stamps) > 1:
                    self.tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
                    self.tpot_of[i] = self.tpots[-1]
                    self.spans.append((stamps[-1] - stamps[0], len(stamps) - 1))

    def tpot_ms(self) -> tuple[float, float, float]:
        """TPOT in milliseconds: the mean and median over requests, and the token-weighted
        mean (all requests' decode time over all their tokens after the first, vLLM's ITL
        mean), NaN without a request of 2+ tokens."""
        if not self.tpots:
            return float("nan"), float("nan"), float("nan")
        weighted = sum(t for t, _ in self.spans) / sum(n for _, n in self.spans)
        return (
            1000 * statistics.fmean(self.tpots),
            1000 * statistics.median(self.tpots),
            1000 * weighted,
        )
