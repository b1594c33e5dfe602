"""The ``edgespec`` command: parse, build configs, call the library, print. No logic here."""

from __future__ import annotations

import functools
import json
import sys
import warnings
from pathlib import Path

import click

from edgespec.errors import EdgespecError


def _user_errors(command):
    """Library errors and invalid settings become one line on stderr and exit code 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning
            try:
                return command(*args, **kwargs)
            except (EdgespecError, ValueError) as e:
                raise click.ClickException(str(e)) from None

    return wrapper


def _one_line_warning(message, category, *args, **kwargs) -> None:
    click.echo(f"warning: {message}", err=True)


@click.group()
@click.version_option(package_name="edgespec")
def main() -> None:
    """Speculative decoding for on-device language models on ONNX Runtime."""


@main.command()
@click.option("--target", required=True, type=click.Path(path_type=Path),
              help="Hugging Face folder of the large model whose output you want.")
@click.option("--draft", required=True, type=click.Path(path_type=Path),
              help="Hugging Face folder of the small model that proposes tokens.")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Package folder to create.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists.")
@_user_errors
def export(target: Path, draft: Path, out: Path, overwrite: bool) -> None:
    """Export a target/draft pair to one ONNX package (needs edgespec[export])."""
    try:
        from edgespec.export import export_pair
    except ImportError as e:
        raise click.ClickException(
            f"export needs the export extra ({e.name} is missing): pip install 'edgespec[export]'"
        ) from None
    manifest = export_pair(target, draft, out, overwrite, progress=lambda line: click.echo(line, err=True))
    click.echo(
        f"wrote {out}: target {manifest.target.parameters / 1e6:.1f}M and draft "
        f"{manifest.draft.parameters / 1e6:.1f}M parameters, vocabulary {manifest.vocab_size}, "
        f"context {manifest.max_positions}",
        err=True,
    )


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.argument("prompt")
@click.option("--max-new-tokens", "-n", default=128, show_default=True)
@click.option("--temperature", "-t", default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, help="0 keeps all tokens.")
@click.option("--top-p", default=1.0, show_default=True, help="1 keeps all tokens.")
@click.option("--gamma", "-k", default=4, show_default=True, help="Tokens drafted per round.")
@click.option("--seed", type=int, default=None, help="Seed for sampling.")
@click.option("--stop", multiple=True, help="Stop at this string (repeatable).")
@click.option("--no-draft", is_flag=True, help="Decode with the target alone (the baseline).")
@click.option("--provider", default="auto", show_default=True,
              type=click.Choice(["auto", "cpu", "cuda", "tensorrt"]))
@click.option("--json", "as_json", is_flag=True, help="Print text and stats as one JSON object.")
@_user_errors
def generate(package: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
             top_p: float, gamma: int, seed: int | None, stop: tuple[str, ...], no_draft: bool,
             provider: str, as_json: bool) -> None:
    """Continue PROMPT with the exported pair in PACKAGE, streaming the text."""
    from edgespec.config import GenerationConfig, SamplingConfig
    from edgespec.runtime import load

    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=SamplingConfig(temperature, top_k, top_p),
        gamma=gamma,
        use_draft=not no_draft,
        seed=seed,
        stop=stop,
    )
    pipe = load(package, provider=provider)
    stream = pipe.stream(prompt, config)
    if as_json:
        text = "".join(stream)
        result = {"prompt": prompt, "text": text, "token_ids": stream.result.token_ids,
                  "stats": stream.result.stats.as_dict()}
        click.echo(json.dumps(result))
        return
    for piece in stream:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    click.echo(stream.result.stats.summary(), err=True)
