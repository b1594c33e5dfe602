"""The sampler alone, in NumPy: logit processing and the acceptance rule.

p is the target's distribution, q the draft's (as in edgespec/runtime/sampling.py). The
functions checked here are the dense reference (tests/reference.py), the fast path's oracle.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from reference import process_logits, sample, verify
from stats_check import ALPHA, fit_pvalue

from edgespec.config import SamplingConfig

# ---------------------------------------------------------------------------------------------
# process_logits


def test_temperature_zero_gives_one_hot_argmax():
    logits = np.array([[0.1, 3.0, -1.0, 3.0], [5.0, 0.0, 0.0, 0.0]])
    probs = process_logits(logits, SamplingConfig(temperature=0))
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])  # first index on ties


def test_temperature_scales_softmax():
    logits = np.log(np.array([[0.5, 0.3, 0.2]]))
    probs = process_logits(logits, SamplingConfig(temperature=0.5))
    expected = np.array([0.25, 0.09, 0.04]) / 0.38
    np.testing.assert_allclose(probs[0], expected)


def test_top_k_keeps_the_k_most_likely():
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]]))
    probs = process_logits(logits, SamplingConfig(temperature=1, top_k=2))
    np.testing.assert_allclose(probs[0], [0, 4 / 7, 0, 3 / 7])


def test_top_p_keeps_smallest_set_reaching_p():
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]]))
    # 0.4 < 0.6, 0.4 + 0.3 >= 0.6: two tokens kept
    probs = process_logits(logits, SamplingConfig(temperature=1, top_p=0.6))
    np.testing.assert_allclose(probs[0], [0, 4 / 7, 0, 3 / 7])
    # exactly reaching p does not add the next token
    probs = process_logits(logits, SamplingConfig(temperature=1, top_p=0.7))
    np.testing.assert_allclose(probs[0], [0, 4 / 7, 0, 3 / 7])


@settings(max_examples=200, deadline=None)
@given(
    logits=arrays(np.float32, (3, 17), elements=st.floats(-30, 30, width=32)),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.integers(0, 20),
    top_p=st.floats(0.01, 1.0),
)
@example(  # found by hypothesis: the best logit by the smallest float32 step above the rest
    logits=np.array([[0.0, np.finfo(np.float32).tiny, *[0.0] * 15]] * 3, dtype=np.float32),
    temperature=0.3, top_k=1, top_p=1.0)
def test_processed_rows_are_distributions_on_the_best_tokens(logits, temperature, top_k, top_p):
    probs = process_logits(logits, SamplingConfig(temperature, top_k, top_p))
    assert probs.shape == logits.shape
    assert np.all(probs >= 0)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0)
    unfiltered = process_logits(logits, SamplingConfig(temperature))
    for row, full, p in zip(logits, unfiltered, probs):
        # the most likely token always survives (its logit's argmax: after the temperature,
        # logits within float rounding of each other give tied probabilities)
        assert p[row.argmax()] > 0
        assert full[p == 0].max(initial=0) <= full[p > 0].min()  # no likelier token dropped


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.1), dict(temperature=float("inf")), dict(temperature=float("nan")),
     dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)],
)
def test_bad_sampling_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


def test_sample_follows_the_distribution():
    rng = np.random.default_rng(0)
    probs = np.array([0.5, 0.0, 0.2, 0.3])
    draws = [sample(probs, rng) for _ in range(20_000)]
    assert 1 not in draws
    assert fit_pvalue(draws, dict(enumerate(probs))) > ALPHA


# ---------------------------------------------------------------------------------------------
# verify: the emitted tokens must follow p whatever q is
#
# The model below is "position-dependent": at position t the target's distribution is P[t] and
# the draft's Q[t], whatever came before. Tokens emitted by repeated verify rounds must then be
# independent with token t ~ P[t], so the first three follow P[0] x P[1] x P[2] exactly.


def emitted_tokens(verify_fn, P, Q, k, n_tokens, rng) -> tuple:
    out: list[int] = []
    while len(out) < n_tokens:
        t = len(out)
        q_draft, p_target = Q[t : t + k], P[t : t + k + 1]  # [k, V], [k+1, V]
        draft = np.array([sample(q, rng) for q in q_draft])
        n_accepted, next_token = verify_fn(draft, q_draft, p_target, rng)
        out += [*draft[:n_accepted].tolist(), next_token]
    return tuple(out[:n_tokens])


def joint_pvalue(verify_fn, P, Q, k, n_tokens=3, n_samples=30_000, seed=0) -> float:
    rng = np.random.default_rng(seed)
    samples = [emitted_tokens(verify_fn, P, Q, k, n_tokens, rng) for _ in range(n_samples)]
    V = P.shape[1]
    expected = {
        seq: float(np.prod([P[t, x] for t, x in enumerate(seq)]))
        for seq in itertools.product(range(V), repeat=n_tokens)
    }
    return fit_pvalue(samples, expected)


def rows(*dists) -> np.ndarray:
    """Stack distributions and repeat them so every position up to 10 has one."""
    arr = np.array(dists, dtype=np.float64)
    arr /= arr.sum(axis=1, keepdims=True)
    return np.concatenate([arr] * (10 // len(arr) + 1))[:10]


P_VARIED = rows([0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25])
CASES = {
    "q different from p": (P_VARIED, rows([0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7])),
    "q equals p": (P_VARIED, P_VARIED),
    "q zero where p is not": (P_VARIED, rows([0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0])),
    "q confident where p is near zero": (
        rows([1e-6, 0.5, 0.3, 0.2], [0.6, 1e-7, 0.2, 0.2]),
        rows([0.97, 0.01, 0.01, 0.01], [0.01, 0.97, 0.01, 0.01]),
    ),
    "greedy one-hot rows": (rows([0, 0, 1, 0], [1, 0, 0, 0]), rows([0, 0, 1, 0], [0, 1, 0, 0])),
}


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_verify_emits_tokens_distributed_as_p(case, k):
    P, Q = CASES[case]
    assert joint_pvalue(verify, P, Q, k) > ALPHA


def always_accept(draft_tokens, q_draft, p_target, rng):
    """Wrong: keeps every draft token, so the output follows q."""
    return len(draft_tokens), sample(p_target[-1], rng)


def resample_from_p(draft_tokens, q_draft, p_target, rng):
    """Wrong: right acceptance, but a rejected token is replaced by a draw from p, not p - q."""
    for i, x in enumerate(draft_tokens):
        if rng.random() * q_draft[i, x] >= p_target[i, x]:
            return i, sample(p_target[i], rng)
    return len(draft_tokens), sample(p_target[-1], rng)


def bonus_from_q(draft_tokens, q_draft, p_target, rng):
    """Wrong: all accepted, then the bonus token comes from the draft's last row."""
    n, token = verify(draft_tokens, q_draft, p_target, rng)
    return (n, sample(q_draft[-1], rng)) if n == len(draft_tokens) else (n, token)


@pytest.mark.parametrize("wrong", [always_accept, resample_from_p, bonus_from_q])
def test_the_same_check_rejects_a_wrong_sampler(wrong):
    P, Q = CASES["q different from p"]
    assert joint_pvalue(wrong, P, Q, k=2) < 1e-12


def test_greedy_verify_accepts_exactly_the_matching_prefix():
    V = 6
    target_argmax = [3, 1, 4, 1]
    p_target = np.eye(V)[target_argmax]  # [k+1, V]
    draft = np.array([3, 1, 5])
    q_draft = np.eye(V)[draft]  # [k, V]
    assert verify(draft, q_draft, p_target, np.random.default_rng(0)) == (2, 4)
    assert verify(draft[:2], q_draft[:2], p_target[:3], np.random.default_rng(0)) == (2, 4)


def test_residual_of_zero_mass_falls_back_to_p():
    # Rounding can leave p <= q everywhere after a rejection; the replacement then comes from p.
    p_target = np.array([[0.3, 0.3, 0.0], [0.0, 0.0, 1.0]])
    q_draft = np.array([[0.6, 0.4, 0.0]])
    rng = np.random.default_rng(0)
    results = {verify(np.array([0]), q_draft, p_target, rng) for _ in range(200)}
    assert results == {(1, 2), (0, 0), (0, 1)}
