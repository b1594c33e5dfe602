"""Held-out perplexity of packages' models, measured on their ONNX graphs with onnxruntime.

Two text sets, each one token stream (every file preceded by EOS, as the recipe encodes) cut
into consecutive windows of context + 1 tokens, every token after a window's first predicted
once, as ``edgespec/models/training/evaluate.py`` scores the pair in PyTorch:

- ``recipe``: the recipe's own held-out split of the running interpreter's standard library
  (the files ``split_corpus`` holds out, never trained on);
- ``outside``: Python that is not the standard library: the pure-Python sources of click,
  jinja2, starlette and httpx as installed (the serve extra's dependencies; versions printed).

Perplexities are per token of each package's tokenizer: compare packages that share one (the
demo recipe trains the same tokenizer on the same files every time; the script says whether
they do).

    python benchmarks/demo_perplexity.py [PKG ...] [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

OUTSIDE_PACKAGES = ("click", "jinja2", "starlette", "httpx")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", help="package folders [default: the bundled demo]")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()

    from edgespec.models import demo_package
    from edgespec.models.training.config import RecipeConfig
    from edgespec.models.training.corpus import find_corpus, split_corpus, stdlib_dir
    from edgespec.runtime.machine import describe, machine_info

    packages = [Path(p) for p in args.packages] or [demo_package()]
    root = stdlib_dir()
    _, heldout = split_corpus(find_corpus(root), RecipeConfig().heldout_fraction, root)
    outside = outside_files()
    versions = {name: metadata.version(name) for name in OUTSIDE_PACKAGES}
    print(f"machine: {describe(machine_info())}")
    print(f"recipe: {len(heldout)} held-out stdlib files; outside: {len(outside)} files of "
          + ", ".join(f"{name} {version}" for name, version in versions.items()))
    rows = []
    for package in packages:
        row = score_package(package, {"recipe": heldout, "outside": outside}, args.threads)
        rows.append(row)
        print(f"{package}: tokenizer {row['tokenizer_sha256'][:12]}")
        for model, sets in row["models"].items():
            print("  " + model + ": " + "; ".join(
                f"{name} perplexity {s['perplexity']:.1f} ({s['tokens']:,} tokens)"
                for name, s in sets.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": " ".join(["python", *sys.argv]), "outside_packages": versions,
             "rows": rows}, indent=2) + "\n")


def outside_files() -> list[Path]:
    """The .py files of OUTSIDE_PACKAGES as installed, sorted."""
    files = []
    for name in OUTSIDE_PACKAGES:
        distribution = metadata.distribution(name)
        files += [Path(distribution.locate_file(f)) for f in distribution.files or []
                  if f.suffix == ".py"]
    return sorted(files)


def score_package(package: Path, sets: dict[str, list[Path]], threads: int) -> dict:
    """Perplexity of the package's target and draft on each set of files."""
    from tokenizers import Tokenizer

    from edgespec.manifest import Manifest
    from edgespec.models.training.corpus import _read_source
    from edgespec.runtime.providers import SessionConfig
    from edgespec.runtime.session import ModelSession

    manifest = Manifest.read(package)
    tokenizer_path = package / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = SessionConfig(threads=threads)
    models = {"target": manifest.target, "draft": manifest.draft}
    result = {"package": str(package), "models": {},
              "tokenizer_sha256": hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()}
    streams = {}  # each set encoded once, for both models
    for set_name, files in sets.items():
        texts = [_read_source(path) for path in files]
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
        streams[set_name] = np.concatenate([np.array([eos, *e.ids], np.int64) for e in encodings])
    for name, spec in models.items():
        if spec is None:
            continue
        context = manifest.max_positions
        session = ModelSession(package / spec.path, spec, manifest.vocab_size, context, config)
        result["models"][name] = {}
        for set_name, stream in streams.items():
            loss, tokens = stream_loss(session, stream, min(context, 512))
            result["models"][name][set_name] = {"loss": loss, "perplexity": math.exp(loss),
                                                "tokens": tokens}
    return result


def stream_loss(session, stream: np.ndarray, context: int) -> tuple[float, int]:
    """Mean next-token cross-entropy over consecutive windows of context + 1 tokens."""
    total, count = 0.0, 0
    for start in range(0, len(stream) - context, context):
        window = stream[start : start + context + 1]
        logits = session.forward(window[:-1], session.new_cache(context)).astype(np.float64)
        top = logits.max(axis=-1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
        total += float((log_z - logits[np.arange(context), window[1:]]).sum())
        count += context
    return total / count, count


if __name__ == "__main__":
    main()
