"""Adaptive k: how many tokens each sequence drafts, from the measured step cost and each
adapter's acceptance (``loraplex.engine.spec.control``)."""

from __future__ import annotations

import pytest

from loraplex.engine.spec.control import (
    ALPHA_PRIOR,
    MIN_FIT_STEPS,
    PROBE_EVERY,
    WARMUP_STEPS,
    Acceptance,
    SpecController,
    StepCost,
)


def _measured(ctl: SpecController, a: float, b: float, sizes: range = range(1, 65, 3)) -> None:
    """Feed ``ctl`` steps that took exactly ``a + b * tokens`` seconds (after the warm-up
    steps, which are not counted)."""
    for _ in range(WARMUP_STEPS):
        ctl.cost.observe(1, 100.0)
    for _ in range(3):
        for n in sizes:
            ctl.cost.observe(n, a + b * n)


def _accepting(ctl: SpecController, key: str, alpha_events: tuple[int, int], times: int) -> None:
    """``times`` drafts of ``alpha_events[0]`` tokens with ``alpha_events[1]`` accepted."""
    for _ in range(times):
        ctl.observe(key, *alpha_events)


def test_step_cost_fits_the_measured_line() -> None:
    cost = StepCost()
    assert cost.coefficients()[1] == pytest.approx(cost.coefficients()[0] / 64)  # the prior
    for _ in range(WARMUP_STEPS):  # cold first steps: not counted
        cost.observe(16, 5.0)
    for n in range(1, 40):
        cost.observe(n, 0.010 + 0.0004 * n)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.010, rel=1e-6) and b == pytest.approx(0.0004, rel=1e-6)
    cost.observe(10, 9.0)  # a pause: counted as 3x its prediction, not 600x
    a2, b2 = cost.coefficients()
    assert a2 + 10 * b2 < 2 * (a + 10 * b)
    cost.observe_draft(4, 0.008)
    assert cost.c == pytest.approx(0.002)


def test_one_step_size_alone_leaves_the_slope_to_the_prior() -> None:
    cost = StepCost()
    for _ in range(MIN_FIT_STEPS * 2 + WARMUP_STEPS):
        cost.observe(16, 0.02)
    a, b = cost.coefficients()
    assert a + 16 * b == pytest.approx(0.02) and b == pytest.approx(a / 64)


def test_acceptance_counts_accepts_and_the_first_reject() -> None:
    acc = Acceptance()
    assert acc.alpha == ALPHA_PRIOR
    for _ in range(200):
        acc.observe(4, 4)  # all kept: 4 accepts, no reject
    assert acc.alpha > 0.99
    for _ in range(200):
        acc.observe(4, 1)  # 1 accept, 1 reject (the rest were never judged)
    assert acc.alpha == pytest.approx(0.5, abs=0.01)


def test_weight_bound_steps_draft_the_most_accepting_adapters_deepest() -> None:
    """Reading the weights dominates (b = a / 1000): a well-accepted adapter drafts k_max, one
    whose drafts fail drafts less, and every sequence drafts something."""
    ctl = SpecController(num_speculative_tokens=6)
    _measured(ctl, a=0.050, b=0.00005)
    _accepting(ctl, "good", (6, 6), 100)
    _accepting(ctl, "bad", (6, 0), 100)
    ks = ctl.limits(["good", "bad", "new"], [6, 6, 6], batch_tokens=3)
    assert ks[0] == 6 and ks[1] < ks[2] <= 6 and ks[2] >= 1


def test_compute_bound_steps_do_not_draft() -> None:
    """Every token costs what the whole intercept does: a draft never pays, even at alpha 0.9;
    at a moderate slope, a large batch drafts less than a small one."""
    ctl = SpecController(num_speculative_tokens=4)
    _measured(ctl, a=0.001, b=0.010)
    _accepting(ctl, "x", (4, 3), 100)
    assert ctl.limits(["x"] * 16, [4] * 16, batch_tokens=16) == [0] * 16
    ctl = SpecController(num_speculative_tokens=4)
    _measured(ctl, a=0.030, b=0.001)
    for _ in range(50):  # half the drafts keep their first token, none a second
        _accepting(ctl, "x", (4, 1), 1)
        _accepting(ctl, "x", (4, 0), 1)
    one = sum(ctl.limits(["x"], [4], batch_tokens=1))
    many = ctl.limits(["x"] * 32, [4] * 32, batch_tokens=32)
    assert one > 0 and sum(many) / 32 < one


def test_caps_fixed_k_and_disable_by_batch_size() -> None:
    ctl = SpecController(num_speculative_tokens=4, adaptive=False, disable_by_batch_size=3)
    assert ctl.limits(["a", "b"], [4, 2], batch_tokens=2) == [4, 2]  # vLLM's fixed k, capped
    assert ctl.limits(["a", "b", "c"], [4, 4, 4], batch_tokens=3) == [0, 0, 0]
    adaptive = SpecController(num_speculative_tokens=4)
    _measured(adaptive, a=0.050, b=0.00001)
    assert adaptive.limits(["a", "b"], [0, 1], batch_tokens=2) == [0, 1]


def test_an_adapter_that_stopped_drafting_is_probed_again() -> None:
    """Compute bound, nobody drafts; an adapter that drafted before gets one token every
    PROBE_EVERY steps, so its acceptance (and the step cost) keep being measured."""
    ctl = SpecController(num_speculative_tokens=4)
    _measured(ctl, a=0.001, b=0.010)
    _accepting(ctl, "x", (4, 1), 5)
    _accepting(ctl, "x", (4, 0), 20)
    got = [ctl.limits(["x"], [4], batch_tokens=1)[0] for _ in range(PROBE_EVERY * 2)]
    assert sum(got) == 2 and set(got) == {0, 1}


def test_a_draft_that_slows_the_other_sequences_more_than_it_saves_is_not_made() -> None:
    """TPOT is per request: at 16 sequences with T = 20 b, one sequence's sure token would
    halve its own time per token (10.5 b) but make the 15 others' step 21 b, a worse mean
    TPOT (20.3 b > 20 b), though more tokens per second; alone, the same draft pays."""
    ctl = SpecController(num_speculative_tokens=1)
    _measured(ctl, a=0.004, b=0.001)
    _accepting(ctl, "sure", (1, 1), 300)
    _accepting(ctl, "never", (1, 0), 300)
    assert ctl.alpha("sure") > 0.99 and ctl.alpha("never") < 0.01
    assert ctl.limits(["sure"] + ["never"] * 15, [1] * 16, batch_tokens=16) == [0] * 16
    assert ctl.limits(["sure"], [1], batch_tokens=1) == [1]


def test_sequences_whose_last_draft_was_kept_are_judged_apart() -> None:
    """Acceptance comes in runs: the speculator keys a sequence whose last draft was kept
    whole apart from the adapter's other sequences, so a copy in progress drafts deep while a
    fresh sequence of the same adapter drafts little."""
    from loraplex.engine.spec.speculator import KEPT_SUFFIX, control_key
    from tests.engine.spec.seqs import make_seq

    seq = make_seq([1, 2, 3])
    assert control_key(seq) == ""
    seq.spec_kept = True
    assert control_key(seq) == KEPT_SUFFIX
    ctl = SpecController(num_speculative_tokens=8)
    _measured(ctl, a=0.010, b=0.0001)  # weight bound, as one sequence's step is
    _accepting(ctl, "x", (8, 0), 100)  # drafts of a fresh start fail
    _accepting(ctl, "x" + KEPT_SUFFIX, (8, 8), 100)  # a run that was kept goes on
    cold, hot = ctl.limits(["x", "x" + KEPT_SUFFIX], [8, 8], batch_tokens=2)
    assert hot == 8 and cold <= 1


def test_a_token_for_every_sequence_can_pay_where_one_alone_does_not() -> None:
    """The step measured at 16 sequences on a 2-core CPU (a = 13.7 ms, b = 0.96 ms a token)
    with drafts kept at 0.7: one sequence's draft alone costs the 15 others more than it saves
    it, but one token for each of the 16 lowers every sequence's time per token (44.4 ms for
    1.7 tokens against 29.1 ms for 1): the controller must not stop at the first position."""
    ctl = SpecController(num_speculative_tokens=4)
    _measured(ctl, a=0.0137, b=0.00096)
    _accepting(ctl, "x", (1, 1), 7)
    _accepting(ctl, "x", (1, 0), 3)
    alpha = ctl.alpha("x")
    assert 0.6 < alpha < 0.75
    one = 0.0137 + 0.00096 * 17
    assert one * (15 + 1 / (1 + alpha)) > (0.0137 + 0.00096 * 16) * 16  # alone: worse
    ks = ctl.limits(["x"] * 16, [4] * 16, batch_tokens=16)
    assert min(ks) >= 1 and max(ks) <= 2


def test_positions_are_judged_by_their_own_acceptance() -> None:
    """Drafts that keep their first token half the time but, once it is kept, hold for the
    whole draft (a copy): position 1 is kept half the time and every deeper one almost always
    once the ones before it were, where the pooled rate (0.89 here) says neither; one sequence
    on a weight-bound step drafts k_max, sixteen on a compute-bound one draft nothing (the
    pooled rate would have them draft: 0.89 at position 1)."""
    ctl = SpecController(num_speculative_tokens=8)
    _measured(ctl, a=0.0126, b=0.00032)  # one sequence's step on a 2-core CPU
    for _ in range(40):
        _accepting(ctl, "copy", (8, 8), 1)
        _accepting(ctl, "copy", (8, 0), 1)
    acc = ctl.acceptance("copy")
    assert acc.alpha > 0.85
    assert 0.4 < acc.alpha_at(1) < 0.6 and acc.alpha_at(2) > 0.9 and acc.alpha_at(8) > 0.9
    assert ctl.limits(["copy"], [8], batch_tokens=1) == [8]
    busy = SpecController(num_speculative_tokens=8)
    _measured(busy, a=0.0137, b=0.00096)  # sixteen sequences' step on the same CPU
    busy._acceptance["copy"] = acc
    assert busy.limits(["copy"] * 16, [8] * 16, batch_tokens=16) == [0] * 16


def test_a_position_costs_and_yields_only_as_often_as_a_draft_is_found() -> None:
    """A proposer finds no draft for some asks (an n-gram without a match), and those run
    nothing: a planned position adds ``found * b`` and ``found * gain``. Where asking has a
    fixed cost of its own (a draft model's forward, ``c``), a key whose drafts are rarely found
    is not asked; one whose drafts are found is."""
    ctl = SpecController(num_speculative_tokens=4)
    _measured(ctl, a=0.0126, b=0.00032)
    ctl.cost.observe_draft(1, 0.003)  # 3 ms a sequential draft position
    for key in ("found", "rare"):
        _accepting(ctl, key, (1, 1), 40)
        _accepting(ctl, key, (1, 0), 10)
    for _ in range(40):
        ctl.observe_found("found", True)
        ctl.observe_found("rare", False)
    assert ctl.acceptance("found").found > 0.95 and ctl.acceptance("rare").found < 0.1
    assert ctl.limits(["found"], [4], batch_tokens=1)[0] >= 1
    assert ctl.limits(["rare"], [4], batch_tokens=1) == [0]
