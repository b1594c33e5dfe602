"""Constrained decoding's cost and speculation's gain on it, side by side in one run.

    python benchmarks/structured.py PACKAGE [--repeats 3] [--max-new-tokens 96] [--json FILE]

For each prompt of PROMPTS (chat requests for JSON of a schema, the package's chat template
rendering them) and repeat, greedy, one after the other:

- ``free``: target-only, no constraint (what the mask costs is measured against it);
- ``json``: target-only, the schema's constraint;
- ``json+draft``: the package's drafter, default (adaptive) schedule, forced tokens proposed
  without a draft run (drafters.Drafter.propose);
- ``json+draft, no forcing``: the same with the forced-token path off (the draft model runs
  at every position, as without this feature).

Prints tokens/s (new tokens / decode seconds, prefill excluded) as medians over prompts and
repeats, each constrained row's ratio to ``json`` (speculation's gain under a constraint),
the share of drafted tokens the grammar forced, and whether every drafted run's tokens equal
``json``'s (greedy identity).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import edgespec
from edgespec import Constraint
from edgespec.runtime import drafters
from edgespec.runtime.machine import describe, machine_info


def describe_machine() -> str:
    return describe(machine_info())

PROMPTS = [
    ("Describe a user of a web shop as JSON with their name, age and city.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                       "age": {"type": "integer", "minimum": 0,
                                               "maximum": 130},
                                       "city": {"type": "string", "maxLength": 40}},
      "required": ["name", "age", "city"], "additionalProperties": False}),
    ("List three fruits with their colour and a price in euros, as JSON.",
     {"type": "object", "properties": {"fruits": {"type": "array", "minItems": 3,
                                                  "maxItems": 3, "items": {
         "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "colour": {"type": "string", "maxLength": 20},
                                          "price_eur": {"type": "number"}},
         "required": ["name", "colour", "price_eur"], "additionalProperties": False}}},
      "required": ["fruits"], "additionalProperties": False}),
    ("Extract the event from: 'Team meeting on Friday at 10 in room B2, about the budget.'",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                       "day": {"enum": ["Monday", "Tuesday", "Wednesday",
                                                        "Thursday", "Friday"]},
                                       "hour": {"type": "integer", "minimum": 0,
                                                "maximum": 23},
                                       "room": {"type": "string", "maxLength": 10},
                                       "topic": {"type": "string", "maxLength": 40}},
      "required": ["title", "day", "hour", "room", "topic"], "additionalProperties": False}),
    ("Give a config for a web server as JSON: host, port, TLS on or off, and workers.",
     {"type": "object", "properties": {"host": {"type": "string", "maxLength": 30},
                                       "port": {"type": "integer", "minimum": 1,
                                                "maximum": 65535},
                                       "tls": {"type": "boolean"},
                                       "workers": {"type": "integer", "minimum": 1,
                                                   "maximum": 64}},
      "required": ["host", "port", "tls", "workers"], "additionalProperties": False}),
]


def rate(result) -> float:
    s = result.stats
    decode = s.total_s - s.prefill_s
    return (s.new_tokens - 1) / decode if decode > 0 and s.new_tokens > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    pipe = edgespec.load(args.package)
    rows: dict[str, list[float]] = {name: [] for name in (
        "free", "json", "json+draft", "json+draft, no forcing")}
    ratios: dict[str, list[float]] = {"json+draft": [], "json+draft, no forcing": []}
    forced = drafted = 0
    identical = True
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=0)
    for text, schema in PROMPTS:
        ids = pipe.encode_chat([{"role": "user", "content": text}])
        constraint = Constraint.json_schema(schema)
        pipe.generate(ids, constraint=constraint, **settings)  # warm: costs, the compiler
        for _ in range(args.repeats):
            free = pipe.generate(ids, drafter="none", **settings)
            alone = pipe.generate(ids, constraint=constraint, drafter="none", **settings)
            both = pipe.generate(ids, constraint=constraint, **settings)
            drafters.ModelDrafter.takes_forced = False
            try:
                unforced = pipe.generate(ids, constraint=constraint, **settings)
            finally:
                drafters.ModelDrafter.takes_forced = True
            for name, result in (("free", free), ("json", alone), ("json+draft", both),
                                 ("json+draft, no forcing", unforced)):
                rows[name].append(rate(result))
            for name, result in (("json+draft", both), ("json+draft, no forcing", unforced)):
                ratios[name].append(rate(result) / rate(alone))
                identical &= result.token_ids == alone.token_ids
            forced += both.stats.forced
            drafted += both.stats.drafted
    print(f"# {describe_machine()}")
    print(f"# package {args.package}; {len(PROMPTS)} prompts x {args.repeats}, greedy, "
          f"{args.max_new_tokens} new tokens at most")
    print(f"{'run':<26}{'tok/s':>8}{'x json':>8}")
    table = {}
    for name, values in rows.items():
        ratio = statistics.median(ratios[name]) if name in ratios else None
        table[name] = {"tokens_per_s": statistics.median(values), "speedup_vs_json": ratio}
        print(f"{name:<26}{table[name]['tokens_per_s']:>8.1f}"
              + (f"{ratio:>7.2f}x" if ratio else ""))
    print(f"forced: {forced} of {drafted} drafted tokens ({forced / max(drafted, 1):.0%}); "
          f"greedy identical to json: {identical}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "table": table, "forced": forced, "drafted": drafted, "identical": identical,
            "machine": describe_machine(), "argv": sys.argv}, indent=2))


if __name__ == "__main__":
    main()
