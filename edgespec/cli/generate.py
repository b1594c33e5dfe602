"""``edgespec export`` and ``generate``: parse, build configs, call the library, print."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path

import click

from edgespec.cli.base import (
    check_chat_template,
    constraint_from,
    constraint_options,
    loader,
    main,
    needs_export_extra,
    resolve_package,
    sampling_options,
    user_errors,
)
from edgespec.config import (
    ADAPTIVE_MAX_K,
    DRAFTERS,
    EXPORT_DTYPES,
    EXPORT_GRAPHS,
    EXPORT_QUANTIZATIONS,
    EXPORT_VALIDATIONS,
    PROVIDERS,
    SCHEDULES,
    GenerationConfig,
    check_draft_length,
    describe_sampling,
    resolve_sampling,
)

_DEFAULTS = GenerationConfig()  # the CLI's defaults are the library's


@main.command()
@click.option("--target", required=True, type=click.Path(path_type=Path),
              help="Hugging Face folder or GGUF file (a .gguf, or a folder holding one) of "
                   "the large model whose output you want.")
@click.option("--draft", type=click.Path(path_type=Path),
              help="Hugging Face folder or GGUF file of the small model that proposes "
                   "tokens, or an EAGLE-3 head's folder (its config names the architecture). "
                   "Without it: a target-only package, decoded with n-gram drafting.")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Package folder to create.")
@click.option("--overwrite", is_flag=True,
              help="Replace --out if it is an edgespec package holding nothing else.")
@click.option("--graph", type=click.Choice(EXPORT_GRAPHS), default="auto",
              show_default=True,
              help="fused: edgespec's Llama-family graph with fused operators; optimum: any model.")
@click.option("--dtype", type=click.Choice(EXPORT_DTYPES), default="fp32", show_default=True,
              help="fp16 computes in half precision (for GPUs).")
@click.option("--quantize", type=click.Choice(EXPORT_QUANTIZATIONS),
              help="Block-wise weight-only quantization of the weights (embedding included).")
@click.option("--draft-quantize", type=click.Choice(["same", "none", *EXPORT_QUANTIZATIONS]),
              default="same", show_default=True,
              help="The draft's own quantization (its precision changes speed, never the "
                   "output): none keeps it at --dtype.")
@click.option("--target-compute", type=click.Choice(["auto", "float", "int8"]), default="auto",
              show_default=True,
              help="What a quantized target's MatMuls compute in; auto measures both on this "
                   "machine, with every run shaped so that greedy output stays token-identical.")
@click.option("--draft-vocab", type=click.IntRange(1),
              help="The draft scores only this many tokens, the most frequent in "
                   "--draft-vocab-text (FR-Spec): a cheaper draft step, the same output.")
@click.option("--draft-vocab-text", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              multiple=True,
              help="Calibration text for --draft-vocab (repeatable; without it: the lowest ids, "
                   "a BPE vocabulary's merge order).")
@click.option("--validate", "validation", type=click.Choice(EXPORT_VALIDATIONS),
              default="strict", show_default=True,
              help="strict: a graph that fails validation stops the export; report: write the "
                   "package anyway and record the figures; skip: no validation.")
@user_errors
def export(target: Path, draft: Path | None, out: Path, overwrite: bool, graph: str, dtype: str,
           quantize: str | None, draft_quantize: str, target_compute: str,
           draft_vocab: int | None, draft_vocab_text: tuple[Path, ...], validation: str) -> None:
    """Export a target/draft pair, or a target alone, to one ONNX package (needs
    edgespec[export])."""
    from edgespec.export.destination import check_destination
    from edgespec.export.gguf_header import refuse_early

    check_destination(out, overwrite)  # before the slow imports and any reading
    for role, path in (("target", target), ("draft", draft)):
        refuse_early(path, role)
    exporter = needs_export_extra("edgespec.export.package")
    manifest = exporter.export_pair(target, draft, out, overwrite, dtype, quantize, graph,
                                    progress=lambda line: click.echo(line, err=True),
                                    validation=validation,
                                    draft_quantize=None if draft_quantize == "none" else
                                    draft_quantize, target_compute=target_compute,
                                    draft_vocab=draft_vocab, draft_vocab_texts=draft_vocab_text)
    draft_size = (f"draft {manifest.draft.parameters / 1e6:.1f}M" if manifest.draft
                  else "no draft (target only: n-gram drafting)")
    click.echo(
        f"wrote {out}: target {manifest.target.parameters / 1e6:.1f}M parameters, {draft_size}, "
        f"vocabulary {manifest.vocab_size}, context {manifest.max_positions}",
        err=True,
    )


@main.command()
@click.argument("args", nargs=-1, required=True, metavar="[PACKAGE] PROMPT")
@click.option("--max-new-tokens", "-n", default=_DEFAULTS.max_new_tokens, show_default=True)
@sampling_options
@click.option("--draft-length", "-k", default=_DEFAULTS.draft_length, show_default=True,
              help="Draft length k: every round's (fixed), the first (heuristic), "
                   f"the most (adaptive, up to {ADAPTIVE_MAX_K}).")
@click.option("--schedule", default=_DEFAULTS.schedule, show_default=True,
              type=click.Choice(SCHEDULES),
              help="How each round's draft length is chosen.")
@click.option("--seed", type=int, default=None, help="Seed for sampling.")
@click.option("--stop", multiple=True, help="Stop at this string (repeatable).")
@click.option("--drafter", default=_DEFAULTS.drafter, show_default=True,
              type=click.Choice(DRAFTERS),
              help="What proposes tokens: the package's draft model, an n-gram lookup of the "
                   "text so far, or none; auto: model if the package has one, else ngram.")
@click.option("--ngram-max", default=_DEFAULTS.ngram_max, show_default=True,
              help="Longest suffix the n-gram lookup matches.")
@click.option("--ngram-min", default=_DEFAULTS.ngram_min, show_default=True,
              help="Shortest suffix the n-gram lookup matches.")
@click.option("--ignore-eos", is_flag=True, help="Generate --max-new-tokens even past EOS.")
@click.option("--token-healing/--no-token-healing", default=_DEFAULTS.token_healing,
              show_default=True,
              help="Back the prompt off its last token and let the first generated token "
                   "regrow it (a prompt ending in a space or a newline, say).")
@click.option("--provider", default="auto", show_default=True,
              type=click.Choice(PROVIDERS),
              help="Where the models run: auto takes TensorRT, then CUDA, then the CPU, as "
                   "onnxruntime offers them; the stats line says which ran.")
@click.option("--draft-provider", type=click.Choice(PROVIDERS),
              help="Where the draft runs, if not where the target does.")
@click.option("--json", "as_json", is_flag=True, help="Print text and stats as one JSON object.")
@click.option("--chat", "as_chat", is_flag=True,
              help="PROMPT is a user's message: answer it through the package's chat template "
                   "(one turn of edgespec chat; never healed).")
@click.option("--system", help="With --chat: a system message before PROMPT.")
@constraint_options
@user_errors
def generate(args: tuple[str, ...], max_new_tokens: int, temperature: float | None,
             top_k: int | None, top_p: float | None, min_p: float | None,
             repetition_penalty: float | None, presence_penalty: float | None,
             frequency_penalty: float | None, draft_length: int,
             schedule: str,
             seed: int | None, stop: tuple[str, ...], drafter: str, ngram_max: int,
             ngram_min: int, ignore_eos: bool, token_healing: bool,
             provider: str, draft_provider: str | None, as_json: bool, as_chat: bool,
             system: str | None, json_schema: Path | None, json_object: bool,
             regex: str | None, grammar: Path | None) -> None:
    """Continue PROMPT with the exported pair in PACKAGE (default: the demo pair); with
    --chat, answer it as a chat message."""
    load = loader()

    if len(args) > 2:
        raise click.ClickException(
            f"expected [PACKAGE] PROMPT, got {len(args)} arguments; quote the prompt"
        )
    if len(args) == 1 and Path(args[0]).is_dir():
        raise click.ClickException(
            f"{args[0]} is a folder and no prompt was given; run edgespec generate "
            f"{shlex.quote(args[0])} \"your prompt\" (a lone argument is the demo's prompt)"
        )
    package, prompt = (Path(args[0]), args[1]) if len(args) == 2 else (None, args[0])
    if system is not None and not as_chat:
        raise click.ClickException("--system is a chat message: give --chat too")

    # sampling settings given here override the package's defaults (its generation_config.json),
    # known only once it is loaded (config.resolve_sampling); checked now, before the slow load
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
             "repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
             "frequency_penalty": frequency_penalty}
    check_draft_length("--draft-length", draft_length)  # named as the option, not the field
    drafting = {"draft_length": draft_length, "drafter": drafter}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=resolve_sampling(given, {}),
        schedule=schedule,
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        ngram_min=ngram_min,
        ngram_max=ngram_max,
        token_healing=token_healing,
        constraint=constraint_from(json_schema, json_object, regex, grammar),
        **drafting,
    )
    package = check_chat_template(package) if as_chat else resolve_package(package)
    pipe = load(package, provider=provider, draft_provider=draft_provider)
    config = replace(config, sampling=resolve_sampling(given, pipe.manifest.generation))
    if config.sampling.greedy and (top_k is not None or top_p is not None or
                                   min_p is not None):
        click.echo("warning: --top-k, --top-p and --min-p do nothing at temperature 0 (greedy); "
                   "give --temperature to sample", err=True)
    if not as_chat and pipe.manifest.chat_template is not None:
        click.echo("note: this package is a chat model: PROMPT is continued as plain text; "
                   "--chat answers it as a message through the chat template (edgespec chat "
                   "for a conversation)", err=True)
    if as_chat:
        messages = [*([{"role": "system", "content": system}] if system else []),
                    {"role": "user", "content": prompt}]
        stream = pipe.chat_stream(messages, config)
    else:
        stream = pipe.stream(prompt, config)
    ran_on = {role: session.providers[0] for role, session in
              (("target", pipe.target), ("draft", pipe.draft)) if session is not None}
    if as_json:
        text = "".join(stream)
        result = {"prompt": prompt, "text": text, "token_ids": stream.result.token_ids,
                  "stats": stream.result.stats.as_dict(), "providers": ran_on,
                  "sampling": asdict(config.sampling)}
        click.echo(json.dumps(result))
        return
    for piece in stream:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    where = ", ".join(f"{role} on {name.removesuffix('ExecutionProvider')}"
                      for role, name in ran_on.items())
    said = ("" if any(value is not None for value in given.values())
            else f"; sampling: {describe_sampling(given, pipe.manifest.generation)}")
    click.echo(f"{stream.result.stats.summary()}; {where}{said}", err=True)
