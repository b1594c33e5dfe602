"""onnxruntime-genai for the side-by-side benchmark: graphs from its own model builder, and
timed runs of n tokens with logits at every position (as speculative verification needs).

Two virtual environments under --work, made on first use (as in benchmarks/README.md):
``genai-venv`` has the 0.15.2 model builder (the 0.18 builder does not import with
transformers 4.57), ``genai18-venv`` the 0.18.0 runtime, which runs those graphs and times them.

    python benchmarks/peer_genai_steps.py setup --work build/peers-side
    python benchmarks/peer_genai_steps.py build CKPT OUT --precision int4 --work build/peers-side
    build/peers-side/genai18-venv/bin/python benchmarks/peer_genai_steps.py time OUT --json t.json

Timing (``time``), after a context of random token ids, each run's positions taken off again:

- ``--api generator`` (the default): genai's own runtime. ``Generator.append_tokens(n ids)``
  runs the model on the n tokens; ``Generator.get_output("logits")`` returns the graph's logits,
  which the builder's graphs give at every fed position ([1, n, vocab]: checked on every run);
  ``Generator.rewind_to(context)`` takes the n positions off the KV cache. The time covers
  append_tokens and the copy of the logits out.
- ``--api ort``: the same graph in a plain onnxruntime InferenceSession (onnxruntime from the
  0.18 environment), with the genai_config's session options, intra-op threads set, spinning on
  (onnxruntime's default, as genai leaves it): ``session.run`` with the context's KV arrays as
  ``past_key_values.*`` and the presents thrown away. A cross-check of the generator's figures.

The build and setup commands use the standard library only (side_by_side.py imports this file);
``time`` imports onnxruntime(-genai) and NumPy, in the 0.18 environment.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BUILDER = ["onnxruntime-genai==0.15.2", "onnx-ir", "transformers==4.57.*", "torch==2.13.0"]
RUNTIME = ["onnxruntime-genai==0.18.0"]
PRECISIONS = {  # variant -> builder arguments after -m/-o
    "fp32": ["-p", "fp32", "-e", "cpu"],
    # int4 weights (MatMulNBits, block 32, the builder's default); accuracy_level 4: int8
    # activations, the builder's default on CPU, named here ("int4_accuracy_level" is the 0.15
    # builder's deprecated alias), as genai's CPU int4 models ship ("...-acc-level-4")
    "int4": ["-p", "int4", "-e", "cpu", "--extra_options", "accuracy_level=4"],
}


class Envs:
    def __init__(self, work: Path):
        work = Path(work).resolve()
        self.builder = work / "genai-venv"
        self.runtime = work / "genai18-venv"
        self.builder_python = self.builder / "bin" / "python"
        self.runtime_python = self.runtime / "bin" / "python"


def run(command: list, log: Path) -> None:
    """Run ``command`` at low priority, its output in ``log``; exit with the tail if it fails."""
    command = ["nice", "-n", "15", *map(str, command)]
    print("  $ " + " ".join(command), file=sys.stderr, flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-15:])
        sys.exit(f"error: {command[3]} failed (exit {done.returncode}); {log} ends:\n    {tail}")


def make_venv(folder: Path, packages: list[str], log: Path) -> None:
    """A virtual environment with ``packages``, once (kept while onnxruntime_genai imports)."""
    python = folder / "bin" / "python"
    if python.is_file() and not subprocess.run([python, "-c", "import onnxruntime_genai"],
                                               capture_output=True, check=False).returncode:
        return
    print(f"making {folder}: {' '.join(packages)}", file=sys.stderr, flush=True)
    run([sys.executable, "-m", "venv", "--clear", folder], log)
    run([python, "-m", "pip", "install", *packages], log)


def version(python: Path, module: str) -> str | None:
    done = subprocess.run([python, "-c", f"import {module} as m; print(m.__version__)"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def setup(work: Path) -> dict:
    envs, logs = Envs(work), Path(work).resolve() / "logs"
    make_venv(envs.builder, BUILDER, logs / "genai-venv.log")
    make_venv(envs.runtime, RUNTIME, logs / "genai18-venv.log")
    return {"builder_python": str(envs.builder_python),
            "builder": version(envs.builder_python, "onnxruntime_genai"),
            "builder_transformers": version(envs.builder_python, "transformers"),
            "builder_torch": version(envs.builder_python, "torch"),
            "runtime_python": str(envs.runtime_python),
            "runtime": version(envs.runtime_python, "onnxruntime_genai"),
            "runtime_onnxruntime": version(envs.runtime_python, "onnxruntime")}


# --- graphs --------------------------------------------------------------------------------------


def stamp(checkpoint: Path) -> dict:
    files = sorted(p for p in checkpoint.iterdir() if p.is_file())
    return {"source": str(checkpoint),
            "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}}


def build(checkpoint: Path, out: Path, precision: str, work: Path) -> dict:
    """genai's model builder on ``checkpoint`` into ``out``, unless a build of the same files
    with the same command is there."""
    envs = Envs(work)
    checkpoint, out = Path(checkpoint).resolve(), Path(out).resolve()
    command = [str(envs.builder_python), "-m", "onnxruntime_genai.models.builder",
               "-m", str(checkpoint), "-o", str(out), *PRECISIONS[precision],
               "-c", str(out.parent / "hf-cache")]
    want = {"checkpoint": stamp(checkpoint), "command": command}
    record = out / "peer_source.json"
    if record.is_file() and json.loads(record.read_text()) == want:
        return {"dir": str(out), "command": " ".join(command), "cached": True}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(f"building {checkpoint.name} {precision} with genai's builder ...", file=sys.stderr,
          flush=True)
    run(command, out.parent / f"{out.name}.build.log")
    if not (out / "genai_config.json").is_file():
        sys.exit(f"error: the builder wrote no genai_config.json in {out}")
    record.write_text(json.dumps(want, indent=2) + "\n")
    return {"dir": str(out), "command": " ".join(command), "cached": False}


# --- timing --------------------------------------------------------------------------------------


def time_generator(folder: Path, threads: int, context: int, steps: int,
                   lengths: list[int], seed: int) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    start = time.perf_counter()
    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    load_s = time.perf_counter() - start
    vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
    longest = max(lengths)
    ids = np.random.default_rng(seed).integers(0, vocab, context + longest).astype(np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=context + longest + 1)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(ids[:context])
    generator.get_output("logits")
    prefill_ms = 1e3 * (time.perf_counter() - start)
    times: dict[str, list[float]] = {str(n): [] for n in lengths}
    for step in range(steps + 1):  # step 0 pays for allocations: not kept
        for n in lengths:
            start = time.perf_counter()
            generator.append_tokens(ids[context : context + n])
            logits = generator.get_output("logits")
            elapsed = 1e3 * (time.perf_counter() - start)
            if logits.shape[-2] != n or logits.shape[-1] < vocab:
                sys.exit(f"error: genai gave logits of shape {logits.shape} for a run of {n} "
                         "tokens, not one row a token")
            generator.rewind_to(context)
            if generator.token_count() != context:
                sys.exit(f"error: rewind_to({context}) left {generator.token_count()} tokens")
            if step:
                times[str(n)].append(elapsed)
    return {"api": "generator", "load_s": load_s, "prefill_ms": prefill_ms, "ms": times,
            "logits_shape_last": list(logits.shape), "logits_dtype": str(logits.dtype),
            "versions": {"onnxruntime-genai": og.__version__}}


def time_ort(folder: Path, threads: int, context: int, steps: int, lengths: list[int],
             seed: int) -> dict:
    import numpy as np
    import onnxruntime as ort

    config = json.loads((folder / "genai_config.json").read_text())["model"]
    decoder = config["decoder"]
    options = ort.SessionOptions()
    for key, value in decoder.get("session_options", {}).items():
        if key not in ("log_id", "provider_options") and hasattr(options, key):
            setattr(options, key, value)
    options.intra_op_num_threads = threads
    start = time.perf_counter()
    session = ort.InferenceSession(str(folder / decoder["filename"]), options,
                                   providers=["CPUExecutionProvider"])
    load_s = time.perf_counter() - start
    types = {i.name: i.type for i in session.get_inputs()}
    kv_inputs = [n for n in types if n.startswith("past_key_values.")]
    kv_outputs = [o.name for o in session.get_outputs() if o.name.startswith("present")]
    integer = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
    longest = max(lengths)
    ids = np.random.default_rng(seed).integers(0, config["vocab_size"], context + longest)

    def feeds(start: int, n: int, past: list) -> dict:
        fed = {"input_ids": ids[start : start + n].astype(integer[types["input_ids"]])[None]}
        if "attention_mask" in types:
            fed["attention_mask"] = np.ones((1, start + n), integer[types["attention_mask"]])
        if "position_ids" in types:
            fed["position_ids"] = np.arange(start, start + n).astype(
                integer[types["position_ids"]])[None]
        fed.update(zip(kv_inputs, past))
        return fed

    first = session.get_inputs()[[i.name for i in session.get_inputs()].index(kv_inputs[0])]
    kv_type = np.float16 if first.type == "tensor(float16)" else np.float32
    shape = (1, decoder["num_key_value_heads"], 0, decoder["head_size"])
    empty = [np.zeros(shape, kv_type) for _ in kv_inputs]
    start = time.perf_counter()
    _, *past = session.run(["logits", *kv_outputs], feeds(0, context, empty))
    prefill_ms = 1e3 * (time.perf_counter() - start)
    times: dict[str, list[float]] = {str(n): [] for n in lengths}
    for step in range(steps + 1):
        for n in lengths:
            fed = feeds(context, n, past)
            start = time.perf_counter()
            logits = session.run(["logits"], fed)[0]
            elapsed = 1e3 * (time.perf_counter() - start)
            if logits.shape[1] != n:
                sys.exit(f"error: logits of shape {logits.shape} for a run of {n} tokens")
            if step:
                times[str(n)].append(elapsed)
    return {"api": "ort", "load_s": load_s, "prefill_ms": prefill_ms, "ms": times,
            "logits_shape_last": list(logits.shape),
            "session": {"intra_op_num_threads": threads, "spinning": "onnxruntime default (on)",
                        "run": "InferenceSession.run, numpy feeds, KV presents discarded"},
            "versions": {"onnxruntime": ort.__version__}}


def time_command(work: Path, folder: Path, threads: int, context: int, steps: int,
                 lengths: list[int], api: str, out: Path, seed: int = 0) -> list[str]:
    """The command that times ``folder`` in the 0.18 environment and writes ``out``."""
    return [str(Envs(work).runtime_python), str(Path(__file__).resolve()), "time", str(folder),
            "--threads", str(threads), "--context", str(context), "--steps", str(steps),
            "--lengths", ",".join(map(str, lengths)), "--api", api, "--seed", str(seed),
            "--json", str(out)]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("build/peers-side"),
                        help="where the two environments live (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="make the builder's and the runtime's environments")
    make = sub.add_parser("build", help="genai's model builder on a checkpoint")
    make.add_argument("checkpoint", type=Path)
    make.add_argument("out", type=Path)
    make.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    timed = sub.add_parser("time", help="ms of runs with logits at every position")
    timed.add_argument("folder", type=Path)
    timed.add_argument("--threads", type=int, default=os.cpu_count())
    timed.add_argument("--context", type=int, default=256)
    timed.add_argument("--steps", type=int, default=10)
    timed.add_argument("--lengths", default="1,2,3,5,9")
    timed.add_argument("--api", choices=["generator", "ort"], default="generator")
    timed.add_argument("--seed", type=int, default=0)
    timed.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.command == "setup":
        print(json.dumps(setup(args.work), indent=2))
    elif args.command == "build":
        print(json.dumps(build(args.checkpoint, args.out, args.precision, args.work), indent=2))
    else:
        lengths = [int(n) for n in args.lengths.split(",")]
        timer = time_generator if args.api == "generator" else time_ort
        result = timer(args.folder.resolve(), args.threads, args.context, args.steps, lengths,
                       args.seed)
        result.update(threads=args.threads, context=args.context)
        text = json.dumps(result, indent=2)
        if args.json:
            args.json.write_text(text + "\n")
        print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
