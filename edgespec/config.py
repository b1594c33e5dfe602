"""Generation settings: small frozen dataclasses, validated once where they are built."""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from dataclasses import dataclass, field

from edgespec.errors import ConfigError

SCHEDULES = ("fixed", "heuristic", "adaptive")  # how the draft length k is chosen each round
# What proposes the draft tokens (runtime/drafters.py): the package's draft model, a lookup of
# the last tokens earlier in the text (n-gram / prompt lookup), nothing (target only); "auto" is
# the draft model if the package has one, else the n-gram lookup.
NO_DRAFTER = "none"  # the one way to say "no drafting": target-only decoding
DRAFTERS = ("auto", "model", "ngram", NO_DRAFTER)
# Longest n-gram the lookup matches. Peers match 1..2 (transformers' prompt lookup), 1..4
# (llama.cpp's lookup decoding) or up to a chosen prompt_lookup_max (vLLM); past 8 a match is
# rarer than its shorter suffix and proposes the same token.
MAX_NGRAM = 8
PROVIDERS = ("auto", "cpu", "cuda", "tensorrt")  # where a graph runs (runtime/providers.py)
# What `edgespec export` offers (export/): graph builders, compute types, weight quantizations
# and validation modes. Here, not in export/, so that the CLI lists them without importing torch.
EXPORT_GRAPHS = ("auto", "optimum", "fused")
EXPORT_DTYPES = ("fp32", "fp16")
EXPORT_QUANTIZATIONS = ("int8", "int4")
EXPORT_VALIDATIONS = ("strict", "report", "skip")
# The largest draft_length a request may ask for. Expected tokens per round, (1 - alpha^(k+1)) / (1 - alpha),
# approach 1 / (1 - alpha): at alpha = 0.95, k = 64 already gets 96% of the way, so a larger k
# only adds draft steps wasted at each rejection. It also bounds what k costs up front: the
# adaptive schedule times target runs on 1..k+1 tokens, and verification holds [k+1, V] rows.
MAX_DRAFT_LENGTH = 64
# The adaptive schedule's largest k: it calibrates a target run on every length up to k + 1,
# and past 16 drafted tokens a round's expected yield barely grows (0.9^17 = 0.17).
ADAPTIVE_MAX_K = 16
# The most tokens a text match proposes in one round (runtime/drafters.py's MixedDrafter). Its
# proposals cost microseconds, so a long copy is verified at the length it deserves; the
# adaptive schedule's calibration also times target runs on TEXT_MAX_K / 2 + 1 and
# TEXT_MAX_K + 1 tokens for it. Past 32, one target run on a CPU costs more per token than the
# chance that a copy goes on unbroken pays back.
TEXT_MAX_K = 32


# What a constraint's text is (runtime/grammar.py compiles it with llguidance): a JSON schema
# (as JSON text), any JSON object, a regular expression (Rust's regex syntax), a grammar in
# Lark's syntax or llama.cpp's GBNF
CONSTRAINTS = ("json_schema", "json_object", "regex", "lark", "gbnf")
MAX_CONSTRAINT_CHARS = 1 << 20  # a schema or grammar longer than 1 MiB is no request's


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match: ``kind`` one of CONSTRAINTS and its ``source`` (a
    JSON schema's text, a regular expression, a grammar; "" for json_object). Every row of
    the target and of the draft is masked to the tokens the grammar allows after the text
    before it (runtime/grammar.py), so output is the target's distribution restricted to the
    grammar and renormalised, with or without drafting."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINTS:
            raise ConfigError(f"a constraint's kind must be one of {', '.join(CONSTRAINTS)}, "
                              f"got {self.kind!r}")
        if not isinstance(self.source, str) or len(self.source) > MAX_CONSTRAINT_CHARS:
            raise ConfigError(f"a constraint's source must be text of at most "
                              f"{MAX_CONSTRAINT_CHARS:,} characters")
        if self.kind != "json_object" and not self.source.strip():
            raise ConfigError(f"a {self.kind} constraint needs its text; got none")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        """A JSON schema given as an object or as its JSON text."""
        import json

        try:
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, (dict, bool)):
                raise ConfigError(f"a JSON schema is an object, got {type(schema).__name__}")
            return cls("json_schema", json.dumps(schema))
        except RecursionError:
            raise ConfigError("the JSON schema is nested too deeply to read") from None
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"the JSON schema is not JSON ({e})") from None


@dataclass(frozen=True)
class SamplingConfig:
    """How a row of logits becomes a distribution; the same for draft and target.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it (finite).
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: keep the smallest set of tokens whose probability mass reaches top_p; 1 keeps all.
    min_p: keep the tokens at least min_p times as likely as the likeliest, at temperature 1
        (llama.cpp's min-p: logit >= max logit + ln(min_p)); 0 keeps all. The three filters
        each keep a top set of the row and a token is drawn from those all three keep.
    repetition_penalty: transformers' (> 0; 1 is none): the logit l of every token in the text
        so far, prompt included, becomes l / r if l > 0, else l * r.
    presence_penalty, frequency_penalty: OpenAI's (-2..2; 0 is none): l - presence [c > 0]
        - frequency c, c the token's count among the generated tokens.
        The penalties change the target's logits before the rest, in greedy decoding too
        (runtime/penalties.py).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not (_is_number(self.temperature) and 0 <= self.temperature < math.inf):
            raise ConfigError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not (is_int(self.top_k) and self.top_k >= 0):
            raise ConfigError(f"top_k must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ConfigError(f"min_p must be a number in [0, 1] (0 = no limit), got "
                              f"{self.min_p!r}")
        if not (_is_number(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf):
            raise ConfigError(f"repetition_penalty must be a finite number > 0 (1 = none), got "
                              f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -2 <= value <= 2):
                raise ConfigError(f"{name} must be a number in [-2, 2] (0 = none), got "
                                  f"{value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def resolve_sampling(given: dict, package: dict) -> SamplingConfig:
    """The one precedence rule for sampling settings, on every surface (library, CLI, chat,
    server): those a request gives (None: not given), else the package's defaults (its
    target's generation_config.json, manifest "generation"), else SamplingConfig's (greedy),
    field by field, as transformers overrides generation_config."""
    chosen = {name: value for name, value in given.items() if value is not None}
    return SamplingConfig(**{**package, **chosen})


def describe_sampling(given: dict, package: dict) -> str:
    """What ``resolve_sampling(given, package)`` chose and where from, in words, e.g.
    "greedy (the package sets no sampling defaults: edgespec's fallback)" or
    "temperature 0.7, top-p 0.9 (the package's defaults)"."""
    sampling = resolve_sampling(given, package)
    if sampling.greedy:
        parts = ["greedy"]
    else:
        parts = [f"temperature {sampling.temperature:g}",
                 *([f"top-k {sampling.top_k}"] if sampling.top_k else []),
                 *([f"top-p {sampling.top_p:g}"] if sampling.top_p < 1 else []),
                 *([f"min-p {sampling.min_p:g}"] if sampling.min_p > 0 else [])]
    parts += [f"{name.replace('_', ' ')} {getattr(sampling, name):g}"
              for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
              if getattr(sampling, name) != SamplingConfig.__dataclass_fields__[name].default]
    what = ", ".join(parts)
    chosen = {name for name, value in given.items() if value is not None}
    if not chosen:
        where = ("the package's defaults" if package else
                 "the package sets no sampling defaults: edgespec's fallback")
    else:
        where = "as given" + ("; the rest the package's defaults" if set(package) - chosen
                              else "")
    return f"{what} ({where})"


@dataclass(frozen=True)
class GenerationConfig:
    """One generation request.

    max_new_tokens: stop after this many generated tokens.
    draft_length: the draft length k (tokens the drafter proposes per round), as the schedule
        reads it: "fixed" drafts k = draft_length every round; "heuristic" starts at it;
        "adaptive" picks k in 0..min(draft_length, ADAPTIVE_MAX_K) each round. The schedules
        take it under those names (FixedSchedule(k), HeuristicSchedule(start),
        AdaptiveSchedule's costs up to kmax); a text match may propose more (TEXT_MAX_K).
    schedule: "fixed", "heuristic" (transformers' +2/-1 rule) or "adaptive" (k maximising
        expected tokens/s from measured costs; see runtime/schedule.py).
    seed: seeds the sampler; with the model or n-gram drafter the same seed gives the same
        text whatever the fixed k (runtime/speculative.py).
    stop: strings that end generation; the text is cut before the first one found.
    ignore_eos: keep generating after EOS until max_new_tokens (for benchmarks: runs of equal
        length whatever they sample).
    drafter: "model" (the package's draft model, or its EAGLE-3 head), "ngram" (the last
        ngram_max..ngram_min tokens looked up earlier in prompt and output, proposing what
        followed them), "none" (the target alone: the baseline speculative decoding must
        match) or "auto" (both, chosen round by round, where the package has a draft model;
        its EAGLE-3 head where it has one; else ngram: runtime/drafters.py).
    ngram_min, ngram_max: the shortest and longest suffix the n-gram lookup matches (longest
        first); 1 <= ngram_min <= ngram_max <= 8.
    token_healing: back a text prompt off its last token and let the first generated token be
        any token whose text starts with that token's text (runtime/healing.py): a prompt
        ending in a space or a newline then continues as the model would have split it.
        The first generated token regrows the removed text, which the returned text leaves out.
        Not applied with a constraint (the grammar's text starts at the first new token).
    constraint: a Constraint the text must match (JSON schema, JSON object, regex, grammar),
        None: free text. Drafts are masked as the target's rows are; EOS is allowed only where
        the grammar may end.
    """

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Defaults from `edgespec bench` on the demo pair (benchmarks/RESULTS-archive.md, "Demo
    # retrain"): adaptive with k up to 8 is close to the best fixed k, and unlike a fixed k it
    # turns drafting down or off where a draft step is dear (real pairs on a CPU)
    draft_length: int = 8
    schedule: str = "adaptive"
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    drafter: str = "auto"
    ngram_min: int = 1
    ngram_max: int = 3
    token_healing: bool = True
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if not (is_int(self.max_new_tokens) and self.max_new_tokens >= 1):
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.sampling, SamplingConfig):
            raise ConfigError(f"sampling must be a SamplingConfig, got {self.sampling!r}")
        check_draft_length("draft_length", self.draft_length)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.drafter not in DRAFTERS:
            raise ConfigError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if not (is_int(self.ngram_max) and 1 <= self.ngram_max <= MAX_NGRAM):
            raise ConfigError(
                f"ngram_max must be an integer in 1..{MAX_NGRAM}, got {self.ngram_max!r}"
            )
        if not (is_int(self.ngram_min) and 1 <= self.ngram_min <= self.ngram_max):
            raise ConfigError(f"ngram_min must be an integer in 1..ngram_max ({self.ngram_max}), "
                              f"got {self.ngram_min!r}")
        for name in ("ignore_eos", "token_healing"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.seed is not None and not (is_int(self.seed) and self.seed >= 0):
            raise ConfigError(f"seed must be None or an integer >= 0, got {self.seed!r}")
        if not (isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop)):
            raise ConfigError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise ConfigError(f"constraint must be a Constraint, got {self.constraint!r}")
            if self.ignore_eos:  # past the grammar's end only EOS is allowed
                raise ConfigError("ignore_eos cannot be combined with a constraint: a "
                                  "constrained text ends where its grammar does")


@dataclass(frozen=True)
class BenchConfig:
    """What ``edgespec bench`` (edgespec/bench.py) runs: every drafter, schedule and draft
    length at every temperature, ``repeats`` times over its prompts. Here, not in bench.py
    (which loads the runtime), so that the CLI's help shows these defaults."""

    draft_lengths: tuple[int, ...] = (2, 4, 8)
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
    max_new_tokens: int = 128
    repeats: int = 3
    seed: int = 0
    # generate's default (adaptive, k up to the largest draft length) beside every fixed one
    schedules: tuple[str, ...] = ("adaptive", "fixed")
    drafters: tuple[str, ...] = ("auto",)  # each runs every schedule and draft length

    def __post_init__(self) -> None:
        unknown = set(self.schedules) - set(SCHEDULES)
        if unknown or not self.schedules:
            raise ConfigError(f"schedules must be among {', '.join(SCHEDULES)}, got {self.schedules}")
        drafters = set(DRAFTERS) - {NO_DRAFTER}  # none is the baseline every row is measured against
        if set(self.drafters) - drafters or not self.drafters:
            raise ConfigError(f"drafters must be among {', '.join(sorted(drafters))}, "
                              f"got {self.drafters}")
        if not self.draft_lengths:
            raise ConfigError("draft_lengths must name at least one draft length")
        for draft_length in self.draft_lengths:  # each a fixed run's k, the adaptive's largest
            check_draft_length("draft_lengths", draft_length)
        if not self.temperatures or min(self.temperatures) < 0:
            raise ConfigError(f"temperatures must be >= 0, got {self.temperatures}")
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}")
        for temperature in self.temperatures:  # every run's settings, refused now, not mid-way
            for drafter, schedule, draft_length in self.variants:
                GenerationConfig(self.max_new_tokens, SamplingConfig(temperature), draft_length,
                                 schedule, seed=self.seed, drafter=drafter)

    @property
    def variants(self) -> list[tuple[str, str, int]]:
        """(drafter, schedule, draft_length) to run: per drafter every draft length fixed, then
        the adaptive schedules."""
        fixed = [("fixed", k) for k in self.draft_lengths] if "fixed" in self.schedules else []
        others = [(s, max(self.draft_lengths)) for s in self.schedules if s != "fixed"]
        return [(d, *v) for d in self.drafters for v in others + fixed]


def check_draft_length(name: str, value: object) -> None:
    """The draft length's range, in the caller's name for it (an option, a former name)."""
    if not (is_int(value) and 1 <= value <= MAX_DRAFT_LENGTH):
        raise ConfigError(f"{name} must be an integer in 1..{MAX_DRAFT_LENGTH} (tokens drafted "
                          f"per round), got {value!r}")


def is_int(value: object) -> bool:
    """An integer, Python's or NumPy's; not a bool. (The one integer check: configs, manifest
    fields, prompt ids.)"""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A real number, Python's or NumPy's; not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
