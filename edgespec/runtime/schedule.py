"""How many tokens the draft proposes each round.

Any choice of k keeps the output exact, as long as it depends only on rounds already verified:
each round is a complete speculative sampling step whatever its k. The choice only moves speed.

- ``fixed``: always draft_length.
- ``heuristic``: transformers' assisted-generation schedule: +2 after a round that accepted
  every draft token, -1 otherwise (transformers' ``num_assistant_tokens_schedule="heuristic"``).
- ``adaptive``: k maximising expected tokens per second, from costs measured at load and the
  acceptance rate measured so far; k = 0 (a plain target step) when speculation is not
  expected to pay.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from functools import cached_property
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from edgespec.config import TEXT_MAX_K
from edgespec.runtime.session import ModelSession

# The longer target runs calibration times besides 1..kmax+1 tokens, for text matches
LONG_RUNS = (TEXT_MAX_K // 2 + 1, TEXT_MAX_K + 1)


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds of one draft step and of one target run on n tokens (n = 1..kmax+1), and
    of target runs on a few longer lengths (``long_ms``: (n, ms), n ascending), which a text
    match's long proposals are verified in."""

    draft_step_ms: float
    target_ms: tuple[float, ...]  # target_ms[n - 1]: a run on n tokens
    long_ms: tuple[tuple[int, float], ...] = ()

    @property
    def kmax(self) -> int:
        return len(self.target_ms) - 1

    @cached_property
    def verify_table(self) -> np.ndarray:
        """``verify_ms(n)`` for n = 0..TEXT_MAX_K + 1 (n = 0: nothing, 0 ms), computed once."""
        return np.array([0.0, *(self.verify_ms(n) for n in range(1, TEXT_MAX_K + 2))])

    def verify_ms(self, n: int) -> float:
        """A target run on n >= 1 tokens: measured up to kmax + 1, else interpolated linearly
        between the measured lengths around n (past the longest, along the last two)."""
        if n <= len(self.target_ms):
            return self.target_ms[n - 1]
        points = [(len(self.target_ms), self.target_ms[-1]), *self.long_ms]
        if len(points) == 1:  # nothing longer measured: as long as the longest
            return points[0][1]
        upper = next((i for i, (m, _) in enumerate(points) if m >= n), len(points) - 1)
        (n0, t0), (n1, t1) = points[max(upper - 1, 0)], points[max(upper, 1)]
        return max(t0 + (t1 - t0) * (n - n0) / (n1 - n0), 0.0)

    def round_ms(self, k: int, alpha: float = 0.0, sampled: bool = False) -> float:
        """Expected ms of a round drafting k tokens (``round_ms``)."""
        return round_ms(k, self.draft_step_ms, self.target_ms[k], alpha, sampled)

    def tokens_per_ms(self, alpha: float, k: int, sampled: bool = False) -> float:
        """Expected tokens per ms of a round drafting k tokens."""
        return expected_tokens(alpha, k) / self.round_ms(k, alpha, sampled)


def round_ms(k: int, draft_step_ms: float, verify_ms: float, alpha: float = 0.0,
             sampled: bool = False) -> float:
    """Expected ms of a round drafting k tokens: k draft steps and one target run on k + 1
    tokens (``verify_ms``).

    A sampled round drafting k >= 1 runs the draft once more after a full acceptance, with
    probability alpha^k (position k is drawn with the draft's proposal there,
    runtime/speculative.py); a k = 0 round is one target step and nothing else.
    """
    extra = draft_step_ms * alpha**k if sampled and k else 0.0
    return k * draft_step_ms + verify_ms + extra


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round drafting k yields on average (Leviathan et al. 2023, equation 1).

    (1 - alpha^(k+1)) / (1 - alpha), when each draft token is accepted with probability alpha,
    independently: the accepted prefix plus the replacement or bonus token.
    """
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, draft_ms: float, verify_ms: float,
                     step_ms: float, sampled: bool = False) -> float:
    """Leviathan et al.'s expected speedup with measured costs.

    expected_tokens(alpha, k) tokens per round, at the cost of a round (round_ms: k draft
    steps, one target run on k+1 tokens, the sampled round's extra draft step), against one
    target step (``step_ms``) per token.
    """
    return expected_tokens(alpha, k) * step_ms / round_ms(k, draft_ms, verify_ms, alpha, sampled)


def best_k(costs: StepCosts, alpha: float, sampled: bool = False, kmin: int = 0) -> int:
    """The k in kmin..costs.kmax of the most expected tokens per ms (0: a plain target step)."""
    return max(range(kmin, costs.kmax + 1),
               key=lambda k: costs.tokens_per_ms(alpha, k, sampled))


class Schedule(Protocol):
    def next_k(self) -> int:
        """Draft tokens wanted this round; 0 asks for a plain target step."""

    def update(self, k: int, n_accepted: int) -> None:
        """Learn from a round that drafted k tokens and accepted n_accepted (k = 0: none)."""


class FixedSchedule:
    def __init__(self, k: int):
        self.k = k

    def next_k(self) -> int:
        return self.k

    def update(self, k: int, n_accepted: int) -> None:
        pass


class HeuristicSchedule:
    """transformers' heuristic: start at ``start``, +2 if all accepted, else -1 (never below 1)."""

    def __init__(self, start: int, kmax: int = 32):
        self.k, self.kmax = start, kmax

    def next_k(self) -> int:
        return self.k

    def update(self, k: int, n_accepted: int) -> None:
        self.k = min(self.k + 2, self.kmax) if n_accepted == k else max(1, self.k - 1)


class AcceptanceEstimate:
    """alpha, the chance that a proposal is accepted, from the proposals verification looked
    at (accepted ones, and the one rejection of each round that had one), forgetting
    exponentially (``decay`` per update) so that it follows the text; it starts from
    ``prior_alpha`` worth ``prior_weight`` proposals."""

    def __init__(self, prior_alpha: float = 0.6, prior_weight: float = 2.0, decay: float = 0.9):
        self.decay, self.prior = decay, (prior_alpha * prior_weight, prior_weight)
        self.accepted, self.looked_at = self.prior

    @property
    def alpha(self) -> float:
        return self.accepted / self.looked_at

    def update(self, accepted: int, looked_at: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.looked_at = self.decay * self.looked_at + looked_at

    def relax(self) -> None:
        """A round without proposals to look at: the evidence forgets as one update would,
        and the prior takes its place (after ~1 / (1 - decay) such rounds it is most of it)."""
        self.accepted = self.decay * self.accepted + (1 - self.decay) * self.prior[0]
        self.looked_at = self.decay * self.looked_at + (1 - self.decay) * self.prior[1]


class AdaptiveSchedule:
    """Pick k each round to maximise expected tokens/s under the measured costs.

    alpha, the chance one draft token is accepted, is estimated from the tokens verification
    looked at (accepted ones, plus the one rejection of each round that had one), with
    exponential forgetting so it follows the text: code boilerplate drafts well, names do not.
    The estimate starts from ``prior_alpha`` worth ``prior_weight`` tokens. While speculation
    is off (k = 0) nothing is learnt, so now and then one round with k = 1 checks whether the
    draft has become useful again; probes are spaced so that they cost at most
    ``probe_overhead`` of the target-only time (a graph whose multi-token runs are slow, like
    int4 MatMulNBits on some CPUs, is probed rarely). A probe that leaves speculation off
    doubles the spacing (up to ``max_backoff`` times the first), so a drafter that guesses
    nothing (an untrained draft, a lookup in text that never repeats) costs ever less; a probe
    that turns speculation back on, or a round the schedule chose itself, restores it.
    """

    def __init__(
        self,
        costs: StepCosts,
        prior_alpha: float = 0.6,
        prior_weight: float = 2.0,
        decay: float = 0.9,
        probe_overhead: float = 0.05,
        sampled: bool = False,
        max_backoff: int = 16,
    ):
        self.costs, self.sampled = costs, sampled
        self.acceptance = AcceptanceEstimate(prior_alpha, prior_weight, decay)
        extra_ms = costs.round_ms(1) - costs.target_ms[0]  # a probe against a plain step
        self.first_spacing = max(4, math.ceil(extra_ms / (probe_overhead * costs.target_ms[0])))
        self.probe_every = self.first_spacing  # plain steps between two probes
        self.max_spacing = max_backoff * self.first_spacing
        self.steps_off = 0
        self.probing = False  # the round asked for last is a probe

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def best_k(self) -> int:
        """The k of the highest expected tokens/ms at the current alpha (0: speculation off)."""
        return best_k(self.costs, self.alpha, self.sampled)

    def next_k(self) -> int:
        best = self.best_k()
        self.probing = best == 0 and self.steps_off >= self.probe_every
        return 1 if self.probing else best

    def update(self, k: int, n_accepted: int) -> None:
        if k == 0:  # a plain step (or a lookup that found nothing to propose)
            self.steps_off += 1
            return
        self.steps_off = 0
        self.acceptance.update(n_accepted, n_accepted + (n_accepted < k))
        if self.probing and self.best_k() == 0:  # the probe found nothing worth drafting
            self.probe_every = min(2 * self.probe_every, self.max_spacing)
        else:
            self.probe_every = self.first_spacing
        self.probing = False


def calibrate(
    target: ModelSession,
    draft: ModelSession | None,
    context: int,
    kmax: int,
    budget_s: float = 1.0,
    repeats: tuple[int, int] = (3, 20),
    long_runs: Sequence[int] = LONG_RUNS,
) -> StepCosts:
    """Median time of a draft step and of target runs on 1..kmax+1 tokens after ``context``,
    and on the ``long_runs`` lengths past kmax + 1 (LONG_RUNS: what a text match is verified
    in; only a drafter that proposes past kmax reads them).

    Bounded: each session is prefilled once, and each run length is timed ``repeats[0]`` times,
    then again while its share of ``budget_s`` lasts, at most ``repeats[1]`` times: about
    ``budget_s`` plus the ``repeats[0]`` runs of each length, however large the target.
    """
    longer = [n for n in long_runs if n > kmax + 1]
    longest = max([kmax + 1, *longer])
    ids = np.random.default_rng(0).integers(0, target.vocab_size, size=context + longest)
    share = budget_s / (kmax + 2 + len(longer))

    def run(session: ModelSession, tokens: np.ndarray, cache) -> None:
        if session.reads_features:
            # an EAGLE-3 head reads feature rows: zeros cost what the target's features do
            features = np.zeros((len(tokens), session.feature_size), np.float32)
            session.forward_rows(tokens, cache, features)
        else:
            session.forward(tokens, cache)

    def timed(session: ModelSession, lengths: Sequence[int]) -> list[float]:
        cache = session.new_cache(context + max(lengths))  # no growth inside the timed runs
        run(session, ids[:context], cache)
        medians = []
        for n in [lengths[0], *lengths]:  # the first run pays for allocations: timed, dropped
            times: list[float] = []
            while len(times) < repeats[0] or (len(times) < repeats[1] and sum(times) < share):
                start = time.perf_counter()
                run(session, ids[context : context + n], cache)
                times.append(time.perf_counter() - start)
                cache.crop(context)
            medians.append(1e3 * statistics.median(times))
        return medians[1:]

    (draft_ms,) = timed(draft, range(1, 2)) if draft is not None else (0.0,)  # target only
    target_ms = timed(target, [*range(1, kmax + 2), *longer])
    return StepCosts(draft_ms, tuple(target_ms[: kmax + 1]),
                     tuple(zip(longer, target_ms[kmax + 1 :])))
