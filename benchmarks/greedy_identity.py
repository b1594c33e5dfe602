"""How often greedy speculative output differs from target-only output, runs as fed or padded.

A verify run scores k + 1 tokens, a target-only step one; onnxruntime's one-row kernels round
differently from the many-row ones (export/runs.py), so a position's logits differ in the last
bits, and a greedy token flips where the top two logits are that close. Padding every run to
two tokens makes the rows bit-identical. This counts, per package and run shape, the
generations whose tokens differ from target-only, the positions whose target rows differ, and
the smallest top-2 margin met:

    python benchmarks/greedy_identity.py edgespec/models/demo --prompts edgespec/models/demo/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))
from common import machine_info, read_prompts  # noqa: E402
from helpers import recorded_target_rows  # noqa: E402  shared with tests/test_runs.py


def recorded(pipe, **settings) -> tuple[list[int], dict[tuple, np.ndarray]]:
    """Token ids of one generation, and the target's (last) row for every prefix it scored."""
    with recorded_target_rows(pipe) as rows:
        token_ids = pipe.generate(**settings).token_ids
    return token_ids, {prefix: found[-1] for prefix, found in rows.items()}


def compare(pipe, prompts: list[str], new_tokens: int, gamma: int) -> dict:
    differing_texts = rows_shared = rows_differing = 0
    max_diff, margins = 0.0, []
    for prompt in prompts:
        common = dict(prompt=prompt, max_new_tokens=new_tokens, ignore_eos=True)
        alone, alone_rows = recorded(pipe, drafter="none", **common)
        spec, spec_rows = recorded(pipe, draft_length=gamma, schedule="fixed", **common)
        differing_texts += alone != spec
        for key in alone_rows.keys() & spec_rows.keys():
            a, b = alone_rows[key], spec_rows[key]
            rows_shared += 1
            if not np.array_equal(a, b):
                rows_differing += 1
                max_diff = max(max_diff, float(np.abs(a - b).max()))
            top2 = np.sort(a)[-2:]
            margins.append(float(top2[1] - top2[0]))
    return {"generations": len(prompts), "generations_differing": differing_texts,
            "rows_shared": rows_shared, "rows_differing": rows_differing,
            "max_abs_diff": max_diff, "smallest_top2_margin": min(margins)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", type=Path, nargs="+")
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("-n", "--new-tokens", type=int, default=64)
    parser.add_argument("--draft-length", type=int, default=4)
    # --gamma: its former name, kept so that recorded commands still run
    parser.add_argument("--gamma", dest="draft_length", type=int, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import edgespec

    prompts = read_prompts(args.prompts)[: args.limit or None]
    results = {"command": " ".join(sys.argv), "machine": machine_info(), "packages": {}}
    print("| package | runs | generations differing | target rows differing | largest "
          "difference | smallest top-2 margin |\n|---|---|---|---|---|---|")
    for path in args.packages:
        pipe = edgespec.load(path, provider="cpu")
        exported = pipe.target.min_run_tokens
        for runs in (1, 2):
            pipe.target.min_run_tokens = runs
            r = compare(pipe, prompts, args.new_tokens, args.draft_length)
            results["packages"].setdefault(str(path), {})[f"min_run_tokens={runs}"] = r
            shape = ("as fed" if runs == 1 else "padded to 2") + (" (exported)" if runs ==
                                                                  exported else "")
            print(f"| {path} | {shape} | {r['generations_differing']}/{r['generations']} | "
                  f"{r['rows_differing']}/{r['rows_shared']} | {r['max_abs_diff']:.1e} | "
                  f"{r['smallest_top2_margin']:.1e} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
