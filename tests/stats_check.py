"""Goodness-of-fit helpers shared by the statistical tests."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy.stats import chisquare

# A correct sampler fails a test at this level once in 10,000 seeds; the wrong samplers the
# tests use are rejected with p-values many orders of magnitude below it.
ALPHA = 1e-4


def fit_pvalue(samples: list, expected: dict) -> float:
    """Chi-square p-value of samples (hashable outcomes) against exact probabilities.

    Outcomes whose expected count is below 5 are pooled into one cell, as the chi-square
    approximation requires; an outcome outside ``expected`` counts in that pooled cell, and
    with zero expected mass there the fit is rejected outright.
    """
    n = len(samples)
    counts = Counter(samples)
    big = {o for o, p in expected.items() if p * n >= 5}
    observed = [counts[o] for o in big]
    predicted = [expected[o] * n for o in big]
    rest_observed = n - sum(observed)
    rest_expected = n - sum(predicted)
    if rest_expected >= 5:
        observed.append(rest_observed)
        predicted.append(rest_expected)
    elif rest_observed > 2 * max(rest_expected, 1):
        return 0.0
    if len(observed) == 1:  # a point mass: every sample must be that outcome
        return 1.0 if observed[0] == n else 0.0
    predicted = np.array(predicted) * sum(observed) / sum(predicted)  # pooled rounding
    return float(chisquare(observed, predicted).pvalue)
