"""The user-facing object: an exported package loaded and ready to generate text."""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from edgespec.config import (
    ADAPTIVE_MAX_K,
    GenerationConfig,
    SamplingConfig,
    resolve_sampling,
)
from edgespec.errors import ConfigError, GenerationError
from edgespec.manifest import Manifest
from edgespec.runtime import calibration, numerics
from edgespec.runtime.chat import chat_prompt_ids, load_chat_template
from edgespec.runtime.drafters import Drafter, make_drafter
from edgespec.runtime.grammar import GrammarTokenizer
from edgespec.runtime.healing import Healing, PrefixIndex, heal
from edgespec.runtime.inputs import check_ids, check_text, load_tokenizer, text_bounds
from edgespec.runtime.machine import OtherLoad
from edgespec.runtime.numerics import Numerics
from edgespec.runtime.schedule import (
    LONG_RUNS,
    AdaptiveSchedule,
    FixedSchedule,
    HeuristicSchedule,
    Schedule,
    StepCosts,
    calibrate,
)
from edgespec.runtime.prefix_cache import KeptCaches, PrefixCache
from edgespec.runtime.providers import SessionConfig, default_session_configs
from edgespec.runtime.session import ModelSession, read_token_ids
from edgespec.runtime.speculative import decode, request_positions
from edgespec.runtime.stats import GenerationStats
from edgespec.runtime.text import TextAssembler

_SAMPLING_FIELDS = {f.name for f in fields(SamplingConfig)}


@dataclass
class GenerationResult:
    """What ``generate`` returns: the text, the generated ids and the stats of the run.

    With token healing (``stats.healed`` not empty) ``token_ids`` starts with the token that
    regrew the prompt's last one, and ``text`` leaves out the healed text, which the prompt
    holds: prompt + text reads on from the prompt as the user wrote it.
    """

    text: str
    token_ids: list[int]
    stats: GenerationStats


class TextStream:
    """Iterate for text pieces as they are decoded; ``result`` is set when the stream ends.

    ``cancel()``, from any thread, ends the generation at its next round (or before its first),
    whether or not that round produced text: ``stats.finish_reason`` is then "cancelled".
    """

    def __init__(self, pieces: Iterator[str], finish: Callable[[str], GenerationResult],
                 cancelled: threading.Event | None = None):
        self._pieces = pieces
        self._finish = finish
        self._cancelled = cancelled or threading.Event()
        self.result: GenerationResult | None = None

    def cancel(self) -> None:
        self._cancelled.set()

    def __iter__(self) -> Iterator[str]:
        text = []
        for piece in self._pieces:
            text.append(piece)
            yield piece
        self.result = self._finish("".join(text))


class Pipeline:
    """A target/draft pair from ``edgespec export``, on onnxruntime.

    >>> pipe = edgespec.load("pkg")
    >>> pipe.generate("def fibonacci(n):", max_new_tokens=64).text
    """

    def __init__(
        self,
        path: str | Path,
        target: SessionConfig | None = None,
        draft: SessionConfig | None = None,
        provider: str = "auto",
        draft_provider: str | None = None,
        calibration_cache: bool = True,
        prefix_cache_slots: int = 1,
        prefix_cache_bytes: int | None = None,
        shared_pool: bool = False,
    ):
        self.path = Path(path)
        # the caches of the last generations, which the next starts from (prefix_cache.py)
        self.prefix_cache = PrefixCache(prefix_cache_slots, prefix_cache_bytes)
        self.calibration_cache = calibration_cache
        self.manifest = Manifest.read(self.path)
        self.tokenizer = load_tokenizer(self.path, self.manifest)  # before the slow sessions
        m = self.manifest
        default_target, default_draft = default_session_configs(
            provider, draft_provider, draft_parameters=m.draft.parameters if m.draft else 0,
            shared_pool=shared_pool)
        configs = {"target": target or default_target, "draft": draft or default_draft}
        self.session_configs = {role: configs[role] for role in m.models}
        sessions = {
            role: ModelSession(self.path / spec.path, spec, m.vocab_size, m.max_positions,
                               self.session_configs[role],
                               read_token_ids(self.path, spec, m.vocab_size))
            for role, spec in m.models.items()
        }
        # draft None: a target-only package (n-gram drafting or the target alone)
        self.target, self.draft = sessions["target"], sessions.get("draft")
        for warning in {s.warning for s in sessions.values()} - {None}:
            warnings.warn(warning, stacklevel=2)
        # the package's sampling defaults (its target's generation_config.json), for requests
        # that set none; without them greedy, GenerationConfig's default
        self.default_sampling = resolve_sampling({}, m.generation)
        # the files the sessions were loaded from (a re-export later must not take their costs)
        self._package_stamp = calibration.package_stamp(
            self.path, [spec.path for spec in m.models.values()])
        # what the package's exactness rests on, checked on this CPU (numerics.py)
        self.numerics = self._check_numerics()
        for warning in self.numerics.warnings():
            warnings.warn(warning, stacklevel=2)
        self._costs: dict[int, StepCosts] = {}
        self.calibration_s: dict[int, float] = {}  # per kmax: seconds spent finding the costs
        # per kmax: "measured", "measured busy" (not stored) or "stored" (read back)
        self.calibration: dict[int, str] = {}
        self._prefix_index: PrefixIndex | None = None  # token healing's, built on first use
        self._chat_template = None  # the package's, compiled on first use (needs jinja2)
        self._grammar_tokenizer: GrammarTokenizer | None = None  # constraints', on first use
        self._bounded_text = None  # its tokenizing and rendering child, started on first use
        self.prefix_index_s = 0.0  # what building it took
        added = self.tokenizer.get_added_tokens_decoder()
        self.special_ids = {i for i, token in added.items() if token.special} | {
            i for i in (*m.eos_token_ids, m.bos_token_id, m.pad_token_id) if i is not None}

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids: text is tokenized by inputs.encode_text's rule (BOS first
        where the tokenizer adds one; in ``bounded_text``'s child, a TokenizerError past its
        time or memory limit);
        a sequence of ids is taken as it is, each checked to be in the vocabulary (a chat
        template's rendered text already holds its special tokens, BOS included)."""
        if isinstance(prompt, (list, tuple)):  # not bytes, also a Sequence of ints
            return check_ids(prompt, self.manifest.vocab_size)
        check_text(prompt)
        ids = self.bounded_text.encode(prompt)
        if not ids:
            raise GenerationError("the prompt is empty; give at least one character")
        return ids

    @property
    def chat_template(self):
        """The package's chat template (runtime/chat_template.py's ``ChatTemplate``), compiled
        on first use; a ChatTemplateError if the package has none."""
        if self._chat_template is None:
            self._chat_template = load_chat_template(self.path, self.manifest)
        return self._chat_template

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        """A conversation's token ids: rendered with the package's chat template, which ends
        where the assistant's answer starts and writes its own special tokens (BOS among them:
        none is added here: inputs.encode_text's rule for rendered text)."""
        return chat_prompt_ids(self.chat_template, self.bounded_text, messages)

    @property
    def bounded_text(self):
        """The package's tokenizer and chat template in a child process bounded in time and
        memory (runtime/bounded_text.py's ``BoundedText``), started on first use: both come
        with the package, so either may be hostile (a regex that backtracks for minutes, a
        template that loops or allocates gigabytes in C code)."""
        if self._bounded_text is None:
            from edgespec.runtime.bounded_text import LIBRARY_TIMEOUT_S, BoundedText

            m = self.manifest
            source = name = None
            if m.chat_template is not None:
                source = (self.path / m.chat_template).read_text(encoding="utf-8")
                name = Path(m.chat_template).name
            # every id, as the tokenizer gives them (the caller counts a text past the window)
            self._bounded_text = BoundedText(self.path, source, name, LIBRARY_TIMEOUT_S,
                                             text_bounds(self.tokenizer, m.max_positions)[0],
                                             max_ids=sys.maxsize)
        return self._bounded_text

    @property
    def prefix_index(self) -> PrefixIndex:
        """Token healing's index of the vocabulary's texts, built on first use."""
        if self._prefix_index is None:
            start = time.perf_counter()
            self._prefix_index = PrefixIndex.from_tokenizer(self.tokenizer, self.special_ids)
            self.prefix_index_s = time.perf_counter() - start
        return self._prefix_index

    def heal(self, prompt: str | Sequence[int], prompt_ids: list[int]) -> Healing | None:
        """The back-off of a text prompt (runtime/healing.py), None where it does not apply.

        Only text is healed: a prompt given as token ids is taken as it is (a rendered chat
        template, the server's chat path, ends on the template's own structural tokens).
        """
        if not isinstance(prompt, str):
            return None
        return heal(prompt_ids, self.tokenizer, self.special_ids, lambda: self.prefix_index)

    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
               prompt_ids: list[int] | None = None, **settings) -> TextStream:
        """Generate, yielding text pieces as they are decoded. Settings as for ``generate``;
        ``prompt`` as for ``encode``: text or token ids (never healed). ``prompt_ids``: what
        ``encode(prompt)`` returned, for a caller that tokenized the prompt already."""
        config = make_config(config, self.default_sampling, **settings)
        prompt_ids = self.encode(prompt) if prompt_ids is None else prompt_ids
        limit = self.manifest.max_positions
        if len(prompt_ids) >= limit:
            raise GenerationError(
                f"the prompt has {len(prompt_ids)} tokens but the context window is {limit}; "
                "shorten the prompt"
            )
        # compiled now, so that a constraint that does not compile fails before any text
        grammar = (self.grammar_tokenizer.compile(config.constraint)
                   if config.constraint is not None else None)
        threads = {role: c.threads for role, c in self.session_configs.items()}
        stats = GenerationStats(speculative=False, threads=threads)
        # what proposes the drafts, decided here once: a kept one of the same key may take
        # its place (_caches)
        drafter = make_drafter(config, self.draft, stats,
                               request_positions(len(prompt_ids), config))
        stats.speculative, stats.drafter = drafter.drafts, drafter.name
        text: TextAssembler | None = None  # made once the prompt is healed (or not)
        cancelled = threading.Event()

        def pieces() -> Iterator[str]:
            nonlocal text
            if cancelled.is_set():  # before the prefill and any measuring of costs
                stats.finish_reason = "cancelled"
                return
            healing = (self.heal(prompt, prompt_ids)
                       if config.token_healing and grammar is None else None)
            stats.healed = healing.removed if healing else ""
            text = TextAssembler(self.tokenizer, config.stop, healing.context if healing else None,
                                 stats.healed)
            eos = set() if config.ignore_eos else set(self.manifest.eos_token_ids)
            ids = healing.prompt if healing else prompt_ids
            kept = self._caches(ids, drafter, config, stats)
            schedule, costs = self._schedule(config, kept.drafter, stats)  # may measure costs
            kept.drafter.begin(stats, costs)
            rounds = decode(self.target, kept.drafter, ids, config, schedule, limit, eos, stats,
                            first_allowed=healing.allowed if healing else None,
                            cache=kept.target, grammar=grammar)
            committed = list(ids)  # between rounds the caches hold all of it but the last token

            def keep() -> None:  # only there: a failed round's caches are never kept
                kept.text = committed
                self.prefix_cache.put(kept)

            for new in rounds:
                committed += new
                if cancelled.is_set():  # checked every round, whether or not it made text
                    stats.finish_reason = "cancelled"
                    keep()
                    return
                if piece := text.add(new):
                    yield piece
                if text.stopped:  # the round's tokens after the stop string are not returned
                    stats.new_tokens = len(text.tokens)
                    stats.finish_reason = "stop_string"
                    keep()
                    return
            keep()
            tail = text.finish()
            if text.stopped:
                stats.finish_reason = "stop_string"
            if tail:
                yield tail

        return TextStream(pieces(), lambda out: GenerationResult(
            out, text.tokens if text else [], stats), cancelled)

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The tokenizer as the constraint engine reads it (grammar.py), made on first use."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(
                self.tokenizer.to_str(), self.manifest.vocab_size, self.manifest.eos_token_ids,
                self.tokenizer)
        return self._grammar_tokenizer

    def _caches(self, ids: list[int], drafter: Drafter, config: GenerationConfig,
                stats: GenerationStats) -> KeptCaches:
        """The target cache and drafter a generation from ``ids`` starts with: the kept ones
        of ``drafter``'s key sharing the longest prefix with ``ids``, cropped to it
        (``stats.prompt_tokens_reused`` says how many positions), else a new cache and
        ``drafter``; the caller ``begin``s the drafter."""
        kept, stats.prompt_tokens_reused = self.prefix_cache.take(ids, drafter.key)
        if kept is None:
            positions = request_positions(len(ids), config)
            return KeptCaches([], self.target.new_cache(positions), drafter, drafter.key)
        return kept

    def _schedule(self, config: GenerationConfig, drafter: Drafter, stats: GenerationStats
                  ) -> tuple[Schedule, StepCosts | None]:
        """The request's schedule, and the step costs it weighs (None: it measures none)."""
        if not drafter.drafts:
            return FixedSchedule(0), None
        if config.schedule == "heuristic":
            return HeuristicSchedule(config.draft_length), None
        if config.schedule == "adaptive":
            kmax = min(config.draft_length, ADAPTIVE_MAX_K)
            first_use = kmax not in self._costs
            costs = self.step_costs(kmax)
            # this request paid for the costs only on their first use in this process
            stats.calibration = self.calibration[kmax] if first_use else "reused"
            stats.calibration_s = self.calibration_s[kmax] if first_use else 0.0
            return AdaptiveSchedule(drafter.paced_costs(costs),
                                    sampled=not config.sampling.greedy), costs
        return FixedSchedule(config.draft_length), None

    def _check_numerics(self) -> Numerics:
        """The run shapes that hold on this CPU (numerics.py), read back from the calibration
        cache or probed now and stored there, and set on the sessions."""
        key = calibration.numerics_key(self._package_stamp, self.describe_sessions())
        manifest_runs = (self.target.min_run_tokens,
                         self.draft.min_run_tokens if self.draft else None)
        found = (Numerics.from_record(calibration.load_entry(key), *manifest_runs)
                 if self.calibration_cache else None)
        if found is None:
            found = numerics.check(self.target, self.draft,
                                   numerics.requires_exact(self.manifest.target))
            if self.calibration_cache:
                calibration.store_entry(key, found.record())
        numerics.apply(found, self.target, self.draft)
        return found

    def step_costs(self, kmax: int) -> StepCosts:
        """Draft and target run times for k = 0..kmax: read from the calibration cache
        (calibration.py), else measured and stored there; kept for this process either way.
        Costs measured while other processes used more than machine.BUSY_SHARE of the CPU
        are not stored (``calibration`` "measured busy"): a later process measures again
        rather than pace every generation by a busy moment's timings.

        Measured at a context of a quarter of the window (at most 128 tokens), where typical
        prompts sit; ``calibration_s`` records what finding each cost, ``calibration`` how. A
        target-only package has no draft step to time (its cost is then 0).
        """
        if kmax not in self._costs:
            context = min(128, self.manifest.max_positions // 4)
            start = time.perf_counter()
            key = calibration.cache_key(self._package_stamp, self.describe_sessions(), kmax,
                                        context)
            # the long runs a text match is verified in: read by the mixed drafter alone
            mixed = self.draft is not None and not self.draft.reads_features
            long_runs = LONG_RUNS if mixed else ()
            costs = (calibration.load_costs(key, kmax, long_runs=long_runs)
                     if self.calibration_cache else None)
            self.calibration[kmax] = "stored" if costs else "measured"
            if costs is None:
                with OtherLoad() as load:
                    costs = calibrate(self.target, self.draft, context, kmax,
                                      long_runs=long_runs)
                if load.busy:  # used by this process, not kept: the next one measures again
                    self.calibration[kmax] = "measured busy"
                elif self.calibration_cache:
                    calibration.store_costs(key, costs)
            self._costs[kmax] = costs
            self.calibration_s[kmax] = time.perf_counter() - start
        return self._costs[kmax]

    def describe_sessions(self) -> dict:
        """Each model's session settings and the providers it runs on (for results files)."""
        sessions = {"target": self.target, "draft": self.draft}
        return {role: {**asdict(config), "providers": sessions[role].providers,
                       "min_run_tokens": sessions[role].min_run_tokens,
                       "on_shared_pool": sessions[role].shared_pool}
                for role, config in self.session_configs.items()}

    def generate(
        self, prompt: str | Sequence[int], config: GenerationConfig | None = None, **settings
    ) -> GenerationResult:
        """Generate a continuation of ``prompt``.

        ``config`` gives every setting at once; keyword settings override its fields:
        max_new_tokens, draft_length, schedule, drafter, ngram_min, ngram_max, seed, stop,
        ignore_eos, token_healing, constraint (a config.Constraint the text must match),
        temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
        frequency_penalty. Without ``config``, sampling
        starts from the package's defaults (``default_sampling``: its target's
        generation_config.json, else greedy) and keyword settings override them. The
        generation starts from the kept caches of an earlier one that share a prefix with the
        prompt (``prefix_cache``, runtime/prefix_cache.py): the same output, less prefill.
        """
        stream = self.stream(prompt, config, **settings)
        for _ in stream:
            pass
        return stream.result

    def chat_stream(self, messages: Sequence[dict], config: GenerationConfig | None = None,
                    prompt_ids: list[int] | None = None, **settings) -> TextStream:
        """The assistant's answer to ``messages`` (``[{"role": "user", "content": ...}, ...]``),
        streamed: the conversation rendered with the package's chat template (``encode_chat``),
        generated from those ids (never healed) until EOS. Settings as for ``generate``;
        ``prompt_ids``: what ``encode_chat(messages)`` returned, for a caller that has them."""
        ids = self.encode_chat(messages) if prompt_ids is None else prompt_ids
        return self.stream(ids, config, **settings)

    def chat(self, messages: Sequence[dict], config: GenerationConfig | None = None,
             **settings) -> GenerationResult:
        """The assistant's answer to ``messages``, whole (``chat_stream``).

        >>> pipe.chat([{"role": "user", "content": "What is the capital of France?"}]).text
        """
        stream = self.chat_stream(messages, config, **settings)
        for _ in stream:
            pass
        return stream.result


def make_config(config: GenerationConfig | None = None,
                default_sampling: SamplingConfig | None = None, **settings) -> GenerationConfig:
    """A GenerationConfig from an optional base and flat keyword settings; without a base,
    sampling starts from ``default_sampling`` (a package's defaults)."""
    given_config = config is not None
    if given_config and not isinstance(config, GenerationConfig):
        raise ConfigError(
            f"config must be a GenerationConfig, got {type(config).__name__}; "
            "pass settings as keywords"
        )
    sampling = {k: settings.pop(k) for k in list(settings) if k in _SAMPLING_FIELDS}
    if "stop" in settings:
        stop = settings["stop"]
        # one string or several; anything else goes on for GenerationConfig to refuse
        settings["stop"] = ((stop,) if isinstance(stop, str)
                            else tuple(stop) if isinstance(stop, Iterable) else stop)
    fields_ = {f.name for f in fields(GenerationConfig)} - {"sampling"}
    unknown = set(settings) - fields_ - {"sampling"}
    if unknown:
        raise ConfigError(f"unknown generation setting(s): {', '.join(sorted(unknown))}; "
                          f"known: {', '.join(sorted(_SAMPLING_FIELDS | fields_))}")
    config = config if config is not None else GenerationConfig()
    # the sampling settings given, else the base's: a SamplingConfig given whole, the config's
    # (the package's defaults without a config)
    base = settings.pop("sampling", config.sampling if given_config else default_sampling)
    if base is None or isinstance(base, SamplingConfig):  # anything else: refused below
        base = resolve_sampling(sampling, asdict(base) if base else {})
    return replace(config, sampling=base, **settings)
