"""The speculative acceptance rule, one position at a time, keyed by position.

p is the target's distribution, q the draft's (sampling.py's ``Dist`` rows). Randomness is
keyed by position, not drawn as the loop goes: generated token n gets three uniforms of its own
(``PositionUniforms``), and its token is ``position_token(p_n, q_n, u[n])``: a draft token drawn
from q_n with u[n, 0], accepted iff u[n, 1] q_n(x) < p_n(x), else replaced by a draw from
norm(max(0, p_n - q_n)) with u[n, 2]. That is speculative sampling with one draft token
(Leviathan et al. 2023, Theorem 1: the token follows p_n), and since p_n and q_n depend only on
the tokens before n, the text is a function of (seed, prompt) whatever the rounds' draft
lengths (as far as the logits are: a run on k+1 tokens and a single step may round differently
in the last bits, which flips a token only if a uniform falls within that rounding of a
decision edge). Greedy decoding needs no randomness: argmaxes only (``verify_greedy``).

The functions are pure: rows and uniforms in, ``(accepted, token)`` out; p(x) and q(x) are read
for the drafted tokens only and the residual is built only at a rejection. ``PositionUniforms``
keeps a table it fills as positions are asked for; its values depend on (seed, position) only.
"""

from __future__ import annotations

import numpy as np

from edgespec.config import SamplingConfig
from edgespec.runtime.sampling import Dist, process_row


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
