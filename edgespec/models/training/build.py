"""The recipe end to end: data, training, evaluation, then checkpoints, report and package."""

import json
import math
import platform
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from edgespec.export import export_pair
from edgespec.export.destination import atomic_folder
from edgespec.manifest import PROMPTS_NAME, REPORT_NAME
from edgespec.models.training.config import RecipeConfig
from edgespec.models.training.corpus import find_corpus, heldout_prompts, split_corpus, stdlib_dir
from edgespec.models.training.evaluate import evaluate
from edgespec.models.training.model import save_checkpoint
from edgespec.models.training.tokenizer import encode_files, train_tokenizer
from edgespec.models.training.train import (PhaseStats, Progress, _ignore, distill_draft,
                                            train_target)
from edgespec.runtime.machine import usable_cores

PROMPT_COUNT = 24



@dataclass(frozen=True)
class Corpus:
    """The trained tokenizer and the token streams of both splits (see encode_files)."""

    tokenizer: PreTrainedTokenizerFast
    train_ids: torch.Tensor  # [N_train]
    heldout_ids: torch.Tensor  # [N_heldout]
    train_files: int
    heldout_files: tuple[Path, ...]


def prepare_corpus(config: RecipeConfig, tokenizer: PreTrainedTokenizerFast | None = None
                   ) -> Corpus:
    """Find and split the stdlib, train the tokenizer on the train split (unless one is given:
    a trained target's), encode both splits."""
    root = stdlib_dir()
    train_files, heldout_files = split_corpus(find_corpus(root), config.heldout_fraction, root)
    if tokenizer is None:
        tokenizer = train_tokenizer(train_files, config.vocab_size)
    return Corpus(
        tokenizer=tokenizer,
        train_ids=encode_files(tokenizer, train_files),
        heldout_ids=encode_files(tokenizer, heldout_files),
        train_files=len(train_files),
        heldout_files=tuple(heldout_files),
    )


def build_demo(out_dir: Path, config: RecipeConfig, progress: Progress | None = None,
               target_checkpoint: Path | None = None) -> dict:
    """Train the demo pair and write it to out_dir, then return the report it also writes.

    Writes out_dir/target/ and out_dir/draft/ (Hugging Face checkpoints sharing one tokenizer)
    and out_dir/training_report.json. Takes target_minutes + draft_minutes plus about ten
    minutes for data, the target's pass for distillation and evaluation. progress, if given,
    receives one short line per event. target_checkpoint: a target trained before (its
    tokenizer and weights; the report keeps its training figures), so only the draft is made.
    """
    report = progress or _ignore
    torch.set_num_threads(config.threads or usable_cores())
    seconds: dict[str, float] = {}
    earlier = _earlier_target(target_checkpoint) if target_checkpoint else None
    report(f"data: tokenizing the Python {platform.python_version()} standard library")
    with _stopwatch(seconds, "data"):
        corpus = prepare_corpus(config, earlier[1] if earlier else None)
    report(
        f"data: {len(corpus.train_ids):,} train and {len(corpus.heldout_ids):,} held-out tokens"
    )
    if earlier:
        target, _, target_stats = earlier
        report(f"target: reusing {target_checkpoint}")
    else:
        target, target_stats = train_target(corpus.train_ids, corpus.tokenizer, config, progress)
    draft, draft_stats = distill_draft(target, corpus.train_ids, corpus.tokenizer, config, progress)
    seconds.update(target=target_stats.seconds, draft=draft_stats.seconds,
                   distill_targets=draft_stats.setup_seconds)
    report("evaluate: scoring both models on the held-out split")
    with _stopwatch(seconds, "evaluate"):
        evaluation = evaluate(target, draft, corpus.heldout_ids, config)
    with _stopwatch(seconds, "save"):
        save_checkpoint(target, corpus.tokenizer, out_dir / "target")
        save_checkpoint(draft, corpus.tokenizer, out_dir / "draft")
    training_report = {
        "python_version": platform.python_version(),
        "config": asdict(config),
        "corpus": _corpus_report(corpus),
        "target": _model_report(target, target_stats, evaluation.target_loss),
        "draft": _model_report(draft, draft_stats, evaluation.draft_loss),
        "greedy_agreement": evaluation.greedy_agreement,
        "expected_acceptance": evaluation.expected_acceptance,
        "seconds": {**seconds, "total": sum(seconds.values())},
    }
    (out_dir / REPORT_NAME).write_text(json.dumps(training_report, indent=2) + "\n")
    write_prompts(out_dir / PROMPTS_NAME, heldout_prompts(corpus.heldout_files, PROMPT_COUNT))
    report(f"done: wrote {out_dir}")
    return training_report


def _earlier_target(folder: Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast, PhaseStats]:
    """A trained target checkpoint, its tokenizer, and its training figures from the report
    next to it (``training_report.json`` in its parent folder, as build_demo writes it)."""
    target = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    report_path = folder.parent / REPORT_NAME
    earlier = json.loads(report_path.read_text()) if report_path.is_file() else {}
    trained = earlier.get("target", {})
    stats = PhaseStats(
        steps=trained.get("steps", 0),
        tokens=trained.get("tokens_seen", 0),
        seconds=earlier.get("seconds", {}).get("target", 0.0),
        train_loss=trained.get("train_loss", float("nan")),
    )
    return target, tokenizer, stats


def write_prompts(path: Path, prompts: Sequence[str]) -> None:
    """JSON Lines, one prompt string a line (the format ``edgespec bench --prompts`` reads)."""
    path.write_text("".join(json.dumps(prompt) + "\n" for prompt in prompts))


def build_demo_package(out: Path, config: RecipeConfig, progress: Progress | None = None,
                       target_checkpoint: Path | None = None) -> dict:
    """The whole recipe: train the pair, then export it with ``edgespec export``.

    Writes out/checkpoints/{target,draft} (Hugging Face, float16) and out/package (the edgespec
    package, with the training report and held-out prompts). Atomic: nothing is left at out if
    any step fails or is interrupted.
    """
    with atomic_folder(out) as tmp:
        training_report = build_demo(tmp / "checkpoints", config, progress, target_checkpoint)
        package_demo(tmp / "checkpoints", tmp / "package", progress)
    return training_report


# How the demo pair is exported: the draft in int8 computing with int8 activations, which kept
# fp32's acceptance at a cheaper step where int4 lost some (benchmarks/RESULTS-archive.md,
# "Draft precision side by side").
DEMO_EXPORT = {"draft_quantize": "int8"}


def package_demo(checkpoints: Path, package: Path, progress: Progress | None = None) -> None:
    """Export trained checkpoints into an edgespec package carrying the report and prompts."""
    export_pair(checkpoints / "target", checkpoints / "draft", package, progress=progress,
                **DEMO_EXPORT)
    for name in (REPORT_NAME, PROMPTS_NAME):
        shutil.copyfile(checkpoints / name, package / name)


@contextmanager
def _stopwatch(seconds: dict[str, float], phase: str) -> Iterator[None]:
    """Record the wall time of the block in seconds[phase]."""
    start = time.perf_counter()
    yield
    seconds[phase] = time.perf_counter() - start


def _corpus_report(corpus: Corpus) -> dict:
    return {
        "train_files": corpus.train_files,
        "heldout_files": len(corpus.heldout_files),
        "train_tokens": len(corpus.train_ids),
        "heldout_tokens": len(corpus.heldout_ids),
        "vocab_size": len(corpus.tokenizer),
    }


def _model_report(model: LlamaForCausalLM, stats: PhaseStats, heldout_loss: float) -> dict:
    return {
        "parameters": model.num_parameters(),
        "steps": stats.steps,
        "tokens_seen": stats.tokens,
        "train_loss": stats.train_loss,
        "heldout_loss": heldout_loss,
        "heldout_perplexity": math.exp(heldout_loss),
    }
