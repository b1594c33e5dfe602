"""Constrained decoding: every row masked to the tokens a grammar allows after the text before
it, the target's and the draft's alike (llguidance computes the masks).

A constraint (config.Constraint: a JSON schema, any JSON object, a regular expression, a Lark or
GBNF grammar) is compiled once per request into a matcher over the package's tokenizer. Row n
(the token at position n) is masked for the generated text before n, drafts included, exactly
as the repetition penalties change it (penalties.py): p_n and q_n stay functions of the prefix
alone, so the acceptance rule and the uniforms keyed by position are unchanged, and the output
is distributed as the target's distribution restricted to the grammar and renormalised (the
masked row then goes through temperature, top-k, top-p and min-p as any row), with or without
drafting; greedy output is the masked argmax either way.

The matcher follows the text the rows are asked about: a draft path is consumed token by token
as the draft proposes it, the masks it met are reused for the target's rows of the same round,
and a rejection rolls the matcher back to the accepted prefix before the next token. A drafted
token the grammar refuses (an n-gram lookup proposes any token) is not consumed: its own row
already gives it probability 0, so the round rejects it there and the rows after it are never
read. Where the grammar is complete only EOS is allowed, which ends the generation.

Bounded: llguidance's parser limits cap the work of compiling a grammar and of each mask (its
"fuel"), a source is at most config.MAX_CONSTRAINT_CHARS characters, and a grammar it cannot
compile is a ConstraintError naming the problem.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from edgespec.config import Constraint
from edgespec.errors import GenerationError, one_line

# llguidance's limits, tighter than its defaults where a request is from anyone (its docs'
# speeds: lexer fuel ~14k/ms, Earley items ~20k/ms): about 20 ms of lexer work to build,
# 10 ms of work per mask at most, 50k grammar symbols
_LIMITS = dict(initial_lexer_fuel=300_000, step_lexer_fuel=150_000, step_max_items=50_000,
               max_lexer_states=50_000, max_grammar_size=50_000, verbose_errors=False)


# forced tokens a round may propose beyond the drafter's k (drafters.Drafter.propose): a JSON
# schema's longest run of keys and punctuation is rarely longer
MAX_FORCED = 32


class ConstraintError(GenerationError):
    """A constraint that cannot be compiled, or an engine that is not installed."""


def _engine():
    try:
        import llguidance
    except ImportError:
        raise ConstraintError("constrained decoding needs llguidance: pip install "
                              "'llguidance>=1.9' (edgespec's structured extra)") from None
    return llguidance


# text whose tokens cover spaces, newlines, digits, quotes, JSON punctuation and non-ASCII
# letters: the grammar engine must read each of its tokens as the bytes the tokenizer writes
_PROBE = '{"name": "Ana Ribeiro", "tags": ["a b", "ção"], "n": 12.5}\n  if x:\n\treturn "ok"'


def readable(tokenizer_json: str) -> str:
    """The tokenizer as llguidance reads its tokens' bytes: a byte-level vocabulary whose
    decoder is a sequence (transformers' GGUF conversion of a "gpt2" vocabulary, as SmolLM2's
    and Llama 3's files have it, writes ByteFallback, Fuse, Replace and ByteLevel) gets the
    ByteLevel decoder alone, which decodes its tokens the same. llguidance (1.9) recognises
    ByteLevel only as the whole decoder and otherwise reads "Ġ" as the two bytes of that
    letter: its masks then follow another text than the model writes, in which no token
    writes a space (an enum's "New York" or a tool call's ", " could not be written)."""
    data = json.loads(tokenizer_json)
    decoder = data.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        levels = [d for d in decoder.get("decoders") or [] if d.get("type") == "ByteLevel"]
        if levels and _byte_level_pre_tokenizer(data.get("pre_tokenizer") or {}):
            data["decoder"] = levels[-1]
            return json.dumps(data)
    return tokenizer_json


def _byte_level_pre_tokenizer(pre: dict) -> bool:
    if pre.get("type") == "ByteLevel":
        return True
    return pre.get("type") == "Sequence" and any(
        _byte_level_pre_tokenizer(p) for p in pre.get("pretokenizers") or [])


def _check_bytes(engine_tokenizer, tokenizer) -> None:
    """Refuse a tokenizer whose tokens the engine reads as other bytes than the tokenizer
    decodes them to: its masks would allow the wrong tokens, silently."""
    added = tokenizer.get_added_tokens_decoder()  # special and added tokens: their text whole
    ids = [i for i in tokenizer.encode(_PROBE, add_special_tokens=False).ids if i not in added]
    wrote = tokenizer.decode(ids).encode()
    read = engine_tokenizer.decode_bytes(ids)
    if read != wrote:
        raise ConstraintError(
            f"llguidance reads this package's tokens as other text than its tokenizer writes "
            f"({read[:40]!r} for {wrote[:40]!r}); constrained decoding cannot use this "
            "tokenizer; report its decoder (tokenizer.json's \"decoder\") to edgespec")


class GrammarTokenizer:
    """A package's tokenizer as llguidance reads it, made once per pipeline (about a second
    for a 150k-token vocabulary) and shared by its requests."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 tokenizer=None):
        """``tokenizer``: the ``tokenizers.Tokenizer`` of ``tokenizer_json``, if the caller
        has it loaded (read from the text otherwise)."""
        llguidance = _engine()
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self.eos_token_ids = sorted(eos_token_ids)
        try:
            self.tokenizer = llguidance.LLTokenizer(readable(tokenizer_json), n_vocab=vocab_size,
                                                    eos_token=self.eos_token_ids or None)
        except Exception as e:  # noqa: BLE001: the library's refusal, said in one line
            raise ConstraintError(f"llguidance cannot read this package's tokenizer "
                                  f"({one_line(e, 160)})") from None
        if tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_str(tokenizer_json)
        _check_bytes(self.tokenizer, tokenizer)

    def compile(self, constraint: Constraint) -> "Grammar":
        """A fresh matcher for one request."""
        llguidance = _engine()
        try:
            if constraint.kind == "json_object":
                grammar = llguidance.grammar_from("json_schema", json.dumps({"type": "object"}))
            elif constraint.kind == "lark":
                grammar = llguidance.grammar_from("lark", constraint.source)
            else:
                grammar = llguidance.grammar_from(constraint.kind, constraint.source)
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                           limits=llguidance.LLParserLimits(**_LIMITS))
        except Exception as e:  # noqa: BLE001: the library's refusal, said in one line
            raise ConstraintError(f"the {constraint.kind} constraint does not compile "
                                  f"({one_line(e, 200)})") from None
        if matcher.is_error():
            raise ConstraintError(f"the {constraint.kind} constraint does not compile "
                                  f"({one_line(matcher.get_error(), 200)})")
        return Grammar(matcher, self.vocab_size, self.eos_token_ids)


class Grammar:
    """One request's matcher, and the masks along the text it was last asked about.

    ``path``: the generated tokens consumed (a prefix of the text asked about, then possibly
    a refused draft, never consumed); ``masks[i]``: the allowed tokens after ``path[:i]``
    (bool ``[V]``), computed when first asked for.
    """

    def __init__(self, matcher, vocab_size: int, eos_token_ids: Sequence[int]):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.path: list[int] = []
        self.masks: list[np.ndarray | None] = [None]
        self.start: int | None = None  # the position of the first generated token
        self.forced_by_depth: dict[int, int | None] = {}  # depth -> the token forced there
        self.mask_calls = 0

    def allowed(self, committed: Sequence[int], drafted: Sequence[int] = ()) -> np.ndarray:
        """The tokens allowed after ``committed + drafted`` (bool ``[V]``); if a token of the
        text is one the grammar refuses, the mask before it (the row that refused it)."""
        if self.start is None:
            self.start = len(committed)
        generated = [*committed[self.start:], *drafted]
        depth = self._follow(generated)
        mask = self.masks[depth]
        if mask is None:
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
            self.masks[depth] = mask
            self.mask_calls += 1
            if self.matcher.is_error():
                raise ConstraintError(f"the constraint's matcher failed "
                                      f"({one_line(self.matcher.get_error(), 200)})")
        return mask

    def forced(self, committed: Sequence[int], drafted: Sequence[int] = ()) -> int | None:
        """ConstrainedRows.forced's token, computed once per position of the path."""
        allowed = self.allowed(committed, drafted)  # the matcher now stands at its depth
        depth = len(self.path)
        if depth != len(committed) - self.start + len(drafted):
            return None  # past a refused token or EOS: nothing is forced there
        if depth not in self.forced_by_depth:
            ahead = self.matcher.compute_ff_tokens()
            token = ahead[0] if ahead else None
            if token is None and np.count_nonzero(allowed) == 1:
                token = int(np.flatnonzero(allowed)[0])
            if token is not None and (token in self.eos_token_ids or not (
                    0 <= token < len(allowed) and allowed[token])):
                token = None
            self.forced_by_depth[depth] = token
        return self.forced_by_depth[depth]

    def _follow(self, generated: list[int]) -> int:
        """Roll the matcher back to what it shares with ``generated``, consume the rest up to
        a refused token; how many of ``generated`` are consumed."""
        shared = 0
        for a, b in zip(self.path, generated):
            if a != b:
                break
            shared += 1
        if shared < len(self.path):
            self.matcher.rollback(len(self.path) - shared)
            del self.path[shared:]
            del self.masks[shared + 1:]
            self.forced_by_depth = {d: t for d, t in self.forced_by_depth.items() if d <= shared}
        for token in generated[shared:]:
            mask = self.masks[len(self.path)]
            if token in self.eos_token_ids or (
                    mask is not None and not (0 <= token < len(mask) and mask[token])):
                break  # EOS ends the text; refused: rows past either are never read
            if not self.matcher.consume_token(token):
                raise ConstraintError(f"the constraint's matcher refused token {token} "
                                      f"({one_line(self.matcher.get_error(), 160)})")
            self.path.append(token)
            self.masks.append(None)
        return len(self.path)


class ConstrainedRows:
    """The request's repetition penalties (penalties.Penalties) and then its grammar, applied
    to a row where the penalties alone were: the same ``rows``/``row`` interface, so that the
    target's rows and a draft model's are processed alike."""

    def __init__(self, penalties, grammar: Grammar):
        self.penalties, self.grammar = penalties, grammar

    @property
    def active(self) -> bool:
        return True

    def rows(self, logits: np.ndarray, committed: list[int], drafted: Sequence[int] = ()
             ) -> np.ndarray:
        out = np.array(self.penalties.rows(logits, committed, drafted), dtype=np.float32)
        for i, row in enumerate(out):
            row[~self.grammar.allowed(committed, drafted[:i])[: len(row)]] = -np.inf
        return out

    def forced(self, committed: list[int], drafted: Sequence[int]) -> int | None:
        """The token the grammar forces after ``committed + drafted``: the first of
        llguidance's fast-forward tokens (the forced text, canonically tokenized: a schema's
        keys and punctuation, tokenized as the model's tokenizer writes them), else the one
        token it allows, if one; None otherwise, and for EOS (the target's to draw). A
        proposal, never a rule: the target verifies it, so a tokenization it would not choose
        is rejected like any draft."""
        return self.grammar.forced(committed, drafted)

    def row(self, logits: np.ndarray, committed: list[int], drafted: Sequence[int],
            token_ids: np.ndarray | None = None) -> np.ndarray:
        out = np.array(self.penalties.row(logits, committed, drafted, token_ids),
                       dtype=np.float32)
        allowed = self.grammar.allowed(committed, drafted)
        out[~(allowed[token_ids] if token_ids is not None else allowed[: len(out)])] = -np.inf
        return out
