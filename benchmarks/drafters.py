"""Each drafter against target-only decoding, by kind of prompt, side by side in one run.

    python benchmarks/drafters.py PACKAGE [--repeats 3] [--max-new-tokens 160]
        [--temperatures 0,0.7] [--prompts benchmarks/prompts/drafter_kinds.jsonl] [--json FILE]

PACKAGE: a package folder or a named model (``edgespec models list``); "demo" for the bundled
pair. The prompts (a JSON line each: ``kind`` and chat ``messages``, rendered by the package's
chat template, or joined as plain text where it has none) are of three kinds: ``edit`` (code
given, an edit asked for: the answer copies most of it), ``new`` (new code) and ``turns`` (a
conversation whose last turn asks to rework an earlier answer).

For each temperature, prompt and repeat, one after the other on the same loaded package:
``none`` (target-only), ``model`` (the draft model), ``ngram`` (the text's lookup) and
``auto`` (the package's default: the two chosen per round, runtime/drafters.py's MixedDrafter),
default (adaptive) schedule and draft length, seeded, until EOS or --max-new-tokens. Prints
per kind and drafter the median tokens/s (new tokens over decode seconds, prefill excluded)
and its ratio to ``none`` (of the medians), the auto drafter's tokens per source (proposed, and
accepted), and whether every greedy run's tokens equal target-only's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import edgespec
from edgespec.runtime.machine import describe, machine_info
from edgespec.runtime.stats import GenerationStats

DRAFTERS = ("none", "model", "ngram", "auto")
DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "drafter_kinds.jsonl"


def read_prompts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompt_ids(pipe, messages: list[dict]) -> list[int]:
    if pipe.manifest.chat_template is not None:
        return pipe.encode_chat(messages)
    return pipe.encode("\n\n".join(m["content"] for m in messages) + "\n\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--temperatures", default="0")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--drafters", default=",".join(DRAFTERS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # as the `edgespec` command loads it (a real draft on the target's pool of workers)
    pipe = edgespec.load(None if args.package == "demo" else args.package, shared_pool=True)
    drafters = args.drafters.split(",")
    if pipe.draft is None:
        drafters = [d for d in drafters if d != "model"]
    prompts = read_prompts(args.prompts)
    ids = [prompt_ids(pipe, p["messages"]) for p in prompts]
    temperatures = [float(t) for t in args.temperatures.split(",")]

    runs = []  # one dict per generation
    for drafter in drafters:  # warm: sessions, calibration, the adaptive schedule's costs
        pipe.generate(ids[0], max_new_tokens=8, drafter=drafter)
    for temperature in temperatures:
        for repeat in range(args.repeats):
            for n, (prompt, tokens) in enumerate(zip(prompts, ids)):
                baseline = None
                for drafter in drafters:
                    pipe.prefix_cache.clear()  # each run prefills its prompt: none reuses
                    result = pipe.generate(tokens, max_new_tokens=args.max_new_tokens,
                                           drafter=drafter, temperature=temperature,
                                           seed=repeat)
                    s = result.stats
                    if drafter == "none":
                        baseline = result.token_ids
                    runs.append({
                        "temperature": temperature, "repeat": repeat, "prompt": n,
                        "kind": prompt["kind"], "drafter": drafter, "as": s.drafter,
                        "new_tokens": s.new_tokens, "decode_s": s.decode_s,
                        "tokens_per_s": s.tokens_per_s, "stats": s,
                        "identical": (result.token_ids == baseline
                                      if temperature == 0 and baseline is not None else None),
                    })
                    print(f"T={temperature:g} r{repeat} p{n} {prompt['kind']:>5} {drafter:>5}: "
                          f"{s.summary()}", file=sys.stderr)

    report = summarise(runs, drafters)
    print(f"\n{describe(machine_info())}; {args.package}; median of {args.repeats} repeats "
          f"x prompts; max_new_tokens {args.max_new_tokens}")
    print(format_table(report))
    if args.json:
        for run in runs:
            run["stats"] = run["stats"].as_dict()
        args.json.write_text(json.dumps({"machine": machine_info(), "package": args.package,
                                         "args": vars(args) | {"json": str(args.json),
                                                               "prompts": str(args.prompts)},
                                         "report": report, "runs": runs}, indent=1,
                                        default=str))
    return 0 if all(r["identical"] is not False for r in runs) else 1


def summarise(runs: list[dict], drafters: list[str]) -> list[dict]:
    """Per temperature, kind and drafter: median tokens/s, ratio to none, the sources' shares."""
    groups = defaultdict(list)
    for run in runs:
        groups[run["temperature"], run["kind"], run["drafter"]].append(run)
        groups[run["temperature"], "all", run["drafter"]].append(run)
    rows = []
    for (temperature, kind, drafter), group in groups.items():
        median = statistics.median(r["tokens_per_s"] for r in group)
        base = statistics.median(r["tokens_per_s"]
                                 for r in groups[temperature, kind, "none"])
        stats = GenerationStats.combined(r["stats"] for r in group)
        rows.append({
            "temperature": temperature, "kind": kind, "drafter": drafter,
            "as": stats.drafter, "tokens_per_s": median, "vs_none": median / base,
            "tokens_per_target_call": stats.tokens_per_target_call,
            "sources": {source: [n, stats.accepted_by.get(source, 0)]
                        for source, n in stats.drafted_by.items()},
            "draft_s_by": stats.draft_s_by,
            "identical": all(r["identical"] is not False for r in group),
        })
    order = {d: i for i, d in enumerate(drafters)}
    kinds = {"edit": 0, "new": 1, "turns": 2, "all": 3}
    rows.sort(key=lambda r: (r["temperature"], kinds.get(r["kind"], 9), order[r["drafter"]]))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'T':>4} {'kind':>6} {'drafter':>8} {'tok/s':>7} {'x none':>7} "
             f"{'tok/call':>8}  sources (proposed/accepted)  identical"]
    for r in rows:
        sources = ", ".join(f"{s} {n}/{a}" for s, (n, a) in
                            sorted(r["sources"].items(), key=lambda i: -i[1][0]))
        lines.append(f"{r['temperature']:>4g} {r['kind']:>6} {r['drafter']:>8} "
                     f"{r['tokens_per_s']:>7.1f} {r['vs_none']:>7.2f} "
                     f"{r['tokens_per_target_call']:>8.2f}  {sources or '-':<28} "
                     f"{'yes' if r['identical'] else 'NO'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
