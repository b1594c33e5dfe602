"""What the peer benchmarks share: prompts, the run loop, medians, the table and the JSON.

Standard library only: peer_genai.py runs in a virtual environment that has onnxruntime-genai and
little else. The scripts import this file as ``common`` (Python puts the script's folder first on
sys.path); the edgespec package never imports anything here.

Timing, the same for every runtime (and comparable with ``edgespec bench``):

- ``ttft_s``: from the call that starts generation until the first new token exists: prefill of
  the prompt plus the first step (for a speculative run, its first whole round).
- ``e2e_tokens_per_s`` = new tokens / total seconds, prefill included.
- ``decode_tokens_per_s`` = (new tokens - 1) / (total seconds - prefill), where prefill is the
  median ``ttft_s`` of the target-only runs of the same prompt (all temperatures and repeats).
  So the prompt's prefill and the first token are left out alike for target-only and
  speculative runs; a speculative run's draft prefill counts as decoding. This is a per-token
  decode rate, the quantity edgespec bench reports as tokens/s (new tokens / decode seconds).
- ``speedup_*``: the median over pairs of (speculative rate / target-only rate), a pair being
  the runs of one prompt, temperature and repeat (made one after the other).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

TIMING_NOTE = (
    "ttft_s: prompt prefill + first token (a speculative run: its first round). "
    "e2e_tokens_per_s = new_tokens / total_s (prefill included). "
    "decode_tokens_per_s = (new_tokens - 1) / (total_s - prefill_s), prefill_s = median ttft_s of "
    "the target-only runs of the same prompt. speedup = median over pairs (same prompt, "
    "temperature, repeat) of speculative rate / target-only rate."
)


# --- prompts -----------------------------------------------------------------------------------


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from JSON Lines (a string, or an object with "prompt", a line) or plain text.

    A ``.jsonl`` file is read as JSON Lines, as ``edgespec bench`` does (the demo package's
    prompts.jsonl holds multi-line code prompts as JSON strings); any other file gives one
    prompt a non-empty line.
    """
    path = Path(path)
    if not path.is_file():
        sys.exit(f"error: no prompts file at {path}")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
            prompts.append(item if isinstance(item, str) else item["prompt"])
        except (ValueError, KeyError, TypeError) as e:
            sys.exit(f"error: {path}:{number}: not a JSON string or {{\"prompt\": ...}} ({e})")
    if not prompts:
        sys.exit(f"error: {path} holds no prompts")
    return prompts


# --- the command line ----------------------------------------------------------------------------


def add_common_args(parser, draft_length_default: str = "1,2,4") -> None:
    parser.add_argument("--target", required=True, help="Hugging Face checkpoint folder (target)")
    parser.add_argument("--draft", help="Hugging Face checkpoint folder (draft)")
    parser.add_argument("--prompts", required=True,
                        help="prompts: JSON Lines of strings (prompts.jsonl) or text, one a line")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens a run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every prompt")
    parser.add_argument("--temperature", default="0,1",
                        help="comma list; 0 is greedy, otherwise plain sampling (no top-k/top-p)")
    parser.add_argument("--draft-length", default=draft_length_default,
                        help="comma list of draft tokens per round for the speculative runs")
    # --gamma: its former name, kept so that recorded commands still run
    parser.add_argument("--gamma", dest="draft_length", default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="intra-op threads (default: every core, os.cpu_count())")
    parser.add_argument("--seed", type=int, default=0,
                        help="run seed = seed + 1000*repeat + prompt")
    parser.add_argument("--limit-prompts", type=int, default=0,
                        help="use only the first N prompts (0: all)")
    parser.add_argument("--json", help="write the results here")


def comma_floats(text: str) -> list[float]:
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 0:
        sys.exit(f"error: expected a comma list of numbers >= 0, got {text!r}")
    return values


def check_common(args) -> list[str]:
    """Validate the shared arguments; return the prompts to use."""
    if args.max_new_tokens < 2:
        sys.exit("error: --max-new-tokens must be >= 2 (decode rate needs a token after the first)")
    if args.repeats < 1:
        sys.exit("error: --repeats must be >= 1")
    if args.threads < 1:
        sys.exit("error: --threads must be >= 1")
    prompts = read_prompts(args.prompts)
    return prompts[: args.limit_prompts] if args.limit_prompts > 0 else prompts


# --- runs ----------------------------------------------------------------------------------------


@dataclass
class Timing:
    """What one generation measured; ``extra`` holds runtime-specific counters."""

    prompt_tokens: int
    new_tokens: int
    total_s: float
    ttft_s: float
    extra: dict = field(default_factory=dict)


@dataclass
class Run:
    mode: str            # "target" (target-only) or a speculative mode
    gamma: int | str | None
    temperature: float
    prompt: int
    repeat: int
    seed: int
    prompt_tokens: int
    new_tokens: int
    total_s: float
    ttft_s: float
    prefill_s: float     # median ttft_s of this prompt's target-only runs
    e2e_tokens_per_s: float
    decode_tokens_per_s: float
    speedup_e2e: float | None = None
    speedup_decode: float | None = None
    extra: dict = field(default_factory=dict)


def _run(mode, gamma, temperature, prompt, repeat, seed, t: Timing, prefill_s: float) -> Run:
    decode_s = t.total_s - prefill_s
    return Run(
        mode=mode, gamma=gamma, temperature=temperature, prompt=prompt, repeat=repeat, seed=seed,
        prompt_tokens=t.prompt_tokens, new_tokens=t.new_tokens, total_s=t.total_s,
        ttft_s=t.ttft_s, prefill_s=prefill_s,
        e2e_tokens_per_s=t.new_tokens / t.total_s,
        decode_tokens_per_s=(t.new_tokens - 1) / decode_s if decode_s > 0 else float("nan"),
        extra=t.extra,
    )


Generate = Callable[[int, float, int], Timing]  # (prompt index, temperature, seed) -> Timing


def run_pairs(
    prompts: list[str],
    temperatures: list[float],
    repeats: int,
    seed: int,
    baseline: Generate,
    variants: list[tuple[str, int | str | None, Generate]],
    max_new_tokens: int,
) -> list[Run]:
    """Interleave target-only and every variant on each prompt, as edgespec bench does.

    For every temperature, repeat and prompt: one target-only run, then each (mode, gamma,
    generate) variant with the same seed. A run that stops short of max_new_tokens is an error:
    the scripts keep EOS from ending generation so every run makes the same number of tokens.
    """
    made: list[tuple] = []  # (mode, gamma, temperature, prompt, repeat, seed, Timing)
    total = len(temperatures) * repeats * len(prompts) * (1 + len(variants))
    started = time.perf_counter()
    for temperature in temperatures:
        for repeat in range(repeats):
            for i in range(len(prompts)):
                run_seed = seed + 1000 * repeat + i
                for mode, gamma, generate in [("target", None, baseline), *variants]:
                    t = generate(i, temperature, run_seed)
                    if t.new_tokens != max_new_tokens:
                        raise RuntimeError(f"{mode}: made {t.new_tokens} new tokens, "
                                           f"wanted {max_new_tokens}")
                    made.append((mode, gamma, temperature, i, repeat, run_seed, t))
                elapsed = time.perf_counter() - started
                print(f"\r{len(made)}/{total} runs, {elapsed:.0f}s", end="", file=sys.stderr,
                      flush=True)
    print(file=sys.stderr)
    return _with_rates(made)


def _with_rates(made: list[tuple]) -> list[Run]:
    """Runs with decode rates (prefill: each prompt's median target-only ttft) and speedups."""
    ttfts: dict[int, list[float]] = {}
    for mode, _, _, prompt, _, _, t in made:
        if mode == "target":
            ttfts.setdefault(prompt, []).append(t.ttft_s)
    prefill = {prompt: statistics.median(values) for prompt, values in ttfts.items()}
    runs = [_run(*m[:6], m[6], prefill[m[3]]) for m in made]
    base = {(r.temperature, r.repeat, r.prompt): r for r in runs if r.mode == "target"}
    for run in runs:
        if run.mode != "target":
            b = base[(run.temperature, run.repeat, run.prompt)]
            run.speedup_e2e = run.e2e_tokens_per_s / b.e2e_tokens_per_s
            run.speedup_decode = run.decode_tokens_per_s / b.decode_tokens_per_s
    return runs


def check_context(prompt_lengths: list[int], max_new_tokens: int, context: int | None) -> None:
    """Exit if a prompt plus the new tokens would not fit the model's context window."""
    longest = max(prompt_lengths)
    if context and longest + max_new_tokens > context:
        sys.exit(f"error: the longest prompt has {longest} tokens; with {max_new_tokens} new "
                 f"tokens that passes the context window of {context}")


def warm_up(generates: Iterable[Generate]) -> None:
    """One run of each, untimed: first runs pay for allocation and kernel selection."""
    for generate in generates:
        generate(0, 0.0, 0)


def measure(args, prompts: list[str], temperatures: list[float], baseline: Generate,
            variants: list[tuple[str, int | str | None, Generate]],
            runtime: str) -> tuple[list[Run], list[dict]]:
    """Warm up, run every pair, summarise and print the table; returns (runs, rows).

    ``runtime`` describes what ran (versions, threads) at the head of the table.
    """
    warm_up([baseline, *(v[2] for v in variants)])
    runs = run_pairs(prompts, temperatures, args.repeats, args.seed, baseline, variants,
                     args.max_new_tokens)
    rows = summarise(runs)
    title = (f"{runtime}: {len(prompts)} prompts x {args.repeats} repeats, "
             f"{args.max_new_tokens} new tokens; medians")
    print(format_table(title, rows))
    return runs, rows


# --- summary -------------------------------------------------------------------------------------


def summarise(runs: list[Run]) -> list[dict]:
    """Medians per (temperature, mode, gamma), in the order the runs were made."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault((run.temperature, run.mode, str(run.gamma)), []).append(run)
    rows = []
    for (temperature, mode, _), group in groups.items():
        row = {
            "temperature": temperature,
            "mode": mode,
            "gamma": group[0].gamma,
            "runs": len(group),
            "new_tokens": _median(r.new_tokens for r in group),
            "ttft_ms": 1e3 * _median(r.ttft_s for r in group),
            "e2e_tokens_per_s": _median(r.e2e_tokens_per_s for r in group),
            "decode_tokens_per_s": _median(r.decode_tokens_per_s for r in group),
            "speedup_e2e": None,
            "speedup_decode": None,
        }
        if mode != "target":
            row["speedup_e2e"] = _median(r.speedup_e2e for r in group)
            row["speedup_decode"] = _median(r.speedup_decode for r in group)
        unmeasured = sum(math.isnan(r.decode_tokens_per_s) for r in group)
        if unmeasured:  # a run that took less than the prompt's median prefill: no decode rate
            row["runs_without_decode_rate"] = unmeasured
        row.update(_pooled_extra(group))
        rows.append(row)
    return rows


def _median(values: Iterable[float]) -> float:
    """The median of the values that are numbers (NaN marks a run without a decode rate)."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else float("nan")


def _pooled_extra(group: list[Run]) -> dict:
    """Acceptance pooled over the group's runs, where the runtime counted drafts."""
    proposed = sum(r.extra.get("draft_tokens_proposed", 0) for r in group)
    accepted = sum(r.extra.get("draft_tokens_accepted", 0) for r in group)
    if not proposed:
        return {}
    return {"draft_tokens_proposed": proposed, "draft_tokens_accepted": accepted,
            "acceptance_rate": accepted / proposed}


def format_table(title: str, rows: list[dict]) -> str:
    lines = [
        title,
        f"{'temp':>4} {'mode':<11} {'gamma':>5} {'runs':>4} {'new':>4} {'TTFT ms':>8} "
        f"{'decode tok/s':>12} {'e2e tok/s':>9} {'x decode':>8} {'x e2e':>6} {'accept':>6}",
    ]
    for r in rows:
        speed = "" if r["speedup_decode"] is None else f"{r['speedup_decode']:.2f}x"
        speed_e2e = "" if r["speedup_e2e"] is None else f"{r['speedup_e2e']:.2f}x"
        accept = f"{r['acceptance_rate']:.0%}" if "acceptance_rate" in r else ""
        gamma = "" if r["gamma"] is None else str(r["gamma"])
        lines.append(
            f"{r['temperature']:>4g} {r['mode']:<11} {gamma:>5} {r['runs']:>4} "
            f"{r['new_tokens']:>4g} {r['ttft_ms']:>8.1f} {r['decode_tokens_per_s']:>12.1f} "
            f"{r['e2e_tokens_per_s']:>9.1f} {speed:>8} {speed_e2e:>6} {accept:>6}"
        )
    return "\n".join(lines)


# --- provenance ----------------------------------------------------------------------------------


def source_stamp(folder: Path) -> dict:
    """What identifies a checkpoint for a cache of its exports: path, file sizes and times."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    return {"source": str(folder),
            "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}}



def _edgespec_machine():
    """edgespec's own machine description (edgespec/runtime/machine.py, standard library only),
    loaded from its file: the peers' environments do not have edgespec installed."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "edgespec" / "runtime" / "machine.py"
    spec = importlib.util.spec_from_file_location("edgespec_machine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine_info() -> dict:
    """What ``edgespec bench`` records of the machine, with the names these results files have
    always used (cpu_model, machine) beside it."""
    info = _edgespec_machine().machine_info()
    return {**info, "cpu_model": info["cpu"], "machine": platform.machine()}


def versions(names: Iterable[str]) -> dict:
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _no_nan(value):
    """NaN (a run without a decode rate) as null, so the file is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value


def write_results(path: str | None, runtime: str, args, settings: dict, package_names: list[str],
                  runs: list[Run], rows: list[dict], notes: list[str]) -> None:
    if not path:
        return
    payload = {
        "runtime": runtime,
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "versions": versions(package_names),
        "settings": {**{k: v for k, v in vars(args).items()}, **settings},
        "timing": TIMING_NOTE,
        "notes": notes,
        "rows": rows,
        "runs": [asdict(r) for r in runs],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_no_nan(payload), indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
