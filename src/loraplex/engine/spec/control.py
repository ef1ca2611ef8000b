"""How many tokens to draft, per sequence and step (adaptive k).

A step's time grows with the tokens it runs: ``T(N) ~ a + b N`` (plus ``c`` per sequential
draft-model position). At low concurrency ``a`` (reading the weights) dominates and verifying
extra positions is nearly free; at high concurrency a step is compute bound and every drafted
token costs about what a decoded one does. A draft of ``k`` tokens whose position ``j`` is kept
with probability ``alpha_j`` once the ones before it were yields, in expectation,
``1 + alpha_1 + alpha_1 alpha_2 + ... + alpha_1 ... alpha_k`` tokens for the sequence this step.

The controller fits ``a`` and ``b`` to the measured steps (least squares with exponential
forgetting) and keeps ``alpha_j`` per key and position (a position's estimate starts at the
key's pooled rate): a key is an adapter, split by the sequence's last draft (the
speculator keys a sequence whose last draft was kept whole apart, since acceptance comes in
runs: a copy goes on, a miss is followed by misses). Its objective is what each request sees,
TPOT: the mean over the decoding sequences of the step's time per token it yields,
``T(N) * S`` with ``S = sum_i 1 / (1 + E_i)`` and ``E_i`` the sequence's expected accepted
tokens. Each step it adds draft positions greedily, the one that lowers ``S`` most first, and
keeps the prefix of that order where ``T * S`` is lowest:

    gain(i, j) = alpha_i,1 * ... * alpha_i,j,  delta = 1 / (1 + E_i) - 1 / (1 + E_i + gain)
    each position: T += b + c [j beyond every k so far],  S -= delta

(a proposer that finds no draft for a sequence, an n-gram without a match, runs nothing for
it: with ``f_i`` the share of asks found for its key, a position adds ``f_i b`` and ``f_i gain``
in expectation.)
The whole order is walked, not cut at the first position that does not pay: with many
sequences one draft alone slows every other sequence's step for one sequence's gain, while a
token for every sequence can pay (each extra position costs ``b * S``, and ``S`` falls as the
drafts add up). At one sequence the objective is tokens per second; with many, a draft that
speeds its own sequence up but slows the others' steps more than that is not made (throughput
alone would make it, and the sequences without drafts would see a slower TPOT). So k falls to
0 where drafting does not pay, and reaches ``num_speculative_tokens`` where it does. With
``adaptive: false`` every sequence drafts ``num_speculative_tokens`` (vLLM's fixed k).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence as Seq

ALPHA_PRIOR = 0.5  # acceptance assumed for an adapter before its first verified draft
ALPHA_PRIOR_WEIGHT = 4.0  # ... worth this many accept/reject events
ALPHA_DECAY = 0.98  # each new event's weight relative to the past (about 50 events remembered)
MAX_TRACKED = 4096  # adapters whose acceptance is kept (least recently drafted dropped)
COST_DECAY = 0.97  # per measured step
PRIOR_TOKEN_SHARE = 1 / 64  # b / a assumed before the steps tell (a 64-token knee)
MIN_FIT_STEPS = 8  # (weighted) steps measured before b is fitted rather than assumed
WARMUP_STEPS = 4  # first steps not measured
OUTLIER_FACTOR = 3.0  # a measured step counts as at most this many times its prediction
PROBE_EVERY = 32  # steps: a key drafting nothing gets one token this often (to re-measure)
DEPTHS = 8  # draft positions tracked apart (position 8 on shares one estimate)
DEPTH_PRIOR_WEIGHT = 2.0  # a position's estimate starts at the pooled rate, worth this many events
FOUND_PRIOR_WEIGHT = 2.0  # a key's drafts are assumed found until this many asks say otherwise


class Acceptance:
    """Running acceptance of one key's drafts: accept events / all events, exponentially
    forgetting, starting from :data:`ALPHA_PRIOR`; pooled over positions (:attr:`alpha`) and
    per position (:meth:`alpha_at`: the chance that position ``j`` is kept once the ones
    before it were, which is not the pooled rate: a draft that holds for two tokens is usually
    a copy that goes on)."""

    __slots__ = ("_at", "_found", "accepted", "events", "last_drafted")

    def __init__(self) -> None:
        self.accepted = ALPHA_PRIOR * ALPHA_PRIOR_WEIGHT
        self.events = ALPHA_PRIOR_WEIGHT
        self.last_drafted = 0
        self._at = [0.0] * (2 * DEPTHS)  # per depth bucket: accepted, events (no prior)
        self._found = [FOUND_PRIOR_WEIGHT, FOUND_PRIOR_WEIGHT]  # drafts found, drafts asked

    @property
    def found(self) -> float:
        """The share of asked-for drafts the proposer found (a lookup finds no match, a
        tree no continuation): a planned position costs and yields only that often."""
        return self._found[0] / self._found[1]

    def observe_found(self, found: bool) -> None:
        f = self._found
        f[0] = f[0] * ALPHA_DECAY + found
        f[1] = f[1] * ALPHA_DECAY + 1.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.events

    def alpha_at(self, j: int) -> float:
        """P(position ``j`` (1-based) kept | positions before it kept): the events at its
        depth (positions from :data:`DEPTHS` on share one), shrunk toward :attr:`alpha` by
        :data:`DEPTH_PRIOR_WEIGHT` events."""
        d = 2 * (min(j, DEPTHS) - 1)
        acc, ev = self._at[d], self._at[d + 1]
        return (acc + DEPTH_PRIOR_WEIGHT * self.alpha) / (ev + DEPTH_PRIOR_WEIGHT)

    def observe(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens of which the first ``accepted`` were kept: that many
        accept events (at positions 1..accepted), and one reject event (at the next position)
        unless all were kept; positions after a reject were never judged."""
        events = accepted + (accepted < drafted)
        w = ALPHA_DECAY**events
        self.accepted = self.accepted * w + accepted
        self.events = self.events * w + events
        at = self._at
        for j in range(1, events + 1):
            d = 2 * (min(j, DEPTHS) - 1)
            at[d] = at[d] * ALPHA_DECAY + (j <= accepted)
            at[d + 1] = at[d + 1] * ALPHA_DECAY + 1.0


class StepCost:
    """``T(N) = a + b N``: seconds of a step that runs ``N`` tokens, fitted by least squares
    over the measured steps with exponential forgetting; ``c``: seconds per sequential draft
    position (a draft model's forward), a running mean."""

    def __init__(self) -> None:
        self._s = [0.0] * 5  # weighted sums of 1, N, T, N^2, N T
        self.c = 0.0
        self._c_weight = 0.0
        self._skipped = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """One measured step. The first :data:`WARMUP_STEPS` are not counted (first calls
        build kernels and plans, touch fresh pages), and once the fit stands a step slower
        than :data:`OUTLIER_FACTOR` x its prediction counts as that (a pause, another process
        on the cores) so one spike cannot turn drafting off for a hundred steps."""
        if self._skipped < WARMUP_STEPS:
            self._skipped += 1
            return
        if self._s[0] >= MIN_FIT_STEPS:
            a, b = self.coefficients()
            seconds = min(seconds, OUTLIER_FACTOR * (a + b * tokens))
        s = self._s
        for i in range(5):
            s[i] *= COST_DECAY
        n = float(tokens)
        s[0] += 1.0
        s[1] += n
        s[2] += seconds
        s[3] += n * n
        s[4] += n * seconds

    def observe_draft(self, positions: int, seconds: float) -> None:
        """A proposer spent ``seconds`` for ``positions`` sequential draft positions."""
        if positions <= 0:
            return
        self._c_weight = self._c_weight * COST_DECAY + positions
        self.c += (seconds - self.c * positions) / self._c_weight

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``: intercept and seconds per token (b >= 0; until :data:`MIN_FIT_STEPS`
        steps of different sizes are measured, ``b = a`` x :data:`PRIOR_TOKEN_SHARE`)."""
        w, sn, st, snn, snt = self._s
        if w <= 0:
            return 1.0, PRIOR_TOKEN_SHARE
        mean_n, mean_t = sn / w, st / w
        var = snn / w - mean_n * mean_n
        if w < MIN_FIT_STEPS or var <= 1e-6 * max(1.0, mean_n * mean_n):  # b unknown yet
            a = mean_t / (1.0 + PRIOR_TOKEN_SHARE * mean_n)
            return a, a * PRIOR_TOKEN_SHARE
        b = max((snt / w - mean_n * mean_t) / var, 0.0)
        a = max(mean_t - b * mean_n, 1e-9)
        return a, b


class SpecController:
    """Per step: the draft length of each decoding sequence (see the module docstring)."""

    def __init__(
        self,
        num_speculative_tokens: int,
        adaptive: bool = True,
        disable_by_batch_size: int | None = None,
    ) -> None:
        self.k_max = num_speculative_tokens
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.cost = StepCost()
        self._acceptance: OrderedDict[str, Acceptance] = OrderedDict()
        self.step = 0

    def acceptance(self, key: str) -> Acceptance:
        """The tracker of adapter ``key`` (created at the prior; most recent last)."""
        acc = self._acceptance.get(key)
        if acc is None:
            acc = self._acceptance[key] = Acceptance()
            if len(self._acceptance) > MAX_TRACKED:
                self._acceptance.popitem(last=False)
        else:
            self._acceptance.move_to_end(key)
        return acc

    def alpha(self, key: str) -> float:
        acc = self._acceptance.get(key)
        return ALPHA_PRIOR if acc is None else acc.alpha

    def observe_found(self, key: str, found: bool) -> None:
        """A draft asked of the proposer for a sequence of ``key`` was found (or not)."""
        self.acceptance(key).observe_found(found)

    def observe(self, key: str, drafted: int, accepted: int) -> None:
        if drafted:
            self.acceptance(key).observe(drafted, accepted)

    def limits(self, keys: Seq[str], caps: Seq[int], batch_tokens: int) -> list[int]:
        """Draft lengths for the decoding sequences whose adapter keys are ``keys`` (each at
        most ``caps[i]``: what its length and max_tokens allow); ``batch_tokens``: the tokens
        the next step runs without drafts (its decode rows and prompt chunks)."""
        self.step += 1
        n = len(keys)
        if self.disable_by_batch_size is not None and n >= self.disable_by_batch_size:
            return [0] * n
        if not self.adaptive:
            return [min(self.k_max, c) for c in caps]
        a, b = self.cost.coefficients()
        c = self.cost.c
        accs = [self._acceptance.get(key) for key in keys]
        found = [1.0 if acc is None else acc.found for acc in accs]
        depth = [0] * n  # positions added so far, per sequence
        expect = [0.0] * n  # E_i: expected accepted tokens of sequence i this step
        share = float(n)  # S = sum_i 1 / (1 + E_i)
        step = a + b * max(batch_tokens, n)  # T: the step's predicted seconds
        deepest = 0
        # a position of sequence i runs (costs b) and yields only when its draft is found
        first = [_alpha_at(acc, 1) for acc in accs]
        heap = [(-_delta(0.0, found[i] * first[i]), i, first[i]) for i in range(n) if caps[i] > 0]
        heapq.heapify(heap)
        order: list[int] = []  # the sequence of each position added, best first
        best, best_len = step * share, 0
        while heap:
            neg_delta, i, gain = heapq.heappop(heap)
            j = depth[i] = depth[i] + 1
            expect[i] += found[i] * gain
            share += neg_delta
            step += found[i] * b + (c if j > deepest else 0.0)
            deepest = max(deepest, j)
            order.append(i)
            if step * share < best * (1.0 - 1e-9):
                best, best_len = step * share, len(order)
            if j < min(self.k_max, caps[i]):
                nxt = gain * _alpha_at(accs[i], j + 1)
                heapq.heappush(heap, (-_delta(expect[i], found[i] * nxt), i, nxt))
        ks = [0] * n
        for i in order[:best_len]:  # the best prefix: each sequence's positions in order
            ks[i] += 1
        for i, acc in enumerate(accs):  # re-measure keys that stopped drafting now and then
            if ks[i] == 0 and caps[i] > 0 and acc is not None:
                if self.step - acc.last_drafted >= PROBE_EVERY:
                    ks[i] = 1
            if ks[i] and acc is not None:
                acc.last_drafted = self.step
        return ks


def _delta(expect: float, gain: float) -> float:
    """How much one more draft position lowers ``1 / (1 + E)`` (a sequence's time per token,
    in steps) when it adds ``gain`` expected tokens to ``expect``."""
    return 1.0 / (1.0 + expect) - 1.0 / (1.0 + expect + gain)


def _alpha_at(acc: Acceptance | None, j: int) -> float:
    """Position ``j``'s acceptance for a key's tracker (the prior for a key never drafted)."""
    return ALPHA_PRIOR if acc is None else acc.alpha_at(j)
