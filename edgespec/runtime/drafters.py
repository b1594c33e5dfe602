"""What proposes the draft tokens: the seam between the speculative round and its drafters.

A drafter answers one question, ``next_row(tokens)``: its proposal q for the token after
``tokens``, a row (``Dist``; a point mass for the n-gram lookup and for greedy drafts) or None
(no proposal: the position is drawn from p alone). Answering runs the drafter (a draft model's
session, an index lookup) and moves its state on to cover ``tokens``. ``propose`` chains those
questions for up to k positions, and ``rollback`` forgets the drafted tokens the target
rejected.

Exactness (the output's distribution is the target's) needs only that each draft token is
drawn from the row q returned with it. Seed-invariance needs more: **a proposal for position
n that is a function of the tokens before n only** (not of where the round began or what was
drafted and rolled back). Then every position's token is ``position_token(p_n, q_n, u[n])``
however the positions are cut into rounds (acceptance.py), and a seed gives the same text
whatever fixed k. The model and n-gram drafters have it; the EAGLE-3 head does not (below).

- ``ModelDrafter``: the package's draft model (one run per position, its cache cropped back).
- ``NgramDrafter``: prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_
  tokens``, vLLM's "ngram" method, llama.cpp's lookup example): the last n tokens, n from
  ngram_max down to ngram_min, looked up earlier in the text; the token that followed their
  latest earlier occurrence is proposed, as a point mass. The lookup is fresh at every
  position, drafts included, so a proposal depends on the prefix alone.
- ``MixedDrafter``: the two above, chosen per round (the default where a package has a draft
  model): the text's continuation where it promises more tokens per millisecond than the
  draft model, the draft model where it does not, or the text's continuation extended by the
  draft model, from the measured step costs and each source's measured acceptance. The
  choice depends on verified rounds only, so the output stays exact; a proposal then depends
  on where the round began, so one seed gives one text per schedule, not whatever k.
- ``NoDrafter``: never proposes: target-only decoding.
- ``Eagle3Drafter``: an EAGLE-3 head (export/eagle3.py) reading the target's own features.
  Its proposal for position n reads the target's feature of n - 2 when the target has run
  there, else its own hidden_out (the test-time chain): it depends on where the round began,
  so one seed gives one text per k, not one text whatever k; greedy output and the sampled
  distribution are the target's all the same.

Each drafter times its own work into the stats (``draft_s``, ``draft_calls``; the model's row
processing into ``sampling_s``), so the round does no timing of its own for drafting.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from edgespec.config import NO_DRAFTER, TEXT_MAX_K, GenerationConfig, SamplingConfig
from edgespec.errors import ConfigError
from edgespec.runtime.kv_cache import CacheError, InPlaceKVCache, KVCache
from edgespec.runtime.penalties import Penalties
from edgespec.runtime.grammar import MAX_FORCED
from edgespec.runtime.sampling import Dist, point_mass, process_row
from edgespec.runtime.schedule import AcceptanceEstimate, StepCosts
from edgespec.runtime.session import ModelSession
from edgespec.runtime.stats import GenerationStats

FORCED = "forced"  # the source of a proposal a constraint's grammar forced (no drafter ran)
# What the adaptive schedule takes an n-gram lookup to cost per proposed token: a few dict
# lookups and one index update, microseconds whatever the context (benchmarks/ngram_cost.py
# measures it).
NGRAM_STEP_MS = 0.005


@dataclass(frozen=True)
class Proposal:
    """What a drafter proposed for a round: the tokens, the rows they were drawn from, and per
    token its source (the name of the drafter that proposed it, or FORCED)."""

    tokens: list[int]
    rows: list[Dist]
    sources: tuple[str, ...]


class Drafter:
    """Proposes draft tokens; subclasses answer ``next_row`` and ``rollback``.

    Every drafter has a name (``name``: "model", "eagle3", "ngram", "none", as the stats and
    the bench say it; config.DRAFTERS are the names a request chooses by, where "model" is
    whichever draft the package has, a draft model or an EAGLE-3 head), its own or a named
    drafter's it extends: a subclass of Drafter without one is refused when it is defined, so
    that none passes for another drafter, or for none.
    """

    name: str
    stats: GenerationStats | None = None  # what its work is timed into: one generation's
    takes_forced = False  # propose: a grammar's forced tokens may skip its runs

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if not isinstance(getattr(cls, "name", None), str):
            raise TypeError(f"{cls.__name__} must set name, a str (config.DRAFTERS), "
                            "like the other drafters")

    @property
    def drafts(self) -> bool:
        """Whether it can propose anything: False for target-only decoding."""
        return self.name != NO_DRAFTER

    @property
    def paced(self) -> str:
        """The source whose proposals the schedule counts and paces (its k): its own."""
        return self.name

    @property
    def key(self) -> tuple:
        """What its state depends on besides the text (its name, a lookup's n): a kept drafter
        goes on only with a request whose drafter has the same key (prefix_cache.py)."""
        return (self.name,)

    def paced_costs(self, costs: StepCosts) -> StepCosts:
        """The measured step costs as the schedule should weigh its proposals (a draft step is
        its own run)."""
        return costs

    def prefill(self, prompt: list[int]) -> None:
        """Take in the prompt before the first round (the model: all but its last token), from
        where its state ends: a kept drafter (prefix_cache.py) covers a prefix of it already."""

    def begin(self, stats: GenerationStats, costs: StepCosts | None = None) -> None:
        """Start a generation: time its work into ``stats`` from now on (a kept drafter goes on
        with the next generation: prefix_cache.py); ``costs``: the measured step costs, for a
        drafter that weighs its sources by them (None: no costs were measured)."""
        self.stats = stats

    def most(self, k: int) -> int:
        """The most proposals of its own a round asked for k may get (forced ones aside)."""
        return k

    def observe(self, committed: list[int], done) -> None:
        """Learn from a verified round that followed ``committed`` (speculative.Round: the
        tokens it committed, the sources of its proposals, how many were accepted)."""

    def _timed(self, start: float, middle: float | None = None) -> None:
        """Count one run of its own that began at ``start``, and its row processing from
        ``middle`` on, into the stats (``draft_s``, ``sampling_s``, per source too)."""
        now = time.perf_counter()
        ran = (middle or now) - start
        self.stats.draft_s += ran
        self.stats.draft_s_by[self.name] = self.stats.draft_s_by.get(self.name, 0.0) + ran
        if middle is not None:
            self.stats.sampling_s += now - middle
        self.stats.draft_calls += 1

    @property
    def nbytes(self) -> int:
        """Memory its state holds (a kept drafter counts against prefix_cache.py's cap)."""
        return 0

    def next_row(self, committed: list[int], drafted: Sequence[int], sampling: SamplingConfig,
                 penalties: Penalties | None = None) -> Dist | None:
        """The proposal q for the token after ``committed + drafted`` (the two apart so that no
        round copies the whole text): a row, a point mass, or None. Runs the drafter, whose
        state then covers those tokens (``rollback`` takes it back). ``penalties``: the
        request's (penalties.py), which a model's rows take as the target's do."""
        return None

    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens (drafts the target rejected)."""

    def target_features(self, start: int, rows: np.ndarray) -> None:
        """The target's feature rows ``[n, h]`` for positions start..start+n-1, from a run of a
        target paired with an EAGLE-3 head (only a head reads them)."""

    def plan(self, committed: list[int], k: int) -> list[tuple["Drafter", int]]:
        """Who proposes this round's positions, in order: (drafter, how many) segments."""
        return [(self, k)]

    def propose(
        self, committed: list[int], k: int, sampling: SamplingConfig, u: np.ndarray | None,
        penalties: Penalties | None = None, limit: int | None = None,
    ) -> Proposal:
        """Up to k draft tokens after ``committed`` (a MixedDrafter: up to ``most(k)``), the rows
        they were drawn from and their sources.

        Greedy (u None): each row's single token (the draft's argmax, or the lookup's point
        mass). Sampling: x_i = F_q_i^-1(u[i, 0]), u: the positions' uniforms ``[>= k, 3]``.
        The positions go to ``plan``'s segments in order; a segment's drafter with no
        proposal (the n-gram lookup found no match) ends its segment, and the last ends the
        round. Under a constraint (grammar.py), a position whose text the grammar forces is
        proposed as its forced token's point mass without running the drafter (``takes_forced``:
        a drafter whose next run feeds whatever its state lacks), on top of its k (up to
        grammar.MAX_FORCED more, k = 0 included), so a JSON answer's keys, quotes and braces
        cost no draft steps; the target still verifies them. ``limit``: the most proposals
        in all (the room left in the window), None: none. ``u`` has a row per proposal it
        may make.
        """
        tokens, rows, sources = [], [], []
        forced = getattr(penalties, "forced", None) if self.takes_forced else None
        segments = self.plan(committed, k)
        most = sum(n for _, n in segments) + (MAX_FORCED if forced is not None else 0)
        most = most if limit is None else min(most, limit)
        for drafter, count in segments:
            own = 0  # this segment's own proposals, at most count
            while len(tokens) < most:
                token = forced(committed, tokens) if forced is not None else None
                if token is not None:  # the grammar forces this token: q = 1, no run
                    q, source = point_mass(token), FORCED
                    self.stats.forced += 1
                elif own < count:
                    q, source = drafter.next_row(committed, tokens, sampling, penalties), drafter.name
                    own += 1
                else:
                    break
                if q is None:
                    break
                rows.append(q)
                tokens.append(int(q.ids[0]) if u is None else q.draw(u[len(tokens), 0]))
                sources.append(source)
        return Proposal(tokens, rows, tuple(sources))


class NoDrafter(Drafter):
    """Target-only decoding: no proposal, every position drawn from p alone."""

    name = NO_DRAFTER


class ModelDrafter(Drafter):
    """The draft model: one run per proposed position on what its cache lacks.

    Its cache covers a prefix of the tokens it was asked about (all but the last), as the
    target's does (kv_cache.py); rollback crops it, never past what it covers.
    """

    name = "model"
    takes_forced = True  # its next run feeds every token its cache lacks

    def __init__(self, session: ModelSession, stats: GenerationStats, positions: int | None = None):
        self.session, self.stats = session, stats
        self.cache: KVCache | InPlaceKVCache = session.new_cache(positions)

    def prefill(self, prompt: list[int]) -> None:
        if len(prompt) - 1 > self.cache.length:
            self.session.forward(np.array(prompt[self.cache.length : -1]), self.cache, keep=1)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def next_row(self, committed: list[int], drafted: Sequence[int],
                 sampling: SamplingConfig, penalties: Penalties | None = None) -> Dist | None:
        start = time.perf_counter()
        fed = np.array(tokens_from(committed, drafted, self.cache.length))
        logits = self.session.forward(fed, self.cache, keep=1)[-1]  # [V], or [N] for a subset draft
        middle = time.perf_counter()
        if penalties is not None:
            logits = penalties.row(logits, committed, drafted, self.session.token_ids)
            if not np.isfinite(logits).any():  # a grammar allows none of a subset draft's
                return None
        q = process_row(logits, sampling)
        if self.session.token_ids is not None:  # column j is token token_ids[j]; q = 0 elsewhere
            q = q.relabel(self.session.token_ids)
        self._timed(start, middle)
        return q

    def rollback(self, length: int) -> None:
        # a greedy draft never ran on a fully accepted round's last token: then it stays
        # one behind and catches up on its next run
        self.cache.crop(min(self.cache.length, length))


class Eagle3Drafter(Drafter):
    """An EAGLE-3 head: row j reads (token x_{j+1}, a feature of position j) at position j and
    scores x_{j+2}; its logits cover the draft vocabulary, relabelled to target ids (q = 0
    outside), as a subset draft's are.

    The feature of row j is the target's (``target_features``: from its prefill and
    verification runs) where the target has run position j, else the head's own hidden_out of
    row j - 1 (drafting past the target). The head's cache holds only rows computed from
    target features (``true_rows`` of them, rows 0..true_rows-1): a round's first proposal
    re-runs every row the target's last run made possible (one run, several rows) after
    dropping the chain rows of the round before. Rows are cropped with the tokens they read:
    row j needs x_{j+1}, so ``rollback(length)`` keeps rows below length - 1, and features
    below length (the target's of rejected drafts go).
    """

    name = "eagle3"

    def __init__(self, session: ModelSession, stats: GenerationStats, positions: int | None = None):
        self.session, self.stats = session, stats
        self.cache: KVCache | InPlaceKVCache = session.new_cache(positions)
        self.features = np.zeros((positions or 64, session.feature_size), np.float32)  # [P, h]
        self.known = 0  # target features held: positions 0..known-1
        self.true_rows = 0  # head rows in the cache computed from target features
        self.hidden = None  # the last row run: (its index, its hidden_out [h])

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + self.features.nbytes

    def target_features(self, start: int, rows: np.ndarray) -> None:
        if start > self.known:
            raise CacheError(f"target features from position {start}, but only {self.known} "
                             "are held")
        end = start + len(rows)
        if end > len(self.features):
            grown = np.zeros((max(end, 2 * len(self.features)), self.features.shape[1]),
                             np.float32)
            grown[: self.known] = self.features[: self.known]
            self.features = grown
        self.features[start:end] = rows
        self.known = end

    def next_row(self, committed: list[int], drafted: Sequence[int],
                 sampling: SamplingConfig, penalties: Penalties | None = None) -> Dist | None:
        n = len(committed) + len(drafted)  # the position proposed: row n - 2 scores it
        row = n - 2
        if row < 0:
            return None  # x_1 has no row before it
        start = time.perf_counter()
        if row < self.known:  # 1. the target has run there: its features, every row missing
            self.cache.crop(min(self.cache.length, self.true_rows))
            first = self.cache.length
            if first > row:
                raise CacheError(f"the EAGLE-3 head's cache covers {first} rows, past row {row}")
            tokens = tokens_from(committed, drafted, first + 1)[: row - first + 1]
            features = self.features[first : row + 1]
            self.true_rows = row + 1
        else:  # 2. the test-time chain: the head's own hidden_out of row n - 3
            if self.hidden is None or self.hidden[0] != row - 1 or self.cache.length != row:
                raise CacheError(f"the EAGLE-3 head cannot chain row {row}: its cache covers "
                                 f"{self.cache.length} rows")
            tokens = tokens_from(committed, drafted, n - 1)
            features = self.hidden[1][None]
        logits, hidden = self.session.forward_rows(np.array(tokens), self.cache, features)
        self.hidden = (row, hidden[-1].copy())  # not a view of a buffer the next run may reuse
        middle = time.perf_counter()
        row = logits[-1]  # [N]: the draft vocabulary's columns
        if penalties is not None:
            row = penalties.row(row, committed, drafted, self.session.token_ids)
            if not np.isfinite(row).any():  # a grammar allows none of the head's tokens
                return None
        q = process_row(row, sampling).relabel(self.session.token_ids)
        self._timed(start, middle)
        return q

    def rollback(self, length: int) -> None:
        self.known = min(self.known, length)
        self.true_rows = min(self.true_rows, max(length - 1, 0))
        self.cache.crop(min(self.cache.length, self.true_rows))
        self.hidden = None


# What one (token, n-gram length) entry of an NgramIndex holds in CPython at most, its key and
# list slot: text whose n-grams are all new (`python benchmarks/ngram_cost.py --memory 100000`
# measures it: benchmarks/RESULTS.md, "Memory"). The index is bounded by the context window:
# at most about 3 x INDEX_BYTES_PER_ENTRY bytes a token at n = 1..3.
INDEX_BYTES_PER_ENTRY = 170


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
        found = self.match()
        return None if found is None else found[0]

    def match(self) -> tuple[int, int] | None:
        """``lookup``'s token and the length n of the suffix it matched; None if none did."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            ends = self.ends.get(tuple(self.tokens[length - n :]))
            if ends:
                return self.tokens[ends[-1]], n
        return None

    def sync(self, text: Sequence[int]) -> None:
        """Cover exactly ``text``, of which it covers a prefix."""
        self.truncate(min(len(self.tokens), len(text)))
        self.extend(text[len(self.tokens) :])

    @property
    def nbytes(self) -> int:
        """About what it holds: per token, one list entry per n-gram length and at most as many
        keys (a tuple of n ints), as ``benchmarks/ngram_cost.py`` measures it."""
        return len(self.tokens) * (self.max_n - self.min_n + 1) * INDEX_BYTES_PER_ENTRY


class NgramDrafter(Drafter):
    """Prompt lookup: the proposal for the next token is a point mass on what followed the
    latest earlier occurrence of the text's last n tokens (n = ngram_max .. ngram_min).

    Acceptance of the point mass on x is then p(x), and the residual is p without x: the same
    verification as for a draft model (acceptance.py), with q(x) = 1.
    """

    name = "ngram"
    takes_forced = True  # its index extends over every token it has not seen

    def __init__(self, min_n: int, max_n: int, stats: GenerationStats):
        self.index, self.stats = NgramIndex(min_n, max_n), stats

    @property
    def key(self) -> tuple:
        return (self.name, self.index.min_n, self.index.max_n)

    def paced_costs(self, costs: StepCosts) -> StepCosts:
        return replace(costs, draft_step_ms=NGRAM_STEP_MS)  # a lookup, not a model's run

    def prefill(self, prompt: list[int]) -> None:
        self.index.extend(prompt[len(self.index.tokens) :])

    def next_row(self, committed: list[int], drafted: Sequence[int], sampling: SamplingConfig,
                 penalties: Penalties | None = None) -> Dist | None:
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
        self._timed(start)
        return None if token is None else point_mass(token)

    def rollback(self, length: int) -> None:
        self.index.truncate(min(len(self.index.tokens), length))

    @property
    def nbytes(self) -> int:
        return self.index.nbytes


class MixedDrafter(Drafter):
    """The draft model and the text's own continuation, chosen round by round.

    Each round weighs three plans by expected tokens per millisecond of the round
    (schedule.py's cost model, with the step costs measured at load): the draft model's k
    (the schedule's), the text's continuation for L <= TEXT_MAX_K positions (an n-gram lookup
    chained along its own proposals, point masses: microseconds each, so a long copy is
    verified in one target run of its length), or that continuation extended by the draft
    model's k. Each source's acceptance is measured: the model's from its verified proposals
    (as the adaptive schedule measures it), fading back to its prior over rounds that do not
    ask it, so a model that lost to the text is tried again; the text's from every committed
    token, proposed or not, by whether the lookup there predicted it, which is unbiased
    because the committed token is drawn from p (P(x_n = x) = p(x), the acceptance of a point
    mass on x). It is kept per n-gram length matched and per whether the lookup predicted the
    token before, since a copy goes on once it has begun. Without measured costs (a fixed or
    heuristic schedule) the text proposes its positions while its acceptance there is at
    least the model's, the model the rest of k.

    Exact as any drafter: each proposal is a row (the model's) or a point mass (the text's),
    and each position is verified with its own q (acceptance.py); the choice reads verified
    rounds only.
    """

    name = "mixed"
    takes_forced = True  # both of its drafters feed whatever their state lacks

    def __init__(self, model: ModelDrafter, text: NgramDrafter, stats: GenerationStats):
        self.model, self.text = model, text
        self.last: Drafter = model  # the last segment's drafter: it proposes after the round
        self.begin(stats)

    def begin(self, stats: GenerationStats, costs: StepCosts | None = None) -> None:
        """As a drafter's, and what it learnt starts again: a generation's text is a function
        of its prompt, settings and seed, whatever generation kept this drafter before."""
        self.stats, self.costs = stats, costs
        self.model.begin(stats)
        self.text.begin(stats)
        self.model_acceptance = AcceptanceEstimate()
        # [after a predicted token?][n-gram length]: the text's acceptance there
        self.text_acceptance = [[AcceptanceEstimate(prior_alpha=0.5, prior_weight=1.0,
                                                    decay=0.95)
                                 for _ in range(self.text.index.max_n + 1)] for _ in range(2)]
        self.predicted_last = False  # whether the lookup predicted the last committed token

    @property
    def paced(self) -> str:
        return self.model.name

    @property
    def cache(self) -> KVCache | InPlaceKVCache:
        """The draft model's cache."""
        return self.model.cache

    @property
    def key(self) -> tuple:
        return (self.name, *self.text.key[1:])

    def most(self, k: int) -> int:
        return max(k, TEXT_MAX_K) if self.costs is not None else k

    def prefill(self, prompt: list[int]) -> None:
        self.model.prefill(prompt)
        self.text.prefill(prompt)

    @property
    def nbytes(self) -> int:
        return self.model.nbytes + self.text.nbytes

    def plan(self, committed: list[int], k: int) -> list[tuple[Drafter, int]]:
        chain = self._text_chain(committed, self.most(k))  # the text's acceptance per position
        alpha = self.model_acceptance.alpha
        if self.costs is None:
            text = next((i for i, a in enumerate(chain[:k]) if a < alpha), min(k, len(chain)))
            plan = (text, k - text)
        else:
            plan = best_plan(self.costs, chain, alpha, k)
        segments = [(drafter, n) for drafter, n in zip((self.text, self.model), plan) if n]
        self.last = segments[-1][0] if segments else self.model
        return segments or [(self.model, 0)]

    def _text_chain(self, committed: list[int], most: int) -> list[float]:
        """The text's estimated acceptance at each position of its continuation after
        ``committed`` (up to ``most``, where its lookup runs out): the lookup chained along
        its own proposals, then taken back."""
        index = self.text.index
        index.sync(committed)
        chain, predicted = [], self.predicted_last
        while len(chain) < most and (found := index.match()) is not None:
            chain.append(self.text_acceptance[predicted][found[1]].alpha)
            index.extend(found[:1])
            predicted = True  # a position further on is reached only if this one is accepted
        index.truncate(len(committed))
        return chain

    def next_row(self, committed: list[int], drafted: Sequence[int], sampling: SamplingConfig,
                 penalties: Penalties | None = None) -> Dist | None:
        return self.last.next_row(committed, drafted, sampling, penalties)

    def observe(self, committed: list[int], done) -> None:
        # the model's acceptance: its proposals looked at, up to and with the first rejection
        looked = done.sources[: done.accepted + 1]
        mine = sum(s == self.model.name for s in looked)
        if mine:
            took = sum(s == self.model.name for s in done.sources[: done.accepted])
            self.model_acceptance.update(took, mine)
        else:  # not asked: what it showed fades back to the prior, so it is asked again
            self.model_acceptance.relax()
        # the text's: whether the lookup predicted each committed token, proposed or not
        index = self.text.index
        index.sync(committed)
        for token in done.tokens:
            found = index.match()
            hit = found is not None and found[0] == token
            if found is not None:
                self.text_acceptance[self.predicted_last][found[1]].update(hit, 1)
            self.predicted_last = hit
            index.extend((token,))

    def rollback(self, length: int) -> None:
        self.model.rollback(length)
        self.text.rollback(length)


def best_plan(costs: StepCosts, chain: Sequence[float], alpha: float, k: int
              ) -> tuple[int, int]:
    """(text positions, model positions) of the round of most expected tokens per ms: a plain
    target step (0, 0), the model's k alone (0, k), the text's first L positions (``chain``:
    the text's acceptance at each) alone (L, 0), or followed by j <= k of the model's where
    the model guesses the next position better than the text (or the text has run out).

    A round's expected yield is 1 + sum over i of P(its first i proposals accepted) (with one
    alpha for all: schedule.expected_tokens); a text position costs nothing but its place in
    the target's run (``costs.verify_ms``), a model position a draft step too, and the model's
    first step of a round feeds the text's L before it, a run that costs a draft step scaled
    as the target's runs scale with their length (the draft's own are not measured).

    The tokens a round commits without the model (a text round's, a plain step's) are owed to
    the model's cache: each is charged where it is committed, at the marginal cost of feeding
    one more token to a draft run. What they add up to is not charged again to the round
    that feeds them: charged there whole, it grew with every text round and kept the model
    from being chosen again, however much better it guessed (conversations that quote
    themselves, the text taken at 50% where the model's proposals were taken at 75%).
    """
    verify = costs.verify_table  # [n]: a target run on n tokens
    draft = costs.draft_step_ms * np.arange(k + 1)  # [j]: j draft steps

    def catch_up(fed: int) -> float:  # a draft run on 1 + fed tokens, past one step
        return costs.draft_step_ms * (verify[min(fed + 1, len(verify) - 1)] / verify[1] - 1)

    owed = catch_up(1) if k else 0.0  # feeding the model one more committed token, later
    tails = np.cumsum(alpha ** np.arange(k + 1)) - 1  # [j]: the model's j, once reached
    plans = [((0, 0), 1.0 / (verify[1] + owed))]
    if k:
        plans.append(((0, k), (1 + tails[k]) / (verify[k + 1] + draft[k])))
    chain = np.asarray(chain[:TEXT_MAX_K], dtype=np.float64)
    if len(chain):
        reached = np.cumprod(chain)  # [L-1]: P(the text's first L accepted)
        tokens = 1 + np.cumsum(reached)  # [L-1]: expected tokens of the text's L
        text_only = tokens / (verify[2 : len(chain) + 2] + owed * tokens)
        best = int(np.argmax(text_only))
        plans.append(((best + 1, 0), text_only[best]))
        # the model's turn is worth weighing where it guesses the next position better
        turns = np.flatnonzero(np.append(chain[1:] < alpha, True)) + 1 if k else []
        for text in turns:
            model = np.arange(1, min(k, TEXT_MAX_K - text) + 1)
            if len(model):
                rates = ((tokens[text - 1] + reached[text - 1] * tails[model])
                         / (verify[text + model + 1] + draft[model] + catch_up(text)))
                j = int(np.argmax(rates))
                plans.append(((int(text), int(model[j])), rates[j]))
    return max(plans, key=lambda plan: plan[1])[0]


def tokens_from(committed: list[int], drafted: Sequence[int], start: int) -> list[int]:
    """``(committed + drafted)[start:]`` without copying the committed text before start."""
    if start <= len(committed):
        return [*committed[start:], *drafted]
    return list(drafted[start - len(committed) :])


def resolve_drafter(config: GenerationConfig, draft: ModelSession | None) -> str:
    """The name of the drafter a request gets (config.DRAFTERS' "model" or "auto" resolved
    with the package's ``draft``): "auto" is the draft model and the text's continuation,
    chosen per round ("mixed"), if the package has a draft model; its EAGLE-3 head ("eagle3")
    if it has one, which reads the target's features of every position and so does not take
    turns with the text; else the n-gram lookup. Refuses the draft model of a target-only
    package."""
    if config.drafter in ("auto", "model"):
        if draft is None:
            if config.drafter == "model":
                raise ConfigError("drafter 'model' needs a draft model and this package is "
                                  "target only; use drafter ngram or none")
            return NgramDrafter.name
        if draft.reads_features:
            return Eagle3Drafter.name
        return MixedDrafter.name if config.drafter == "auto" else ModelDrafter.name
    return config.drafter


def make_drafter(config: GenerationConfig, draft: ModelSession | None, stats: GenerationStats,
                 positions: int | None = None) -> Drafter:
    """The drafter a request gets (``resolve_drafter``), fresh, timing its work into ``stats``;
    a draft model's cache starts with room for ``positions``. Built once where the request is
    read: its ``name`` is what the stats say, its ``key`` what a kept one must match, its
    ``paced_costs`` what the schedule weighs."""
    name = resolve_drafter(config, draft)
    if name == NgramDrafter.name:
        return NgramDrafter(config.ngram_min, config.ngram_max, stats)
    if name == MixedDrafter.name:
        return MixedDrafter(ModelDrafter(draft, stats, positions),
                            NgramDrafter(config.ngram_min, config.ngram_max, stats), stats)
    if name == ModelDrafter.name:
        return ModelDrafter(draft, stats, positions)
    if name == Eagle3Drafter.name:
        return Eagle3Drafter(draft, stats, positions)
    return NoDrafter()
