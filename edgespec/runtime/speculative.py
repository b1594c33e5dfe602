"""The decoding loop: a drafter proposes, the target verifies (target-only: nothing proposed).

The cache invariant of ``kv_cache.py``: at the start of a round the target's cache covers
``committed[:-1]`` and each run feeds what the cache does not cover yet. What drafts (a draft
model, an n-gram lookup, nothing) is behind one interface, ``drafters.Drafter``. A healed prompt
(healing.py) starts with one constrained target step, ``constrained_step``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from edgespec.config import GenerationConfig, SamplingConfig
from edgespec.runtime.drafters import Drafter
from edgespec.runtime.grammar import MAX_FORCED, ConstrainedRows, Grammar
from edgespec.runtime.kv_cache import CacheError, InPlaceKVCache, KVCache
from edgespec.runtime.penalties import Penalties
from edgespec.runtime.sampling import process_row
from edgespec.runtime.acceptance import (
    PositionUniforms,
    position_token,
    verify_greedy,
    verify_sampled,
)
from edgespec.runtime.schedule import Schedule
from edgespec.runtime.session import ModelSession
from edgespec.runtime.stats import GenerationStats


@dataclass
class TargetRunner:
    """The target's session and cache during one generation; it times its own runs into
    ``stats``, and gives the feature rows a run returns (an EAGLE-3 pair's target: the session
    returns rows) to ``drafter.target_features``."""

    session: ModelSession
    cache: KVCache | InPlaceKVCache
    stats: GenerationStats
    drafter: Drafter

    def run(self, committed: list[int], extra: Sequence[int] = (), keep: int = 0,
            timed: bool = True) -> np.ndarray:
        """Feed the committed tokens the cache lacks, then ``extra``; logits ``[n, V]`` (of the
        last ``keep`` rows if given: a prefill keeps one). ``timed`` False: not counted (the
        prefill, timed as a whole)."""
        start = time.perf_counter()
        first = self.cache.length
        tokens = np.array([*committed[first:], *extra])
        logits, rows = self.session.forward_rows(tokens, self.cache, keep=keep)
        if rows is not None:
            self.drafter.target_features(first, rows)
        if timed:
            self.stats.target_s += time.perf_counter() - start
            self.stats.target_calls += 1
        return logits


@contextmanager
def _timed(stats: GenerationStats, field: str) -> Iterator[None]:
    """Add the time spent in the block to ``stats.<field>``."""
    start = time.perf_counter()
    yield
    setattr(stats, field, getattr(stats, field) + time.perf_counter() - start)


@dataclass(frozen=True)
class Round:
    """What one round did: the tokens to commit, and how many were drafted and accepted."""

    tokens: list[int]  # 1..drafted+1: the accepted drafts, then a replacement or position k
    drafted: int  # what the drafter proposed: k, or fewer where a lookup ran out
    accepted: int
    sources: tuple[str, ...] = ()  # per draft, who proposed it (drafters.Proposal.sources)

    def of(self, source: str) -> tuple[int, int, int]:
        """Of ``source``'s proposals: how many it made, how many verification looked at (the
        accepted prefix and the first rejection; a rejection before a proposal leaves it
        unseen) and how many were accepted. What the schedule learns of the source it paces
        (forced proposals and a text match cost it no draft steps: not its to count)."""
        mine = [s == source for s in self.sources]
        seen = self.accepted + (self.accepted < self.drafted)
        return sum(mine), sum(mine[:seen]), sum(mine[: self.accepted])


def speculative_round(
    target: TargetRunner,
    drafter: Drafter,
    committed: list[int],
    k: int,
    sampling: SamplingConfig,
    uniforms: PositionUniforms,
    stats: GenerationStats,
    penalties: Penalties | None = None,
    limit: int | None = None,
) -> Round:
    """One round of speculative sampling (Leviathan et al. 2023, Algorithm 1), keyed by position.

    Sampling uses, for the token at position n = len(committed) + i, the uniforms u[n] and
    nothing else random: each token of a round drafting k >= 1 is ``position_token(p_n, q_n,
    u[n])`` (acceptance.py) however the positions are cut into such rounds, so a seed gives the
    same text whatever fixed k >= 1; a k = 0 round draws from p_n alone.
    q_n is the drafter's proposal (runtime/drafters.py): a draft model's row, an n-gram
    lookup's point mass, or none (then the token is drawn from p_n with u[n, 0]). k = 0, or a
    drafter with nothing to propose, makes the round one target step, the token drawn from p_n
    alone (k = 0 does not ask the drafter). Greedy reads no uniforms.
    Returns what happened (the 1..k+1 tokens to commit, drafted, accepted); the target's cache
    ends covering ``committed`` and the drafts (``_commit`` crops it and the drafter's state
    to what is committed). ``stats``
    only receives the sampling time (the sessions time their own runs). ``penalties``: the
    repetition penalties of the request (penalties.py), None: none. ``limit``: the most
    tokens it may draft (a text match and forced tokens go past k, never past the window).
    """
    greedy = sampling.greedy
    forcing = getattr(penalties, "forced", None) is not None  # a constraint: forced drafts
    most = drafter.most(k) + MAX_FORCED * forcing  # the most it may draft
    most = most if limit is None else min(most, limit)
    u = None if greedy else uniforms.rows(len(committed), most + 1)

    # 1. the drafter proposes up to k tokens with their rows q (fewer if a lookup runs out; a
    #    text match, more; under a constraint, the grammar's forced tokens besides:
    #    drafters.Drafter.propose)
    proposal = drafter.propose(committed, k, sampling, u, penalties, most)
    draft_tokens, q_rows = proposal.tokens, proposal.rows
    scheduled, k = k, len(draft_tokens)
    u = None if greedy else u[: k + 1]  # [k+1, 3]

    # 2. target scores the last committed token and the k drafts in one run   logits: [k+1, V]
    #    row i penalized for the text before its token, committed + drafts[:i] (penalties.py)
    logits = target.run(committed, draft_tokens)[-(k + 1) :]
    if penalties is not None:
        with _timed(stats, "sampling_s"):
            logits = penalties.rows(logits, committed, draft_tokens)

    # 3. target rows one at a time, up to the first rejection. Greedy: accept while the argmax
    #    matches, then the argmax (all k matched: the bonus argmax of row k). Sampling: accept
    #    x_i iff u[i, 1] q(x) < p(x) (probability min(1, p/q); a point mass: p(x)); the first
    #    rejection draws from norm(max(0, p - q)) with u[i, 2] (a point mass: p without x)
    with _timed(stats, "sampling_s"):
        if greedy:
            n_accepted, next_token = verify_greedy(draft_tokens, logits)
        else:
            n_accepted, next_token = verify_sampled(draft_tokens, q_rows, logits, sampling, u)

    # 4. sampling, all k >= 1 accepted: no bonus token from p. Position k is drawn like every
    #    other, with the drafter's proposal there (as it would be next round):
    #    x = F_q_k^-1(u[k, 0]) tested against p_k (row k) as in step 3; no proposal, or k = 0
    #    (drafting off: a plain target step, the drafter not asked): F_p_k^-1(u[k, 0])
    if next_token is None:
        q = (drafter.next_row(committed, draft_tokens, sampling, penalties)
             if k and scheduled else None)
        with _timed(stats, "sampling_s"):
            p = process_row(logits[k], sampling)
            next_token = p.draw(u[k, 0]) if q is None else position_token(p, q, u[k])

    # 5. the accepted prefix and the next token; the caller commits them and crops both
    #    caches to them (``_commit``): the target's covers every draft until then
    new_tokens = [*draft_tokens[:n_accepted], next_token]
    return Round(new_tokens, drafted=k, accepted=n_accepted, sources=proposal.sources)


def constrained_step(
    target: TargetRunner,
    committed: list[int],
    allowed: np.ndarray,
    sampling: SamplingConfig,
    uniforms: PositionUniforms,
    stats: GenerationStats,
    penalties: Penalties | None = None,
) -> int:
    """One target step whose token is drawn from p restricted to ``allowed`` (token healing).

    The target's row at position n = len(committed), its logits outside ``allowed`` at -inf,
    then the request's processing (temperature, top-k, top-p: the restricted row renormalised):
    greedy the argmax over ``allowed``, sampling F_p^-1(u[n, 0]), as target-only decoding
    draws every position. No drafter takes part, so this position is drawn the same way, from
    the same row and uniform, with or without one. The cache keeps its invariant: it ends
    covering ``committed``, i.e. the new ``committed[:-1]``. ``penalties``: as for a round,
    applied before the restriction.
    """
    logits = target.run(committed)[-1:]  # [1, V]
    with _timed(stats, "sampling_s"):
        logits = (logits if penalties is None else penalties.rows(logits, committed))[0]  # [V]
        masked = np.full_like(logits, -np.inf)  # [V]
        masked[allowed] = logits[allowed]
        p = process_row(masked, sampling)
        if sampling.greedy:
            return int(p.ids[0])
        return p.draw(uniforms.rows(len(committed), 1)[0, 0])


def request_positions(prompt_tokens: int, config: GenerationConfig) -> int:
    """Cache positions one request needs: every token it may commit, plus one round's drafts
    (not the model's whole context; an in-place cache grows if a schedule drafts further)."""
    return prompt_tokens + config.max_new_tokens + config.draft_length + 1


def decode(
    target: ModelSession,
    drafter: Drafter,
    prompt: list[int],
    config: GenerationConfig,
    schedule: Schedule,
    max_positions: int,
    eos_token_ids: set[int],
    stats: GenerationStats,
    first_allowed: np.ndarray | None = None,
    cache: KVCache | InPlaceKVCache | None = None,
    grammar: Grammar | None = None,
) -> Iterator[list[int]]:
    """Yield the tokens each round commits, until EOS, ``max_new_tokens`` or the context ends.

    ``drafter``: what proposes the drafts, made for this request (drafters.make_drafter; a
    NoDrafter decodes with the target alone). ``schedule`` picks each round's k (0: a plain
    target step). An EOS token is yielded and ends the generation. ``stats.finish_reason``
    says why it stopped. ``first_allowed``: the ids the first generated token may take (token
    healing: ``prompt`` is then the user's backed off its last token, healing.py); it is drawn
    by one ``constrained_step`` before any drafting, and counts as a generated token.
    ``cache``: the target's cache to decode in, covering a prefix of ``prompt[:-1]`` already
    (a kept one, cropped to what it shares with the prompt: prefix_cache.py; ``drafter`` then
    covers a prefix of it too), None: a new one. Between rounds, the caches and the prompt
    with every list yielded so far agree (the cache invariant), which is what keeping them
    for the next generation needs. ``grammar``: the request's constraint compiled
    (grammar.py), None: free text; every row, the target's and the drafter's, is then masked
    after the penalties, and the generation cannot be healed (``first_allowed`` None).
    """
    uniforms = PositionUniforms(config.seed, first=len(prompt))  # u[n] for generated token n
    penalties = Penalties(config.sampling, len(prompt))
    if grammar is not None:
        if first_allowed is not None:
            raise ValueError("a constrained generation is not healed")
        penalties = ConstrainedRows(penalties, grammar)
    started = time.perf_counter()
    committed = list(prompt)
    stats.prompt_tokens = len(prompt)

    # 1. prefill: every prompt token but the last that the cache lacks, so the cache invariant
    #    holds from round one
    target_runner = _prefill(target, drafter, committed, request_positions(len(prompt), config),
                             stats, cache)

    # 2. token healing: the first token from the target's row restricted to the allowed ids,
    #    drawn alike in target-only and speculative decoding and never drafted, so it is exact
    #    by construction (and a seed gives the same token whatever k or the schedule). A target
    #    step: counted as a k = 0 round, not shown the schedule.
    if first_allowed is not None:
        new = [constrained_step(target_runner, committed, first_allowed, config.sampling,
                                uniforms, stats, penalties)]
        stats.record_round(Round(new, drafted=0, accepted=0), drafter.paced, drafter.drafts)
        new = _commit(new, 1, committed, target_runner, drafter, eos_token_ids, stats, started)
        yield new
        stats.finish_reason = _finish_reason(new, committed, config, max_positions,
                                             eos_token_ids, stats)

    # 3. rounds, each committing 1..k+1 tokens, until EOS, max_new_tokens or the context's end
    while not stats.finish_reason:
        room = min(config.max_new_tokens - stats.new_tokens, max_positions - len(committed))
        new = _scheduled_round(target_runner, drafter, committed, room, config, schedule,
                               uniforms, stats, penalties)
        new = _commit(new, room, committed, target_runner, drafter, eos_token_ids, stats,
                      started)
        yield new
        stats.finish_reason = _finish_reason(new, committed, config, max_positions,
                                             eos_token_ids, stats)


def _prefill(target: ModelSession, drafter: Drafter, prompt: list[int], positions: int,
             stats: GenerationStats, cache: KVCache | InPlaceKVCache | None = None
             ) -> TargetRunner:
    """The target's runner with ``prompt[:-1]`` in its cache, the drafter given the prompt;
    timed as a whole into ``stats.prefill_s``, the runner timing its own runs from then on.
    ``cache``: one covering a prefix of ``prompt[:-1]`` (only the rest is run), None: a new
    one with room for ``positions``; one covering the prompt's last token is refused."""
    if cache is None:
        cache = target.new_cache(positions)
    elif cache.length > len(prompt) - 1:
        raise CacheError(f"a cache of {cache.length} positions cannot start a prompt of "
                         f"{len(prompt)} tokens: it must cover every token but the last")
    target_runner = TargetRunner(target, cache, stats, drafter)
    with _timed(stats, "prefill_s"):
        if len(prompt) - 1 > cache.length:
            target_runner.run(prompt[:-1], keep=1, timed=False)  # its logits go unread
        drafter.prefill(prompt)
    return target_runner


def _scheduled_round(target: TargetRunner, drafter: Drafter, committed: list[int], room: int,
                     config: GenerationConfig, schedule: Schedule, uniforms: PositionUniforms,
                     stats: GenerationStats, penalties: Penalties) -> list[int]:
    """One round with the k the schedule picks, recorded in the stats and shown the schedule.

    A round commits up to k + 1 tokens: drafting more than the request or the window has room
    for is wasted, but a round the schedule gives drafts stays one, down to k = 1 for the last
    token (its surplus dropped by ``_commit``), so that every position of a fixed k >= 1 is
    drawn from (p, q, u) alike: one seed, one text, whatever k. Proposals past k (a text
    match's, a grammar's forced tokens) stop at the room left.
    """
    wanted = schedule.next_k() if drafter.drafts else 0
    k = min(wanted, max(room - 1, 1))
    done = speculative_round(target, drafter, committed, k, config.sampling, uniforms, stats,
                             penalties, limit=max(room - 1, k))
    stats.record_round(done, drafter.paced, drafter.drafts)
    if drafter.drafts:
        proposed, seen, accepted = done.of(drafter.paced)
        if seen or not proposed:  # proposals left unseen by an earlier rejection teach nothing
            schedule.update(seen, accepted)
        drafter.observe(committed, done)
    return done.tokens


def _commit(new: list[int], room: int, committed: list[int], target: TargetRunner,
            drafter: Drafter, eos_token_ids: set[int], stats: GenerationStats,
            started: float) -> list[int]:
    """Append a step's tokens to ``committed``, at most ``room`` of them and up to and with an
    EOS, and count them; returns them. The one place the caches are cropped: both to every
    committed token but the last (the cache invariant; the target's covered the step's drafts,
    and a crop past what it covers raises), so that it holds between steps and when decoding
    ends: the next generation may start from these caches (prefix_cache.py)."""
    ends_at_eos = next((i for i, t in enumerate(new) if t in eos_token_ids), None)
    new = new[: min(room, len(new) if ends_at_eos is None else ends_at_eos + 1)]
    keep = len(committed) + len(new) - 1
    if target.cache.length < keep:
        raise CacheError(f"the target's cache covers {target.cache.length} tokens, "
                         f"not the {keep} committed before the last")
    target.cache.crop(keep)
    drafter.rollback(keep)
    committed += new
    stats.new_tokens += len(new)
    stats.total_s = time.perf_counter() - started
    return new


def _finish_reason(new: list[int], committed: list[int], config: GenerationConfig,
                   max_positions: int, eos_token_ids: set[int], stats: GenerationStats) -> str:
    """Why decoding stops after committing ``new``; "" if it goes on."""
    if new[-1] in eos_token_ids:
        return "eos"
    if stats.new_tokens >= config.max_new_tokens:
        return "max_new_tokens"
    if len(committed) >= max_positions:
        return "context_limit"
    return ""
