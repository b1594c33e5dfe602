"""Is a token's row of logits the same whatever the number of tokens in its run?

Speculative decoding verifies k drafts in one run of k + 1 tokens; target-only decoding runs one
token at a time. Greedy output is token-identical only if both give a position the same row.
This script measures it on graphs with the layer shapes of real models (random weights, a few
layers: every operator sees the real model's sizes), for each compute a quantized graph can use:

    python benchmarks/row_identity.py make qwen2.5-1.5b build/rows/qwen2.5-1.5b   # needs torch
    python benchmarks/row_identity.py check build/rows/qwen2.5-1.5b --trials 20

``make`` exports the checkpoint fp32 and int4 (edgespec export, float compute) and writes the
int4 graph again with int8 compute (MatMulNBits accuracy_level 4). ``check`` needs onnxruntime
and edgespec's runtime only, so it runs in any environment, the onnxruntime floor's included:
after a past of random tokens it runs the next M tokens for M = 1..MMAX and compares each row,
bit for bit, with the same row of the longest run (and the KV cache the run wrote likewise).
Printed per graph and M: rows compared, rows differing, the largest difference.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("fp32", "int4-float", "int4-int8")
STARTS = (0, 1, 3, 8)  # where in the reference run the compared rows begin


def make(shape: str, out: Path, layers: int) -> None:
    """Random checkpoint with ``shape``'s config but ``layers`` layers; three packages."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import real_shapes

    real_shapes.SHAPES[shape] = {**real_shapes.SHAPES[shape], "num_hidden_layers": layers}
    checkpoint = real_shapes.make_checkpoint(shape, out / "checkpoint")
    for variant, flags in (("fp32", []), ("int4", ["--quantize", "int4"])):
        subprocess.run([str(Path(sys.executable).parent / "edgespec"), "export", "--target", str(checkpoint),
                        "--out", str(out / variant), "--validate", "skip", *flags], check=True)
    set_compute(out / "int4", out / "int4-float", accuracy_level=0)
    set_compute(out / "int4", out / "int4-int8", accuracy_level=4)
    shutil.rmtree(out / "int4")
    shutil.rmtree(checkpoint)


def set_compute(package: Path, out: Path, accuracy_level: int) -> None:
    """A copy of ``package`` whose MatMulNBits nodes compute at ``accuracy_level``."""
    import onnx
    from onnx import helper

    shutil.copytree(package, out)
    path = out / "target" / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("accuracy_level", accuracy_level)])
    onnx.save(model, str(path))
    manifest = json.loads((out / "edgespec.json").read_text())
    manifest["target"]["compute"] = "int8" if accuracy_level == 4 else "float"
    (out / "edgespec.json").write_text(json.dumps(manifest, indent=2))


def check(folder: Path, trials: int, past: int, m_max: int, threads: int) -> dict:
    """Per graph and run size M: rows (and KV entries) that differ from the reference run's.

    Each trial: a random past of ``past`` tokens, then a reference run of the next ``m_max``
    tokens. Then, for each start s in STARTS and M = 1..m_max - s, the cache is cropped back to
    past + s (what the reference run wrote before s stays: in decoding, a position's cache
    entry comes from whichever run held it) and tokens s .. s + M - 1 run again: a row must not
    depend on the run's size nor on where in the run it sits.
    """
    import onnxruntime

    from edgespec.manifest import Manifest
    from edgespec.runtime.providers import SessionConfig
    from edgespec.runtime.session import ModelSession

    results = {"onnxruntime": onnxruntime.__version__, "graphs": {}}
    for variant in VARIANTS:
        package = folder / variant
        if not package.is_dir():
            continue
        manifest = Manifest.read(package)
        spec = manifest.target
        session = ModelSession(package / spec.path, spec, spec.vocab_size, manifest.max_positions,
                               SessionConfig(provider="cpu", threads=threads))
        session.min_run_tokens = 1  # every run exactly as long as asked
        rng = np.random.default_rng(0)
        differ = {m: [0, 0, 0.0, 0] for m in range(1, m_max + 1)}  # rows, differing, max, kv
        for _ in range(trials):
            ids = rng.integers(0, manifest.vocab_size, size=past + m_max)
            cache = session.new_cache(past + m_max)
            session.forward(ids[:past], cache)
            reference = session.forward(ids[past:], cache).copy()  # [m_max, V]
            ref_kv = [b.numpy()[:, :, past : past + m_max].copy() for b in cache.buffers]
            for s in STARTS:
                for m in range(1, m_max - s + 1):
                    cache.crop(past + s)
                    rows = session.forward(ids[past + s : past + s + m], cache)
                    delta = np.abs(rows - reference[s : s + m]).max(axis=-1)  # [m]
                    kv_same = [np.array_equal(b.numpy()[:, :, past + s : past + s + m],
                                              r[:, :, s : s + m])
                               for b, r in zip(cache.buffers, ref_kv)]
                    stats = differ[m]
                    stats[0] += m
                    stats[1] += int(np.count_nonzero(delta))
                    stats[2] = max(stats[2], float(delta.max()))
                    stats[3] += kv_same.count(False)
        results["graphs"][variant] = {
            str(m): {"rows": r, "rows_differing": d, "max_abs_diff": x, "kv_buffers_differing": k}
            for m, (r, d, x, k) in differ.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make")
    p.add_argument("shape")
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p = sub.add_parser("check")
    p.add_argument("folder", type=Path)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--past", type=int, default=200)
    p.add_argument("--m-max", type=int, default=17)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.command == "make":
        make(args.shape, args.out, args.layers)
        return
    results = check(args.folder, args.trials, args.past, args.m_max, args.threads)
    print(f"onnxruntime {results['onnxruntime']}, {args.folder}: rows differing from the same "
          f"row of a {args.m_max}-token run (their largest |difference|; KV entries differing)")
    for variant, per_m in results["graphs"].items():
        cells = [f"M={m}: {v['rows_differing']}/{v['rows']}"
                 + (f" ({v['max_abs_diff']:.1e}; kv {v['kv_buffers_differing']})"
                    if v["rows_differing"] or v["kv_buffers_differing"] else "")
                 for m, v in per_m.items()]
        print(f"  {variant:11s} " + ", ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
