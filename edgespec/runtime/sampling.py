"""Logit processing and the speculative acceptance rule, in pure NumPy.

Letters as in the speculative sampling papers (Leviathan et al. 2023, Chen et al. 2023):
**p is the target's distribution, q is the draft's**, as in transformers'
``_speculative_sampling`` ("q_i and p_i denote the assistant and model probabilities");
gpt-fast swaps them (its p is the draft's, its q the target's).

Two implementations of the same maths:

- The dense reference, ``process_logits``, ``sample`` and ``verify``: float64 rows ``[n, V]``,
  full sorts, a one-hot row for greedy. Plain enough to check by eye; the tests' oracle.
- The fast path the decoding loop uses: one float32 row at a time (``process_row`` gives a
  ``Dist``), and only the work a round needs: an argmax for greedy; for sampling one exp pass
  for the normaliser, top-k by a partition of a few candidates, top-p by sorting only the
  likeliest tokens (all of them only when the nucleus is that wide), p(x) and q(x) read for the
  drafted tokens, the residual built only at a rejection.

Randomness is keyed by position, not drawn as the loop goes: generated token n gets three
uniforms of its own (``PositionUniforms``), and its token is ``position_token(p_n, q_n, u[n])``:
a draft token drawn from q_n with u[n, 0], accepted iff u[n, 1] q_n(x) < p_n(x), else replaced by a
draw from norm(max(0, p_n - q_n)) with u[n, 2]. That is speculative sampling with one draft
token (Leviathan et al. 2023, Theorem 1: the token follows p_n), and since p_n and q_n depend
only on the tokens before n, the text is a function of (seed, prompt) whatever the rounds'
draft lengths (as far as the logits are: a run on k+1 tokens and a single step may round
differently in the last bits, which flips a token only if a uniform falls within that rounding
of a decision edge). Greedy decoding needs no randomness: argmaxes only.

The functions are pure: arrays (and uniforms) in, arrays or tokens out. ``PositionUniforms``
keeps a table it fills as positions are asked for; its values depend on (seed, position) only.
"""

from __future__ import annotations

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


# ---------------------------------------------------------------------------------------------
# The dense reference


def process_logits(logits: np.ndarray, sampling: SamplingConfig) -> np.ndarray:
    """Turn logits ``[n, V]`` into probabilities ``[n, V]`` (float64, rows sum to 1).

    Applied identically to draft and target rows so that p and q come from the same processing.
    Order as in transformers: temperature, then top-k, then top-p (nucleus). Temperature 0
    gives one-hot rows on the argmax (first index on ties), so greedy decoding runs through the
    same acceptance rule: it accepts exactly when the draft's argmax equals the target's.
    The max is subtracted before dividing by the temperature, so a temperature whose inverse
    overflows (1e-310) gives its limit, uniform over the tied maxima, not NaN.
    """
    if sampling.greedy:
        probs = np.zeros(logits.shape, dtype=np.float64)  # [n, V]
        probs[np.arange(len(logits)), logits.argmax(axis=-1)] = 1.0
        return probs

    # One float64 array, then worked on in place: fresh large temporaries cost more than the
    # arithmetic (each one's pages are faulted in anew).
    scaled = logits.astype(np.float64)  # [n, V]
    if sampling.top_k and sampling.top_k < scaled.shape[-1]:
        # on the logits themselves: the same set as after dividing by T, without the ties that
        # rounding (x - max) / T can make
        kth = np.partition(scaled, -sampling.top_k, axis=-1)[:, -sampling.top_k, None]  # [n, 1]
        scaled[scaled < kth] = -np.inf
    scaled -= scaled.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):  # -0.5 / 1e-310 = -inf: probability 0, as it should be
        scaled /= sampling.temperature
    probs = _softmax_(scaled)
    if sampling.top_p < 1.0:
        probs = _nucleus_(probs, sampling.top_p)
    return probs


def _softmax_(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, overwriting x."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


def _nucleus_(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the most likely tokens until their mass reaches top_p, renormalise, in place.

    A token is kept if the mass of the tokens strictly likelier than it is below top_p (so the
    top token always is); tokens tied with the last one kept are kept too.
    """
    ranked = np.sort(probs, axis=-1)[:, ::-1]  # [n, V], descending
    mass_before = np.cumsum(ranked, axis=-1) - ranked
    kept = (mass_before < top_p).sum(axis=-1)  # [n], >= 1
    threshold = ranked[np.arange(len(probs)), kept - 1, None]  # [n, 1]
    probs[probs < threshold] = 0.0
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a probability row ``[V]`` (inverse CDF, one uniform)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


def verify(
    draft_tokens: np.ndarray,
    q_draft: np.ndarray,
    p_target: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Speculative sampling's accept/reject step; returns ``(n_accepted, next_token)``.

    draft_tokens: ``[k]`` ids the draft sampled, token i from ``q_draft[i]``.
    q_draft:      ``[k, V]`` draft probabilities.
    p_target:     ``[k+1, V]`` target probabilities at the same k positions plus one more.

    Token i is accepted with probability min(1, p(x)/q(x)). At the first rejection the
    replacement is drawn from the residual norm(max(0, p - q)); if all k are accepted a bonus
    token is drawn from ``p_target[k]``. The emitted tokens are then distributed exactly as
    if sampled from p one by one (Leviathan et al. 2023, Theorem 1). (The loop draws position
    k otherwise, see ``position_token``; the distribution is the same.)
    """
    k = len(draft_tokens)
    if q_draft.shape[0] != k or p_target.shape[0] != k + 1:
        raise ValueError(f"verify needs q_draft [k, V] and p_target [k+1, V] for k = {k}, got "
                         f"{q_draft.shape} and {p_target.shape}")
    for i, x in enumerate(draft_tokens):
        p, q = p_target[i, x], q_draft[i, x]
        # q >= p: always accept. q < p: accept with probability p/q. q = 0 cannot have been
        # drawn, but if it was (a zero from rounding) accepting is right: p/q is infinite.
        if q <= p or rng.random() * q < p:
            continue
        residual = np.maximum(p_target[i] - q_draft[i], 0.0)  # [V]
        # A residual of zero mass means p == q up to rounding: then sampling from p is exact.
        if residual.sum() <= 0.0:
            residual = p_target[i]
        return i, sample(residual, rng)
    return k, sample(p_target[k], rng)


# ---------------------------------------------------------------------------------------------
# The fast path: one row at a time, float32, only what a round reads


@dataclass(frozen=True)
class Dist:
    """One processed row: token ``ids[j]`` has probability ``weights[j] / total``.

    ``ids`` ascending, the row's support (top-k and top-p rows: a few tokens); ``ids`` None:
    the whole vocabulary, token j has ``weights[j] / total``. Weights are unnormalised
    (float32 exps, or float64), never negative. Draws go through the support in token-id
    order, as the reference's ``sample`` does, so the same uniform picks the same token.
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
    """``process_logits`` of one row ``[V]`` for the loop: the same distribution, less work.

    Greedy: a point mass on the argmax (first index on ties). Otherwise float32: the max, then
    the exps of (logit - max) / T (one pass, 1 for the likeliest token), top-k as the tokens at
    or above the k-th largest logit (ties kept, as the reference keeps them) found by partitioning
    a few candidates, top-p by ``_nucleus``. Probabilities agree with ``process_logits`` to
    float32 rounding; a token whose mass-before lies within that rounding of top_p may fall on
    either side of the nucleus boundary.
    """
    if sampling.greedy:
        return point_mass(int(np.argmax(logits)))
    x = np.asarray(logits, dtype=np.float32)  # [V]; no copy for onnxruntime's float32
    top = x.max()
    ids = None
    if 0 < sampling.top_k < len(x):
        ids = _top_k_ids(x, sampling.top_k)
        x = x[ids]
    weights = _scaled_exp(x, top, sampling.temperature)  # [V] or [m], max 1
    if sampling.top_p < 1.0:
        ids, weights = _nucleus(ids, x, weights, sampling.top_p)
    return Dist(ids, weights, float(weights.sum()))


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


def residual(p: Dist, q: Dist) -> Dist:
    """norm(max(0, p - q)) on p's support; p itself if that has no mass (p == q to rounding).

    A sparse q under a whole-vocabulary p (an n-gram's point mass at T > 0 without top-k or
    top-p) is subtracted on its own support: p without x, for a point mass on x.
    """
    if p.ids is None and q.ids is not None:
        r = p.probs_at(None)  # float64 [V], a new array
        r[q.ids] = np.maximum(r[q.ids] - q.probs_at(q.ids), 0.0)
    else:
        r = np.maximum(p.probs_at(p.ids) - q.probs_at(p.ids), 0.0)  # float64, [m] or [V]
    total = float(r.sum())
    return Dist(p.ids, r, total) if total > 0.0 else p


# ---------------------------------------------------------------------------------------------
# Position-keyed randomness and the per-position draw


class PositionUniforms:
    """Three uniforms per generated position, ``u[n, 0..2]``, from one seeded generator.

    The table is filled in chunks as positions are asked for; a Generator's stream is the same
    drawn in chunks or at once, so ``u[n]`` depends only on the seed and n. Positions are given
    as indices into the committed sequence; ``first`` (the prompt's length) is generated token 0.
    """

    CHUNK = 256

    def __init__(self, seed: int | None, first: int = 0):
        self.first = first
        self._rng = np.random.default_rng(seed)
        self._table = np.empty((0, 3))  # [filled, 3]

    def rows(self, position: int, count: int) -> np.ndarray:
        """``u`` of positions position .. position + count - 1: ``[count, 3]``."""
        n = position - self.first
        if n < 0:
            raise IndexError(f"position {position} is in the prompt (generated from {self.first})")
        if len(self._table) < n + count:  # doubled: a long generation copies it O(log n) times
            more = max(self.CHUNK, len(self._table), n + count - len(self._table))
            self._table = np.concatenate([self._table, self._rng.random((more, 3))])
        return self._table[n : n + count]


def accept_or_replace(x: int, p: Dist, q: Dist, u: np.ndarray) -> tuple[bool, int]:
    """One position's test of the draft token x (drawn from q): ``(accepted, token)``.

    Accepted iff u[1] q(x) < p(x): always when q(x) <= p(x), else with probability p(x)/q(x)
    (q(x) = 0 cannot have been drawn; if rounding did, accepting is right: p/q is infinite).
    Otherwise the token is drawn with u[2] from the residual norm(max(0, p - q)).
    """
    px, qx = p.prob(x), q.prob(x)
    if qx <= px or u[1] * qx < px:
        return True, x
    return False, residual(p, q).draw(u[2])


def position_token(p: Dist, q: Dist, u: np.ndarray) -> int:
    """Generated token n as a function of (u[n], p_n, q_n): speculative sampling with k = 1.

    x = F_q^-1(u[0]) follows q; it is kept with probability min(1, p(x)/q(x)), else replaced
    by a draw from norm(max(0, p - q)), so the token follows p exactly (Leviathan et al. 2023,
    Theorem 1). With u[n] independent of every other position's uniforms, and p_n, q_n functions
    of the tokens before n, tokens drawn this way one position after another are distributed as
    sampling from p alone; and since a round of k drafts computes the same (u[n], p_n, q_n) for
    each of its positions, how the positions are cut into rounds changes nothing.
    """
    return accept_or_replace(q.draw(u[0]), p, q, u)[1]


def verify_greedy(draft_tokens: list[int], target_logits: np.ndarray) -> tuple[int, int]:
    """Greedy verification: ``(n_accepted, next_token)`` from target logits ``[k+1, V]``.

    Accepts while the target's argmax equals the draft token, one row at a time; the first
    mismatch gives the target's argmax, a full match the bonus argmax of row k.
    """
    for i, x in enumerate(draft_tokens):
        best = int(np.argmax(target_logits[i]))
        if best != x:
            return i, best
    return len(draft_tokens), int(np.argmax(target_logits[len(draft_tokens)]))


def verify_sampled(
    draft_tokens: list[int],
    q_rows: list[Dist],
    target_logits: np.ndarray,
    sampling: SamplingConfig,
    u: np.ndarray,
) -> tuple[int, int | None]:
    """Each drafted position's test, the target rows processed lazily: ``(n_accepted, token)``.

    target_logits: ``[k+1, V]``; u: ``[k, 3]`` (or more rows), the drafted positions' uniforms.
    Returns ``(i, replacement)`` at the first rejection, having processed target rows 0..i
    only; ``(k, None)`` when all k are accepted: position k is then drawn like any other, with
    ``position_token`` and a draft row at position k (there is no bonus token drawn from p).
    """
    for i, (x, q) in enumerate(zip(draft_tokens, q_rows)):
        accepted, token = accept_or_replace(x, process_row(target_logits[i], sampling), q, u[i])
        if not accepted:
            return i, token
    return len(draft_tokens), None
