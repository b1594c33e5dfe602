"""The mixed drafter's planner against an earlier commit's, in one process, side by side.

    python benchmarks/planner_ab.py PACKAGE --old REV [--repeats 2] [--temperature 0]
        [--max-new-tokens 128] [--prompts benchmarks/prompts/drafter_kinds.jsonl] [--json FILE]

PACKAGE: a package folder or a named model ("demo": the bundled pair); the prompts as
benchmarks/drafters.py renders them. REV: a git commit whose runtime/drafters.py holds the
planner to compare with (read with ``git show REV:edgespec/runtime/drafters.py``). One
package is loaded once, so both planners weigh the same calibrated step costs; for each
repeat and prompt the ``auto`` drafter runs with the old planner (``MixedDrafter.plan``, and
no fading of the model's estimate) and with the current one, in alternating order. Prints per kind the median tokens/s of each and their ratio,
and per run the tokens per target call and the drafts by source (which say whether the
planners chose differently: the same sources and counts are the same rounds, and a difference
in tokens/s between them is the machine's noise).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from drafters import prompt_ids  # noqa: E402  (benchmarks/drafters.py)

import edgespec  # noqa: E402
from edgespec.runtime import drafters, schedule
from edgespec.runtime.machine import describe, machine_info

DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "drafter_kinds.jsonl"


def old_plan(rev: str):
    """``MixedDrafter.plan`` as commit ``rev`` has it (its module's own best_plan with it)."""
    source = subprocess.run(["git", "show", f"{rev}:edgespec/runtime/drafters.py"], check=True,
                            capture_output=True, text=True,
                            cwd=Path(__file__).parent.parent).stdout
    path = Path(tempfile.mkdtemp()) / "drafters_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("drafters_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["drafters_old"] = module
    spec.loader.exec_module(module)
    return module.MixedDrafter.plan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("--old", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    plans = {"old": old_plan(args.old), "new": drafters.MixedDrafter.plan}
    relax = schedule.AcceptanceEstimate.relax

    def use(form: str) -> None:
        drafters.MixedDrafter.plan = plans[form]
        schedule.AcceptanceEstimate.relax = relax if form == "new" else (lambda self: None)

    pipe = edgespec.load(None if args.package == "demo" else args.package, shared_pool=True)
    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line]
    ids = [prompt_ids(pipe, prompt["messages"]) for prompt in prompts]
    runs = []
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for form in ("old", "new") if repeat % 2 == 0 else ("new", "old"):
                use(form)
                stats = pipe.generate(ids[i], max_new_tokens=args.max_new_tokens,
                                      temperature=args.temperature, seed=repeat,
                                      drafter="auto").stats
                runs.append({"repeat": repeat, "prompt": i, "kind": prompt["kind"],
                             "form": form, "tokens_per_s": stats.tokens_per_s,
                             "tokens_per_target_call": stats.tokens_per_target_call,
                             "sources": stats.by_source()})
                print(f"r{repeat} p{i} {prompt['kind']:5s} {form}: {stats.tokens_per_s:5.1f} "
                      f"tok/s, {stats.tokens_per_target_call:.2f} tokens/target call "
                      f"({stats.by_source()})", flush=True)
    use("new")
    print(f"\n{describe(machine_info())}; old planner: {args.old}; T = {args.temperature}")
    table = {}
    for kind in sorted({run["kind"] for run in runs}):
        old, new = (statistics.median(r["tokens_per_s"] for r in runs
                                      if r["kind"] == kind and r["form"] == form)
                    for form in ("old", "new"))
        table[kind] = {"old": old, "new": new, "ratio": new / old}
        print(f"{kind:6s} old {old:5.1f}  new {new:5.1f}  new/old {new / old:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": describe(machine_info()), "argv": sys.argv,
                                         "runs": runs, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
