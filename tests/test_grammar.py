"""Constrained decoding (runtime/grammar.py): exact under speculation.

On fake sessions over a six-token vocabulary ("a".."e" and an end token) with a regular
expression whose allowed tokens at each position are known without llguidance (LANGUAGE): the
output of speculative decoding is the target's distribution restricted to the grammar and
renormalised (chi-square against a dense reference that masks each row by LANGUAGE), and two
wrong variants are rejected: the target's rows left unmasked (only the draft's masked), and a
matcher that is not rolled back after a rejection. Then the demo package: greedy constrained
output token-identical with and without drafting, JSON that parses and fits its schema.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from fakes import fake_drafter, fake_pair
from reference import penalize, process_logits
from stats_check import ALPHA, fit_pvalue

import edgespec
from edgespec.config import Constraint, GenerationConfig, SamplingConfig
from edgespec.errors import ConfigError
from edgespec.runtime import grammar as grammar_module
from edgespec.runtime.grammar import ConstrainedRows, ConstraintError, Grammar, GrammarTokenizer
from edgespec.runtime.speculative import decode
from edgespec.runtime.stats import GenerationStats

pytest.importorskip("llguidance")

LETTERS = "abcde"
EOS = 5
# The regular expression, and the tokens it allows at each position (then only the end): the
# second is forced, which the draft model proposes without a run (drafters.propose)
REGEX = "[ab]c[bcd][ace]"
LANGUAGE = ({0, 1}, {2}, {1, 2, 3}, {0, 2, 4})
PROMPT = (1, 2)
N_SAMPLES = 1200


@pytest.fixture(scope="module")
def tokenizer() -> GrammarTokenizer:
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel

    vocab = {letter: i for i, letter in enumerate(LETTERS)} | {"</s>": EOS}
    backend = Tokenizer(WordLevel(vocab, unk_token="</s>"))
    backend.decoder = decoders.ByteLevel()  # a-e are their own bytes
    backend.add_special_tokens(["</s>"])
    return GrammarTokenizer(backend.to_str(), len(vocab), [EOS])


def constrained_decode(tokenizer, target, draft, config, k: int) -> list[int]:
    """decode() on fake sessions with the REGEX constraint, at a fixed draft length k."""
    from edgespec.runtime.schedule import FixedSchedule

    stats = GenerationStats(speculative=draft is not None)
    out = []
    for new in decode(target, fake_drafter(draft, config, stats, PROMPT), list(PROMPT), config,
                      FixedSchedule(k), 64, {EOS}, stats,
                      grammar=tokenizer.compile(Constraint("regex", REGEX))):
        out += new
    constrained_decode.drafted += stats.drafted
    constrained_decode.forced += stats.forced
    return out


constrained_decode.drafted = constrained_decode.forced = 0


def exact_constrained(target, sampling: SamplingConfig) -> dict[tuple, float]:
    """Each text of the language (three tokens, then the end) with the target's probability
    restricted to LANGUAGE position by position and renormalised (the dense reference)."""
    def p(prefix: tuple, allowed: set[int]) -> np.ndarray:
        row = np.full(EOS + 1, -np.inf, np.float32)
        logits = penalize(target.row(prefix), list(prefix), len(PROMPT), sampling)
        row[list(allowed)] = logits[list(allowed)]
        return process_logits(row[None], sampling)[0]

    expected = {}
    for text in itertools.product(*LANGUAGE):
        expected[(*text, EOS)] = float(np.prod(
            [p((*PROMPT, *text[:i]), LANGUAGE[i])[t] for i, t in enumerate(text)]))
    return expected


def constrained_pvalue(tokenizer, sampling: SamplingConfig, k: int = 2) -> float:
    target, draft = fake_pair(vocab=EOS + 1)
    samples = [tuple(constrained_decode(
        tokenizer, target, draft, GenerationConfig(max_new_tokens=6, sampling=sampling, seed=seed,
                                                   draft_length=k), k))
        for seed in range(N_SAMPLES)]
    return fit_pvalue(samples, exact_constrained(target, sampling))


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=2),
                                      SamplingConfig(1.0, repetition_penalty=1.5)],
                         ids=["T=1", "T=0.8 top-k 2", "T=1 penalties"])
def test_constrained_speculative_sampling_is_the_restricted_target_distribution(
        tokenizer, sampling):
    constrained_decode.drafted = constrained_decode.forced = 0
    assert constrained_pvalue(tokenizer, sampling) > ALPHA
    # the draft proposed under the grammar, the forced position without a run
    assert constrained_decode.drafted > constrained_decode.forced > 0


def test_the_check_rejects_a_target_whose_rows_are_not_masked(tokenizer, monkeypatch):
    """Wrong: only the draft's rows masked (the target verifies with its free rows)."""
    monkeypatch.setattr(ConstrainedRows, "rows",
                        lambda self, logits, committed, drafted=(): self.penalties.rows(
                            logits, committed, drafted))
    assert constrained_pvalue(tokenizer, SamplingConfig(1.0)) < ALPHA


def test_the_check_rejects_a_matcher_not_rolled_back(tokenizer, monkeypatch):
    """Wrong: after a rejection the matcher keeps the rejected drafts, so the next rows are
    masked for a text that is not the one committed."""
    def never_rolled_back(self, generated):
        for token in generated[len(self.path):]:
            if token == EOS or not self.matcher.consume_token(token):
                break
            self.path.append(token)
            self.masks.append(None)
        return len(self.path)

    monkeypatch.setattr(Grammar, "_follow", never_rolled_back)
    assert constrained_pvalue(tokenizer, SamplingConfig(1.0)) < ALPHA


def test_greedy_constrained_output_is_the_same_whatever_k(tokenizer):
    target, draft = fake_pair(vocab=EOS + 1)
    config = GenerationConfig(max_new_tokens=6)
    alone = constrained_decode(tokenizer, target, None, config, 0)
    assert len(alone) == 5 and all(t in allowed for t, allowed in zip(alone, LANGUAGE))
    for k in (1, 2, 4):
        assert constrained_decode(tokenizer, target, draft, config, k) == alone


def test_constraints_are_checked_where_they_are_made(tokenizer):
    with pytest.raises(ConfigError, match="kind must be one of"):
        Constraint("xml", "<a/>")
    with pytest.raises(ConfigError, match="needs its text"):
        Constraint("regex", " ")
    with pytest.raises(ConfigError, match="not JSON"):
        Constraint.json_schema("{")
    with pytest.raises(ConfigError, match="ignore_eos"):
        GenerationConfig(constraint=Constraint("json_object"), ignore_eos=True)
    with pytest.raises(ConstraintError, match="does not compile"):
        tokenizer.compile(Constraint("regex", "(unclosed"))
    with pytest.raises(ConstraintError, match="does not compile"):
        tokenizer.compile(Constraint("lark", "start: undefined_rule"))


def test_a_missing_engine_is_named_with_its_install_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ConstraintError, match="pip install 'llguidance"):
        grammar_module._engine()


# -- the demo package through the pipeline ---------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer"},
                                           "kind": {"enum": ["file", "folder"]}},
          "required": ["name", "size", "kind"], "additionalProperties": False}


def gguf_style_byte_level_tokenizer() -> str:
    """A byte-level BPE tokenizer (GPT-2's alphabet: a space is "Ġ") whose decoder is the
    sequence transformers' GGUF conversion writes for a "gpt2" vocabulary (SmolLM2's and Llama
    3's files): ByteFallback, Fuse, Replace and ByteLevel."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    backend = Tokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(
        ["New York and Los Angeles", '{"city": "New York"}', "the city of New York"] * 20,
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                            special_tokens=["</s>"]))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Replace("▁", " "), decoders.ByteLevel()])
    return backend.to_str()


def test_a_gguf_conversions_byte_level_tokens_are_read_as_the_text_they_write(monkeypatch):
    """llguidance reads a ByteLevel decoder only when it is the whole decoder: inside the
    sequence above it took "ĠYork" for the bytes of "ĠYork", so a constraint saw other text
    than the model wrote (a space in an enum or a tool call's ", " could never be written).
    Given the decoder it reads, every token of "New York" is allowed along the text; wrong
    variants: the tokenizer handed over as it is (refused by the byte check, and with that
    check off, the text leaves the grammar)."""
    from tokenizers import Tokenizer

    source = gguf_style_byte_level_tokenizer()
    backend = Tokenizer.from_str(source)
    eos = backend.token_to_id("</s>")
    ids = backend.encode('{"city": "New York"}').ids
    assert any(backend.id_to_token(i).startswith("Ġ") for i in ids)  # a space inside a token

    def follows(grammar_tokenizer: GrammarTokenizer) -> bool:
        schema = {"type": "object", "properties": {"city": {"enum": ["New York", "Boston"]}},
                  "required": ["city"]}
        grammar = grammar_tokenizer.compile(Constraint.json_schema(schema))
        return all(grammar.allowed(ids[:n])[ids[n]] for n in range(len(ids)))

    assert follows(GrammarTokenizer(source, backend.get_vocab_size(), [eos]))
    monkeypatch.setattr(grammar_module, "readable", lambda tokenizer_json: tokenizer_json)
    with pytest.raises(ConstraintError, match="other text than its tokenizer writes"):
        GrammarTokenizer(source, backend.get_vocab_size(), [eos])
    monkeypatch.setattr(grammar_module, "_check_bytes", lambda *args: None)
    assert not follows(GrammarTokenizer(source, backend.get_vocab_size(), [eos]))


@pytest.fixture(scope="module")
def demo():
    return edgespec.load(calibration_cache=False)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_json_is_token_identical_with_and_without_drafting(demo, drafter):
    """The schema's JSON from the demo pair, greedy: the same tokens target-only and drafted
    at a fixed k (tokens were drafted), and the text parses with the schema's keys."""
    constraint = Constraint.json_schema(SCHEMA)
    for prompt in ("def read(path):", "The file"):
        alone = demo.generate(prompt, max_new_tokens=80, constraint=constraint, drafter="none")
        drafted = demo.generate(prompt, max_new_tokens=80, constraint=constraint,
                                drafter=drafter, draft_length=3, schedule="fixed")
        assert drafted.token_ids == alone.token_ids and drafted.stats.drafted > 0
        assert drafted.stats.forced > 0  # the schema's keys and quotes, drafted without runs
        if alone.stats.finish_reason == "eos":
            answer = json.loads(alone.text)
            assert set(answer) == {"name", "size", "kind"} and answer["kind"] in ("file",
                                                                                   "folder")


def test_sampled_regex_output_always_matches(demo):
    import re

    pattern = r"(return|yield) [a-z]{1,8} \+ [0-9]{1,3}"
    constraint = Constraint("regex", pattern)
    for seed in range(6):
        result = demo.generate("def f(x):", max_new_tokens=40, constraint=constraint,
                               temperature=0.9, seed=seed, draft_length=3, schedule="fixed")
        assert result.stats.finish_reason == "eos" and re.fullmatch(pattern, result.text)


# -- the server: response_format as OpenAI defines it ------------------------------------------

def test_the_server_answers_response_format_with_json_through_the_openai_client(chat_package):
    """json_schema and json_object through the openai package against the app: the answer
    is the library's constrained one (same tokens), and it parses; a malformed
    response_format or a schema that does not compile is a 400 naming the field."""
    from openai import BadRequestError, OpenAI
    from starlette.testclient import TestClient

    from edgespec.serve.app import build_app

    pipe = edgespec.load(chat_package, calibration_cache=False)
    messages = [{"role": "user", "content": "Describe a file as JSON."}]
    with TestClient(build_app(pipe), base_url="http://localhost") as http:
        client = OpenAI(base_url="http://localhost/v1", api_key="x", http_client=http,
                        max_retries=0)
        form = {"type": "json_schema", "json_schema": {"name": "file", "schema": SCHEMA,
                                                       "strict": True}}
        answer = client.chat.completions.create(model="chat", messages=messages,
                                                temperature=0, max_tokens=80,
                                                response_format=form)
        expected = pipe.chat(messages, temperature=0, max_new_tokens=80,
                             constraint=Constraint.json_schema(SCHEMA))
        text = answer.choices[0].message.content
        assert text == expected.text
        if answer.choices[0].finish_reason == "stop":
            assert set(json.loads(text)) == {"name", "size", "kind"}
        any_object = client.chat.completions.create(
            model="chat", messages=messages, temperature=0, max_tokens=40,
            response_format={"type": "json_object"})
        assert any_object.choices[0].message.content.lstrip().startswith("{")
        for form, said in (({"type": "json_schema", "json_schema": {"name": "a b"}}, "name"),
                           ({"type": "json_schema", "json_schema": {
                               "name": "x", "schema": {"type": "nonsense"}}}, "compile")):
            with pytest.raises(BadRequestError) as error:
                client.chat.completions.create(model="chat", messages=messages,
                                               response_format=form)
            assert said in str(error.value)


def test_the_cli_takes_a_schema_file_a_regex_or_a_grammar_file(tmp_path):
    """generate --json-schema/--regex/--grammar answer within them; a constraint that does not
    compile, a file that does not read, or two constraints are one line and exit 1."""
    import re

    from click.testing import CliRunner

    from edgespec.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    lark = tmp_path / "answer.lark"
    lark.write_text('start: "yes" | "no"\n')
    gbnf = tmp_path / "answer.gbnf"
    gbnf.write_text('root ::= "maybe" | "never"\n')
    runner = CliRunner()

    def text(*args: str) -> str:
        result = runner.invoke(main, ["generate", "def f(x):", "-n", "60", "--json", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["text"]

    assert text("--json-schema", str(schema)).lstrip().startswith("{")
    assert re.fullmatch("[0-9]{2}", text("--regex", "[0-9]{2}"))
    assert text("--grammar", str(lark)) in ("yes", "no")
    assert text("--grammar", str(gbnf)) in ("maybe", "never")
    for args, said in ((["--regex", "("], "does not compile"),
                       (["--json-schema", str(tmp_path / "none.json")], "cannot read"),
                       (["--json-object", "--regex", "a"], "give one")):
        result = runner.invoke(main, ["generate", "x", *args])
        assert result.exit_code == 1 and "Traceback" not in result.output
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and said in errors[0], result.output


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE_SCHEMAS = {
    "unknown_type": {"type": "nonsense"},
    "bad_regex": {"type": "string", "pattern": "(unclosed"},
    "deeply_nested": _nested(5000),
    "huge_enum": {"enum": [f"value {i} " * 20 for i in range(20_000)]},
    "exploding_alternatives": {"anyOf": [{"type": "string", "pattern": f"(a|b){{{i},{i + 50}}}x"}
                                         for i in range(200)]},
}


@pytest.mark.parametrize("case", sorted(HOSTILE_SCHEMAS))
def test_hostile_schemas_are_refused_in_bounded_time(demo, case):
    """A schema from any web page: invalid, nested 5,000 deep, an enum of megabytes, a union
    whose automaton explodes: a ConstraintError or ConfigError (the server's 400) within a few
    seconds, never a crash, and the pipeline answers the next request."""
    import time

    schema = HOSTILE_SCHEMAS[case]
    start = time.perf_counter()
    try:
        constraint = Constraint.json_schema(schema)
        demo.generate("x", max_new_tokens=4, constraint=constraint, drafter="none")
    except (ConstraintError, ConfigError) as e:
        assert "\n" not in str(e)
    assert time.perf_counter() - start < 30
    assert demo.generate("x", max_new_tokens=2, drafter="none").stats.new_tokens == 2
