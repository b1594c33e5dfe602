"""``edgespec bench``: parse, build the benchmark's config, run it, print its table and
progress."""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import replace
from pathlib import Path

import click

from edgespec.cli.base import given_args, loader, main, resolve_package, user_errors
from edgespec.config import PROVIDERS, BenchConfig, check_draft_length

_DEFAULTS = BenchConfig()
# --quick's settings, by option: edgespec/bench.py's QUICK (that module loads numpy and
# onnxruntime, so it is read when the command runs); an option given explicitly wins
_QUICK_OPTIONS = ("draft_lengths", "temperatures", "schedules", "drafters", "max_new_tokens",
                  "repeats")


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _listed(values: tuple) -> str:
    """A default tuple as its option takes it: comma-separated, numbers as short as they go."""
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


@main.command()
@click.argument("package", required=False, type=click.Path(path_type=Path))
@click.option("--draft-length", "draft_lengths", default=_listed(_DEFAULTS.draft_lengths),
              show_default=True,
              help="Draft lengths to compare, comma-separated (the largest is the adaptive "
                   "schedule's most, as generate's --draft-length).")
@click.option("--temperature", "temperatures", default=_listed(_DEFAULTS.temperatures),
              show_default=True,
              help="Temperatures, comma-separated.")
@click.option("--schedule", "schedules", default=_listed(_DEFAULTS.schedules),
              show_default=True,
              help="Draft-length schedules, comma-separated: fixed runs every --draft-length; "
                   "heuristic and adaptive (generate's default) run once with the largest.")
@click.option("--drafter", "drafters", default=_listed(_DEFAULTS.drafters), show_default=True,
              help="Drafters to compare, comma-separated: model (the package's draft; an "
                   "EAGLE-3 head's rows say eagle3), ngram, auto (model if the package has "
                   "one, else ngram); each against target-only runs.")
@click.option("--max-new-tokens", "-n", default=_DEFAULTS.max_new_tokens, show_default=True)
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path),
              help="Prompts, one per line (or JSON Lines of strings or of {\"messages\": "
                   "[...]}, rendered through the chat template). Default: the package's "
                   "prompts.jsonl, else, with a chat template, edgespec's task prompts.")
@click.option("--repeats", default=_DEFAULTS.repeats, show_default=True,
              help="Runs of each prompt.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Write the report here.")
@click.option("--plot", "plot_out", type=click.Path(path_type=Path),
              help="Plot speedup against the draft length to this PNG (needs matplotlib).")
@click.option("--provider", default="auto", show_default=True,
              type=click.Choice(PROVIDERS))
@click.option("--quick", is_flag=True,
              help="A first look in minutes: greedy, the package's drafter, adaptive and fixed "
                   "k = 4, 32 tokens, one run of the first 4 prompts (options given explicitly "
                   "still apply).")
@click.pass_context
@user_errors
def bench(ctx: click.Context, package: Path | None, draft_lengths: str,
          temperatures: str, schedules: str, drafters: str, max_new_tokens: int, prompts_file: Path | None,
          repeats: int, json_out: Path | None, plot_out: Path | None, provider: str,
          quick: bool) -> None:
    """Speedup of speculative over target-only decoding, measured side by side. Ctrl-C prints
    the table of the runs finished so far."""
    load = loader()
    from edgespec import bench as benchmark

    option = "--draft-length"
    try:
        length_list, temperature_list = _ints(draft_lengths), _floats(temperatures)
    except ValueError as e:
        raise click.ClickException(f"{option}/--temperature: {e}") from None
    for draft_length in length_list:  # named as the option given
        check_draft_length(option, draft_length)
    config = BenchConfig(length_list, temperature_list, max_new_tokens, repeats,
                         schedules=tuple(schedules.split(",")),
                         drafters=tuple(drafters.split(",")))
    if quick:  # QUICK's settings where the command line left an option at its default
        default = click.core.ParameterSource.DEFAULT
        config = replace(config, **{option: getattr(benchmark.QUICK, option)
                                    for option in _QUICK_OPTIONS
                                    if ctx.get_parameter_source(option) == default})
    if json_out:  # outputs checked now: the benchmark may take many minutes
        benchmark.check_writable(json_out, "--json")
    if plot_out:
        benchmark.check_plotting(plot_out)
    package = resolve_package(package)
    pipe = load(package, provider=provider)
    benchmark.check_drafters(pipe, config)
    prompts, where = benchmark.bench_prompts(pipe, prompts_file)
    if quick:
        prompts = prompts[: benchmark.QUICK_PROMPTS]
    total = benchmark.total_runs(config, len(prompts))
    per_prompt = total // (len(prompts) * config.repeats * len(config.temperatures))
    click.echo(f"benchmarking {package}: {total} generations of {config.max_new_tokens} tokens "
               f"({len(prompts)} prompts x {config.repeats} repeats x "
               f"{len(config.temperatures)} temperatures x {per_prompt} "
               f"settings, target-only included); prompts: {where}"
               + (f" ({held} of them held to a JSON schema, with and without drafting)"
                  if (held := sum(isinstance(p, benchmark.ConstrainedPrompt) for p in prompts))
                  else ""), err=True)
    try:
        report = benchmark.run_bench(pipe, prompts, config, progress=_ProgressLines(total),
                                     command=shlex.join(["edgespec", *given_args()]))
    except benchmark.BenchInterrupted as e:  # what was measured, then exit as Ctrl-C does
        click.echo(benchmark.format_table(e.report))
        raise
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

