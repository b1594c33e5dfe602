"""GenerationStats: several runs combined give the figures of all their rounds together."""

from __future__ import annotations

import pytest

from edgespec.runtime.speculative import Round
from edgespec.runtime.stats import GenerationStats


def drafted(k: int, n: int, source: str = "model") -> Round:
    """A round that drafted k tokens from ``source`` and accepted the first n."""
    return Round([0] * (n + 1), drafted=k, accepted=n, sources=(source,) * k)


def run(rounds, **counters) -> GenerationStats:
    stats = GenerationStats(speculative=True, **counters)
    for k, n in rounds:
        stats.record_round(drafted(k, n), "model")
    return stats


def test_combined_equals_one_run_of_all_the_rounds():
    a = run([(4, 4), (4, 1)], new_tokens=9, target_calls=2, draft_s=0.5, target_s=1.0,
            total_s=2.0, prefill_s=0.25, finish_reason="length")
    b = run([(2, 0), (6, 5)], new_tokens=7, target_calls=2, draft_s=0.25, target_s=0.5,
            total_s=1.0, prefill_s=0.25, finish_reason="length")
    together = run([(4, 4), (4, 1), (2, 0), (6, 5)])
    total = GenerationStats.combined([a, b])
    assert (total.rounds, total.drafted, total.accepted, total.rejected) == (
        together.rounds, together.drafted, together.accepted, together.rejected)
    assert total.accepted_at == together.accepted_at and total.drafted_at == together.drafted_at
    assert total.alpha == together.alpha and total.acceptance_rate == together.acceptance_rate
    assert total.per_position_acceptance == together.per_position_acceptance
    assert total.draft_lengths == {4: 2, 2: 1, 6: 1}
    assert (total.new_tokens, total.target_calls) == (16, 4)
    assert total.draft_s == pytest.approx(0.75) and total.decode_s == pytest.approx(2.5)
    assert total.tokens_per_s == pytest.approx(16 / 2.5)
    assert total.speculative and total.finish_reason == "length"
    assert a.accepted_at == [2, 1, 1, 1]  # the inputs are left as they were


def test_combined_runs_that_ended_differently_and_target_only_runs():
    a = GenerationStats(speculative=False, new_tokens=3, finish_reason="eos")
    b = GenerationStats(speculative=False, new_tokens=5, finish_reason="length")
    total = GenerationStats.combined([a, b])
    assert not total.speculative and total.new_tokens == 8 and total.finish_reason == "mixed"
    assert total.per_position_acceptance == [] and total.alpha == 0.0


def test_other_time_is_what_the_runs_and_the_sampling_leave():
    stats = GenerationStats(speculative=True, total_s=1.0, prefill_s=0.2, draft_s=0.1,
                            target_s=0.4, sampling_s=0.05)
    assert stats.other_s == pytest.approx(0.25) and stats.as_dict()["other_s"] == stats.other_s


def test_a_round_is_counted_per_source_and_its_paced_length():
    stats = GenerationStats(speculative=True)
    stats.record_round(Round([1, 2, 3], drafted=4, accepted=2,
                             sources=("ngram", "ngram", "model", "forced")), "model")
    stats.record_round(Round([5], drafted=0, accepted=0), "model")  # a plain target step
    assert stats.drafted_by == {"ngram": 2, "model": 1, "forced": 1}
    assert stats.accepted_by == {"ngram": 2, "model": 0, "forced": 0}
    assert stats.draft_lengths == {1: 1, 0: 1} and stats.rounds == 1
    assert "ngram 2 at 100%, model 1 at 0%, forced 1 at 0%" in stats.by_source()
