"""What proposes the draft tokens: the seam between the speculative round and its drafters.

A drafter answers one question, ``next_row(tokens)``: its proposal q for the token after
``tokens``, a row (``Dist``; a point mass for the n-gram lookup and for greedy drafts) or None
(no proposal: the position is drawn from p alone). Answering runs the drafter (a draft model's
session, an index lookup) and moves its state on to cover ``tokens``. ``propose`` chains those
questions for up to k positions, and ``rollback`` forgets the drafted tokens the target
rejected.

Exactness needs one property of every drafter: **its proposal for position n is a function of
the tokens before n only** (not of where the round began or what was drafted and rolled back).
Then every position's token is ``position_token(p_n, q_n, u[n])`` however the positions are cut
into rounds (acceptance.py), and a seed gives the same text whatever fixed k.

- ``ModelDrafter``: the package's draft model (one run per position, its cache cropped back).
- ``NgramDrafter``: prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_
  tokens``, vLLM's "ngram" method, llama.cpp's lookup example): the last n tokens, n from
  ngram_max down to ngram_min, looked up earlier in the text; the token that followed their
  latest earlier occurrence is proposed, as a point mass. The lookup is fresh at every
  position, drafts included, so a proposal depends on the prefix alone.
- ``NoDrafter``: never proposes: target-only decoding.

Each drafter times its own work into the stats (``draft_s``, ``draft_calls``; the model's row
processing into ``sampling_s``), so the round does no timing of its own for drafting.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from edgespec.config import NO_DRAFTER, GenerationConfig, SamplingConfig
from edgespec.errors import ConfigError
from edgespec.runtime.kv_cache import CacheError, InPlaceKVCache, KVCache
from edgespec.runtime.sampling import Dist, point_mass, process_row
from edgespec.runtime.session import ModelSession
from edgespec.runtime.stats import GenerationStats


class Drafter:
    """Proposes draft tokens; subclasses answer ``next_row`` and ``rollback``.

    Every drafter has a name (``name``: "model", "ngram", "none", as config.DRAFTERS and the
    stats say it), its own or a named drafter's it extends: a subclass of Drafter without one
    is refused when it is defined, so that none passes for another drafter, or for none.
    """

    name: str

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if not isinstance(getattr(cls, "name", None), str):
            raise TypeError(f"{cls.__name__} must set name, a str (config.DRAFTERS), "
                            "like the other drafters")

    @property
    def drafts(self) -> bool:
        """Whether it can propose anything: False for target-only decoding."""
        return self.name != NO_DRAFTER

    def prefill(self, prompt: list[int]) -> None:
        """Take in the prompt before the first round (the model: all but its last token)."""

    def next_row(self, committed: list[int], drafted: Sequence[int], sampling: SamplingConfig
                 ) -> Dist | None:
        """The proposal q for the token after ``committed + drafted`` (the two apart so that no
        round copies the whole text): a row, a point mass, or None. Runs the drafter, whose
        state then covers those tokens (``rollback`` takes it back)."""
        return None

    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens (drafts the target rejected)."""

    def propose(
        self, committed: list[int], k: int, sampling: SamplingConfig, u: np.ndarray | None
    ) -> tuple[list[int], list[Dist]]:
        """Up to k draft tokens after ``committed`` and the rows they were drawn from.

        Greedy (u None): each row's single token (the draft's argmax, or the lookup's point
        mass). Sampling: x_i = F_q_i^-1(u[i, 0]), u: the positions' uniforms ``[>= k, 3]``.
        Stops early at a position with no proposal (the n-gram lookup found no match).
        """
        tokens, rows = [], []
        for i in range(k):
            q = self.next_row(committed, tokens, sampling)
            if q is None:
                break
            rows.append(q)
            tokens.append(int(q.ids[0]) if u is None else q.draw(u[i, 0]))
        return tokens, rows


class NoDrafter(Drafter):
    """Target-only decoding: no proposal, every position drawn from p alone."""

    name = NO_DRAFTER


class ModelDrafter(Drafter):
    """The draft model: one run per proposed position on what its cache lacks.

    Its cache covers a prefix of the tokens it was asked about (all but the last), as the
    target's does (kv_cache.py); rollback crops it, never past what it covers.
    """

    name = "model"

    def __init__(self, session: ModelSession, stats: GenerationStats, positions: int | None = None):
        self.session, self.stats = session, stats
        self.cache: KVCache | InPlaceKVCache = session.new_cache(positions)

    def prefill(self, prompt: list[int]) -> None:
        if len(prompt) > 1:
            self.session.forward(np.array(prompt[:-1]), self.cache)

    def next_row(self, committed: list[int], drafted: Sequence[int],
                 sampling: SamplingConfig) -> Dist:
        start = time.perf_counter()
        fed = np.array(tokens_from(committed, drafted, self.cache.length))
        logits = self.session.forward(fed, self.cache)[-1]  # [V], or [N] for a subset draft
        middle = time.perf_counter()
        q = process_row(logits, sampling)
        if self.session.token_ids is not None:  # column j is token token_ids[j]; q = 0 elsewhere
            q = q.relabel(self.session.token_ids)
        self.stats.draft_s += middle - start
        self.stats.sampling_s += time.perf_counter() - middle
        self.stats.draft_calls += 1
        return q

    def rollback(self, length: int) -> None:
        # a greedy draft never ran on a fully accepted round's last token: then it stays
        # one behind and catches up on its next run
        self.cache.crop(min(self.cache.length, length))


class NgramIndex:
    """Where each n-gram (n in ``min_n..max_n``) of a token sequence ended, kept as it grows.

    ``ends[g]`` lists, ascending, every position e whose preceding n tokens are g and which
    has a token of its own: ``tokens[e - n : e] == g`` and ``e < len(tokens)``. Appending a
    token adds at most ``max_n - min_n + 1`` entries and truncating removes them again, so the
    cost per token is constant, whatever the context (no scan of the whole text per round,
    as transformers' and vLLM's lookups do).
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            e = len(self.tokens)  # the n-grams ending at e get their follower
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.ends.setdefault(tuple(self.tokens[e - n : e]), []).append(e)
            self.tokens.append(token)

    def truncate(self, length: int) -> None:
        while len(self.tokens) > length:
            self.tokens.pop()
            e = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, e) + 1):
                gram = tuple(self.tokens[e - n : e])
                ends = self.ends[gram]
                ends.pop()  # e, the last one added
                if not ends:
                    del self.ends[gram]

    def lookup(self) -> int | None:
        """The token that followed the latest earlier occurrence of the longest suffix that
        occurred before (longest first, as every peer does); None if none did."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            ends = self.ends.get(tuple(self.tokens[length - n :]))
            if ends:
                return self.tokens[ends[-1]]
        return None


class NgramDrafter(Drafter):
    """Prompt lookup: the proposal for the next token is a point mass on what followed the
    latest earlier occurrence of the text's last n tokens (n = ngram_max .. ngram_min).

    Acceptance of the point mass on x is then p(x), and the residual is p without x: the same
    verification as for a draft model (acceptance.py), with q(x) = 1.
    """

    name = "ngram"

    def __init__(self, min_n: int, max_n: int, stats: GenerationStats):
        self.index, self.stats = NgramIndex(min_n, max_n), stats

    def prefill(self, prompt: list[int]) -> None:
        self.index.extend(prompt)

    def next_row(self, committed: list[int], drafted: Sequence[int], sampling: SamplingConfig
                 ) -> Dist | None:
        start = time.perf_counter()
        index = self.index
        known = len(index.tokens)
        if known > len(committed) + len(drafted) or (
            known and tokens_from(committed, drafted, known - 1)[:1] != index.tokens[-1:]
        ):
            raise CacheError(f"the n-gram index holds {known} tokens that are not a prefix of "
                             "the text it is asked about")
        index.extend(tokens_from(committed, drafted, known))  # drafts too: rollback removes them
        token = index.lookup()
        self.stats.draft_s += time.perf_counter() - start
        self.stats.draft_calls += 1
        return None if token is None else point_mass(token)

    def rollback(self, length: int) -> None:
        self.index.truncate(min(len(self.index.tokens), length))


def tokens_from(committed: list[int], drafted: Sequence[int], start: int) -> list[int]:
    """``(committed + drafted)[start:]`` without copying the committed text before start."""
    if start <= len(committed):
        return [*committed[start:], *drafted]
    return list(drafted[start - len(committed) :])


def resolve_drafter(config: GenerationConfig, has_draft: bool) -> str:
    """The drafter a request gets: "auto" is the draft model if there is one, else the n-gram
    lookup."""
    if config.drafter == "auto":
        return "model" if has_draft else "ngram"
    if config.drafter == "model" and not has_draft:
        raise ConfigError("drafter 'model' needs a draft model and this package is target only; "
                          "use drafter ngram or none")
    return config.drafter


def make_drafter(
    name: str,
    draft: ModelSession | None,
    config: GenerationConfig,
    stats: GenerationStats,
    positions: int | None = None,
) -> Drafter:
    """A fresh drafter for one generation (``name`` as ``resolve_drafter`` gives it; a draft
    model's cache starts with room for ``positions``)."""
    if name == "model":
        return ModelDrafter(draft, stats, positions)
    if name == "ngram":
        return NgramDrafter(config.ngram_min, config.ngram_max, stats)
    return NoDrafter()
