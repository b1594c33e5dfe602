"""NumPy fake sessions for the decoding loop: logits are a function of the token prefix.

Shared by the loop's tests (test_fast_sampling.py, test_drafters.py): fast, no onnxruntime.
Exactness is also proven through real sessions (test_speculative.py, test_ngram.py).
"""

from __future__ import annotations

import itertools

import numpy as np

from edgespec.config import GenerationConfig, SamplingConfig
from edgespec.runtime.drafters import Drafter, make_drafter
from reference import penalize, process_logits
from edgespec.runtime.speculative import decode, request_positions
from edgespec.runtime.stats import GenerationStats


class FakeCache:
    def __init__(self):
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length
        del self.tokens[length:]


class PrefixSession:
    """Logits ``[n, V]`` drawn from a generator seeded by the prefix: a deterministic "model"."""

    token_ids = None  # scores the whole vocabulary (not a subset draft)
    reads_features = False  # a model, not an EAGLE-3 head

    def __init__(self, vocab: int, scale: float, salt: int, like: PrefixSession | None = None):
        self.vocab, self.scale, self.salt, self.like = vocab, scale, salt, like
        self.caches: list[FakeCache] = []

    def new_cache(self, positions: int | None = None) -> FakeCache:
        self.caches.append(FakeCache())
        return self.caches[-1]

    def row(self, prefix: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([self.salt, len(prefix), *prefix])
        own = rng.standard_normal(self.vocab) * self.scale
        base = self.like.row(prefix) if self.like else 0.0  # a draft near its target
        return (base + own).astype(np.float32)

    def forward(self, tokens: np.ndarray, cache: FakeCache, keep: int = 0) -> np.ndarray:
        rows = []
        for t in tokens.tolist():
            cache.tokens.append(t)
            rows.append(self.row(tuple(cache.tokens)))
        return np.stack(rows[-keep:] if keep else rows)

    def forward_rows(self, tokens: np.ndarray, cache: FakeCache, features=None, keep: int = 0):
        """ModelSession's: (logits, None), a graph without feature rows."""
        return self.forward(tokens, cache, keep), None


class RandomSchedule:
    """k drawn at random in 0..4 each round, 0 included (a target step inside a speculative run)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def next_k(self) -> int:
        return int(self.rng.integers(0, 5))

    def update(self, k: int, n_accepted: int) -> None:
        pass


def fake_drafter(draft, config: GenerationConfig, stats: GenerationStats, prompt) -> Drafter:
    """The drafter a request gets, as the pipeline makes it (draft: a fake session or None)."""
    return make_drafter(config, draft, stats, request_positions(len(prompt), config))


def fake_decode(target, draft, config: GenerationConfig, schedule, prompt=(1, 2)) -> list[int]:
    """decode() on fake sessions, checking both caches after every round."""
    stats = GenerationStats(speculative=draft is not None)
    committed = list(prompt)
    for new in decode(target, fake_drafter(draft, config, stats, prompt), list(prompt), config,
                      schedule, 64, set(), stats):
        committed += new
        assert target.caches[-1].tokens == committed[:-1]
        if draft is not None:  # the draft covers a prefix of committed[:-1]
            covered = draft.caches[-1].tokens
            assert len(covered) < len(committed) and covered == committed[: len(covered)]
    return committed[len(prompt) :]


def fake_pair(vocab=12):
    target = PrefixSession(vocab, scale=1.5, salt=1)
    return target, PrefixSession(vocab, scale=1.0, salt=2, like=target)


SAMPLED = {
    "T=1": SamplingConfig(1.0),
    "T=0.7 top-p 0.8": SamplingConfig(0.7, top_p=0.8),
    "T=1.2 top-k 4": SamplingConfig(1.2, top_k=4),
    "T=0.8 min-p 0.2": SamplingConfig(0.8, min_p=0.2),
}
# the loop's settings with repetition penalties too (rows that depend on the text before them)
SAMPLED_AND_PENALIZED = {
    **SAMPLED,
    "T=1 penalties": SamplingConfig(1.0, repetition_penalty=1.5, presence_penalty=0.8,
                                    frequency_penalty=0.6),
}


def exact_joint(target, sampling_config: SamplingConfig, prompt: tuple, vocab: int,
                length: int) -> dict[tuple, float]:
    """The target's exact probability of every continuation of ``prompt`` of ``length`` tokens
    (the reference's p, prefix by prefix, penalized for the prefix if the config says so)."""
    def p(prefix) -> np.ndarray:
        row = penalize(target.row(prefix), list(prefix), len(prompt), sampling_config)
        return process_logits(row[None], sampling_config)[0]

    expected = {}
    for seq in itertools.product(range(vocab), repeat=length):
        prefixes = [(*prompt, *seq[:i]) for i in range(length)]
        expected[seq] = float(np.prod([p(pre)[t] for pre, t in zip(prefixes, seq)]))
    return expected


# Wrong draws the distribution checks must reject


def keep_every_draft_token(x, p, q, u):
    """Wrong: no acceptance test, so the output follows q."""
    return True, x


def replace_rejected_from_p(x, p, q, u):
    """Wrong: the right test, but a rejected draft token is replaced by a draw from p."""
    px, qx = p.prob(x), q.prob(x)
    return (True, x) if qx <= px or u[1] * qx < px else (False, p.draw(u[2]))
