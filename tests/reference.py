"""The dense reference of the sampler: the oracle the fast path (edgespec/runtime/sampling.py,
acceptance.py) is checked against, plain enough to check by eye.

float64 rows ``[n, V]``, full sorts, a one-hot row for greedy; ``verify`` is the acceptance rule
of Leviathan et al. 2023 over a whole round with a sequential generator. p is the target's
distribution, q the draft's. The package never uses it; tests and benchmarks/ do.
"""

from __future__ import annotations

import numpy as np

from edgespec.config import SamplingConfig


def process_logits(logits: np.ndarray, sampling: SamplingConfig) -> np.ndarray:
    """Turn logits ``[n, V]`` into probabilities ``[n, V]`` (float64, rows sum to 1).

    Applied identically to draft and target rows so that p and q come from the same processing.
    Order as in transformers: temperature, then top-k, then top-p (nucleus), then min-p (its
    cut on the logits, as llama.cpp takes it: what all three keep). Temperature 0
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
    if sampling.min_p > 0:
        # llama.cpp's min-p, on the logits (temperature 1): p_1(x) >= min_p * max p_1
        raw = logits.astype(np.float64)  # [n, V]
        probs[raw < raw.max(axis=-1, keepdims=True) + np.log(sampling.min_p)] = 0.0
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def penalize(logits: np.ndarray, text: list[int], prompt_tokens: int,
             sampling: SamplingConfig) -> np.ndarray:
    """One row ``[V]`` (float64 copy) penalized for ``text``, whose first ``prompt_tokens``
    are the prompt: transformers' repetition penalty over every token of the text, then
    OpenAI's presence and frequency penalties over the generated ones, token by token."""
    row = logits.astype(np.float64)
    r = sampling.repetition_penalty
    for token in set(text):
        row[token] = row[token] / r if row[token] > 0 else row[token] * r
    generated = text[prompt_tokens:]
    for token in set(generated):
        count = generated.count(token)
        row[token] -= sampling.presence_penalty + sampling.frequency_penalty * count
    return row


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
