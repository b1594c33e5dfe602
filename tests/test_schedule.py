"""Draft-length schedules: what each picks. (Exactness under every schedule: test_speculative.)"""

from __future__ import annotations

import pytest

from edgespec.runtime.schedule import (
    AdaptiveSchedule,
    HeuristicSchedule,
    StepCosts,
    best_k,
    expected_speedup,
    expected_tokens,
)

# a target run costs 10 ms for one token and 1 ms more per extra token
CHEAP_DRAFT = StepCosts(draft_step_ms=0.5, target_ms=tuple(10.0 + n for n in range(9)))
COSTLY_DRAFT = StepCosts(draft_step_ms=9.0, target_ms=tuple(10.0 + n for n in range(9)))


def test_tokens_per_ms_follows_the_geometric_acceptance_model():
    # alpha 0.5, k 2: 1 + 0.5 + 0.25 tokens in 2 * 0.5 + 12 ms
    assert CHEAP_DRAFT.tokens_per_ms(0.5, 2) == pytest.approx(1.75 / 13)
    assert CHEAP_DRAFT.tokens_per_ms(1.0, 3) == pytest.approx(4 / 14.5)
    assert CHEAP_DRAFT.tokens_per_ms(0.3, 0) == pytest.approx(1 / 10)


@pytest.mark.parametrize("alpha", [1.0, 1 - 1e-12, 0.999999])
def test_a_draft_always_accepted_is_k_plus_one_tokens_not_a_division_by_zero(alpha):
    """(1 - alpha^(k+1)) / (1 - alpha) is 0/0 at alpha = 1: its limit, k + 1, is what a round
    yields; the benchmarks' copies divided by zero there and now call this one."""
    assert expected_tokens(alpha, 4) == pytest.approx(5, rel=1e-5)
    assert best_k(CHEAP_DRAFT, alpha) == CHEAP_DRAFT.kmax  # drafting more always pays
    assert expected_speedup(alpha, 1, 0.5, 10, 10) == pytest.approx(2 * 10 / 10.5, rel=1e-5)
    assert AdaptiveSchedule(CHEAP_DRAFT, prior_alpha=alpha).next_k() == CHEAP_DRAFT.kmax


def test_best_k_is_the_k_of_most_tokens_per_ms_from_kmin():
    rates = {k: CHEAP_DRAFT.tokens_per_ms(0.7, k) for k in range(9)}
    assert best_k(CHEAP_DRAFT, 0.7) == max(rates, key=rates.get)
    assert best_k(COSTLY_DRAFT, 0.1) == 0  # speculation off
    assert best_k(COSTLY_DRAFT, 0.1, kmin=1) == 1  # the benchmarks' "best k of 1..kmax"


def test_sampled_rounds_pay_for_the_extra_draft_run():
    """Sampling runs the draft once more after a full acceptance (alpha^k); a k = 0 round is a
    target step and nothing else."""
    greedy, sampled = CHEAP_DRAFT.round_ms(2, 0.5), CHEAP_DRAFT.round_ms(2, 0.5, sampled=True)
    assert sampled - greedy == pytest.approx(CHEAP_DRAFT.draft_step_ms * 0.25)
    assert CHEAP_DRAFT.round_ms(0, 0.5, sampled=True) == CHEAP_DRAFT.target_ms[0]


def test_heuristic_grows_by_two_on_full_acceptance_and_shrinks_by_one():
    schedule = HeuristicSchedule(start=4)
    schedule.update(4, 4)
    assert schedule.next_k() == 6
    schedule.update(6, 2)
    assert schedule.next_k() == 5
    for _ in range(10):
        schedule.update(schedule.next_k(), 0)
    assert schedule.next_k() == 1


def test_adaptive_drafts_long_when_the_draft_is_cheap_and_good():
    schedule = AdaptiveSchedule(CHEAP_DRAFT, prior_alpha=0.6)
    for _ in range(20):
        k = schedule.next_k()
        schedule.update(k, k)  # everything accepted
    assert schedule.alpha > 0.9
    assert schedule.next_k() == CHEAP_DRAFT.kmax


def test_adaptive_turns_speculation_off_when_it_cannot_pay_and_probes_again():
    # a probe costs 9 + 11 - 10 = 10 ms more than a plain 10 ms step: at 25% overhead, every 4
    schedule = AdaptiveSchedule(COSTLY_DRAFT, prior_alpha=0.3, probe_overhead=0.25)
    assert schedule.probe_every == 4
    assert schedule.next_k() == 0
    ks = []
    for _ in range(10):
        k = schedule.next_k()
        ks.append(k)
        schedule.update(k, 0)
    assert ks == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]  # the failed probe doubled the spacing


def _probe_gaps(schedule: AdaptiveSchedule, steps: int, accepts) -> list[int]:
    """Plain steps before each probe over ``steps`` rounds; ``accepts(i)``: probe i's outcome."""
    gaps, off = [], 0
    for _ in range(steps):
        k = schedule.next_k()
        if k == 0:
            off += 1
            schedule.update(0, 0)
            continue
        schedule.update(k, k if accepts(len(gaps)) else 0)
        gaps.append(off)
        off = 0
    return gaps


def test_probes_back_off_while_the_drafter_guesses_nothing():
    """A hopeless drafter (an untrained draft) is probed ever more rarely: 4, 8, 16, ...
    plain steps apart, up to 16 times the first spacing, so it costs less and less."""
    schedule = AdaptiveSchedule(COSTLY_DRAFT, prior_alpha=0.3, probe_overhead=0.25)
    gaps = _probe_gaps(schedule, 400, accepts=lambda i: False)
    assert gaps[:5] == [4, 8, 16, 32, 64]
    assert set(gaps[5:]) == {64}


def test_a_probe_that_turns_speculation_on_restores_the_first_spacing():
    """Once a probe finds the draft worth running again (its estimate of alpha high enough),
    drafting resumes and later probes start from the first spacing again."""
    schedule = AdaptiveSchedule(CHEAP_DRAFT, prior_alpha=0.05, prior_weight=20)
    assert schedule.next_k() == 0
    first = schedule.probe_every
    gaps = _probe_gaps(schedule, 200, accepts=lambda i: i >= 3)  # the text turns draftable
    assert gaps[:4] == [first, 2 * first, 4 * first, 8 * first]
    assert schedule.probe_every == first
    assert schedule.next_k() > 0  # speculating again


def test_probes_are_rare_when_a_multi_token_run_is_slow():
    slow_verify = StepCosts(draft_step_ms=0.1, target_ms=(0.7, 2.8, 3.0))  # int4 on a CPU
    assert AdaptiveSchedule(slow_verify).probe_every == 63  # (0.1 + 2.8 - 0.7) / (5% of 0.7)
    assert AdaptiveSchedule(CHEAP_DRAFT).probe_every == 4


def test_adaptive_shortens_k_as_acceptance_falls():
    schedule = AdaptiveSchedule(CHEAP_DRAFT, prior_alpha=0.9, prior_weight=10)
    first = schedule.next_k()
    for _ in range(15):
        schedule.update(2, 0)  # the draft's first token is always rejected
    assert schedule.alpha < 0.3
    assert schedule.next_k() < first


class _CountingSession:
    """A stand-in session that counts its runs (calibrate only needs forward and new_cache)."""

    vocab_size = 100
    reads_features = False

    def __init__(self):
        self.runs = []

    def new_cache(self, positions):
        class Cache:
            def crop(self, length):
                pass

        return Cache()

    def forward(self, tokens, cache):
        self.runs.append(len(tokens))


def test_calibration_is_bounded_whatever_the_budget():
    from edgespec.runtime.schedule import calibrate

    target, draft = _CountingSession(), _CountingSession()
    costs = calibrate(target, draft, context=32, kmax=16, budget_s=0.0)
    assert costs.kmax == 16
    # one prefill, then 3 timed runs of each length (the first length twice: warm-up), the
    # long runs past kmax + 1 among them
    lengths = [*range(1, 18), 33]
    assert target.runs == [32, *[1] * 3, *[n for n in lengths for _ in range(3)]]
    assert costs.long_ms and [n for n, _ in costs.long_ms] == [33]
    target = _CountingSession()
    calibrate(target, _CountingSession(), context=32, kmax=4, budget_s=1e9)
    assert len(target.runs) == 1 + 20 * 8  # at most 20 runs of each length, however long


def test_a_long_run_costs_what_the_measured_lengths_around_it_say():
    from edgespec.runtime.schedule import StepCosts

    costs = StepCosts(1.0, (10.0, 11.0, 12.0), ((17, 26.0), (33, 50.0)))
    assert costs.verify_ms(2) == 11.0  # measured
    assert costs.verify_ms(10) == 12.0 + 14.0 * 7 / 14  # between 3 and 17
    assert costs.verify_ms(25) == 26.0 + 24.0 * 8 / 16  # between 17 and 33
    assert costs.verify_ms(41) == 50.0 + 24.0 * 8 / 16  # along the last two
    assert StepCosts(1.0, (10.0, 11.0)).verify_ms(9) == 11.0  # nothing longer measured
