"""Logit processing, in pure NumPy: a row of logits becomes a distribution (``Dist``).

Letters as in the speculative sampling papers (Leviathan et al. 2023, Chen et al. 2023):
**p is the target's distribution, q is the draft's**, as in transformers'
``_speculative_sampling`` ("q_i and p_i denote the assistant and model probabilities");
gpt-fast swaps them (its p is the draft's, its q the target's).

The loop processes one float32 row at a time (``process_row`` gives a ``Dist``), and only the
work a round needs: an argmax for greedy; for sampling one exp pass for the normaliser, top-k
by a partition of a few candidates, top-p by sorting only the likeliest tokens (all of them
only when the nucleus is that wide). What a round does with the rows (accept, reject, the
residual) is the acceptance rule, in acceptance.py. The dense reference this fast path must
agree with (float64 rows ``[n, V]``, full sorts, a one-hot row for greedy) is the tests'
oracle, tests/reference.py.

The functions are pure: arrays in, a ``Dist`` or a token out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgespec.config import SamplingConfig

# Largest 1/temperature the float32 fast path scales by; below T ~ 3e-39 it works in float64.
_F32_MAX = float(np.finfo(np.float32).max)
# Candidate threshold for top-p, relative to the likeliest token (weight 1): within ~8.3 nats.
_NUCLEUS_TAU = 2.0**-12
# More candidates than this (or too little mass in them): the histogram path, not a sort.
_SORT_LIMIT = 4096
_NUCLEUS_BINS = 4096
# Rows longer than this draw by inverse CDF in blocks (sums per block, then one block's cumsum).
_CDF_BLOCK = 2048


@dataclass(frozen=True)
class Dist:
    """One processed row: token ``ids[j]`` has probability ``weights[j] / total``.

    ``ids`` ascending, the row's support (top-k and top-p rows: a few tokens); ``ids`` None:
    the whole vocabulary, token j has ``weights[j] / total``. Weights are unnormalised
    (float32 exps, or float64), never negative. Draws go through the support in token-id
    order, as the dense reference's ``sample`` does (tests/reference.py), so the same uniform picks the same token.
    """

    ids: np.ndarray | None  # [m] int64, ascending; None: every token of the vocabulary
    weights: np.ndarray  # [m], or [V] when ids is None
    total: float  # the weights' sum

    def prob(self, token: int) -> float:
        """p(token) (or q(token)): one lookup, 0 off the support."""
        if self.ids is None:
            return float(self.weights[token]) / self.total
        j = int(np.searchsorted(self.ids, token))
        found = j < len(self.ids) and self.ids[j] == token
        return float(self.weights[j]) / self.total if found else 0.0

    def probs_at(self, ids: np.ndarray | None) -> np.ndarray:
        """Probabilities (float64) of the tokens ``ids``; None: of every token, ``[V]``."""
        if self.ids is None:
            weights = self.weights if ids is None else self.weights[ids]
            return weights / np.float64(self.total)
        if ids is None:
            raise ValueError("a sparse row does not know the vocabulary size; use dense()")
        j = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return np.where(self.ids[j] == ids, self.weights[j] / np.float64(self.total), 0.0)

    def draw(self, u: float) -> int:
        """The token whose CDF interval (token-id order) holds u in [0, 1): inverse CDF."""
        j = _inverse_cdf(self.weights, u)
        return j if self.ids is None else int(self.ids[j])

    def relabel(self, token_ids: np.ndarray) -> "Dist":
        """This row of a graph whose column j is token ``token_ids[j]`` (ascending): the same
        distribution over those tokens, 0 elsewhere (a subset draft's q, FR-Spec)."""
        return Dist(token_ids if self.ids is None else token_ids[self.ids], self.weights,
                    self.total)

    def dense(self, vocab_size: int) -> np.ndarray:
        """The row as float64 probabilities ``[V]`` (for tests and the reference)."""
        probs = np.zeros(vocab_size)
        probs[slice(None) if self.ids is None else self.ids] = self.probs_at(self.ids)
        return probs


def point_mass(token: int) -> Dist:
    """A row with all its mass on one token: greedy decoding's distribution."""
    return Dist(np.array([token]), np.ones(1), 1.0)


def process_row(logits: np.ndarray, sampling: SamplingConfig) -> Dist:
    """One row of logits ``[V]`` as a distribution: the dense reference's ``process_logits``
    (tests/reference.py) for one row, with less work.

    Greedy: a point mass on the argmax (first index on ties). Otherwise float32: the max, then
    the exps of (logit - max) / T (one pass, 1 for the likeliest token), top-k as the tokens at
    or above the k-th largest logit (ties kept, as the reference keeps them) found by partitioning
    a few candidates, top-p by ``_nucleus``. Probabilities agree with ``process_logits`` to
    float32 rounding; a token whose mass-before lies within that rounding of top_p may fall on
    either side of the nucleus boundary.
    """
    if sampling.greedy:
        return point_mass(int(np.argmax(logits)))
    row = x = np.asarray(logits, dtype=np.float32)  # [V]; no copy for onnxruntime's float32
    top = x.max()
    ids = None
    if 0 < sampling.top_k < len(x):
        ids = _top_k_ids(x, sampling.top_k)
        x = x[ids]
    weights = _scaled_exp(x, top, sampling.temperature)  # [V] or [m], max 1
    if sampling.top_p < 1.0:
        ids, weights = _nucleus(ids, x, weights, sampling.top_p)
    if sampling.min_p > 0:
        ids, weights = _min_p(ids, row, weights, float(top) + math.log(sampling.min_p))
    return Dist(ids, weights, float(weights.sum()))


def _min_p(ids: np.ndarray | None, row: np.ndarray, weights: np.ndarray, cut: float
           ) -> tuple[np.ndarray, np.ndarray]:
    """Of the tokens ``ids`` (None: all) and their ``weights``, those whose logit in ``row``
    ``[V]`` is at least ``cut`` (max + ln(min_p), compared in float64 as the reference does):
    p_1(x) >= min_p * p_1(argmax) at temperature 1. The likeliest token always stays."""
    logits = row if ids is None else row[ids]
    keep = logits.astype(np.float64) >= cut
    return (np.flatnonzero(keep) if ids is None else ids[keep]), weights[keep]


def _scaled_exp(x: np.ndarray, top: float, temperature: float) -> np.ndarray:
    """exp((x - top) / T), the max first so that nothing overflows; float32 if 1/T fits."""
    scale = 1.0 / temperature
    if scale >= _F32_MAX:  # T < ~3e-39: float64, as the reference; the limit of T -> 0 if tiny
        with np.errstate(over="ignore"):
            return np.exp((x.astype(np.float64) - top) / temperature)
    weights = np.subtract(x, top)  # float32, <= 0
    if scale != 1.0:
        weights *= np.float32(scale)
    return np.exp(weights, out=weights)


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids (ascending) of the tokens whose logit is >= the k-th largest: ties at the edge kept.

    A strided sample guesses a cut with some 4k tokens above it; the k-th largest is then found
    by partitioning those candidates, or the whole row if the guess kept fewer than k.
    """
    sample_ = x[:: max(1, len(x) // 4096)]
    rank = min(len(sample_), 4 * k * len(sample_) // len(x) + 8)
    cand = np.flatnonzero(x >= np.partition(sample_, -rank)[-rank])
    if len(cand) < k:
        cand = np.arange(len(x))
    values = x[cand]
    return cand[values >= np.partition(values, -k)[-k]]


def _nucleus(
    ids: np.ndarray | None, x: np.ndarray, weights: np.ndarray, top_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """The reference's nucleus; returns (ids ascending, their float64 weights).

    x, weights: ``[m]``, the logits and exps of the tokens ``ids`` (None: of every token).
    Kept: the tokens where the mass strictly likelier than them is < top_p, and the ties of the
    last one kept. Likelier means a larger logit: float32 exps can round distinct logits to
    one weight (at T = 1e6, say), which would make ties that the reference does not have.
    Usually the nucleus is small: the candidates with weight >= 2^-12 hold it when their mass
    reaches top_p (it is the smallest top set reaching top_p, and they are a top set), and only
    they are sorted. Otherwise (near-flat rows, where the nucleus is most of the vocabulary)
    ``_wide_nucleus`` finds the edge without sorting the row.
    """
    total = np.float64(weights.sum())
    cand = np.flatnonzero(weights >= _NUCLEUS_TAU)
    w_cand = weights[cand]
    if len(cand) > _SORT_LIMIT or w_cand.sum(dtype=np.float64) < top_p * total:
        keep = _wide_nucleus(x, weights, top_p * total)
        kept = np.flatnonzero(keep)
        return (kept if ids is None else ids[kept]), weights[kept].astype(np.float64)
    x_cand = x[cand]
    probs = np.sort(w_cand)[::-1] / total  # float64, likeliest first
    kept = np.count_nonzero(np.cumsum(probs) - probs < top_p)  # >= 1
    # The weights are a monotone function of the logits: both sorted, they line up.
    last_kept = np.sort(x_cand)[::-1][kept - 1]
    keep = x_cand >= last_kept  # ties of the last kept too
    kept_ids = cand[keep] if ids is None else ids[cand[keep]]  # ascending
    return kept_ids, w_cand[keep].astype(np.float64)


def _wide_nucleus(x: np.ndarray, weights: np.ndarray, target: float) -> np.ndarray:
    """The nucleus of a whole row as a mask, by a histogram of the logits instead of a sort.

    Tokens fall into _NUCLEUS_BINS bins by logit (a monotone map, so ties share a bin and a
    higher bin holds only likelier tokens); the bins' masses, summed from the top, name the bin
    b where the mass reaches ``target`` (top_p times the total weight). Every token of a higher
    bin is kept (less than ``target`` is likelier than it), none of a lower one; only bin b's
    few tokens are sorted, to apply the rule and the ties among them.
    """
    lo, hi = float(x[weights > 0].min()), float(x.max())  # the tokens that can be drawn
    if hi == lo:
        return x >= hi  # every token that can be drawn is tied with the likeliest
    # -inf logits (and weights that underflowed to 0) join the lowest bin, with no mass
    clipped = np.maximum(x, np.float32(lo))
    bins = ((clipped - np.float32(lo)) * ((_NUCLEUS_BINS - 1) / (hi - lo))).astype(np.intp)
    mass = np.bincount(bins, weights=weights, minlength=_NUCLEUS_BINS)  # float64
    at_or_above = np.cumsum(mass[::-1])[::-1]
    edge = int(np.count_nonzero(at_or_above >= target)) - 1  # the highest bin reaching target
    edge = max(edge, 0)
    in_edge = np.flatnonzero(bins == edge)
    order = in_edge[np.argsort(-x[in_edge], kind="stable")]  # likeliest first
    w = weights[order].astype(np.float64)
    before = (at_or_above[edge] - mass[edge]) + np.cumsum(w) - w
    kept = max(1, int(np.count_nonzero(before < target)))
    return (bins > edge) | ((bins == edge) & (x >= x[order[kept - 1]]))


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
    """First j with cdf[j] > u * cdf[-1] (float64 sums): never a token of weight 0.

    Long rows are done in blocks: the block sums' cumsum picks the block, then one block's
    cumsum the token; rounding that puts the target past the end picks the last positive weight.
    """
    n = len(weights)
    if n <= 4 * _CDF_BLOCK:
        cdf = np.cumsum(weights, dtype=np.float64)
        return _search(cdf, u * cdf[-1])
    full = n // _CDF_BLOCK * _CDF_BLOCK
    sums = weights[:full].reshape(-1, _CDF_BLOCK).sum(axis=1, dtype=np.float64)
    cum = np.cumsum(np.append(sums, weights[full:].sum(dtype=np.float64)))
    target = u * cum[-1]
    block = _search(cum, target)
    start = block * _CDF_BLOCK
    inner = np.cumsum(weights[start : start + _CDF_BLOCK], dtype=np.float64)
    return start + _search(inner, target - (cum[block - 1] if block else 0.0))


def _search(cdf: np.ndarray, target: float) -> int:
    if target < cdf[-1]:
        return int(np.searchsorted(cdf, target, side="right"))
    return int(np.searchsorted(cdf, cdf[-1], side="left"))  # the last positive weight
