"""What a grammar's token mask costs per token at large vocabularies: 152k and 262k tokens.

    python benchmarks/mask_cost.py PACKAGE [--pad-to 262144] [--repeats 5] [--json FILE]

PACKAGE: a package folder or a named model (its tokenizer.json is read; qwen2.5-coder: 151,936
tokens). A second tokenizer is made from it with invented tokens added up to --pad-to (262,144
is Gemma 3's vocabulary: the mask's width and the token trie llguidance walks grow with it).

For each tokenizer and each schema of benchmarks/structured.py's PROMPTS, a valid answer (the
schema's example below, as JSON text) is tokenized, and the grammar's matcher follows it token
by token as decoding does (runtime/grammar.py: ``Grammar.allowed`` then the mask applied to a
float32 row of the vocabulary's width, as ``ConstrainedRows.row`` does, and the forced-token
check ``Grammar.forced``). Prints per vocabulary the median and 90th percentile of ms per token
(all answers' tokens together) and the compile time of one schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from structured import PROMPTS  # noqa: E402

from edgespec import Constraint  # noqa: E402
from edgespec.runtime.grammar import GrammarTokenizer  # noqa: E402
from edgespec.runtime.machine import describe, machine_info  # noqa: E402

ANSWERS = [
    {"name": "Ana Ribeiro", "age": 34, "city": "Porto"},
    {"fruits": [{"name": "apple", "colour": "red", "price_eur": 0.4},
                {"name": "banana", "colour": "yellow", "price_eur": 0.25},
                {"name": "plum", "colour": "purple", "price_eur": 0.3}]},
    {"title": "Team meeting", "day": "Friday", "hour": 10, "room": "B2", "topic": "budget"},
    {"host": "0.0.0.0", "port": 8443, "tls": True, "workers": 8},
]


def padded(tokenizer_json: str, size: int) -> str:
    """The tokenizer with invented vocabulary entries (lowercase words of 4-9 letters) added
    to its model's vocabulary up to ``size`` ids."""
    data = json.loads(tokenizer_json)
    vocab = data["model"]["vocab"]
    taken = {*vocab, *(t["content"] for t in data.get("added_tokens", []))}
    used = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))]) + 1
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    while used < size:
        word = "Ġ" + "".join(rng.choice(letters, rng.integers(4, 10)))
        if word not in taken:
            taken.add(word)
            vocab[word] = used
            used += 1
    return json.dumps(data)


def per_token_ms(grammar_tokenizer: GrammarTokenizer, tokenizer, vocab: int) -> tuple[list, list]:
    times, compiles = [], []
    row = np.zeros(vocab, dtype=np.float32)
    for (_, schema), answer in zip(PROMPTS, ANSWERS):
        ids = tokenizer.encode(json.dumps(answer), add_special_tokens=False).ids
        start = time.perf_counter()
        grammar = grammar_tokenizer.compile(Constraint.json_schema(schema))
        compiles.append(1e3 * (time.perf_counter() - start))
        for n in range(len(ids)):
            start = time.perf_counter()
            allowed = grammar.allowed(ids[:n])
            grammar.forced(ids[:n])
            masked = row.copy()
            masked[~allowed[:vocab]] = -np.inf
            times.append(1e3 * (time.perf_counter() - start))
            assert allowed[ids[n]], "the answer left the grammar"
    return times, compiles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("--pad-to", type=int, default=262_144)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    # the package's manifest and tokenizer only: the mask needs no session
    from edgespec.manifest import Manifest
    from edgespec.models.registry import package_path

    path = package_path(args.package)
    manifest = Manifest.read(path)
    source = (path / manifest.tokenizer).read_text()
    eos = sorted(manifest.eos_token_ids)
    table = {}
    for label, text, vocab in (("package", source, manifest.vocab_size),
                               ("padded", padded(source, args.pad_to), args.pad_to)):
        start = time.perf_counter()
        grammar_tokenizer = GrammarTokenizer(text, vocab, eos)
        load_s = time.perf_counter() - start
        tokenizer = Tokenizer.from_str(text)
        times, compiles = [], []
        for _ in range(args.repeats):
            t, c = per_token_ms(grammar_tokenizer, tokenizer, vocab)
            times += t
            compiles += c
        table[label] = {"vocab": vocab, "tokens": len(times) // args.repeats,
                        "median_ms": statistics.median(times),
                        "p90_ms": float(np.percentile(times, 90)),
                        "compile_ms_median": statistics.median(compiles),
                        "tokenizer_load_s": load_s}
    print(f"# {describe(machine_info())}")
    print(f"{'vocabulary':>12}{'tokens':>8}{'ms/token':>10}{'p90':>8}{'compile ms':>12}"
          f"{'load s':>8}")
    for row in table.values():
        print(f"{row['vocab']:>12,}{row['tokens']:>8}{row['median_ms']:>10.3f}"
              f"{row['p90_ms']:>8.3f}{row['compile_ms_median']:>12.1f}"
              f"{row['tokenizer_load_s']:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"table": table, "machine": describe(machine_info()),
                                         "argv": sys.argv}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
