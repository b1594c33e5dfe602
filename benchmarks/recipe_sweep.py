"""A short learning-rate sweep of the demo target's recipe, before a longer retrain.

Trains the demo target (edgespec/models/training, its default shape and data) for the same
wall-clock budget at each peak learning rate, on an otherwise idle machine, and scores each on
the recipe's held-out split (perplexity, float32). Same seed and data order for every run, so
the runs differ by the learning rate alone (and by how many steps the budget allowed).

    python benchmarks/recipe_sweep.py --minutes 6 --lr 1e-3,2e-3,4e-3 [--batch 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--lr", default="1e-3,2e-3,4e-3")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch

    from edgespec.models.training.build import prepare_corpus
    from edgespec.models.training.config import RecipeConfig
    from edgespec.models.training.evaluate import evaluate
    from edgespec.models.training.train import train_target
    from edgespec.runtime.machine import describe, machine_info

    machine = machine_info()
    base = RecipeConfig(target_minutes=args.minutes)
    if args.batch:
        base = replace(base, batch_size=args.batch)
    corpus = prepare_corpus(base)
    print(f"machine: {describe(machine)}", flush=True)
    print(f"corpus: {len(corpus.train_ids):,} train, {len(corpus.heldout_ids):,} held-out tokens",
          flush=True)
    rows = []
    for lr in (float(x) for x in args.lr.split(",")):
        config = replace(base, target_lr=lr)
        torch.manual_seed(config.seed)
        start = time.perf_counter()
        target, stats = train_target(corpus.train_ids, corpus.tokenizer, config)
        loss = evaluate(target, target, corpus.heldout_ids, config).target_loss
        row = {"lr": lr, "batch": config.batch_size, "minutes": args.minutes,
               "steps": stats.steps, "tokens": stats.tokens, "train_loss": stats.train_loss,
               "heldout_loss": loss, "heldout_perplexity": math.exp(loss),
               "seconds": time.perf_counter() - start}
        rows.append(row)
        print(f"lr {lr:g}: {stats.steps} steps, {stats.tokens:,} tokens, train loss "
              f"{stats.train_loss:.3f}, held-out perplexity {math.exp(loss):.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": " ".join(["python", *sys.argv]), "machine": machine, "rows": rows},
            indent=2) + "\n")


if __name__ == "__main__":
    main()
