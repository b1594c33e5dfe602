"""The ``edgespec`` command: parse, build configs, call the library, print. No logic here."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import shlex
import signal
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import click

from edgespec.config import (
    EXPORT_DTYPES,
    EXPORT_GRAPHS,
    EXPORT_QUANTIZATIONS,
    EXPORT_VALIDATIONS,
    DRAFTERS,
    PROVIDERS,
    SCHEDULES,
    GenerationConfig,
    SamplingConfig,
    resolve_sampling,
)
from edgespec.errors import EdgespecError
from edgespec.manifest import PROMPTS_NAME
from edgespec.serve.config import ServeConfig

_DEFAULTS = GenerationConfig()  # the CLI's defaults are the library's
_SERVE = ServeConfig()  # and the server's, its own (edgespec/serve/config.py, no imports)


class Terminated(BaseException):
    """SIGTERM, raised where the program is, so that cleanup runs as it does for Ctrl-C."""


def entry() -> None:
    """The ``edgespec`` console script: the commands, with signals and exit codes handled.

    Ctrl-C exits 130 and SIGTERM 143 (128 + the signal's number, as shells report them), with
    one line and no traceback, after every ``finally`` has run (an export removes its temporary
    folder). A closed stdout (``| head``) ends quietly.
    """
    signal.signal(signal.SIGTERM, _terminate)
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort as e:
        if isinstance(e.__cause__, KeyboardInterrupt):
            _exit("interrupted", 130)
        _exit("Aborted!", 1)
    except KeyboardInterrupt:
        _exit("interrupted", 130)
    except Terminated:
        _exit("terminated", 143)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        sys.exit(1)


def _terminate(signum, frame) -> None:
    raise Terminated()


def _exit(message: str, code: int) -> None:
    """Say why, then leave at once with ``code``: every ``finally`` has already run.

    Not ``sys.exit``: CPython remembers a KeyboardInterrupt raised inside code it ran for a
    library during start-up, and then ends the process by SIGINT (status -2) instead of 130.
    """
    click.echo(message, err=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _user_errors(command):
    """Library errors (EdgespecError: bad packages, settings, prompts) become one line on
    stderr and exit code 1. Nothing else is translated: any other exception is a bug in
    edgespec and keeps its traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning
            try:
                return command(*args, **kwargs)
            except EdgespecError as e:
                raise click.ClickException(str(e)) from None

    return wrapper


def _one_line_warning(message, category, *args, **kwargs) -> None:
    click.echo(f"warning: {message}", err=True)


def _needs_export_extra(module: str):
    """Import a module that needs torch/transformers/optimum, or say how to install them."""
    try:
        with _signals_held():
            import onnx  # noqa: F401  (C extensions: imported here, where signals wait)

            return importlib.import_module(module)
    except ImportError as e:
        raise click.ClickException(
            f"this command needs the export extra ({e.name} is missing): "
            "pip install 'edgespec[export]'"
        ) from None


SERVE_MODULES = ("starlette", "uvicorn", "pydantic", "jinja2", "prometheus_client")  # what the serve extra installs


def _needs_serve_extra():
    """edgespec.serve, or one line saying how to install what it needs."""
    try:
        for module in SERVE_MODULES:
            importlib.import_module(module)
        import edgespec.serve.server

        return edgespec.serve
    except ImportError as e:
        raise click.ClickException(
            f"edgespec serve needs the serve extra ({e.name} is missing): "
            'pip install "edgespec[serve]"'
        ) from None


def _runtime():
    """edgespec.runtime (onnxruntime, NumPy, tokenizers), imported while signals wait."""
    with _signals_held():
        import edgespec.runtime

        return edgespec.runtime


@contextlib.contextmanager
def _signals_held():
    """Hold Ctrl-C and SIGTERM while C extensions import: an import interrupted half-way can
    crash the interpreter (seen with onnx's). A signal that arrives meanwhile is delivered,
    and handled as usual, as soon as the block ends."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@click.group()
@click.version_option(package_name="edgespec")
def main() -> None:
    """Speculative decoding for on-device language models on ONNX Runtime."""


@main.command()
@click.option("--target", required=True, type=click.Path(path_type=Path),
              help="Hugging Face folder or GGUF file (a .gguf, or a folder holding one) of "
                   "the large model whose output you want.")
@click.option("--draft", type=click.Path(path_type=Path),
              help="Hugging Face folder or GGUF file of the small model that proposes "
                   "tokens. Without it: "
                   "a target-only package, decoded with n-gram drafting.")
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
@_user_errors
def export(target: Path, draft: Path | None, out: Path, overwrite: bool, graph: str, dtype: str,
           quantize: str | None, draft_quantize: str, target_compute: str,
           draft_vocab: int | None, draft_vocab_text: tuple[Path, ...], validation: str) -> None:
    """Export a target/draft pair, or a target alone, to one ONNX package (needs
    edgespec[export])."""
    exporter = _needs_export_extra("edgespec.export")
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
@click.option("--temperature", "-t", type=float,
              help="0 is greedy. [default: the package's, else 0]")
@click.option("--top-k", type=int, help="0 keeps all tokens. [default: the package's, else 0]")
@click.option("--top-p", type=float, help="1 keeps all tokens. [default: the package's, else 1]")
@click.option("--gamma", "-k", default=_DEFAULTS.gamma, show_default=True,
              help="Draft length k: every round's (fixed), the first (heuristic), "
                   "the most (adaptive, up to 16).")
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
@click.option("--no-draft", is_flag=True, help="Decode with the target alone (the baseline).")
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
@_user_errors
def generate(args: tuple[str, ...], max_new_tokens: int, temperature: float | None,
             top_k: int | None, top_p: float | None, gamma: int, schedule: str,
             seed: int | None, stop: tuple[str, ...], drafter: str, ngram_max: int,
             ngram_min: int, no_draft: bool, ignore_eos: bool, token_healing: bool,
             provider: str, draft_provider: str | None, as_json: bool) -> None:
    """Continue PROMPT with the exported pair in PACKAGE (default: the demo pair)."""
    load = _runtime().load

    if len(args) > 2:
        raise click.ClickException(
            f"expected [PACKAGE] PROMPT, got {len(args)} arguments; quote the prompt"
        )
    if len(args) == 1 and Path(args[0]).is_dir():
        raise click.ClickException(
            f"{args[0]} is a folder and no prompt was given; run edgespec generate "
            f"{shlex.quote(args[0])} \"your prompt\" (a lone argument is the demo's prompt)"
        )
    package, prompt = (Path(args[0]), args[1]) if len(args) == 2 else (_demo_package(), args[0])

    # sampling settings given here override the package's defaults (its generation_config.json),
    # known only once it is loaded; checked now, before the slow load
    given = {name: value for name, value in
             (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
             if value is not None}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=SamplingConfig(**given),
        gamma=gamma,
        schedule=schedule,
        use_draft=not no_draft,
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        drafter=drafter,
        ngram_min=ngram_min,
        ngram_max=ngram_max,
        token_healing=token_healing,
    )
    pipe = load(package, provider=provider, draft_provider=draft_provider)
    config = replace(config, sampling=resolve_sampling(given, pipe.manifest.generation))
    if config.sampling.greedy and (top_k is not None or top_p is not None):
        click.echo("warning: --top-k and --top-p do nothing at temperature 0 (greedy); "
                   "give --temperature to sample", err=True)
    stream = pipe.stream(prompt, config)
    ran_on = {role: session.providers[0] for role, session in
              (("target", pipe.target), ("draft", pipe.draft)) if session is not None}
    if as_json:
        text = "".join(stream)
        result = {"prompt": prompt, "text": text, "token_ids": stream.result.token_ids,
                  "stats": stream.result.stats.as_dict(), "providers": ran_on}
        click.echo(json.dumps(result))
        return
    for piece in stream:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    where = ", ".join(f"{role} on {name.removesuffix('ExecutionProvider')}"
                      for role, name in ran_on.items())
    click.echo(f"{stream.result.stats.summary()}; {where}", err=True)


def _demo_package() -> Path:
    from edgespec.models import demo_package

    return demo_package()


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


@main.command()
@click.argument("package", required=False, type=click.Path(path_type=Path))
@click.option("--gamma", "gammas", default="2,4,8", show_default=True,
              help="Draft lengths to compare, comma-separated (the largest is the adaptive "
                   "schedule's most, as generate's --gamma).")
@click.option("--temperature", "temperatures", default="0,0.7,1", show_default=True,
              help="Temperatures, comma-separated.")
@click.option("--schedule", "schedules", default="adaptive,fixed", show_default=True,
              help="Draft-length schedules, comma-separated: fixed runs every --gamma; "
                   "heuristic and adaptive (generate's default) run once with the largest.")
@click.option("--drafter", "drafters", default="auto", show_default=True,
              help="Drafters to compare, comma-separated: model, ngram, auto (model if the "
                   "package has one, else ngram); each against target-only runs.")
@click.option("--max-new-tokens", "-n", default=_DEFAULTS.max_new_tokens, show_default=True)
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path),
              help="Prompts, one per line (or JSON Lines of strings). "
                   "Default: the package's prompts.jsonl.")
@click.option("--repeats", default=3, show_default=True, help="Runs of each prompt.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Write the report here.")
@click.option("--plot", "plot_out", type=click.Path(path_type=Path),
              help="Plot speedup against gamma to this PNG (needs matplotlib).")
@click.option("--provider", default="auto", show_default=True,
              type=click.Choice(PROVIDERS))
@_user_errors
def bench(package: Path | None, gammas: str, temperatures: str, schedules: str, drafters: str,
          max_new_tokens: int, prompts_file: Path | None, repeats: int, json_out: Path | None,
          plot_out: Path | None, provider: str) -> None:
    """Speedup of speculative over target-only decoding, measured side by side."""
    load = _runtime().load
    from edgespec import bench as benchmark

    try:
        gamma_list, temperature_list = _ints(gammas), _floats(temperatures)
    except ValueError as e:
        raise click.ClickException(f"--gamma/--temperature: {e}") from None
    config = benchmark.BenchConfig(gamma_list, temperature_list, max_new_tokens, repeats,
                                   schedules=tuple(schedules.split(",")),
                                   drafters=tuple(drafters.split(",")))
    if json_out:  # outputs checked now: the benchmark may take many minutes
        benchmark.check_writable(json_out, "--json")
    if plot_out:
        benchmark.check_plotting(plot_out)
    package = package or _demo_package()
    pipe = load(package, provider=provider)
    benchmark.check_drafters(pipe, config)
    prompts = benchmark.read_prompts(prompts_file or package / PROMPTS_NAME)
    total = benchmark.total_runs(config, len(prompts))
    click.echo(f"benchmarking {package}: {total} generations of {max_new_tokens} tokens "
               f"({len(prompts)} prompts x {repeats} repeats x {len(config.temperatures)} "
               f"temperatures x {total // (len(prompts) * repeats * len(config.temperatures))} "
               "settings, target-only included)", err=True)
    report = benchmark.run_bench(pipe, prompts, config, progress=_ProgressLines(total),
                                 command=shlex.join(["edgespec", *sys.argv[1:]]))
    click.echo(benchmark.format_table(report))
    if json_out:
        json_out.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
        click.echo(f"wrote {json_out}", err=True)
    if plot_out:
        benchmark.plot(report, plot_out)
        click.echo(f"wrote {plot_out}", err=True)


class _ProgressLines:
    """Progress of a long command on stderr, one line every EVERY seconds and at the end:
    done / total, elapsed, and the time left at the rate so far (works in logs, not only on a
    terminal, where click's progress bar stays silent)."""

    EVERY = 10.0  # seconds between lines

    def __init__(self, total: int):
        self.total = total
        self.start = self.last = time.monotonic()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last < self.EVERY and done < self.total:
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed / done * (self.total - done) if done else 0.0
        click.echo(f"  {done}/{self.total} generations, {_duration(elapsed)} elapsed"
                   + (f", about {_duration(left)} left" if done < self.total else ""), err=True)


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


@main.command()
@click.argument("package", required=False, type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 or :: opens the server to the network "
                   "(then set --api-key).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="0 picks a free port.")
@click.option("--model-name", help="The model's id in the API  [default: the package folder's "
                                   "name, e.g. demo]")
@click.option("--api-key", envvar="EDGESPEC_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' (the openai client's api_key) on "
                   "every request but GET /health.")
@click.option("--allowed-hosts", multiple=True, metavar="HOST[,HOST...]",
              help="Host header values to answer besides the loopback names and --host "
                   "(the names clients use to reach a server on the network); '*': any.")
@click.option("--allowed-origins", multiple=True, metavar="ORIGIN[,ORIGIN...]",
              help="Web origins (e.g. http://localhost:3000) whose pages may call the server "
                   "(CORS); none by default.")
@click.option("--queue", default=_SERVE.queue, show_default=True, type=click.IntRange(0),
              help="Requests that may wait while one generates; more are answered 429.")
@click.option("--max-tokens", default=_SERVE.max_tokens, show_default=True,
              type=click.IntRange(1),
              help="Most tokens one request may ask for (and a chat's default).")
@click.option("--request-timeout", default=_SERVE.request_timeout_s, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="Seconds one generation may run; it then ends as at max_tokens.")
@click.option("--max-body", default=_SERVE.max_body, show_default=True, type=click.IntRange(1),
              help="Largest request body in bytes; larger ones are answered 413.")
@click.option("--read-timeout", default=_SERVE.read_timeout_s, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="Seconds a client has to send a request's headers, and again its body.")
@click.option("--keep-alive", default=_SERVE.keep_alive_s, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="Seconds an idle connection stays open.")
@click.option("--limit-concurrency", default=_SERVE.limit_concurrency, show_default=True,
              type=click.IntRange(1), help="Connections at once; more are answered 503.")
@click.option("--provider", default="auto", show_default=True, type=click.Choice(PROVIDERS))
@click.option("--draft-provider", type=click.Choice(PROVIDERS),
              help="Where the draft runs, if not where the target does.")
@_user_errors
def serve(package: Path | None, host: str, port: int, model_name: str | None,
          api_key: str | None, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...],
          queue: int, max_tokens: int, request_timeout: float, max_body: int,
          read_timeout: float, keep_alive: float, limit_concurrency: int, provider: str,
          draft_provider: str | None) -> None:
    """Serve PACKAGE (default: the demo pair) over an OpenAI-compatible HTTP API
    (needs edgespec[serve])."""
    serving = _needs_serve_extra()
    from edgespec.serve.config import hosts_for, is_loopback

    config = ServeConfig(
        model=model_name, queue=queue, max_body=max_body, max_tokens=max_tokens,
        request_timeout_s=request_timeout, read_timeout_s=read_timeout,
        keep_alive_s=keep_alive, limit_concurrency=limit_concurrency,
        allowed_hosts=hosts_for(host, _listed(allowed_hosts)),
        allowed_origins=_listed(allowed_origins), api_key=api_key)
    sock = serving.server.bind(host, port)  # first: a port in use is reported at once
    try:
        pipe = _runtime().load(package or _demo_package(), provider=provider,
                               draft_provider=draft_provider)
        app = serving.build_app(pipe, config)
    except BaseException:
        sock.close()
        raise
    if api_key is None and not is_loopback(host):
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach "
                   "this machine can use the model", err=True)

    def listening() -> None:  # the socket accepts connections: now the address is true
        address = serving.server.url(host, sock.getsockname()[1])
        click.echo(f"serving {app.state.server.model} at {address}/v1 (one generation at a "
                   f"time, {queue} waiting at most); Ctrl-C stops", err=True)

    serving.server.run(app, sock, config, listening)


def _listed(values: tuple[str, ...]) -> tuple[str, ...]:
    """Repeated and comma-separated option values as one tuple."""
    return tuple(v.strip() for value in values for v in value.split(",") if v.strip())


@main.group()
def models() -> None:
    """The bundled demo pair and the recipe that rebuilds it."""


@models.command("list")
@click.argument("packages", nargs=-1, type=click.Path(path_type=Path))
@_user_errors
def list_models(packages: tuple[Path, ...]) -> None:
    """Show the bundled model pairs (and any PACKAGES given), their size and where they live."""
    from edgespec.models import describe_package, describe_pairs

    for line in describe_pairs():
        click.echo(line)
    for package in packages:
        for line in describe_package(package.name, package):
            click.echo(line)


@models.command("build-demo")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Folder to create: checkpoints/ and package/ go inside.")
@click.option("--target-minutes", type=float, help="Target training budget [default: 72].")
@click.option("--draft-minutes", type=float, help="Draft distillation budget [default: 60].")
@click.option("--target-checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A target trained before (e.g. checkpoints/demo/target): only the draft is "
                   "made, with that target's tokenizer.")
@click.option("--threads", default=0, show_default=True, type=click.IntRange(0),
              help="PyTorch's threads; 0: every usable core (1 is steadier beside other jobs).")
@click.option("--seed", default=0, show_default=True)
@_user_errors
def build_demo(out: Path, target_minutes: float | None, draft_minutes: float | None,
               target_checkpoint: Path | None, threads: int, seed: int) -> None:
    """Train the demo pair on this Python's standard library and export it (needs the export extra)."""
    if out.exists():
        raise click.ClickException(f"{out} already exists; choose another --out")
    recipe = _needs_export_extra("edgespec.models.recipe")
    budgets = {"target_minutes": target_minutes, "draft_minutes": draft_minutes}
    config = recipe.RecipeConfig(seed=seed, threads=threads,
                                 **{k: v for k, v in budgets.items() if v is not None})
    report = recipe.build_demo_package(out, config, target_checkpoint=target_checkpoint,
                                       progress=lambda line: click.echo(line, err=True))
    click.echo(
        f"wrote {out}: target held-out perplexity {report['target']['heldout_perplexity']:.1f}, "
        f"draft greedy agreement {report['greedy_agreement']:.0%}",
        err=True,
    )
