"""The decoding loops: speculative (draft proposes, target verifies) and target-only.

Both share the sampler and the cache invariant of ``kv_cache.py``: at the start of a round the
target's cache covers ``committed[:-1]`` and each run feeds what the cache does not cover yet.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from edgespec.config import GenerationConfig, SamplingConfig
from edgespec.runtime.kv_cache import CacheError, InPlaceKVCache, KVCache
from edgespec.runtime.sampling import (
    Dist,
    PositionUniforms,
    position_token,
    process_row,
    verify_greedy,
    verify_sampled,
)
from edgespec.runtime.schedule import Schedule
from edgespec.runtime.session import ModelSession
from edgespec.runtime.stats import GenerationStats


@dataclass
class Decoder:
    """A session and its cache: one model's state during one generation."""

    session: ModelSession
    cache: KVCache | InPlaceKVCache

    @classmethod
    def start(cls, session: ModelSession, positions: int | None = None) -> "Decoder":
        """An empty cache with room for ``positions`` tokens to start with (it grows if needed)."""
        return cls(session, session.new_cache(positions))

    def run(self, committed: list[int], extra: Sequence[int] = ()) -> np.ndarray:
        """Feed the committed tokens the cache lacks, then ``extra``; logits ``[n, V]``."""
        return self.session.forward(np.array([*committed[self.cache.length :], *extra]), self.cache)


@contextmanager
def _timed(stats: GenerationStats, field: str) -> Iterator[None]:
    """Add the time spent in the block to ``stats.<field>``."""
    start = time.perf_counter()
    yield
    setattr(stats, field, getattr(stats, field) + time.perf_counter() - start)


def speculative_round(
    target: Decoder,
    draft: Decoder,
    committed: list[int],
    k: int,
    sampling: SamplingConfig,
    uniforms: PositionUniforms,
    stats: GenerationStats,
) -> list[int]:
    """One round of speculative sampling (Leviathan et al. 2023, Algorithm 1), keyed by position.

    Sampling uses, for the token at position n = len(committed) + i, the uniforms u[n] and
    nothing else random: each token is ``position_token(p_n, q_n, u[n])`` (sampling.py) however
    the positions are cut into rounds, so a seed gives the same text whatever the schedule.
    Greedy reads no uniforms. Returns the 1..k+1 tokens to commit; both caches end covering a
    prefix of the new ``committed[:-1]``.
    """
    greedy = sampling.greedy
    u = None if greedy else uniforms.rows(len(committed), k + 1)  # [k+1, 3]

    # 1. draft proposes k tokens, one run each: its argmax, or x_i = F_q_i^-1(u[i, 0])  q: k rows
    draft_tokens, q_rows = [], []
    for i in range(k):
        q = _draft_row(draft, committed, draft_tokens[-1:], sampling, stats)
        q_rows.append(q)
        draft_tokens.append(int(q.ids[0]) if greedy else q.draw(u[i, 0]))  # greedy: one id

    # 2. target scores the last committed token and the k drafts in one run   logits: [k+1, V]
    with _timed(stats, "target_s"):
        logits = target.run(committed, draft_tokens)[-(k + 1) :]
    stats.target_calls += 1

    # 3. target rows one at a time, up to the first rejection. Greedy: accept while the argmax
    #    matches, then the argmax (all k matched: the bonus argmax of row k). Sampling: accept
    #    x_i iff u[i, 1] q(x) < p(x) (probability min(1, p/q)); the first rejection draws from
    #    norm(max(0, p - q)) with u[i, 2]
    with _timed(stats, "sampling_s"):
        if greedy:
            n_accepted, next_token = verify_greedy(draft_tokens, logits)
        else:
            n_accepted, next_token = verify_sampled(draft_tokens, q_rows, logits, sampling, u)
    stats.record_round(k, n_accepted)

    # 4. sampling, all k accepted: no bonus token from p. Position k is drawn like every other:
    #    the draft runs on its k-th token (as it would next round) for q_k, then
    #    x = F_q_k^-1(u[k, 0]) is tested against p_k (row k) as in step 3
    if next_token is None:
        next_token = _draw_position(
            draft, committed, draft_tokens, logits[k], sampling, u[k], stats
        )

    # 5. commit; crop both caches to the accepted prefix (a greedy draft never ran on its k-th
    #    token, so after a full acceptance it stays one behind and catches up next round)
    new_tokens = [*draft_tokens[:n_accepted], next_token]
    keep = len(committed) + n_accepted  # = len(new committed) - 1
    target.cache.crop(keep)
    draft.cache.crop(min(draft.cache.length, keep))
    return new_tokens


def _draft_row(
    draft: Decoder,
    committed: list[int],
    extra: Sequence[int],
    sampling: SamplingConfig,
    stats: GenerationStats,
) -> Dist:
    """One draft run (what its cache lacks, then ``extra``); its last row as q."""
    with _timed(stats, "draft_s"):
        logits = draft.run(committed, extra)[-1]  # [V]
    stats.draft_calls += 1
    with _timed(stats, "sampling_s"):
        return process_row(logits, sampling)


def _draw_position(
    draft: Decoder,
    committed: list[int],
    drafted: Sequence[int],
    target_logits: np.ndarray,
    sampling: SamplingConfig,
    u: np.ndarray,
    stats: GenerationStats,
) -> int:
    """The token after ``committed + drafted``: ``position_token(p, q, u)``, q from a draft run.

    target_logits: ``[V]``, the target's row at that position; u: ``[3]``, its uniforms.
    """
    q = _draft_row(draft, committed, drafted[-1:], sampling, stats)
    with _timed(stats, "sampling_s"):
        return position_token(process_row(target_logits, sampling), q, u)


def target_step(
    target: Decoder,
    committed: list[int],
    sampling: SamplingConfig,
    uniforms: PositionUniforms,
    stats: GenerationStats,
    draft: Decoder | None = None,
) -> list[int]:
    """One target run, one token: a round with k = 0.

    Greedy: the argmax. With a draft (a k = 0 round of a speculative run) the token is drawn as
    every other position's, ``position_token`` with one draft run for q, so a schedule that
    chooses k = 0 changes no text. Without one (target-only decoding): a draw from p with
    u[n, 0], by inverse CDF.
    """
    with _timed(stats, "target_s"):
        logits = target.run(committed)[-1]  # [V]
    stats.target_calls += 1
    if sampling.greedy:
        with _timed(stats, "sampling_s"):
            return [int(np.argmax(logits))]
    u = uniforms.rows(len(committed), 1)[0]  # [3]
    if draft is not None:
        return [_draw_position(draft, committed, (), logits, sampling, u, stats)]
    with _timed(stats, "sampling_s"):
        return [process_row(logits, sampling).draw(u[0])]


def decode(
    target: ModelSession,
    draft: ModelSession | None,
    prompt: list[int],
    config: GenerationConfig,
    schedule: Schedule,
    max_positions: int,
    eos_token_ids: set[int],
    stats: GenerationStats,
) -> Iterator[list[int]]:
    """Yield the tokens each round commits, until EOS, ``max_new_tokens`` or the context ends.

    ``draft`` None (or ``config.use_draft`` False) decodes with the target alone; otherwise
    ``schedule`` picks each round's k (0: a plain target step). An EOS token is yielded and
    ends the generation. ``stats.finish_reason`` says why it stopped.
    """
    uniforms = PositionUniforms(config.seed, first=len(prompt))  # u[n] for generated token n
    speculative = draft is not None and config.use_draft
    started = time.perf_counter()
    committed = list(prompt)
    stats.prompt_tokens = len(prompt)

    # Caches sized to this request (every token it may commit, plus one round's drafts), not
    # to the model's whole context; an in-place cache grows if a schedule drafts further.
    positions = len(prompt) + config.max_new_tokens + config.gamma + 1
    sessions = [target, draft] if speculative else [target]
    # Prefill: every prompt token but the last, so the invariant holds from the first round.
    decoders = [Decoder.start(s, positions) for s in sessions]
    with _timed(stats, "prefill_s"):
        for decoder in decoders:
            if len(prompt) > 1:
                decoder.run(committed[:-1])
    target_decoder, draft_decoder = decoders[0], decoders[-1]

    while True:
        remaining = config.max_new_tokens - stats.new_tokens
        # Drafting more than remaining - 1 is wasted; a round commits up to k + 1 tokens, and
        # the window holds max_positions, as target-only decoding fills it.
        k = min(schedule.next_k(), remaining - 1, max_positions - len(committed) - 1)
        if speculative:
            stats.draft_lengths[k] = stats.draft_lengths.get(k, 0) + 1
        if speculative and k > 0:
            new = speculative_round(
                target_decoder, draft_decoder, committed, k, config.sampling, uniforms, stats
            )
            schedule.update(k, n_accepted=len(new) - 1)
        else:
            new = target_step(
                target_decoder, committed, config.sampling, uniforms, stats,
                draft_decoder if speculative else None,
            )
            schedule.update(0, 0)
        if target_decoder.cache.length != len(committed) + len(new) - 1:
            raise CacheError(f"the target's cache covers {target_decoder.cache.length} tokens, "
                             f"not the {len(committed) + len(new) - 1} committed before the last")

        ends_at_eos = next((i for i, t in enumerate(new) if t in eos_token_ids), None)
        if ends_at_eos is not None:
            new = new[: ends_at_eos + 1]
        committed += new
        stats.new_tokens += len(new)
        stats.total_s = time.perf_counter() - started
        yield new

        if ends_at_eos is not None:
            stats.finish_reason = "eos"
        elif stats.new_tokens >= config.max_new_tokens:
            stats.finish_reason = "max_new_tokens"
        elif len(committed) >= max_positions:
            stats.finish_reason = "context_limit"
        else:
            continue
        return
