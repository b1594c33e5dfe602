"""The drafter that picks per round between the draft model and the text's own continuation
(runtime/drafters.py's MixedDrafter): its plans, its acceptance estimates, and exactness
through real onnxruntime sessions with both sources firing."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import PrefixSession
from helpers import PROMPTS, exact_two_token_distribution
from stats_check import ALPHA, fit_pvalue

import edgespec
from edgespec.config import TEXT_MAX_K, GenerationConfig, SamplingConfig
from edgespec.runtime import drafters
from edgespec.runtime.drafters import MixedDrafter, NgramDrafter, Proposal, best_plan
from edgespec.runtime.schedule import StepCosts
from edgespec.runtime.speculative import Round
from edgespec.runtime.stats import GenerationStats

# Edits: the answer copies the prompt's code, so the text's continuation runs long.
EDIT_PROMPTS = [
    "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    "# the same two functions again:\ndef area(w, h):\n",
    "for i in range(10):\n    total = total + i * i\n    print(i, total)\nfor i in range(10):\n",
    "a b c d e f g h a b c d e f g h a b c",
]
# a CPU-like cost model: a draft step a fifth of a target step, runs growing with their length
COSTS = StepCosts(2.0, tuple(10.0 + 0.4 * n for n in range(9)),
                  ((17, 10.0 + 0.4 * 16), (33, 10.0 + 0.4 * 32)))


@pytest.fixture(scope="module")
def pipes(packages):
    return {name: edgespec.load(packages[name]) for name in ("llama", "words")}


# ---------------------------------------------------------------------------------------------
# The plan: which source proposes how many of a round's positions


def test_a_long_copy_is_proposed_whole_by_the_text():
    assert best_plan(COSTS, [0.99] * 30, alpha=0.6, k=4) == (30, 0)
    text, model = best_plan(COSTS, [0.95] * 30, alpha=0.6, k=4)  # a copy may break: shorter
    assert 16 < text < 30 and model == 0


def test_a_text_that_guesses_badly_leaves_the_round_to_the_model():
    assert best_plan(COSTS, [0.05] * 30, alpha=0.7, k=4) == (0, 4)


def test_nothing_worth_drafting_is_a_plain_target_step():
    assert best_plan(COSTS, [0.01] * 3, alpha=0.01, k=0) == (0, 0)
    assert best_plan(COSTS, [], alpha=0.0, k=3) == (0, 0)


def test_a_short_sure_match_is_extended_by_the_model():
    assert best_plan(COSTS, [0.99] * 2, alpha=0.8, k=4) == (2, 1)
    assert best_plan(COSTS, [0.99] * 2, alpha=0.95, k=4) == (2, 4)


# the real coder pair's costs on a 2-core CPU: a 9 ms draft step, a 52 ms target step and
# 11.6 ms more per verified position
REAL = StepCosts(9.0, tuple(52.0 + 11.6 * n for n in range(9)),
                 ((17, 52.0 + 11.6 * 16), (33, 52.0 + 11.6 * 32)))


def test_the_tokens_a_round_commits_without_the_model_are_owed_to_its_cache():
    """A text round's tokens must be fed to the draft model before it drafts again: each is
    charged where it is committed (a draft run's marginal cost per token), so a text at 45%
    loses to a model at 70%, which it beat when those feeds were free."""
    assert best_plan(REAL, [0.45] * 6, alpha=0.7, k=3) == (0, 3)
    assert best_plan(REAL, [0.45] * 6, alpha=0.7, k=0) == (1, 0)  # no model: nothing owed


def test_a_model_that_guesses_better_is_chosen_however_long_the_text_went_before():
    """What the text rounds before left the model's cache to feed is charged to them, never
    again, whole, to the model's next round: charged there, a text at 35% kept the round
    from a model at 90% after 32 such tokens (conversations that quote themselves kept the
    text at 50% where the model's proposals were taken at 75%)."""
    assert best_plan(REAL, [0.35] * 6, alpha=0.9, k=3) == (0, 3)
    assert best_plan(REAL, [0.35] * 6, alpha=0.3, k=3)[1] == 0  # and a worse one is not


def test_a_model_not_asked_is_asked_again_once_its_evidence_fades():
    """Rounds that do not ask the model relax its estimate back to the prior, so a model that
    once guessed worse than the text (0.2 here) is tried again."""
    from edgespec.runtime.schedule import AcceptanceEstimate

    estimate = AcceptanceEstimate(prior_alpha=0.6, prior_weight=2.0, decay=0.9)
    estimate.update(2, 10)
    assert estimate.alpha < 0.3
    for _ in range(60):
        estimate.relax()
    assert estimate.alpha == pytest.approx(0.6, abs=0.01)
    # the drafter relaxes its model's estimate after a round of the text's alone, not after
    # one that looked at the model's proposals
    drafter = _mixed()
    drafter.prefill([1, 2, 3, 1, 2])
    drafter.model_acceptance.update(0, 10)
    low = drafter.model_acceptance.alpha
    drafter.observe([1, 2, 3, 1, 2, 3], Round([3], 1, 1, ("ngram",)))
    assert drafter.model_acceptance.alpha > low
    relaxed = drafter.model_acceptance.alpha
    drafter.observe([1, 2, 3, 1, 2, 3, 9], Round([9], 2, 0, ("model", "model")))
    assert drafter.model_acceptance.alpha < relaxed  # its first proposal rejected


def test_a_plan_never_proposes_more_than_a_round_can_verify():
    text, model = best_plan(COSTS, [0.999] * 40, alpha=0.99, k=8)
    assert text + model <= TEXT_MAX_K


class ZeroSession(PrefixSession):
    """A draft model whose argmax is token 0 everywhere."""

    def row(self, prefix: tuple[int, ...]) -> np.ndarray:
        return (np.eye(self.vocab)[0] * 5.0).astype(np.float32)


def _mixed():
    """A MixedDrafter whose draft model proposes token 0 everywhere."""
    stats = GenerationStats(speculative=True)
    draft = ZeroSession(8, 1.0, 0)
    drafter = drafters.make_drafter(GenerationConfig(), draft, stats, positions=256)
    drafter.begin(stats, None)
    return drafter


def test_the_text_acceptance_is_learnt_from_every_committed_token():
    """Tokens the text would have predicted raise its estimate, whether or not it proposed
    them; tokens it mispredicts lower it."""
    drafter = _mixed()
    copy = [1, 2, 3, 4, 5] * 4
    drafter.prefill(copy[:6])
    before = drafter.text_acceptance[True][3].alpha
    drafter.observe(copy[:6], Round(copy[6:], 3, 3, ("model",) * 3))  # proposed by the model
    learnt = drafter.text_acceptance[True][3].alpha
    assert learnt > 0.9 > before
    drafter.observe(copy, Round([0, 0, 0], 1, 1, ("model",)))
    assert drafter.text_acceptance[True][3].alpha < learnt


def test_the_schedule_learns_only_the_model_proposals_verification_looked_at(monkeypatch):
    """A text-then-model round rejected at a text position says nothing of the model: its
    proposals were never looked at, so the schedule pacing the model is not shown a rejection
    (the former count, every proposal of the source, would show it (2, 0))."""
    from edgespec.runtime import speculative

    text, model = ("ngram",) * 2, ("model",) * 2
    rounds = iter([Round([7, 8], 4, 1, text + model),  # rejected at the text's second: unseen
                   Round([7, 8, 9], 4, 2, text + model),  # rejected at the model's first
                   Round([7] * 5, 4, 4, text + model),  # all accepted
                   Round([7, 8, 9], 2, 2, text)])  # the text alone: a round without the model
    monkeypatch.setattr(speculative, "speculative_round", lambda *a, **k: next(rounds))

    class Recording:
        updates: list = []

        def next_k(self):
            return 2

        def update(self, k, n_accepted):
            self.updates.append((k, n_accepted))

    class Drafter:
        drafts, paced = True, "model"

        def observe(self, committed, done):
            pass

    schedule, stats = Recording(), GenerationStats(speculative=True)
    for _ in range(4):
        speculative._scheduled_round(None, Drafter(), [1, 2, 3], 100, GenerationConfig(),
                                     schedule, None, stats, None)
    assert schedule.updates == [(1, 0), (2, 2), (0, 0)]
    assert Round([7, 8], 4, 1, text + model).of("model") == (2, 0, 0)
    assert Round([7, 8, 9], 4, 2, text + model).of("ngram") == (2, 2, 2)


def test_without_costs_the_text_proposes_where_it_guesses_at_least_as_well_as_the_model():
    drafter = _mixed()
    copy = [1, 2, 3, 4, 5] * 4
    drafter.prefill(copy[:12])
    drafter.observe(copy[:6], Round(copy[6:12], 6, 6, ("model",) * 6))
    proposal = drafter.propose(copy[:12], 4, SamplingConfig(), None)
    assert proposal.tokens == copy[12:16] and proposal.sources == ("ngram",) * 4
    # a text that never repeats: the model's
    fresh = _mixed()
    fresh.prefill([1, 2, 3, 4, 5, 6])
    proposal = fresh.propose([1, 2, 3, 4, 5, 6], 3, SamplingConfig(), None)
    assert proposal.sources == ("model",) * 3 and proposal.tokens == [0, 0, 0]


def test_a_hundred_thousand_token_prompt_of_one_token_keeps_the_round_bounded():
    """The index holds a constant number of entries per token, and a round's lookahead stops at
    TEXT_MAX_K positions, however long the text and however often it repeats."""
    drafter = _mixed()
    drafter.begin(drafter.stats, COSTS)
    prompt = [7] * 100_000
    drafter.prefill(prompt)
    index = drafter.text.index
    entries = sum(len(ends) for ends in index.ends.values())
    assert entries <= len(prompt) * (index.max_n - index.min_n + 1)
    assert len(index.ends) == index.max_n - index.min_n + 1  # one key per length: (7,), (7, 7), ...
    drafter.observe(prompt[:-64], Round(prompt[-64:], 0, 0))  # the text predicts itself
    lookups = 0
    match = index.match

    def counted():
        nonlocal lookups
        lookups += 1
        return match()

    index.match = counted
    proposal = drafter.propose(prompt, 4, SamplingConfig(), None)
    assert proposal.tokens == [7] * TEXT_MAX_K and set(proposal.sources) == {"ngram"}
    assert lookups <= 2 * TEXT_MAX_K  # the plan's lookahead, then one per proposal
    assert len(index.tokens) == len(prompt) + TEXT_MAX_K - 1  # all but the last proposal
    drafter.rollback(len(prompt))
    assert len(index.tokens) == len(prompt)


# ---------------------------------------------------------------------------------------------
# Through real sessions: greedy identity with every choice, the distribution with both sources


@pytest.mark.parametrize("pair", ["llama", "words"])
def test_greedy_mixed_drafting_equals_target_only(pipes, pair):
    pipe = pipes[pair]
    used = GenerationStats(speculative=True)
    for prompt in [*PROMPTS, *EDIT_PROMPTS]:
        baseline = pipe.generate(prompt, max_new_tokens=40, drafter="none").token_ids
        for settings in (dict(draft_length=3, schedule="fixed"), dict(draft_length=8)):
            result = pipe.generate(prompt, max_new_tokens=40, **settings)  # auto: mixed
            assert result.stats.drafter == "mixed"
            assert result.token_ids == baseline, (prompt, settings)
            used = GenerationStats.combined([used, result.stats])
    assert used.drafted_by.get("ngram", 0) > 0 and used.drafted_by.get("model", 0) > 0
    assert 0 < used.accepted < used.drafted


def test_a_long_copy_is_verified_in_long_runs(pipes):
    """With measured costs a copy is proposed past the schedule's k: rounds of many tokens."""
    pipe = pipes["llama"]
    prompt = EDIT_PROMPTS[2]
    result = pipe.generate(prompt, max_new_tokens=48, draft_length=4, ignore_eos=True)
    assert result.token_ids == pipe.generate(prompt, max_new_tokens=48, drafter="none",
                                             ignore_eos=True).token_ids
    assert result.stats.drafted_by.get("ngram", 0) > 0
    assert len(result.stats.drafted_at) > 4  # some round proposed more than k = 4


T1 = SamplingConfig(1.0)
TWO_SOURCES = "a b c a b"  # the lookup proposes "c" for the first position


def _text_then_model(self, committed, k):
    """The plan fixed for the distribution test: the text's first position, then the
    model's (a round of k = 2 with both sources)."""
    self.last = self.model
    return [(self.text, 1), (self.model, 1)]


def test_a_round_of_both_sources_draws_the_target_distribution(pipes, monkeypatch):
    monkeypatch.setattr(MixedDrafter, "plan", _text_then_model)
    pipe = pipes["words"]
    expected = exact_two_token_distribution(pipe, T1, TWO_SOURCES)
    stats = []
    samples = _samples(pipe, 3000, stats)
    both = GenerationStats.combined(stats)
    assert both.drafted_by["ngram"] >= 3000 and both.drafted_by["model"] >= 3000
    assert 0.05 * both.drafted < both.accepted < 0.95 * both.drafted
    assert fit_pvalue(samples, expected) > ALPHA


def _samples(pipe, n, stats):
    samples = []
    for seed in range(n):
        result = pipe.generate(TWO_SOURCES, max_new_tokens=3, draft_length=2, schedule="fixed",
                               seed=seed, temperature=1.0)
        samples.append(tuple(result.token_ids[:2]))
        stats.append(result.stats)
    return samples


def test_the_distribution_check_rejects_a_match_verified_as_a_draft_row(pipes, monkeypatch):
    """Wrong: the text's token tested against the draft model's row there, not its point mass."""
    monkeypatch.setattr(MixedDrafter, "plan", _text_then_model)
    right = MixedDrafter.propose

    def as_model_rows(self, committed, k, sampling, u, penalties=None, limit=None):
        proposal = right(self, committed, k, sampling, u, penalties, limit)
        rows = list(proposal.rows)
        for i, source in enumerate(proposal.sources):
            if source == NgramDrafter.name:
                self.model.rollback(len(committed) + i - 1)  # its cache: all but the last
                rows[i] = self.model.next_row(committed, proposal.tokens[:i], sampling)
        return Proposal(proposal.tokens, rows, proposal.sources)

    monkeypatch.setattr(MixedDrafter, "propose", as_model_rows)
    pipe = pipes["words"]
    expected = exact_two_token_distribution(pipe, T1, TWO_SOURCES)
    assert fit_pvalue(_samples(pipe, 1500, []), expected) < 1e-6


def test_the_bench_and_the_stats_line_say_which_source_drafted_how_much(pipes):
    from edgespec.bench import format_table, run_bench
    from edgespec.config import BenchConfig

    pipe = pipes["llama"]
    config = BenchConfig(draft_lengths=(3,), temperatures=(0.0,), max_new_tokens=32, repeats=1,
                         schedules=("fixed",))
    report = run_bench(pipe, EDIT_PROMPTS, config)
    (row,) = report.rows
    assert row.drafter == "mixed" and {"model", "ngram"} <= set(row.sources)
    assert all(accepted <= n for n, accepted, _ in row.sources.values())
    assert "proposals by source" in format_table(report)
    result = pipe.generate(EDIT_PROMPTS[2], max_new_tokens=32, draft_length=3, schedule="fixed")
    assert "ngram" in result.stats.summary()
