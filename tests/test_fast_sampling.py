"""The loop's fast sampler against the dense reference, and the per-position draw.

p is the target's distribution, q the draft's (as in edgespec/runtime/sampling.py). The
reference (``process_logits``, ``verify``, tests/reference.py) is the oracle: the fast path must give the same
distributions, the same greedy tokens, and tokens distributed exactly as p.
"""

from __future__ import annotations

from contextlib import contextmanager

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from fakes import (
    SAMPLED,
    SAMPLED_AND_PENALIZED,
    PrefixSession,
    RandomSchedule,
    exact_joint,
    fake_decode,
    fake_pair,
    keep_every_draft_token,
    replace_rejected_from_p,
)
from stats_check import ALPHA, fit_pvalue

from edgespec.config import GenerationConfig, SamplingConfig
from reference import penalize, process_logits

from edgespec.runtime import acceptance, sampling
from edgespec.runtime.acceptance import (
    PositionUniforms,
    accept_or_replace,
    position_token,
    residual,
    verify_greedy,
    verify_sampled,
)
from edgespec.runtime.penalties import Penalties
from edgespec.runtime.sampling import Dist, process_row
from edgespec.runtime.schedule import FixedSchedule, HeuristicSchedule

# The fast path works in float32: probabilities agree with the float64 reference to this, and a
# nucleus boundary whose mass lies this close to top_p may fall on either side.
ATOL = 1e-6
BOUNDARY = 1e-5


def assert_same_distribution(logits: np.ndarray, config: SamplingConfig) -> None:
    """process_row(row) == process_logits(row), allowing for top_p's float32 rounding.

    Where the reference's mass before some token lies within BOUNDARY of top_p, the nucleus may
    end on either side of that token: then the fast row must still be a nucleus (a top set, ties
    together, its last token due and its mass reaching top_p) to within BOUNDARY.
    """
    fast = process_row(logits, config).dense(len(logits))
    assert np.all(fast >= 0) and fast.sum() == pytest.approx(1.0)
    if np.allclose(fast, process_logits(logits[None], config)[0], rtol=1e-5, atol=ATOL):
        return
    assert config.top_p < 1, "only a nucleus boundary may differ"
    unfiltered = process_logits(logits[None], replace(config, top_p=1.0))[0]
    kept = fast > 0
    np.testing.assert_allclose(fast[kept], unfiltered[kept] / unfiltered[kept].sum(),
                               rtol=1e-5, atol=ATOL)
    least = unfiltered[kept].min()
    assert unfiltered[~kept].max(initial=0.0) < least  # a top set, tied tokens together
    assert unfiltered[unfiltered > least].sum() < config.top_p + BOUNDARY  # the last was due
    assert unfiltered[kept].sum() >= config.top_p - BOUNDARY  # and the set reaches top_p


def mass_before(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """The reference's mass likelier than each token, likeliest first, computed as it does."""
    ranked = np.sort(process_logits(logits[None], replace(config, top_p=1.0))[0])[::-1]
    return np.cumsum(ranked) - ranked


# ---------------------------------------------------------------------------------------------
# process_row == process_logits


# Logits on a grid of 1/64: distinct logits stay distinct through (x - max) / T in float64. Closer
# ones (1e-34 and 0 next to a max of 1) are tied or not by rounding, in the reference too.
logit_values = st.integers(-30 * 64, 30 * 64).map(lambda i: i / 64)
tied_values = st.sampled_from([-np.inf, -3.0, -1.0, 0.0, 0.5, 2.0, 2.0, 7.0])  # many ties
temperatures = st.sampled_from([1e-310, 1e-40, 1e-30, 0.05, 0.3, 0.7, 1.0, 2.5, 1e6])


@settings(max_examples=400, deadline=None)
@given(
    logits=st.integers(1, 40).flatmap(
        lambda n: arrays(np.float32, n, elements=logit_values | tied_values)
    ),
    temperature=temperatures,
    top_k=st.integers(0, 45),
    top_p=st.floats(0.01, 1.0) | st.sampled_from([0.25, 0.5, 0.75, 0.9, 1.0]),
)
def test_fast_rows_are_the_reference_distribution(logits, temperature, top_k, top_p):
    assume(np.isfinite(logits.max()))  # at least one token possible
    assert_same_distribution(logits, SamplingConfig(temperature, top_k, top_p))


@contextmanager
def wide_nucleus_only():
    """Every top-p row through the histogram path, however small its nucleus."""
    limit = sampling._SORT_LIMIT
    sampling._SORT_LIMIT = -1
    try:
        yield
    finally:
        sampling._SORT_LIMIT = limit


@settings(max_examples=400, deadline=None)
@given(
    logits=st.integers(1, 40).flatmap(
        lambda n: arrays(np.float32, n, elements=logit_values | tied_values)
    ),
    temperature=temperatures,
    top_p=st.floats(0.01, 0.999) | st.sampled_from([0.25, 0.5, 0.75, 0.9]),
)
def test_the_histogram_nucleus_is_the_reference_nucleus(logits, temperature, top_p):
    assume(np.isfinite(logits.max()))
    with wide_nucleus_only():
        assert_same_distribution(logits, SamplingConfig(temperature, 0, top_p))


def test_the_histogram_nucleus_keeps_ties_and_is_strict():
    weights = np.array([1.0, 4.0, 2.0, 1.0], dtype=np.float32)  # p = 1/8, 1/2, 1/4, 1/8
    x = np.log2(weights)
    with wide_nucleus_only():
        kept = {p: sampling._nucleus(None, x, weights, p)[0].tolist() for p in (0.5, 0.75, 0.76)}
    assert kept == {0.5: [1], 0.75: [1, 2], 0.76: [0, 1, 2, 3]}


@settings(max_examples=200, deadline=None)
@given(
    logits=st.integers(2, 30).flatmap(lambda n: arrays(np.float32, n, elements=logit_values)),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_k=st.integers(0, 10),
    token=st.integers(1, 29),
)
def test_top_p_exactly_at_a_mass_the_reference_reaches(logits, temperature, top_k, token):
    """top_p = the reference's own mass before its j-th likeliest token: the nucleus ends there."""
    config = SamplingConfig(temperature, top_k)
    top_p = float(mass_before(logits, config)[min(token, len(logits) - 1)])
    assume(0 < top_p <= 1)
    assert_same_distribution(logits, replace(config, top_p=top_p))


@pytest.mark.parametrize("vocab", [20_000, 151_936, 262_144])  # 262,144: Gemma 3
@pytest.mark.parametrize(
    "config",
    [SamplingConfig(1.0), SamplingConfig(0.7, top_p=0.9), SamplingConfig(0.8, top_k=50),
     SamplingConfig(1.2, top_k=400, top_p=0.5), SamplingConfig(0.7, top_p=0.999),
     SamplingConfig(5.0, top_p=0.95), SamplingConfig(0.8, min_p=0.05),
     SamplingConfig(1.5, top_k=400, top_p=0.9, min_p=0.01)],
    ids=str,
)
def test_fast_rows_match_at_real_vocabulary_sizes(vocab, config):
    """Wide rows exercise the candidate sets, the fallbacks and the blocked CDF."""
    rng = np.random.default_rng(vocab)
    for scale in (0.3, 3.0, 8.0):  # flat (the nucleus is most of the row), typical, peaked
        logits = (rng.standard_normal(vocab) * scale).astype(np.float32)
        assert_same_distribution(logits, config)


def test_greedy_is_the_argmax_first_on_ties():
    logits = np.array([0.1, 3.0, -1.0, 3.0], dtype=np.float32)
    assert process_row(logits, SamplingConfig(0)).dense(4).tolist() == [0, 1, 0, 0]
    rows = np.array([[0.1, 3.0, -1.0, 3.0], [5.0, 0.0, 0.0, 5.0]], dtype=np.float32)
    assert verify_greedy([1], rows) == (1, 0)
    assert verify_greedy([3], rows) == (0, 1)


@settings(max_examples=300, deadline=None)
@given(
    logits=st.integers(1, 40).flatmap(
        lambda n: arrays(np.float32, n, elements=logit_values | tied_values)
    ),
    temperature=temperatures,
    top_k=st.integers(0, 45),
    min_p=st.floats(0.0, 1.0) | st.sampled_from([0.05, 0.1, 0.5, 1.0]),
)
def test_min_p_rows_are_the_reference_distribution(logits, temperature, top_k, min_p):
    assume(np.isfinite(logits.max()))
    assert_same_distribution(logits, SamplingConfig(temperature, top_k, min_p=min_p))


def test_min_p_is_cut_on_the_logits_not_on_the_tempered_row(monkeypatch):
    """llama.cpp's min-p (p at temperature 1) keeps 2 tokens of this row at T = 2, where the
    cut taken after temperature (transformers') keeps 3: the check above tells them apart."""
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    config = SamplingConfig(2.0, min_p=0.3)  # ln 0.3 = -1.2: a cut at 0.8; at T = 2, -0.4
    assert_same_distribution(logits, config)
    assert np.count_nonzero(process_row(logits, config).dense(4)) == 2
    original = sampling._min_p

    def tempered(ids, row, weights, cut):
        top = float(row.max())
        return original(ids, row, weights, top + (cut - top) * config.temperature)

    monkeypatch.setattr(sampling, "_min_p", tempered)
    with pytest.raises(AssertionError):
        assert_same_distribution(logits, config)


def test_top_p_keeps_tokens_tied_with_the_last_kept():
    logits = np.log(np.array([0.3, 0.3, 0.3, 0.1], dtype=np.float32))
    fast = process_row(logits, SamplingConfig(1.0, top_p=0.2)).dense(4)
    np.testing.assert_allclose(fast, [1 / 3, 1 / 3, 1 / 3, 0], rtol=1e-6)


def test_top_k_keeps_ties_at_the_kth_logit():
    logits = np.array([4.0, 1.0, 2.0, 2.0, 2.0, 0.0], dtype=np.float32)
    fast = process_row(logits, SamplingConfig(1.0, top_k=2)).dense(6)
    assert np.flatnonzero(fast).tolist() == [0, 2, 3, 4]


def test_a_single_token_vocabulary():
    for config in (SamplingConfig(0), SamplingConfig(1.0, top_k=1, top_p=0.1)):
        row = process_row(np.array([-2.0], dtype=np.float32), config)
        assert row.dense(1).tolist() == [1.0] and row.draw(0.99) == 0


@pytest.mark.parametrize("temperature", [1e-310, 1e-40, 1e-300])
def test_a_vanishing_temperature_is_uniform_over_the_tied_maxima(temperature):
    """1/T overflows (float32 or float64): the max is subtracted first, so no NaN."""
    logits = np.array([[1.0, 3.0, 3.0, -np.inf, 2.999]], dtype=np.float32)
    expected = [0, 0.5, 0.5, 0, 0]
    config = SamplingConfig(temperature=temperature)
    np.testing.assert_array_equal(process_logits(logits, config)[0], expected)
    np.testing.assert_array_equal(process_row(logits[0], config).dense(5), expected)
    np.testing.assert_array_equal(
        process_row(logits[0], replace(config, top_p=0.3)).dense(5), expected
    )


# ---------------------------------------------------------------------------------------------
# Draws, residuals, acceptance


def reference_inverse_cdf(probs: np.ndarray, u: float) -> int:
    cdf = np.cumsum(probs)
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


@pytest.mark.parametrize("vocab", [7, 5_000, 151_936, 262_144])
@pytest.mark.parametrize("config", [SamplingConfig(1.0), SamplingConfig(0.7, top_p=0.9)], ids=str)
def test_a_uniform_draws_the_token_the_reference_would(vocab, config):
    rng = np.random.default_rng(1)
    row = process_row((rng.standard_normal(vocab) * 3).astype(np.float32), config)
    probs = row.dense(vocab)
    cdf = np.cumsum(probs)
    for u in rng.random(300):
        if np.min(np.abs(cdf - u)) > 1e-6:  # away from an interval's edge, where rounding decides
            assert row.draw(u) == reference_inverse_cdf(probs, u)


@pytest.mark.parametrize("vocab", [9, 30_000])
def test_a_draw_never_lands_on_a_zero_weight(vocab):
    weights = np.zeros(vocab, dtype=np.float32)
    weights[[2, vocab // 2, vocab - 3]] = [1.0, 2.0, 1.0]
    row = Dist(None, weights, 4.0)
    u_max = np.nextafter(1.0, 0.0)
    assert [row.draw(u) for u in (0.0, 0.25, 0.5, 0.75, u_max)] == [
        2, vocab // 2, vocab // 2, vocab - 3, vocab - 3
    ]


def random_dist(rng: np.random.Generator, vocab: int, config: SamplingConfig) -> Dist:
    return process_row((rng.standard_normal(vocab) * 2).astype(np.float32), config)


@pytest.mark.parametrize(
    "config", [SamplingConfig(1.0), SamplingConfig(0.9, top_p=0.8), SamplingConfig(1, top_k=5)],
    ids=str,
)
def test_the_residual_is_norm_max_p_minus_q(config):
    rng = np.random.default_rng(2)
    for vocab in (6, 40, 20_000):
        p, q = random_dist(rng, vocab, config), random_dist(rng, vocab, config)
        expected = np.maximum(p.dense(vocab) - q.dense(vocab), 0)
        np.testing.assert_allclose(residual(p, q).dense(vocab), expected / expected.sum(),
                                   atol=1e-9)
    p = random_dist(rng, 30, config)
    assert residual(p, p) is p  # no mass left: p itself


def test_acceptance_reads_only_the_drafted_tokens_and_rows_up_to_the_first_rejection():
    rng = np.random.default_rng(3)
    config = SamplingConfig(1.0)
    rows = (rng.standard_normal((5, 50)) * 3).astype(np.float32)  # target rows [k+1, V]
    q_rows = [process_row(r, config) for r in rows[:4]]  # draft == target: always accepted
    read = []

    class Rows:
        def __getitem__(self, i):
            read.append(i)
            return rows[i]

    u = np.full((5, 3), 0.5)
    assert verify_sampled([1, 2, 3, 4], q_rows, Rows(), config, u) == (4, None)
    assert read == [0, 1, 2, 3]  # row k is read by the position draw, not here

    read.clear()
    q_rows[1] = process_row(-rows[1], config)  # unlike p: its likeliest tokens are p's least
    x = int(np.argmax(-rows[1]))
    n, token = verify_sampled([1, x, 3, 4], q_rows, Rows(), config, u)
    assert (n, read) == (1, [0, 1]) and token != x

    read.clear()
    assert verify_greedy([int(rows[0].argmax()), -1, 0], Rows()) == (1, int(rows[1].argmax()))
    assert read == [0, 1]


def test_acceptance_is_u_times_q_below_p():
    p = Dist(np.array([0, 1]), np.array([0.25, 0.75]), 1.0)
    q = Dist(np.array([0, 1]), np.array([0.5, 0.5]), 1.0)
    assert accept_or_replace(1, p, q, np.array([0, 0.99, 0])) == (True, 1)  # q <= p: always
    assert accept_or_replace(0, p, q, np.array([0, 0.49, 0])) == (True, 0)  # 0.49 * 0.5 < 0.25
    assert accept_or_replace(0, p, q, np.array([0, 0.5, 0])) == (False, 1)  # residual: token 1


# ---------------------------------------------------------------------------------------------
# The per-position draw: token = f(u[n], p_n, q_n) follows p


def dist(probs, top_p=1.0) -> Dist:
    """The row process_row makes from log-probabilities at temperature 1 (0 -> -inf)."""
    with np.errstate(divide="ignore"):
        logits = np.log(np.asarray(probs, dtype=np.float32))
    return process_row(logits, SamplingConfig(1.0, top_p=top_p))


CASES = {
    "q different from p": (dist([0.1, 0.2, 0.3, 0.4]), dist([0.4, 0.3, 0.2, 0.1])),
    "q equals p": (dist([0.7, 0.1, 0.1, 0.1]), dist([0.7, 0.1, 0.1, 0.1])),
    "q zero where p is not": (dist([0.1, 0.2, 0.3, 0.4]), dist([0.0, 0.5, 0.5, 0.0])),
    "q confident where p is near zero": (
        dist([1e-6, 0.5, 0.3, 0.2]), dist([0.97, 0.01, 0.01, 0.01])
    ),
    "nuclei with other supports": (
        dist([0.1, 0.2, 0.3, 0.4], top_p=0.6), dist([0.4, 0.3, 0.2, 0.1], top_p=0.6)
    ),
    "greedy point masses": (sampling.point_mass(2), sampling.point_mass(1)),
}


def draw_pvalue(draw, p: Dist, q: Dist, n_samples=15_000, seed=0) -> float:
    u = np.random.default_rng(seed).random((n_samples, 3))
    samples = [draw(p, q, row) for row in u]
    return fit_pvalue(samples, {t: float(x) for t, x in enumerate(p.dense(4))})


@pytest.mark.parametrize("case", CASES)
def test_the_position_draw_follows_p(case):
    assert draw_pvalue(position_token, *CASES[case]) > ALPHA


def draft_without_the_test(p, q, u):
    """Wrong: emits the draft token as drawn: the output follows q."""
    return q.draw(u[0])


def replace_from_p(p, q, u):
    """Wrong: right acceptance test, but a rejected token is replaced by a draw from p."""
    x = q.draw(u[0])
    return x if u[1] * q.prob(x) < p.prob(x) or q.prob(x) <= p.prob(x) else p.draw(u[2])


def reuse_the_draft_uniform(p, q, u):
    """Wrong: the acceptance test reuses u[0], which chose x: test and draw are dependent."""
    return position_token(p, q, np.array([u[0], u[0], u[2]]))


@pytest.mark.parametrize("wrong", [draft_without_the_test, replace_from_p, reuse_the_draft_uniform])
def test_the_same_check_rejects_a_wrong_draw(wrong):
    assert draw_pvalue(wrong, *CASES["q different from p"]) < 1e-12


# ---------------------------------------------------------------------------------------------
# Position-keyed uniforms


def test_a_generator_gives_the_same_stream_in_chunks_or_at_once():
    at_once = np.random.default_rng(42).random((700, 3))
    rng = np.random.default_rng(42)
    chunks = np.concatenate([rng.random((n, 3)) for n in (1, 255, 256, 188)])
    np.testing.assert_array_equal(chunks, at_once)


def test_position_uniforms_depend_only_on_seed_and_position():
    table = np.random.default_rng(7).random((1000, 3))
    uniforms = PositionUniforms(7, first=12)
    for n, count in [(600, 9), (0, 1), (3, 4), (255, 2), (999, 1), (40, 9)]:
        np.testing.assert_array_equal(uniforms.rows(12 + n, count), table[n : n + count])
    with pytest.raises(IndexError):
        uniforms.rows(11, 1)


def test_the_nucleus_rule_is_strict_and_keeps_ties():
    """Exactly representable masses: a token is kept iff the mass likelier than it is < top_p."""
    weights = np.array([1.0, 4.0, 2.0, 1.0], dtype=np.float32)  # p = 1/8, 1/2, 1/4, 1/8
    x = np.log2(weights)
    kept = {p: sampling._nucleus(None, x, weights, p)[0].tolist() for p in (0.5, 0.75, 0.76)}
    assert kept == {0.5: [1], 0.75: [1, 2], 0.76: [0, 1, 2, 3]}  # 0.76: token 3's tie kept


# ---------------------------------------------------------------------------------------------
# The loop on NumPy fake sessions: logits are a function of the token prefix


@pytest.mark.parametrize("setting", SAMPLED_AND_PENALIZED)
def test_the_text_depends_on_the_seed_not_on_the_draft_lengths(setting):
    for seed in range(4):
        config = GenerationConfig(max_new_tokens=24, sampling=SAMPLED_AND_PENALIZED[setting],
                                  seed=seed, draft_length=4, drafter="model")
        texts = {
            name: fake_decode(*fake_pair(), config, schedule)
            for name, schedule in {
                **{f"k={k}": FixedSchedule(k) for k in (1, 2, 3, 5, 8)},
                "heuristic": HeuristicSchedule(2),
            }.items()
        }
        assert len({tuple(t) for t in texts.values()}) == 1, texts
    other = replace(config, seed=99)
    assert fake_decode(*fake_pair(), other, FixedSchedule(2)) != texts["k=1"]


class CountingSession(PrefixSession):
    """A PrefixSession that counts the tokens it was run on."""

    fed = 0

    def forward(self, tokens: np.ndarray, cache, keep: int = 0) -> np.ndarray:
        self.fed += len(tokens)
        return super().forward(tokens, cache, keep)


@pytest.mark.parametrize("setting", SAMPLED_AND_PENALIZED)
def test_drafting_off_is_one_target_step_and_the_target_only_text(setting):
    """k = 0 rounds never run the draft (after its prefill) and draw from p alone, with the
    position's first uniform: the same text as target-only decoding with the same seed."""
    for seed in range(4):
        config = GenerationConfig(max_new_tokens=24, sampling=SAMPLED_AND_PENALIZED[setting],
                                  seed=seed)
        target, _ = fake_pair()
        draft = CountingSession(12, scale=1.0, salt=2, like=target)
        off = fake_decode(target, draft, config, FixedSchedule(0), prompt=(1, 2))
        assert draft.fed == 1  # the prompt's first token, at prefill; nothing in the rounds
        assert off == fake_decode(fake_pair()[0], None, config, FixedSchedule(0))


def test_greedy_on_fake_sessions_is_the_target_argmax_whatever_k():
    config = GenerationConfig(max_new_tokens=20)
    alone = fake_decode(fake_pair()[0], None, config, FixedSchedule(1))
    for schedule in (FixedSchedule(1), FixedSchedule(4), RandomSchedule(0)):
        assert fake_decode(*fake_pair(), config, schedule) == alone


PENALTIES = SamplingConfig(0.0, repetition_penalty=1.8, presence_penalty=0.7,
                           frequency_penalty=0.5)


def penalized_mismatches(n_cases: int = 200) -> int:
    """Rows Penalties.rows penalizes otherwise than the reference's ``penalize``: random
    texts (prompt, then generated tokens) and drafts over 30 tokens, logits of both signs."""
    rng = np.random.default_rng(0)
    wrong = 0
    for case in range(n_cases):
        prompt = rng.integers(0, 30, rng.integers(1, 8)).tolist()
        committed = prompt + rng.integers(0, 30, rng.integers(0, 8)).tolist()
        drafted = rng.integers(0, 30, rng.integers(0, 4)).tolist()
        logits = rng.standard_normal((len(drafted) + 1, 30)).astype(np.float32) * 3
        penalties = Penalties(PENALTIES, len(prompt))
        if case % 2:  # the counts caught up on an earlier, shorter text first
            penalties.rows(logits[:1], committed[: len(prompt)])
        rows = penalties.rows(logits, committed, drafted)
        for i, row in enumerate(rows):
            expected = penalize(logits[i], committed + drafted[:i], len(prompt), PENALTIES)
            wrong += not np.allclose(row, expected, rtol=1e-6, atol=1e-5)
    return wrong


def test_penalized_rows_are_the_references():
    assert penalized_mismatches() == 0
    none = Penalties(SamplingConfig(1.0), 2)
    logits = np.ones((2, 5), np.float32)
    assert none.rows(logits, [1, 2, 3], [4]) is logits  # nothing set: the rows as they are


def test_a_draft_row_is_penalized_as_the_target_row_at_its_position():
    """``row`` (a draft's: the text so far and every draft) gives the row ``rows`` gives the
    target at that position, and a subset draft's columns of it."""
    rng = np.random.default_rng(1)
    committed, drafted = [3, 5, 5, 7, 3, 9], [9, 2, 5]
    logits = rng.standard_normal((4, 30)).astype(np.float32) * 3
    penalties = Penalties(PENALTIES, 3)
    target_rows = penalties.rows(logits, committed, drafted)
    np.testing.assert_array_equal(penalties.row(logits[3], committed, drafted), target_rows[3])
    subset = np.array([0, 2, 3, 9, 20])  # column j scores token subset[j]; 5 and 7 are outside
    np.testing.assert_array_equal(
        penalties.row(logits[3][subset], committed, drafted, subset), target_rows[3][subset])


def test_the_penalty_check_rejects_counting_the_prompt_as_generated(monkeypatch):
    """OpenAI's counts are the generated tokens': a Penalties counting the prompt's too (as
    repetition_penalty's set does) fails the same check."""
    original = Penalties.__init__

    def counting_the_prompt(self, sampling, prompt_tokens):
        original(self, sampling, 0)

    monkeypatch.setattr(Penalties, "__init__", counting_the_prompt)
    assert penalized_mismatches() > 0


def test_greedy_with_penalties_is_the_penalized_argmax_whatever_k():
    """Greedy rows are penalized too: speculative == target-only at every k, and the
    penalties change the text (else the check would say nothing)."""
    config = GenerationConfig(max_new_tokens=20, sampling=PENALTIES)
    alone = fake_decode(fake_pair()[0], None, config, FixedSchedule(1))
    for schedule in (FixedSchedule(1), FixedSchedule(4), RandomSchedule(0)):
        assert fake_decode(*fake_pair(), config, schedule) == alone
    assert alone != fake_decode(fake_pair()[0], None, GenerationConfig(max_new_tokens=20),
                                FixedSchedule(1))


N_LOOP = 2000  # generations per check (about 1 s); wrong draws score p < 1e-20


def first_tokens_pvalue(n_samples: int, sampling_config: SamplingConfig, k: int,
                        random_k: bool = False) -> float:
    """Chi-square of the first 3 tokens of speculative decoding on fake sessions against the
    target's exact joint distribution (the reference's p, prefix by prefix). ``random_k``:
    each round's k drawn from 0..4 (drafting switched off and on), else k fixed."""
    target, draft = fake_pair(vocab=4)
    prompt = (1, 2)
    expected = exact_joint(target, sampling_config, prompt, vocab=4, length=3)
    samples = []
    for seed in range(n_samples):
        config = GenerationConfig(max_new_tokens=3, sampling=sampling_config, seed=seed,
                                  draft_length=k)
        schedule = RandomSchedule(seed) if random_k else FixedSchedule(k)
        samples.append(tuple(fake_decode(target, draft, config, schedule, prompt)))
    return fit_pvalue(samples, expected)


@pytest.mark.parametrize("setting", SAMPLED_AND_PENALIZED)
def test_the_loop_emits_the_targets_distribution(setting):
    # One k >= 1 is enough: the same seeds give the same tokens whatever k >= 1 (test above).
    assert first_tokens_pvalue(N_LOOP, SAMPLED_AND_PENALIZED[setting], k=2) > ALPHA


def test_the_loop_emits_the_targets_distribution_with_drafting_switched_on_and_off():
    """k = 0 rounds draw from p and k >= 1 rounds from the draft's proposals, position by
    position in one generation: still the target's distribution."""
    assert first_tokens_pvalue(N_LOOP, SAMPLED["T=1"], k=4, random_k=True) > ALPHA


@pytest.mark.parametrize("wrong", [keep_every_draft_token, replace_rejected_from_p])
def test_the_loop_check_rejects_a_wrong_draw(monkeypatch, wrong):
    monkeypatch.setattr(acceptance, "accept_or_replace", wrong)
    assert first_tokens_pvalue(N_LOOP, SAMPLED["T=1"], k=2) < 1e-6


def test_the_loop_check_rejects_rows_penalized_without_their_drafts(monkeypatch):
    """Row i of a round is penalized for the drafts before it too: penalizing every row for
    the committed text alone draws the later positions from the wrong rows."""
    rows = Penalties.rows
    monkeypatch.setattr(Penalties, "rows",
                        lambda self, logits, committed, drafted=(): rows(self, logits, committed))
    assert first_tokens_pvalue(N_LOOP, SAMPLED_AND_PENALIZED["T=1 penalties"], k=2) < 1e-6


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.7, top_p=0.9)],
                         ids=str)
def test_the_loop_at_gemmas_vocabulary_gives_one_text_whatever_k(sampling):
    """The loop at 262,144 rows (Gemma 3's vocabulary; the distribution checks above need a
    small one): one seed, one text at every fixed k, another seed another text."""
    vocab = 262_144
    config = GenerationConfig(max_new_tokens=12, sampling=sampling, seed=3, draft_length=4)
    texts = [fake_decode(*fake_pair(vocab), config, FixedSchedule(k)) for k in (1, 2, 4)]
    assert texts[0] == texts[1] == texts[2]
    assert fake_decode(*fake_pair(vocab), replace(config, seed=4), FixedSchedule(2)) != texts[0]


def test_greedy_at_gemmas_vocabulary_is_target_only_whatever_k():
    config = GenerationConfig(max_new_tokens=12)
    alone = fake_decode(fake_pair(262_144)[0], None, config, FixedSchedule(1))
    for schedule in (FixedSchedule(1), FixedSchedule(4), RandomSchedule(1)):
        assert fake_decode(*fake_pair(262_144), config, schedule) == alone
