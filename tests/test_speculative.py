"""The speculative loop through real onnxruntime sessions: exact against target-only decoding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import (
    PROMPTS,
    SAMPLED,
    exact_two_token_distribution,
    texts_by_schedule,
    two_token_samples,
)
from stats_check import ALPHA, fit_pvalue

import edgespec
from edgespec.config import SamplingConfig
from edgespec.runtime import acceptance as sampler
from edgespec.runtime import speculative
from edgespec.runtime.penalties import Penalties

@pytest.fixture(scope="module")
def pipes(packages):
    return {name: edgespec.load(path) for name, path in packages.items()}


@pytest.mark.parametrize("pair", ["llama", "gpt2", "llama_noisy", "llama_noisy_optimum"])
def test_greedy_speculative_equals_target_only(pipes, pair):
    pipe = pipes[pair]
    for prompt in PROMPTS:
        baseline = pipe.generate(prompt, max_new_tokens=48, drafter="none")
        for gamma in range(1, 7):
            result = pipe.generate(prompt, max_new_tokens=48, draft_length=gamma, schedule="fixed")
            assert result.token_ids == baseline.token_ids, (prompt, gamma)
            assert result.text == baseline.text


@pytest.mark.parametrize("schedule", ["heuristic", "adaptive"])
@pytest.mark.parametrize("pair", ["gpt2", "llama_noisy"])
def test_greedy_identity_holds_whatever_the_schedule(pipes, pair, schedule):
    pipe = pipes[pair]
    for prompt in PROMPTS:
        baseline = pipe.generate(prompt, max_new_tokens=48, drafter="none")
        result = pipe.generate(prompt, max_new_tokens=48, draft_length=6, schedule=schedule)
        assert result.token_ids == baseline.token_ids, prompt
        assert sum(result.stats.draft_lengths.values()) == result.stats.target_calls


def test_greedy_identity_exercises_both_accept_and_reject(pipes):
    """The noisy draft agrees only sometimes, so the identity above covered partial rounds."""
    stats = [pipes["llama_noisy"].generate(p, max_new_tokens=48, draft_length=4,
                                           schedule="fixed").stats
             for p in PROMPTS]
    rate = sum(s.accepted for s in stats) / sum(s.drafted for s in stats)
    assert 0.1 < rate < 0.95
    assert any(0 < s.accepted < s.drafted for s in stats)


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_draft_equal_to_target_accepts_everything_at_temperature_zero(pipes, gamma):
    for prompt in PROMPTS:
        stats = pipes["llama_self"].generate(prompt, max_new_tokens=40, draft_length=gamma,
                                             schedule="fixed").stats
        assert stats.accepted == stats.drafted
        assert stats.per_position_acceptance == [1.0] * len(stats.per_position_acceptance)
        if stats.finish_reason == "max_new_tokens":
            assert stats.tokens_per_target_call == pytest.approx(40 / stats.target_calls)
            assert stats.target_calls <= -(-40 // (gamma + 1)) + 1


PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)


def test_a_draft_equal_to_its_target_accepts_everything_with_penalties_too(pipes, monkeypatch):
    """The draft's rows are penalized as the target's: a draft that is the target proposes
    the target's penalized argmax every time. Unpenalized drafts (any q is exact) would not."""
    def acceptance():
        stats = [pipes["llama_self"].generate(p, max_new_tokens=32, draft_length=3,
                                              schedule="fixed", **PENALTIES).stats
                 for p in PROMPTS]
        return sum(s.accepted for s in stats), sum(s.drafted for s in stats)

    accepted, drafted = acceptance()
    assert drafted > 0 and accepted == drafted
    monkeypatch.setattr(Penalties, "row", lambda self, logits, *args: logits)
    accepted, drafted = acceptance()
    assert accepted < drafted


def test_a_wrong_acceptance_rule_breaks_greedy_identity(pipes, monkeypatch):
    """The identity test can fail: accepting every draft token changes the output."""
    monkeypatch.setattr(
        speculative, "verify_greedy", lambda d, logits: (len(d), int(logits[len(d)].argmax()))
    )
    pipe = pipes["llama"]
    differs = [
        pipe.generate(p, max_new_tokens=24, draft_length=3, schedule="fixed").token_ids
        != pipe.generate(p, max_new_tokens=24, drafter="none").token_ids
        for p in PROMPTS
    ]
    assert any(differs)


def test_sampling_is_reproducible_with_a_seed(pipes):
    pipe = pipes["llama_noisy"]
    runs = [pipe.generate("def", max_new_tokens=30, temperature=1, seed=7).token_ids for _ in "ab"]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("setting", SAMPLED)
@pytest.mark.parametrize("pair", ["llama_noisy", "gpt2"])
def test_a_seed_gives_the_same_text_whatever_the_draft_lengths(pipes, pair, setting):
    """Randomness is keyed by position: k and a schedule that always drafts change no token."""
    pipe = pipes[pair]
    for seed, prompt in enumerate(PROMPTS[:3]):
        settings = dict(max_new_tokens=40, seed=seed, ignore_eos=True, **SAMPLED[setting])
        texts = texts_by_schedule(pipe, prompt, **settings)
        assert all(t == texts["k=1"] for t in texts.values()), (prompt, seed, texts)
    assert pipe.generate(prompt, **{**settings, "seed": 99}).token_ids != texts["k=1"]


def test_the_same_text_check_fails_for_a_sequential_random_stream(pipes, monkeypatch):
    """Uniforms drawn in the order the loop asks for them (as from one rng) break it."""

    class Sequential(sampler.PositionUniforms):
        def rows(self, position: int, count: int) -> np.ndarray:
            return self._rng.random((count, 3))

    monkeypatch.setattr(speculative, "PositionUniforms", Sequential)
    texts = texts_by_schedule(pipes["gpt2"], PROMPTS[0], max_new_tokens=40, seed=0,
                              ignore_eos=True, temperature=1.0)
    assert len({tuple(t) for t in texts.values()}) > 1


# ---------------------------------------------------------------------------------------------
# End-to-end distribution: the first two tokens of speculative sampling, through the real
# sessions, must follow the target's exact joint distribution (computed from the target graph).
# One setting here, per drafter (a draft model; the target alone): the sampler's settings
# (top-k, top-p, temperatures) and the loop's other paths are checked on NumPy fake sessions
# (test_fast_sampling.py), tens of thousands of generations in seconds.

PROMPT = "a b c"
T1 = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def words(pipes):
    pipe = pipes["words"]
    # The check is only meaningful if the draft disagrees with the target.
    p = exact_two_token_distribution(pipe, T1, PROMPT)
    assert max(p.values()) < 0.5
    return pipe


def test_speculative_sampling_matches_the_target_distribution(words):
    expected = exact_two_token_distribution(words, T1, PROMPT)
    samples, drafted, accepted = two_token_samples(words, T1, 3000, PROMPT)
    assert drafted >= 2 * 3000 and accepted < 0.9 * drafted  # the draft is far from the target
    assert fit_pvalue(samples, expected) > ALPHA


def test_min_p_sampling_matches_the_target_distribution(words):
    """llama.cpp's min-p through the loop and the real sessions: draft rows cut as the
    target's, the first two tokens follow the target's cut distribution."""
    min_p = SamplingConfig(temperature=1.0, min_p=0.15)
    expected = exact_two_token_distribution(words, min_p, PROMPT)
    assert len(expected) < len(exact_two_token_distribution(words, T1, PROMPT))  # it cuts
    samples, drafted, _ = two_token_samples(words, min_p, 2000, PROMPT)
    assert drafted >= 2 * 2000
    assert fit_pvalue(samples, expected) > ALPHA


def test_penalized_sampling_matches_the_target_distribution(words):
    """Repetition, presence and frequency penalties: the second token's row is penalized for
    the first, in the round that drafted it as in the exact distribution."""
    penalized = SamplingConfig(temperature=1.0, repetition_penalty=1.6, presence_penalty=0.7,
                               frequency_penalty=0.5)
    expected = exact_two_token_distribution(words, penalized, PROMPT)
    assert max(abs(expected[t] - p) for t, p in
               exact_two_token_distribution(words, T1, PROMPT).items()) > 0.01  # it changes p
    samples, drafted, _ = two_token_samples(words, penalized, 2000, PROMPT)
    assert drafted >= 2 * 2000
    assert fit_pvalue(samples, expected) > ALPHA


@pytest.mark.parametrize("pair", ["llama_noisy", "gpt2"])
def test_greedy_with_penalties_equals_target_only(pipes, pair):
    pipe = pipes[pair]
    penalties = PENALTIES
    changed = 0
    for prompt in PROMPTS:
        baseline = pipe.generate(prompt, max_new_tokens=32, drafter="none", **penalties)
        changed += baseline.token_ids != pipe.generate(prompt, max_new_tokens=32,
                                                       drafter="none").token_ids
        for k in (1, 3):
            result = pipe.generate(prompt, max_new_tokens=32, draft_length=k, schedule="fixed",
                                   **penalties)
            assert result.token_ids == baseline.token_ids, (prompt, k)
            assert result.stats.drafted > 0
    assert changed  # the penalties bite


def test_target_only_sampling_matches_the_same_distribution(words):
    top_k = SamplingConfig(temperature=0.8, top_k=3)
    samples, drafted, _ = two_token_samples(words, top_k, 1500, PROMPT, drafter="none")
    assert drafted == 0
    assert fit_pvalue(samples, exact_two_token_distribution(words, top_k, PROMPT)) > ALPHA


def test_the_distribution_check_rejects_a_wrong_loop(words, monkeypatch):
    """Resampling from p instead of the residual after a rejection biases the output."""

    def resample_from_p(x, p, q, u):
        px, qx = p.prob(x), q.prob(x)
        return (True, x) if qx <= px or u[1] * qx < px else (False, p.draw(u[2]))

    monkeypatch.setattr(sampler, "accept_or_replace", resample_from_p)
    samples, _, _ = two_token_samples(words, T1, 1500, PROMPT)
    assert fit_pvalue(samples, exact_two_token_distribution(words, T1, PROMPT)) < 1e-6


# ---------------------------------------------------------------------------------------------
# Stopping


def test_stops_at_max_new_tokens_and_counts_tokens(pipes):
    for gamma, n in itertools.product([1, 4], [1, 2, 7]):
        result = pipes["llama_self"].generate("The quick brown", max_new_tokens=n,
                                              draft_length=gamma,
                                              schedule="fixed")
        assert len(result.token_ids) <= n
        if result.stats.finish_reason == "max_new_tokens":
            assert len(result.token_ids) == n
        assert result.stats.new_tokens == len(result.token_ids)


def test_stops_at_the_context_limit(pipes):
    pipe = pipes["llama_noisy"]
    limit = pipe.manifest.max_positions
    prompt_ids = pipe.encode("x " * 200)[: limit - 5]
    prompt = pipe.tokenizer.decode(prompt_ids)
    assert len(pipe.encode(prompt)) == limit - 5
    result = pipe.generate(prompt, max_new_tokens=50, draft_length=4, schedule="fixed")
    assert len(result.token_ids) <= 5
    if not result.stats.finish_reason == "eos":
        assert result.stats.finish_reason == "context_limit"
        assert len(result.token_ids) == 5


@pytest.mark.parametrize("pair", ["llama_self", "gpt2"])
def test_the_window_ends_on_the_same_token_with_or_without_the_draft(pipes, pair):
    """Up to the context's last position: a full acceptance near the end must not add one more."""
    pipe = pipes[pair]
    limit = pipe.manifest.max_positions
    for left in (1, 2, 3, 4, 6):
        prompt = pipe.tokenizer.decode(pipe.encode("x " * 200)[: limit - left])
        baseline = pipe.generate(prompt, max_new_tokens=50, drafter="none", ignore_eos=True)
        assert len(baseline.token_ids) == left
        for gamma in (1, 3, 5):
            result = pipe.generate(prompt, max_new_tokens=50, draft_length=gamma, ignore_eos=True,
                                   schedule="fixed")
            assert result.token_ids == baseline.token_ids, (left, gamma)
            assert result.stats.finish_reason == "context_limit"


def test_prompt_longer_than_the_context_is_refused(pipes):
    with pytest.raises(edgespec.EdgespecError, match="context window is 128; shorten"):
        pipes["llama"].generate("x " * 300)


def test_eos_ends_generation_and_is_not_in_the_text(pipes):
    pipe = pipes["gpt2"]
    results = [pipe.generate(p, max_new_tokens=100, temperature=1, seed=s) for p in PROMPTS
               for s in range(6)]
    ended = [r for r in results if r.stats.finish_reason == "eos"]
    assert ended, "no sample ended with EOS; pick other seeds"
    for r in ended:
        assert r.token_ids[-1] in pipe.manifest.eos_token_ids
        assert "<|endoftext|>" not in r.text


def test_ignore_eos_generates_max_new_tokens(pipes):
    pipe = pipes["gpt2"]
    ended = next(
        (p, s) for p in PROMPTS for s in range(6)
        if pipe.generate(p, max_new_tokens=100, temperature=1, seed=s).stats.finish_reason == "eos"
    )
    prompt, seed = ended
    full = pipe.generate(prompt, max_new_tokens=100, temperature=1, seed=seed, ignore_eos=True)
    assert len(full.token_ids) == 100 and full.stats.finish_reason == "max_new_tokens"


def test_stop_strings_cut_the_text(pipes):
    pipe = pipes["llama"]
    full = pipe.generate("def add(a, b):", max_new_tokens=40).text
    stop = full[5:8]
    cut = pipe.generate("def add(a, b):", max_new_tokens=40, stop=[stop])
    assert cut.text == full[: full.index(stop)]
    assert cut.stats.finish_reason == "stop_string"


def test_a_stop_string_ends_the_ids_at_the_token_completing_it(pipes):
    pipe = pipes["llama"]
    settings = {"max_new_tokens": 40, "draft_length": 8, "schedule": "fixed", "token_healing": False}
    full = pipe.generate("def add(a, b):", **settings)
    for start in (3, 9, 15):
        stop = full.text[start : start + 2]
        if "\ufffd" in stop:  # a byte of a character: not a string a user would stop at
            continue
        cut = pipe.generate("def add(a, b):", stop=[stop], **settings)
        ids = cut.token_ids
        assert ids == full.token_ids[: len(ids)]
        assert stop in pipe.tokenizer.decode(ids) and stop not in pipe.tokenizer.decode(ids[:-1])
        assert cut.stats.new_tokens == len(ids)


def test_stream_yields_the_text_in_pieces(pipes):
    pipe = pipes["llama_noisy"]
    stream = pipe.stream("Grüße aus", max_new_tokens=40, draft_length=3)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text
    assert stream.result.text == pipe.generate("Grüße aus", max_new_tokens=40,
                                               draft_length=3).text
    assert all(pieces)



def test_a_prefill_scores_one_row_and_a_run_after_it_all_of_them(packages, monkeypatch):
    """A fused graph scores only the rows asked for (LOGITS_TO_KEEP): a prefill, whose logits
    go unread, gets one row, the same as the last of a run scoring all; the run after it
    scores every row again (the input is fed at every run: an IO binding would otherwise keep
    the prefill's 1). Then a generation prefills with one row and decodes as before."""
    from edgespec.runtime import session as session_module

    pipe = edgespec.load(packages["llama"], calibration_cache=False)
    target = pipe.target
    assert target.keeps_rows
    tokens = np.arange(3, 12)
    one = target.forward(tokens, target.new_cache(16), keep=1)
    cache = target.new_cache(16)
    every = target.forward(tokens, cache)
    assert one.shape == (1, every.shape[1]) and every.shape[0] == len(tokens)
    np.testing.assert_allclose(one[0], every[-1], rtol=0, atol=1e-5)
    after_one = target.new_cache(16)
    target.forward(tokens[:5], after_one, keep=1)
    rest = target.forward(tokens[5:], after_one)
    assert rest.shape == every[5:].shape
    np.testing.assert_allclose(rest, every[5:], rtol=0, atol=1e-5)

    scored = []
    run = session_module.ModelSession._run

    def spy(self, tokens, cache, features, keep=0):
        logits, rows = run(self, tokens, cache, features, keep)
        scored.append((self is pipe.target, len(tokens), len(logits)))
        return logits, rows

    monkeypatch.setattr(session_module.ModelSession, "_run", spy)
    result = pipe.generate("def add(a, b):\n    return", max_new_tokens=8, temperature=0.0,
                           drafter="model", draft_length=2, schedule="fixed", ignore_eos=True)
    prefill = next(s for s in scored if s[0])
    assert prefill[1] == result.stats.prompt_tokens - 1 > 1 and prefill[2] == 1
    assert any(s[0] and s[2] == s[1] > 1 for s in scored)  # verification scores every row
    assert result.stats.drafted > 0
