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
from edgespec.runtime.kv_cache import InPlaceKVCache, KVCache
from edgespec.runtime.sampling import process_logits, sample, verify
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
    rng: np.random.Generator,
    stats: GenerationStats,
) -> list[int]:
    """One round of speculative sampling (Leviathan et al. 2023, Algorithm 1).

    Returns the 1..k+1 tokens to commit; both caches end covering a prefix of the new
    ``committed[:-1]``.
    """
    # 1. draft proposes k tokens, one run each          q_draft: [k, V]
    draft_tokens, q_rows = [], []
    for _ in range(k):
        with _timed(stats, "draft_s"):
            logits = draft.run(committed, draft_tokens[-1:])[-1:]  # [1, V]
        with _timed(stats, "sampling_s"):
            q = process_logits(logits, sampling)[0]
            draft_tokens.append(sample(q, rng))
            q_rows.append(q)
    stats.draft_calls += k

    # 2. target scores the last committed token and the k drafts in one run   p_target: [k+1, V]
    with _timed(stats, "target_s"):
        logits = target.run(committed, draft_tokens)[-(k + 1) :]
    stats.target_calls += 1

    # 3. accept draft i with probability min(1, p/q); the first rejection resamples from
    #    norm(max(0, p - q)); all k accepted: a bonus token from p_target[k]
    with _timed(stats, "sampling_s"):
        p_target = process_logits(logits, sampling)
        n_accepted, next_token = verify(np.array(draft_tokens), np.stack(q_rows), p_target, rng)
    stats.record_round(k, n_accepted)

    # 4. commit; crop both caches to the accepted prefix (the draft never ran on its k-th
    #    token, so after a full acceptance it stays one behind and catches up next round)
    new_tokens = [*draft_tokens[:n_accepted], next_token]
    keep = len(committed) + n_accepted  # = len(new committed) - 1
    target.cache.crop(keep)
    draft.cache.crop(min(draft.cache.length, keep))
    return new_tokens


def target_step(
    target: Decoder,
    committed: list[int],
    sampling: SamplingConfig,
    rng: np.random.Generator,
    stats: GenerationStats,
) -> list[int]:
    """Plain decoding: one target run, one token sampled from p."""
    with _timed(stats, "target_s"):
        logits = target.run(committed)[-1:]  # [1, V]
    stats.target_calls += 1
    with _timed(stats, "sampling_s"):
        token = sample(process_logits(logits, sampling)[0], rng)
    return [token]


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
    rng = np.random.default_rng(config.seed)
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
        # Drafting more than remaining - 1 is wasted; the target must fit k more positions.
        k = min(schedule.next_k(), remaining - 1, max_positions - len(committed))
        if speculative:
            stats.draft_lengths[k] = stats.draft_lengths.get(k, 0) + 1
        if speculative and k > 0:
            new = speculative_round(
                target_decoder, draft_decoder, committed, k, config.sampling, rng, stats
            )
            schedule.update(k, n_accepted=len(new) - 1)
        else:
            new = target_step(target_decoder, committed, config.sampling, rng, stats)
            schedule.update(0, 0)
        assert target_decoder.cache.length == len(committed) + len(new) - 1, "cache invariant"

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
