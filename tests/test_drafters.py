"""The drafters behind the one seam: the n-gram index against a brute-force scan, and the loop
with n-gram drafting on NumPy fake sessions (same seed, same text; the target's distribution).
Exactness through real onnxruntime sessions: test_ngram.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from fakes import (
    SAMPLED,
    PrefixSession,
    RandomSchedule,
    exact_joint,
    fake_drafter,
    fake_pair,
    keep_every_draft_token,
    replace_rejected_from_p,
)
from stats_check import ALPHA, fit_pvalue

from edgespec.config import GenerationConfig, SamplingConfig
from edgespec.errors import ConfigError
from edgespec.runtime import acceptance, drafters, sampling
from edgespec.runtime.drafters import NgramDrafter, NgramIndex, resolve_drafter
from edgespec.runtime.schedule import FixedSchedule, HeuristicSchedule
from edgespec.runtime.speculative import decode
from edgespec.runtime.stats import GenerationStats


def brute_force_lookup(tokens: list[int], min_n: int, max_n: int) -> int | None:
    """The definition: longest suffix first, its latest earlier occurrence, what followed it."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        for end in range(length - 1, n - 1, -1):  # an occurrence followed by a token
            if tokens[end - n : end] == tokens[length - n :]:
                return tokens[end]
    return None


operations = st.lists(
    st.one_of(
        st.tuples(st.just("extend"), st.lists(st.integers(0, 3), max_size=12)),
        st.tuples(st.just("truncate"), st.integers(0, 40)),
    ),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(operations, st.integers(1, 4), st.integers(0, 3))
def test_the_index_agrees_with_a_brute_force_scan_through_appends_and_rollbacks(ops, lo, extra):
    index = NgramIndex(lo, lo + extra)
    for op, arg in ops:
        if op == "extend":
            index.extend(arg)
        else:
            index.truncate(min(arg, len(index.tokens)))
        assert index.lookup() == brute_force_lookup(index.tokens, lo, lo + extra)
    fresh = NgramIndex(lo, lo + extra)
    fresh.extend(index.tokens)
    assert index.ends == fresh.ends  # a rollback leaves nothing behind


def test_the_lookup_prefers_the_longest_match_then_the_latest():
    index = NgramIndex(1, 3)
    index.extend([5, 6, 7, 1, 6, 7, 2, 9, 7, 3, 6, 7])
    assert index.lookup() == 2  # "6 7" followed by 1, then by 2: the latest
    index.extend([2, 8, 6, 7])  # "8 6 7" is new; "6 7" was last followed by 2 (position 12)
    assert index.lookup() == 2
    index.truncate(3)  # [5, 6, 7]: "7" never occurred before
    assert index.lookup() is None


def test_the_drafter_proposal_depends_on_the_prefix_only():
    """Drafted, rolled back, asked again: the same point masses as a fresh drafter's."""
    rng = np.random.default_rng(0)
    text = rng.integers(0, 4, size=60).tolist()
    used = NgramDrafter(1, 3, GenerationStats(speculative=True))
    used.prefill(text[:10])
    for cut in range(10, 50, 3):
        drafted = used.propose(text[:cut], 5, SamplingConfig(), None).tokens
        fresh = NgramDrafter(1, 3, GenerationStats(speculative=True))
        fresh.prefill(text[:cut])
        assert fresh.propose(text[:cut], 5, SamplingConfig(), None).tokens == drafted
        used.rollback(cut - 2)  # as a round that kept part of its drafts
    assert used.stats.draft_calls > 0 and used.stats.draft_s > 0


def test_drafter_settings_are_validated():
    with pytest.raises(ConfigError, match="drafter must be one of auto, model, ngram, none"):
        GenerationConfig(drafter="lookup")
    with pytest.raises(ConfigError, match=r"ngram_max must be an integer in 1..8"):
        GenerationConfig(ngram_max=9)
    with pytest.raises(ConfigError, match=r"ngram_min must be an integer in 1..ngram_max \(2\)"):
        GenerationConfig(ngram_min=3, ngram_max=2)
    with pytest.raises(ConfigError, match="target only; use drafter ngram or none"):
        resolve_drafter(GenerationConfig(drafter="model"), None)
    assert resolve_drafter(GenerationConfig(), None) == "ngram"
    model, head = PrefixSession(4, 1.0, 0), PrefixSession(4, 1.0, 0)
    head.reads_features = True  # as an EAGLE-3 head's session
    assert resolve_drafter(GenerationConfig(), model) == "mixed"
    assert resolve_drafter(GenerationConfig(drafter="model"), model) == "model"
    assert resolve_drafter(GenerationConfig(), head) == "eagle3"
    assert resolve_drafter(GenerationConfig(drafter="model"), head) == "eagle3"
    assert resolve_drafter(GenerationConfig(drafter="none"), model) == "none"


def test_a_drafter_without_a_name_is_refused_where_it_is_defined():
    with pytest.raises(TypeError, match="Forgetful must set name"):
        class Forgetful(drafters.Drafter):
            def next_row(self, committed, drafted, sampling):
                return None

    class Named(drafters.Drafter):
        name = "mine"

    class Extended(drafters.NgramDrafter):  # an n-gram drafter: its parent's name
        pass

    assert Named().drafts and Extended.name == "ngram" and not drafters.NoDrafter().drafts


# ---------------------------------------------------------------------------------------------
# The loop with n-gram drafting on fake sessions (logits a function of the prefix)

PROMPT = (1, 2, 3, 1, 2, 3, 1, 2)  # repeats: the lookup proposes from the first token on


def ngram_decode(config: GenerationConfig, schedule, prompt=PROMPT, vocab=12):
    """Generated tokens and stats of decode() with the n-gram drafter (or none) on a fake target."""
    target, _ = fake_pair(vocab)
    stats = GenerationStats(speculative=config.drafter != "none")
    committed = list(prompt)
    for new in decode(target, fake_drafter(None, config, stats, prompt), list(prompt), config,
                      schedule, 64, set(), stats):
        committed += new
        assert target.caches[-1].tokens == committed[:-1]
    return committed[len(prompt) :], stats


KEYED_SCHEDULES = {  # every round drafts (k >= 1): every position drawn from (p, q, u)
    **{f"k={k}": lambda k=k: FixedSchedule(k) for k in (1, 2, 4, 8)},
    "heuristic": lambda: HeuristicSchedule(2),
}
SCHEDULES = {**KEYED_SCHEDULES, "random, with k = 0": lambda: RandomSchedule(3)}


@pytest.mark.parametrize("setting", SAMPLED)
def test_ngram_text_depends_on_the_seed_not_on_the_draft_lengths(setting):
    for seed in range(4):
        config = GenerationConfig(max_new_tokens=30, sampling=SAMPLED[setting], seed=seed,
                                  drafter="ngram")
        runs = {name: ngram_decode(config, make()) for name, make in KEYED_SCHEDULES.items()}
        texts = {name: tuple(text) for name, (text, _) in runs.items()}
        assert len(set(texts.values())) == 1, texts
        assert runs["k=4"][1].accepted > 0 and runs["k=4"][1].rejected > 0


def test_ngram_greedy_on_fake_sessions_is_the_target_argmax_whatever_k():
    config = GenerationConfig(max_new_tokens=30, drafter="ngram")
    alone, _ = ngram_decode(replace(config, drafter="none"), FixedSchedule(1))
    for name, make in SCHEDULES.items():
        text, stats = ngram_decode(config, make())
        assert text == alone, name
        assert stats.drafted > 0


class CopyOnDrafter(NgramDrafter):
    """Wrong: one lookup per round, then copying on from that match (what transformers' and
    vLLM's lookups propose, but not a function of the prefix: it depends on where the round
    began, so k changes the text)."""

    def propose(self, committed, k, sampling_config, u, penalties=None, limit=None):
        tokens = super().propose(committed, 1, sampling_config, u).tokens
        if tokens:
            self.rollback(len(committed))
            text = self.index.tokens
            end = next(e for e in range(len(text) - 1, 0, -1)  # the latest match, any length
                       if text[e - 1] == text[-1] and text[e] == tokens[0])
            tokens = text[end : end + k]
        return drafters.Proposal(tokens, [sampling.point_mass(t) for t in tokens],
                                 (self.name,) * len(tokens))


def test_the_same_text_check_fails_for_a_drafter_that_copies_on_from_one_match(monkeypatch):
    monkeypatch.setattr(drafters, "NgramDrafter", CopyOnDrafter)
    differs = []
    for seed in range(4):
        config = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(1.0), seed=seed,
                                  drafter="ngram")
        texts = {tuple(ngram_decode(config, make(), vocab=4)[0])
                 for make in KEYED_SCHEDULES.values()}
        differs.append(len(texts) > 1)
    assert any(differs)


N_LOOP = 2000


def first_tokens_pvalue(sampling_config: SamplingConfig, k: int) -> tuple[float, int, int]:
    """Chi-square of the first 3 tokens of n-gram speculative decoding on a fake 4-token target
    against its exact joint distribution; also the tokens drafted and accepted in all."""
    target, _ = fake_pair(vocab=4)
    expected = exact_joint(target, sampling_config, PROMPT, vocab=4, length=3)
    samples, drafted, accepted = [], 0, 0
    for seed in range(N_LOOP):
        config = GenerationConfig(max_new_tokens=3, sampling=sampling_config, seed=seed,
                                  draft_length=k,
                                  drafter="ngram")
        text, stats = ngram_decode(config, FixedSchedule(k), vocab=4)
        samples.append(tuple(text))
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    return fit_pvalue(samples, expected), drafted, accepted


@pytest.mark.parametrize("setting", SAMPLED)
def test_the_ngram_loop_emits_the_targets_distribution(setting):
    pvalue, drafted, accepted = first_tokens_pvalue(SAMPLED[setting], k=2)
    assert 0.1 * drafted < accepted < 0.9 * drafted  # both outcomes exercised
    assert pvalue > ALPHA


@pytest.mark.parametrize("wrong", [keep_every_draft_token, replace_rejected_from_p])
def test_the_ngram_loop_check_rejects_a_wrong_draw(monkeypatch, wrong):
    monkeypatch.setattr(acceptance, "accept_or_replace", wrong)
    assert first_tokens_pvalue(SAMPLED["T=1"], k=2)[0] < 1e-6
