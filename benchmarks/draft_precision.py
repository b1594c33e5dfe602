"""The draft's precision, side by side: the same target, prompts and seeds, each draft variant.

Exports the demo checkpoints once per draft variant (fp32, int8, int4; the target stays fp32, so
every variant decodes the same text), then interleaves, prompt by prompt, a target-only run and
a speculative run with each variant, so drift of a noisy machine hits all alike. Prints the
median speedup over target-only, alpha, the draft step and the verify run per variant.

    python benchmarks/draft_precision.py [--draft-length 4,8] [--temperature 0,1] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"fp32": None, "int8": "int8", "int4": "int4"}


def export_variants(folder: Path) -> dict[str, Path]:
    from edgespec.export import export_pair

    packages = {}
    for name, quantize in VARIANTS.items():
        package = folder / f"demo-draft-{name}"
        if not (package / "edgespec.json").exists():
            export_pair(ROOT / "checkpoints/demo/target", ROOT / "checkpoints/demo/draft", package,
                        draft_quantize=quantize)
        packages[name] = package
    return packages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-length", default="4,8")
    # --gamma: its former name, kept so that recorded commands still run
    parser.add_argument("--gamma", dest="draft_length", default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
    parser.add_argument("--temperature", default="0,1")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--build", default=str(ROOT / "build" / "draft-precision"))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    import edgespec
    from edgespec.bench import read_prompts, summarise
    from edgespec.config import GenerationConfig, SamplingConfig
    from edgespec.runtime.machine import describe, machine_info

    machine = machine_info()
    packages = export_variants(Path(args.build))
    pipes = {name: edgespec.load(p, calibration_cache=False, prefix_cache_slots=0)  # cold runs
             for name, p in packages.items()}
    prompts = read_prompts(ROOT / "edgespec/models/demo/prompts.jsonl")
    for pipe in pipes.values():
        pipe.generate(prompts[0], max_new_tokens=8)  # warm-up
    draft_lengths = [int(k) for k in args.draft_length.split(",")]
    rows = []
    print(f"machine: {describe(machine)}")
    print(f"{'T':>4} {'k':>3} {'draft':>6} {'speedup':>8} {'alpha':>6} {'draft ms':>9} "
          f"{'step ms':>8} {'verify ms':>9} {'draft MB':>8}")
    for temperature in (float(t) for t in args.temperature.split(",")):
        pairs = {(name, k): [] for k in draft_lengths for name in pipes}
        for repeat in range(args.repeats):
            for i, prompt in enumerate(prompts):
                seed = 1000 * repeat + i
                settings = dict(sampling=SamplingConfig(temperature), seed=seed, ignore_eos=True)
                base = pipes["fp32"].generate(
                    prompt, GenerationConfig(args.tokens, drafter="none", **settings)).stats
                for k in draft_lengths:
                    for name, pipe in pipes.items():
                        spec = pipe.generate(prompt, GenerationConfig(args.tokens, draft_length=k, schedule="fixed",
                                                                      **settings)).stats
                        pairs[name, k].append((base, spec))
        for (name, k), runs in pairs.items():
            summary = summarise(temperature, "model", "fixed", k, runs)  # edgespec bench's
            size = (packages[name] / "draft" / "model.onnx").stat().st_size / 2**20
            row = {
                "temperature": temperature, "draft_length": k, "draft": name,
                "speedup": summary.speedup, "alpha": summary.alpha,
                "draft_step_ms": summary.draft_step_ms, "target_step_ms": summary.target_step_ms,
                "verify_ms": summary.verify_ms, "draft_mib": size,
            }
            rows.append(row)
            print(f"{temperature:>4g} {k:>3} {name:>6} {row['speedup']:>7.2f}x {row['alpha']:>6.3f} "
                  f"{row['draft_step_ms']:>9.3f} {row['target_step_ms']:>8.3f} "
                  f"{row['verify_ms']:>9.3f} {size:>8.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine,
             "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
