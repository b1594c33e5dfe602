"""The draft scoring only its most frequent tokens (FR-Spec, ``--draft-vocab``): cost and acceptance.

Two measurements, each package exported by ``edgespec export`` with every subset size:

    # a trained pair: draft step, target step, c, alpha and speedup per size (edgespec bench)
    python benchmarks/draft_vocab.py pair --target checkpoints/demo/target \\
        --draft checkpoints/demo/draft --sizes 512,1024,2048,full --text CALIBRATION.py ...

    # a real-shaped draft (random weights, so only costs mean something): its step per size
    python benchmarks/draft_vocab.py step --draft build/shapes/qwen2.5-0.5b \\
        --sizes 8192,16384,32768,65536,full --quantize int4

``pair`` runs ``edgespec bench`` (greedy and T = 1, a fixed k and the adaptive schedule) on each
package and tabulates alpha, the draft's and target's steps, c = draft / target and the
speedup. ``step`` exports the checkpoint as its own draft (a self pair; the target's graph is
not timed) and times the draft's one-token step after 256 tokens, on one thread and on every
core, interleaved across sizes. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

EDGESPEC = str(Path(sys.executable).parent / "edgespec")


def export(target: Path, draft: Path, out: Path, size: str, texts: list[Path],
           extra: list[str]) -> Path:
    """The package for one subset size, exported once (reused when its command matches)."""
    command = [EDGESPEC, "export", "--target", str(target), "--draft", str(draft), "--out",
               str(out), "--overwrite", *extra]
    if size != "full":
        command += ["--draft-vocab", size, *[a for t in texts for a in ("--draft-vocab-text", str(t))]]
    record = out.with_name(out.name + ".command.json")
    if record.is_file() and json.loads(record.read_text()) == command and out.is_dir():
        return out
    print(f"exporting {out.name} ...", flush=True)
    subprocess.run(command, check=True)
    record.write_text(json.dumps(command))
    return out


def bench(package: Path, args) -> dict:
    out = package.with_name(package.name + ".bench.json")
    command = [EDGESPEC, "bench", str(package), "--draft-length", args.gamma, "--temperature",
               args.temperatures, "--schedule", "fixed,adaptive", "-n", str(args.new_tokens),
               "--repeats", str(args.repeats), "--json", str(out)]
    if args.prompts:
        command += ["--prompts", str(args.prompts)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def pair(args) -> None:
    rows = []
    for size in args.sizes.split(","):
        package = export(args.target, args.draft, args.out / f"vocab-{size}", size, args.text,
                         args.export_args.split())
        report = bench(package, args)
        manifest = json.loads((package / "edgespec.json").read_text())
        for row in report["rows"]:
            rows.append({"size": size, "draft_rows": manifest["draft"]["vocab_size"], **{
                k: row[k] for k in ("temperature", "schedule", "gamma", "alpha", "speedup",
                                    "draft_step_ms", "target_step_ms", "verify_ms")}})
    lines = ["| draft vocabulary | T | schedule | alpha | draft step ms | target step ms | c | "
             "speedup |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']} ({r['draft_rows']} rows) | {r['temperature']:g} | "
                     f"{r['schedule']} k={r['gamma']} | {r['alpha']:.2f} | "
                     f"{r['draft_step_ms']:.3f} | {r['target_step_ms']:.3f} | "
                     f"{r['draft_step_ms'] / r['target_step_ms']:.3f} | {r['speedup']:.2f}x |")
    finish(args, rows, lines)


def step(args) -> None:
    import numpy as np

    import edgespec
    from edgespec.runtime.providers import SessionConfig

    packages = {size: export(args.draft, args.draft, args.out / f"step-{size}", size, args.text,
                             ["--validate", "skip", "--quantize", args.quantize]
                             if args.quantize else ["--validate", "skip"])
                for size in args.sizes.split(",")}
    times: dict[tuple[str, int], list[float]] = {}
    pipes = {(size, threads): edgespec.load(path, provider="cpu",
                                            draft=SessionConfig("cpu", threads=threads),
                                            prefix_cache_slots=0)  # cold runs
             for size, path in packages.items() for threads in (1, 0)}
    context = 256
    states = {}
    for key, pipe in pipes.items():
        ids = np.random.default_rng(0).integers(0, pipe.manifest.vocab_size, context + 1)
        cache = pipe.draft.new_cache(context + 2)
        pipe.draft.forward(ids[:context], cache)
        states[key] = (pipe, ids, cache)
    for repeat in range(args.repeats * 10 + 1):
        for key, (pipe, ids, cache) in states.items():
            start = time.perf_counter()
            pipe.draft.forward(ids[context:], cache)
            elapsed = time.perf_counter() - start
            cache.crop(context)
            if repeat:
                times.setdefault(key, []).append(1e3 * elapsed)
    lines = ["| draft vocabulary | rows | step ms, 1 thread | step ms, every core |",
             "|---|---|---|---|"]
    rows = []
    for size in packages:
        rows_n = pipes[(size, 1)].draft.vocab_size if pipes[(size, 1)].draft.token_ids is None \
            else len(pipes[(size, 1)].draft.token_ids)
        one, every = (statistics.median(times[(size, t)]) for t in (1, 0))
        rows.append({"size": size, "rows": rows_n, "step_ms_1_thread": one,
                     "step_ms_all_cores": every})
        lines.append(f"| {size} | {rows_n} | {one:.2f} | {every:.2f} |")
    finish(args, rows, lines)


def finish(args, rows: list[dict], lines: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from common import machine_info

    table = "\n".join(lines)
    print(table)
    (args.out / f"{args.command}.md").write_text(table + "\n")
    (args.out / f"{args.command}.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "machine": machine_info(), "rows": rows}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("pair", "step"):
        p = sub.add_parser(name)
        if name == "pair":
            p.add_argument("--target", type=Path, required=True)
            p.add_argument("--prompts", type=Path)
            p.add_argument("--gamma", default="4")
            p.add_argument("--temperatures", default="0,1")
            p.add_argument("--new-tokens", type=int, default=128)
            p.add_argument("--export-args", default="", help="more flags for edgespec export")
        else:
            p.add_argument("--quantize", default="int4")
        p.add_argument("--draft", type=Path, required=True)
        p.add_argument("--sizes", default="1024,2048,full")
        p.add_argument("--text", type=Path, action="append", default=[],
                       help="calibration text (repeatable)")
        p.add_argument("--repeats", type=int, default=2)
        p.add_argument("--out", type=Path, default=Path("build/draft-vocab"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pair(args) if args.command == "pair" else step(args)


if __name__ == "__main__":
    main()
