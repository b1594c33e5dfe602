"""FR-Spec sizes on a real pair: packages that differ only in ``--draft-vocab``, the draft model
alone against target-only on the same prompts, greedy, in turns.

    python benchmarks/draft_vocab_real.py SIZE=PACKAGE [SIZE=PACKAGE ...] \
        [--prompts benchmarks/prompts/drafter_kinds.jsonl] [--max-new-tokens 128] [--json FILE]

For each prompt (rendered by the first package's chat template): one target-only run of the
first package, then each package's draft model (adaptive schedule, default k); per size the
draft step and target step timed after the runs in this process (not read from the cache), the median
of per-prompt speedups, acceptance (accepted / drafted over all runs) and the median alpha, and
whether every drafted run's tokens equal target-only's (they must: a smaller head changes q,
never the output).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import edgespec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="+", metavar="SIZE=PACKAGE")
    parser.add_argument("--prompts", type=Path,
                        default=Path(__file__).parent / "prompts" / "drafter_kinds.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = dict(item.split("=", 1) for item in args.packages)
    pipes = {size: edgespec.load(path, calibration_cache=False) for size, path in sizes.items()}
    first = next(iter(pipes.values()))
    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    runs = {size: [] for size in pipes}
    baseline, identical = [], True
    for prompt in prompts:
        ids = first.encode_chat(prompt["messages"])
        alone = first.generate(ids, max_new_tokens=args.max_new_tokens, drafter="none")
        baseline.append(alone.stats.tokens_per_s)
        for size, pipe in pipes.items():
            drafted = pipe.generate(ids, max_new_tokens=args.max_new_tokens, drafter="model")
            identical &= drafted.token_ids == alone.token_ids
            s = drafted.stats
            runs[size].append((s.tokens_per_s / alone.stats.tokens_per_s, s.accepted, s.drafted,
                               s.alpha))
    table = {}
    for size, pipe in pipes.items():
        costs = pipe.step_costs(4)  # a draft step and a one-token target run, timed now
        table[size] = {"draft_step_ms": costs.draft_step_ms, "target_step_ms": costs.target_ms[0],
                       "speedup_median": statistics.median(r[0] for r in runs[size]),
                       "acceptance": sum(r[1] for r in runs[size]) / sum(r[2] for r in runs[size]),
                       "alpha_median": statistics.median(r[3] for r in runs[size])}
        print(size, {k: round(v, 3) for k, v in table[size].items()})
    print(f"target-only tokens/s (median): {statistics.median(baseline):.1f}; "
          f"greedy identical: {identical}")
    if args.json:
        from edgespec.runtime.machine import machine_info

        args.json.write_text(json.dumps({"table": table, "greedy_identical": identical,
                                         "argv": sys.argv, "machine": machine_info(),
                                         "sessions": first.describe_sessions()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
