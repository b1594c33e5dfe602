"""``edgespec bench``: speculative against target-only decoding, measured side by side.

For each temperature and draft length, target-only and speculative runs of the same prompts are
interleaved in one process (so drift of a noisy machine hits both alike) and summarised by
medians. From the step costs measured in those same runs it also gives the speedup the theory
expects (Leviathan et al. 2023, Theorem 3.8, with the cost of verifying k+1 tokens measured
rather than assumed equal to one target step) and the efficiency, measured / expected: what
the loop loses to sampling, Python and acceptance that is not independent from token to token.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# BenchConfig lives in config.py, light, so that the CLI's help shows its defaults
from edgespec.config import (
    NO_DRAFTER,
    BenchConfig,
    Constraint,
    GenerationConfig,
    SamplingConfig,
)
from edgespec.errors import ConfigError, EdgespecError
from edgespec.manifest import PROMPTS_NAME
from edgespec.runtime.drafters import resolve_drafter
from edgespec.runtime.machine import describe, machine_info
from edgespec.runtime.pipeline import Pipeline
from edgespec.runtime.schedule import expected_speedup
from edgespec.runtime.stats import GenerationStats


@dataclass
class Row:
    """One configuration's medians."""

    temperature: float
    drafter: str  # "mixed", "model", "eagle3" or "ngram": what drafted (runtime/drafters.py)
    schedule: str
    draft_length: int  # k when fixed; the starting or largest k otherwise
    baseline_tokens_per_s: float
    tokens_per_s: float
    speedup: float
    acceptance_rate: float
    alpha: float
    tokens_per_target_call: float
    per_position_acceptance: list[float]
    expected_speedup: float | None  # None for the adaptive schedules
    efficiency: float | None
    target_step_ms: float  # in the target-only runs
    draft_step_ms: float  # in the speculative runs
    verify_ms: float  # a target run on up to k+1 tokens, in the speculative runs
    runs: int
    # per source of proposals ("model", "ngram", "forced"): [proposed, accepted, seconds of its
    # runs] over every run (the mixed drafter's two, chosen per round)
    sources: dict[str, list[float]] = field(default_factory=dict)


# ``edgespec bench --quick``: a first look in about two minutes on an idle 2-core machine with
# a SmolLM2-sized pair: greedy only, one drafter, adaptive and one fixed k, short generations,
# one run of the first QUICK_PROMPTS prompts
QUICK = BenchConfig(draft_lengths=(4,), temperatures=(0.0,), max_new_tokens=32, repeats=1)
QUICK_PROMPTS = 4


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during the runs: ``report`` holds the rows of what was measured so far."""

    def __init__(self, report: BenchReport):
        super().__init__()
        self.report = report


@dataclass
class BenchReport:
    config: BenchConfig
    rows: list[Row] = field(default_factory=list)
    prompts: int = 0
    interrupted: int | None = None  # generations done when Ctrl-C stopped the runs
    # what the ratios were measured on (runtime/machine.py), the sessions' settings and the
    # command: ratios from machines with other caches or cores are not comparable
    machine: dict = field(default_factory=dict)
    sessions: dict = field(default_factory=dict)
    package: str = ""
    command: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def run_bench(
    pipe: Pipeline,
    prompts: list[str | list[int]],
    config: BenchConfig,
    progress: Callable[[int], None] | None = None,
    command: str = "",
) -> BenchReport:
    """Interleave target-only and speculative runs of every prompt (text, or token ids such as
    a rendered conversation: ``bench_prompts``); ``progress(n)`` after n runs.

    Every run generates exactly ``max_new_tokens`` (EOS is ignored), so sampled runs, which
    differ in text, still decode the same number of tokens over the same context lengths; a
    ConstrainedPrompt's runs end where its grammar's answer does (at most ``max_new_tokens``).
    Speedups are medians of paired ratios: each speculative run against the target-only run of
    the same prompt, temperature and repeat.
    """
    if not prompts:
        raise EdgespecError("no prompts to benchmark; give at least one")
    progress = progress or (lambda n: None)
    machine = machine_info()  # the load average before this process adds to it
    check_drafters(pipe, config)
    first, constraint = _unwrapped(prompts[0])
    pipe.generate(first, max_new_tokens=8, constraint=constraint)  # warm both sessions up
    report = BenchReport(config, prompts=len(prompts), machine=machine,
                         sessions=pipe.describe_sessions(),
                         package=str(pipe.path), command=command)
    done = 0

    def finished(generations: int) -> None:
        nonlocal done
        done += generations
        progress(done)

    runs: dict[tuple[str, str, int], list] = {}
    try:
        for temperature in config.temperatures:
            runs = {v: [] for v in config.variants}
            _bench_temperature(pipe, prompts, config, temperature, runs, finished)
            report.rows += [summarise(temperature, *v, runs[v]) for v in config.variants]
    except KeyboardInterrupt as e:  # the temperature under way: the pairs it finished
        report.rows += [summarise(temperature, *v, runs[v]) for v in config.variants if runs[v]]
        report.interrupted = done
        raise BenchInterrupted(report) from e
    return report


def _bench_temperature(pipe: Pipeline, prompts: list[str | list[int]], config: BenchConfig,
                       temperature: float, runs: dict[tuple[str, str, int], list],
                       finished: Callable[[int], None]) -> None:
    """Every repeat of every prompt at one temperature: (baseline, speculative) stats pairs
    appended to ``runs`` per variant as each finishes, ``finished(n)`` after each prompt's n
    generations."""
    sampling = SamplingConfig(temperature)
    for repeat in range(config.repeats):
        for i, item in enumerate(prompts):
            prompt, constraint = _unwrapped(item)
            seed = config.seed + 1000 * repeat + i
            # cold runs, each prefilling its whole prompt: the speculative run would
            # otherwise start from the KV its baseline left (runtime/prefix_cache.py)
            pipe.prefix_cache.clear()
            # EOS ignored: every run makes max_new_tokens, whatever it samples
            # (a constrained answer ends where its grammar does: EOS is not ignored there)
            free = constraint is None
            base = GenerationConfig(config.max_new_tokens, sampling, drafter=NO_DRAFTER,
                                    seed=seed, ignore_eos=free, constraint=constraint)
            baseline = pipe.generate(prompt, base).stats
            for drafter, schedule, draft_length in config.variants:
                spec = GenerationConfig(config.max_new_tokens, sampling, draft_length, schedule,
                                        seed=seed, ignore_eos=free, drafter=drafter,
                                        constraint=constraint)
                pipe.prefix_cache.clear()
                runs[drafter, schedule, draft_length].append(
                    (baseline, pipe.generate(prompt, spec).stats))
            finished(1 + len(config.variants))


def check_drafters(pipe: Pipeline, config: BenchConfig) -> None:
    """Refuse, before any run, a drafter the package lacks (the draft model of a target-only
    package)."""
    for drafter in config.drafters:
        resolve_drafter(GenerationConfig(drafter=drafter), pipe.draft)


def total_runs(config: BenchConfig, prompts: int) -> int:
    return len(config.temperatures) * config.repeats * prompts * (1 + len(config.variants))


def summarise(temperature: float, drafter: str, schedule: str, draft_length: int,
              pairs: list) -> Row:
    """Rates and speedups are medians over runs; acceptance and step costs pool all the runs'
    rounds and calls (GenerationStats.combined)."""
    median = statistics.median
    base = GenerationStats.combined(b for b, _ in pairs)
    spec = GenerationStats.combined(s for _, s in pairs)
    speedup = median(s.tokens_per_s / b.tokens_per_s for b, s in pairs)
    step_ms = 1e3 * base.target_s / base.target_calls
    draft_ms = 1e3 * spec.draft_s / max(1, spec.draft_calls)
    verify_ms = 1e3 * spec.target_s / spec.target_calls
    # the formula assumes k drafted every round: not for the adaptive schedules, nor for the
    # n-gram lookup, which drafts only where it finds a match
    expected = (
        expected_speedup(spec.alpha, draft_length, draft_ms, verify_ms, step_ms, temperature > 0)
        if schedule == "fixed" and spec.drafter in ("model", "eagle3") else None
    )
    return Row(
        temperature=temperature,
        drafter=spec.drafter,
        schedule=schedule,
        draft_length=draft_length,
        baseline_tokens_per_s=median(b.tokens_per_s for b, _ in pairs),
        tokens_per_s=median(s.tokens_per_s for _, s in pairs),
        speedup=speedup,
        acceptance_rate=spec.acceptance_rate,
        alpha=spec.alpha,
        tokens_per_target_call=median(s.tokens_per_target_call for _, s in pairs),
        per_position_acceptance=spec.per_position_acceptance,
        expected_speedup=expected,
        efficiency=speedup / expected if expected else None,
        target_step_ms=step_ms,
        draft_step_ms=draft_ms,
        verify_ms=verify_ms,
        runs=len(pairs),
        sources={source: [n, spec.accepted_by.get(source, 0), spec.draft_s_by.get(source, 0.0)]
                 for source, n in spec.drafted_by.items()},
    )


@dataclass(frozen=True)
class ConstrainedPrompt:
    """A prompt (text, token ids or chat messages) whose answers must match ``constraint``: a
    JSON Lines prompt with a ``json_schema``. Both its target-only and speculative runs are
    constrained, so its rows compare constrained decoding with and without drafting."""

    prompt: str | list
    constraint: Constraint


def _unwrapped(prompt) -> tuple[object, Constraint | None]:
    if isinstance(prompt, ConstrainedPrompt):
        return prompt.prompt, prompt.constraint
    return prompt, None


# edgespec's own task prompts, for a chat package without a prompts file: JSON Lines of
# {"kind": "summarize" | "code" | "question", "messages": [...]}, rendered through its template
BUILT_IN_PROMPTS = Path(__file__).with_name("bench_prompts.jsonl")


def read_prompts(path: str | Path) -> list[str | list[dict] | ConstrainedPrompt]:
    """Prompts from a UTF-8 text file, one a line, or JSON Lines of strings, {"prompt": ...}
    or {"messages": [...]} (a conversation, for the package's chat template); an object with a
    ``json_schema`` (a JSON schema object) is a ConstrainedPrompt, its answers held to it."""
    path = Path(path)
    if not path.is_file():
        raise EdgespecError(f"no prompts file at {path}; pass --prompts FILE (one prompt a line)")
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as e:
        raise EdgespecError(f"{path} is not UTF-8 (byte {e.start}); save it as UTF-8") from None
    if not lines:
        raise EdgespecError(f"{path} holds no prompts; put one prompt a line")
    if path.suffix != ".jsonl":
        return lines
    try:
        items = [json.loads(line) for line in lines]
        prompts = [item if isinstance(item, str) else
                   item["messages"] if "messages" in item else item["prompt"] for item in items]
    except (ValueError, KeyError, TypeError) as e:
        raise EdgespecError(f"{path}: not JSON Lines of prompts ({e})") from None
    if not all(isinstance(prompt, (str, list)) for prompt in prompts):
        raise EdgespecError(f"{path}: not JSON Lines of prompts (a prompt that is not a string "
                            "or a list of messages)")
    for n, item in enumerate(items):
        if isinstance(item, dict) and "json_schema" in item:
            try:
                prompts[n] = ConstrainedPrompt(prompts[n], Constraint.json_schema(
                    item["json_schema"]))
            except ConfigError as e:
                raise EdgespecError(f"{path}, line {n + 1}: its json_schema is not one ({e}); "
                                    "give a JSON schema object") from None
    return prompts


def bench_prompts(pipe: Pipeline, path: Path | None = None) -> tuple[list[str | list[int]], str]:
    """What bench runs, and where it came from: the prompts in ``path``, else the package's
    prompts.jsonl, else (a package with a chat template) edgespec's task prompts
    (BUILT_IN_PROMPTS). Conversations become token ids through the chat template
    (``Pipeline.encode_chat``), so that they are read as the model is chatted with."""
    own = pipe.path / PROMPTS_NAME
    has_template = pipe.manifest.chat_template is not None
    if path is None and not own.is_file():
        if not has_template:
            raise EdgespecError(
                f"{pipe.path} has no {PROMPTS_NAME} and no chat template to render edgespec's "
                "task prompts with; pass --prompts FILE (one prompt a line)")
        path = BUILT_IN_PROMPTS
    path = path or own
    prompts = read_prompts(path)
    if not has_template and any(isinstance(_unwrapped(p)[0], list) for p in prompts):
        raise EdgespecError(f"{path} holds chat messages but {pipe.path} has no chat template "
                            "to render them with; give the prompts as text")
    where = ("edgespec's task prompts, through the chat template" if path == BUILT_IN_PROMPTS
             else str(path))

    def rendered(prompt):
        text, constraint = _unwrapped(prompt)
        text = pipe.encode_chat(text) if isinstance(text, list) else text
        return text if constraint is None else ConstrainedPrompt(text, constraint)

    return [rendered(p) for p in prompts], where


def check_writable(path: Path, option: str) -> None:
    """Refuse, before any benchmarking, an output file that could not be written at the end."""
    parent = path.parent
    if path.is_dir():
        raise EdgespecError(f"{option} {path} is a folder; give a file name")
    if not parent.is_dir():
        missing = "does not exist" if not parent.exists() else "is not a folder"
        raise EdgespecError(f"{option} {path}: {parent} {missing}; create the folder first")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise EdgespecError(f"{option} {path}: no permission to write there; choose another path")


def check_plotting(path: Path) -> None:
    """Refuse ``--plot`` before any benchmarking if matplotlib is missing or ``path`` unwritable."""
    _pyplot()
    check_writable(path, "--plot")


def _pool(session: dict) -> str:
    """How a session's worker threads were set up, as the results file recorded it."""
    if session.get("on_shared_pool"):
        return " on the shared pool"
    return " spinning" if session["spin"] else ""


def format_table(report: BenchReport) -> str:
    threads = ", ".join(f"{role} {s['threads'] or 'all'} thread(s)"
                        f"{_pool(s)} on {s['providers'][0]}"
                        for role, s in report.sessions.items())
    lines = [
        f"machine: {describe(report.machine)}" if report.machine else "machine: not recorded",
        f"sessions: {threads}" if threads else "sessions: not recorded",
        f"{report.prompts} prompts x {report.config.repeats} repeats, "
        f"{report.config.max_new_tokens} new tokens; medians; costs in ms per run, measured in "
        "the same runs (target step: target-only runs; draft step and verify of k+1 tokens: "
        "speculative runs)",
        *([f"interrupted after {report.interrupted} generations: the rows of the runs "
           "finished (a temperature cut short has fewer)"] if report.interrupted is not None
          else []),
        "",
        f"{'temp':>5} {'drafter':>7} {'schedule':>9} {'k':>3} {'target tok/s':>12} "
        f"{'spec tok/s':>10} "
        f"{'speedup':>7} {'accept':>6} {'alpha':>5} {'tok/call':>8} {'step':>5} {'draft':>5} "
        f"{'verify':>6} {'expected':>8} {'effic.':>6}",
    ]
    for r in report.rows:
        expected = f"{r.expected_speedup:>7.2f}x {r.efficiency:>6.0%}" if r.expected_speedup else (
            f"{'-':>8} {'-':>6}")
        lines.append(
            f"{r.temperature:>5.2g} {r.drafter:>7} {r.schedule:>9} {r.draft_length:>3} "
            f"{r.baseline_tokens_per_s:>12.1f} "
            f"{r.tokens_per_s:>10.1f} {r.speedup:>6.2f}x {r.acceptance_rate:>6.0%} "
            f"{r.alpha:>5.2f} {r.tokens_per_target_call:>8.2f} {r.target_step_ms:>5.2f} "
            f"{r.draft_step_ms:>5.2f} {r.verify_ms:>6.2f} {expected}"
        )
    mixed = [r for r in report.rows if len(r.sources) > 1]
    if mixed:
        lines += ["", "proposals by source (proposed, accepted, seconds of its runs), "
                  "over every run of the row:"]
        for r in mixed:
            shares = ", ".join(f"{source} {n:.0f} at {accepted / n:.0%} in {seconds:.2f}s"
                               for source, (n, accepted, seconds) in sorted(
                                   r.sources.items(), key=lambda item: -item[1][0]))
            lines.append(f"{r.temperature:>5.2g} {r.drafter:>7} {r.schedule:>9} "
                         f"{r.draft_length:>3}: {shares}")
    return "\n".join(lines)


def plot(report: BenchReport, path: Path) -> None:
    """Speedup against the draft length, one colour per temperature: measured solid, expected dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for i, temperature in enumerate(report.config.temperatures):
        for drafter, marker in zip(dict.fromkeys(r.drafter for r in report.rows), "os^"):
            rows = [r for r in report.rows if r.temperature == temperature
                    and r.schedule == "fixed" and r.drafter == drafter]
            draft_lengths = [r.draft_length for r in rows]
            color = f"C{i}"
            ax.plot(draft_lengths, [r.speedup for r in rows], f"{marker}-", color=color,
                    label=f"T={temperature:g} {drafter}")
            if all(r.expected_speedup for r in rows):
                ax.plot(draft_lengths, [r.expected_speedup for r in rows], "--", color=color, alpha=0.6)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("draft length k (draft tokens per round)")
    ax.set_ylabel("speedup over target-only")
    ax.set_title("edgespec: measured (solid) and expected (dashed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _pyplot():
    """matplotlib.pyplot, drawing to files only."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgespecError("--plot needs matplotlib: pip install 'edgespec[bench]'") from None
    return plt
