"""A speculative round's model time with each session on a pool of its own, and with both on
the process's one shared pool (edgespec.load's ``shared_pool``, the ``edgespec`` command's
choice for a real draft).

A round here is k draft steps of one token, then a target run on k + 1 tokens, both caches
cropped back after it; the same after 64 prompt tokens each time, so only the pools differ.
onnxruntime makes its global pools once per process, so each setting runs in a child process
of its own, the settings taking turns ``--repeats`` times.

    python benchmarks/thread_pools.py ~/.cache/edgespec/models/qwen2.5-coder --k 3 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "own pools": "load()'s default: the target every core spinning, a real draft every core not",
    "own pools, none spinning": "both every core, neither pool spinning",
    "shared pool": "load(shared_pool=True): both on one pool of every core, spinning",
}
PROMPT_TOKENS = 64


def measure(package: str, setting: str, k: int, rounds: int) -> dict:
    """Median ms of a round, a draft step and a verification, in this process."""
    import numpy as np

    import edgespec
    from edgespec.runtime.machine import usable_cores
    from edgespec.runtime.providers import SessionConfig

    cores = usable_cores()
    if setting == "shared pool":
        pipe = edgespec.load(package, provider="cpu", shared_pool=True, calibration_cache=False)
    elif setting == "own pools":
        pipe = edgespec.load(package, provider="cpu", calibration_cache=False)
    else:
        still = SessionConfig("cpu", threads=cores, spin=False)
        pipe = edgespec.load(package, provider="cpu", target=still, draft=still,
                             calibration_cache=False)
    if pipe.draft is None:
        raise SystemExit(f"{package}: no draft model to take turns with")
    target_cache, draft_cache = pipe.target.new_cache(512), pipe.draft.new_cache(512)
    prompt = np.arange(1, PROMPT_TOKENS + 1, dtype=np.int64)
    pipe.target.forward(prompt, target_cache)
    pipe.draft.forward(prompt, draft_cache)
    round_ms, draft_ms, verify_ms = [], [], []
    for i in range(rounds + 3):  # the first three warm up
        start = time.perf_counter()
        for j in range(k):
            pipe.draft.forward(np.array([5 + j], np.int64), draft_cache)
        drafted = time.perf_counter()
        pipe.target.forward(np.arange(1, k + 2, dtype=np.int64), target_cache)
        end = time.perf_counter()
        target_cache.crop(PROMPT_TOKENS)
        draft_cache.crop(PROMPT_TOKENS)
        if i >= 3:
            round_ms.append(1000 * (end - start))
            draft_ms.append(1000 * (drafted - start) / k)
            verify_ms.append(1000 * (end - drafted))
    sessions = pipe.describe_sessions()
    return {"round_ms": statistics.median(round_ms), "draft_step_ms": statistics.median(draft_ms),
            "verify_ms": statistics.median(verify_ms),
            "on_shared_pool": [sessions[r]["on_shared_pool"] for r in ("target", "draft")]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package")
    parser.add_argument("--k", type=int, default=3, help="draft steps a round")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3, help="children per setting, in turn")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.package, args.child, args.k, args.rounds)))
        return

    from edgespec.runtime.machine import machine_info

    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for _ in range(args.repeats):
        for setting in SETTINGS:
            out = subprocess.run([sys.executable, __file__, args.package, "--k", str(args.k),
                                  "--rounds", str(args.rounds), "--child", setting],
                                 capture_output=True, text=True, check=True).stdout
            runs[setting].append(json.loads(out.splitlines()[-1]))
    print(f"k = {args.k}, {args.rounds} rounds a child, medians of the children's medians (ms)")
    print(f"{'setting':26s} {'round':>7s} {'draft step':>11s} {'verify':>7s}")
    summary = {}
    for setting, results in runs.items():
        summary[setting] = {key: statistics.median(r[key] for r in results)
                            for key in ("round_ms", "draft_step_ms", "verify_ms")}
        s = summary[setting]
        print(f"{setting:26s} {s['round_ms']:7.1f} {s['draft_step_ms']:11.1f} {s['verify_ms']:7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": machine_info(), "k": args.k,
                       "settings": SETTINGS, "runs": runs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
