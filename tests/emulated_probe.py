"""What packages decode on this CPU, as JSON on stdout: run by tests/test_portable.py natively
and under an emulated CPU (qemu-user), with the runtime's dependencies only (no torch, no
pytest, no scipy: the test judges the figures where those are).

    python emulated_probe.py --pair PKG [--stats PKG] [--probe-runs 2]

--pair: a package with a draft; its load's numerics, the draft's one-token rows against a
run's, the target's row identity with the run shape the load chose and with runs padded to two
tokens alone, and greedy tokens with and without drafting
at a fixed k on PROMPTS. --stats: a package whose two-token joint distribution is sampled with
speculative decoding at a fixed k = 2 (``STATS_SAMPLES`` seeds), beside the exact one from its
target. --probe-runs: the run sizes the load's release probe runs (session.PROBE_RUNS): "2"
is the probe before its fix, the wrong variant the test must see fail where it failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # helpers, reference (NumPy only)

PROMPTS = ("def add(a, b):", "The quick brown", "for i in range(10):\n    print(")
STATS_SAMPLES = 500
# The command (JSON list) that runs the tokenizer's child process (runtime/bounded_text.py)
# under the emulator too: qemu-user does not carry an exec over to the emulator without the
# kernel's binfmt_misc, and an ARM64 child would not start at all
CHILD_PREFIX = "EDGESPEC_PROBE_CHILD_PREFIX"
DRAFT_LENGTH = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pair", required=True)
    parser.add_argument("--stats")
    parser.add_argument("--probe-runs")
    args = parser.parse_args()

    from edgespec.runtime import bounded_text, session

    if os.environ.get(CHILD_PREFIX):  # the tokenizer's child runs under the same emulator
        bounded_text.CHILD = (*json.loads(os.environ[CHILD_PREFIX]), *bounded_text.CHILD)
    if args.probe_runs:
        session.PROBE_RUNS = tuple(int(n) for n in args.probe_runs.split(","))
    from edgespec import load
    from edgespec.runtime import machine, run_checks

    pipe = load(args.pair, calibration_cache=False)
    out = {"instruction_sets": list(machine.instruction_sets()),
           "numerics": {**pipe.numerics.record(), "fell_back": pipe.numerics.fell_back},
           "draft_gap_as_fed": run_checks.draft_gap(pipe.draft, 1),
           # the rows of the shape the load chose, and of runs padded to two tokens alone
           "rows_identical_chosen": run_checks.rows_identical(
               pipe.target, pipe.target.min_run_tokens, pipe.target.run_align),
           "rows_identical_padded": run_checks.rows_identical(pipe.target, 2, 1),
           "greedy": []}
    out["greedy"] = greedy(pipe)
    shape = pipe.target.min_run_tokens, pipe.target.run_align
    if shape != (2, 1):  # the wrong variant where it differs: runs padded to two tokens alone
        pipe.target.min_run_tokens, pipe.target.run_align = 2, 1
        out["greedy_padded"] = greedy(pipe)
        pipe.target.min_run_tokens, pipe.target.run_align = shape
    if args.stats:
        out["stats"] = sampled(args.stats)
    json.dump(out, sys.stdout)


def greedy(pipe) -> list[dict]:
    """Per prompt: greedy tokens target-only and with the draft at DRAFT_LENGTH, and how many
    of the rows of logits both scored (by prefix) differ by a bit (helpers'
    recorded_target_rows: identical rows make identical greedy output by construction)."""
    from helpers import recorded_target_rows

    found = []
    for prompt in PROMPTS:
        with recorded_target_rows(pipe) as recorded:
            alone = pipe.generate(prompt, max_new_tokens=24, drafter="none", ignore_eos=True)
        alone_rows = {prefix: rows[0].tobytes() for prefix, rows in recorded.items()}
        with recorded_target_rows(pipe) as recorded:
            drafted = pipe.generate(prompt, max_new_tokens=24, drafter="model",
                                    schedule="fixed", draft_length=DRAFT_LENGTH,
                                    ignore_eos=True)
        shared = [p for p in recorded if p in alone_rows]
        found.append({"prompt": prompt, "target_only": alone.token_ids,
                      "drafted": drafted.token_ids, "tokens_drafted": drafted.stats.drafted,
                      "accepted": drafted.stats.accepted, "rows_shared": len(shared),
                      "rows_differing": sum(any(r.tobytes() != alone_rows[p]
                                                for r in recorded[p]) for p in shared)})
    return found


def sampled(package: str) -> dict:
    """Samples of the first two tokens at T = 1 through speculative sessions, and the exact
    joint distribution of the target (helpers' functions, as the native tests use them)."""
    from helpers import exact_two_token_distribution, two_token_samples

    from edgespec.config import SamplingConfig
    from edgespec import load

    pipe = load(package, calibration_cache=False)
    sampling = SamplingConfig(temperature=1.0)
    prompt = "a b"
    samples, drafted, accepted = two_token_samples(pipe, sampling, STATS_SAMPLES, prompt)
    exact = exact_two_token_distribution(pipe, sampling, prompt)
    return {"samples": [list(s) for s in samples], "drafted": drafted, "accepted": accepted,
            "exact": [[list(k), float(v)] for k, v in exact.items()],
            "sampling": asdict(sampling)}


if __name__ == "__main__":
    main()
