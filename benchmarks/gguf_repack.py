"""A GGUF file exported three ways, against its own dequantized weights in PyTorch.

    python benchmarks/gguf_repack.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/gguf

1. transformers dequantizes the file into a Hugging Face folder (the reference model);
2. exports, each in its own process (wall time, peak resident memory, package size):
   repacked  the GGUF file itself: its blocks repacked for MatMulNBits (export/gguf.py)
   repacked-int8  the same with --target-compute int8: int8 activations, the Q8_0 head repacked
   fp32      the dequantized folder, float32
   int4      the dequantized folder quantized again (--quantize int4), float compute
3. over the first ``--positions`` tokens of README.md: each package's logits (one uncached run)
   against PyTorch's: mean / max total variation, top-1 agreement, max |dlogit|;
4. the target's step on ``--threads`` threads: median and best of one-token runs after a
   64-token prefix, the packages taking turns (5 rounds of ``--steps`` / 5), so that other
   work on the machine weighs on each alike.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def dequantize(gguf: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (folder / "config.json").is_file():
        return
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


_EXPORT = """
import sys
from edgespec.cli import main
main(sys.argv[1:], standalone_mode=False)
print([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
"""


def export(source: Path, out: Path, *options: str) -> dict:
    """One `edgespec export` in a child process: its wall time and peak memory (Linux)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _EXPORT, "export", "--target", str(source),
                           "--out", str(out), "--overwrite", *options],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        sys.exit(done.stderr[-2000:])
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"export_s": time.perf_counter() - start,
            "peak_gb": int(done.stdout.split()[-1]) / 2**20, "package_mb": size / 2**20}


def session(package: Path, threads: int):
    from edgespec.manifest import Manifest
    from edgespec.runtime.providers import SessionConfig
    from edgespec.runtime.session import ModelSession

    manifest = Manifest.read(package)
    spec = manifest.target
    return ModelSession(package / spec.path, spec, spec.vocab_size, manifest.max_positions,
                        SessionConfig("cpu", threads=threads))


def figures(target, ids: list[int], reference: np.ndarray) -> dict:
    from edgespec.export.validate import distribution_figures

    logits = target.forward(np.array(ids), target.new_cache())
    found = distribution_figures(reference, logits)
    return {"mean_tv": found["mean_tv"], "max_tv": found["max_tv"],
            "top1": found["top1_agreement"], "max_dlogit": float(np.abs(logits - reference).max())}


def step_times(targets: dict, ids: list[int], steps: int) -> dict[str, list[float]]:
    times = {name: [] for name in targets}
    for _ in range(5):
        for name, target in targets.items():
            cache = target.new_cache()
            target.forward(np.array(ids[:64]), cache)
            for i in range(steps // 5):
                start = time.perf_counter()
                target.forward(np.array([ids[64 + i % 64]]), cache)
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--positions", type=int, default=400)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    dequantized = args.work / "dequantized"
    dequantize(args.gguf.resolve(), dequantized)
    runs = {"repacked": export(args.gguf, args.work / "repacked"),
            "repacked-int8": export(args.gguf, args.work / "repacked-int8",
                                    "--target-compute", "int8"),
            "fp32": export(dequantized, args.work / "fp32"),
            "int4": export(dequantized, args.work / "int4", "--quantize", "int4",
                           "--target-compute", "float")}

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(dequantized)
    ids = tokenizer((REPO / "README.md").read_text(), add_special_tokens=False).input_ids
    ids = ids[: args.positions]
    model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].numpy()
    del model
    targets = {name: session(args.work / name, args.threads) for name in runs}
    times = step_times(targets, ids, args.steps)
    print(f"{args.gguf.name}: {len(ids)} positions of README.md against the dequantized model; "
          f"step: {args.threads} thread(s), {args.steps} one-token runs each")
    print(f"{'':13} {'export s':>9} {'peak GB':>8} {'MB':>6} {'mean TV':>8} {'max TV':>7} "
          f"{'top-1':>6} {'max|dl|':>8} {'step ms':>8} {'best':>6}")
    for name, run in runs.items():
        run |= figures(targets[name], ids, reference)
        run |= {"step_ms": 1000 * float(np.median(times[name])),
                "best_step_ms": 1000 * min(times[name])}
        print(f"{name:13} {run['export_s']:9.1f} {run['peak_gb']:8.2f} {run['package_mb']:6.0f} "
              f"{run['mean_tv']:8.5f} {run['max_tv']:7.4f} {run['top1']:6.1%} "
              f"{run['max_dlogit']:8.1e} {run['step_ms']:8.1f} {run['best_step_ms']:6.1f}")


if __name__ == "__main__":
    main()
