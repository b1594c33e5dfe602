"""edgespec, onnxruntime-genai and llama.cpp side by side on the same checkpoints: the costs
speculative decoding is made of, and the speedup they allow.

Per engine and variant, after a context of --context random token ids (each run's positions
taken off the KV cache again, as a rejected round does):

- the target's 1-token step, and v(k) = ms(run of k+1 tokens, logits at every position, as
  verification needs) / ms(1 token), for k = 1..--kmax;
- the draft's 1-token step (--draft-threads, a comma list);
- the expected speedup (Leviathan et al. 2023): (1 - a^(k+1)) / (1 - a) tokens a round of
  k draft steps + the target on k+1 tokens, against a target step; at alpha 0.6, 0.7, 0.8, the
  best k in 1..--kmax and the best of the engine's drafts.

Engines (each timed in a fresh child process, in its own environment; the children of one
repeat run one after the other in a rotating order, so drift hits every engine alike; figures
are medians over every timed run of every repeat):

- edgespec: ``edgespec export`` of the pair, one package per --edgespec-variant (default fp32:
  fp32 target + int4 draft; int4: both int4), timed through ``edgespec.load(PKG)`` and
  ``pipe.target.forward`` / ``pipe.draft.forward`` with the runtime's own caches, sessions as
  edgespec sets them (target spinning, draft not); with --eagle-head, also the int4 target
  with that EAGLE-3 head as its draft (the head paired with that target only);
- onnxruntime-genai: graphs by its 0.15.2 model builder (fp32, int4 accuracy level 4), timed by
  the 0.18 runtime (benchmarks/peer_genai_steps.py);
- llama.cpp: built from source; convert_hf_to_gguf.py f32, llama-quantize q8_0 and q4_0, timed
  by a C++ program against libllama (benchmarks/peer_llamacpp.py).

    python benchmarks/side_by_side.py --target build/shapes/qwen2.5-1.5b \\
        --draft build/shapes/qwen2.5-0.5b --work build/peers-side --out build/side-by-side
    python benchmarks/side_by_side.py ... --quick          # one repeat, two steps: a smoke test
    python benchmarks/side_by_side.py ... --prepare-only   # builds, conversions and exports

Everything slow is cached under --work (llama.cpp's build, the environments, conversions, genai
graphs, edgespec packages), reused while the checkpoints' files and the commands are the same.
--out gets side_by_side.json (every run, figure and command, the machine and versions),
side_by_side.md (the tables) and logs/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import common  # benchmarks/common.py: machine_info, versions
import peer_genai_steps as genai
import peer_llamacpp as llamacpp

from edgespec.runtime.schedule import StepCosts
from edgespec.runtime.schedule import best_k as schedule_best_k

ALPHAS = (0.6, 0.7, 0.8)
SHOWN_K = (1, 2, 4, 8)  # v(k) columns of the table
EDGESPEC_VARIANTS = {  # name -> edgespec export arguments (after --target/--draft/--out)
    "fp32": ["--draft-quantize", "int4"],
    "int4": ["--quantize", "int4"],
}
GENAI_VARIANTS = ("fp32", "int4")
LLAMA_VARIANTS = llamacpp.TYPES
CPU_FLAGS_SHOWN = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                   "avx512_vnni", "avx512_bf16", "avx512vbmi", "avx_vnni", "amx_tile",
                   "amx_int8", "amx_bf16")


# --- jobs ----------------------------------------------------------------------------------------


@dataclass
class Job:
    """One timing child: an engine's model (variant) in a role, on some threads."""

    engine: str
    variant: str
    role: str  # "target" or "draft"
    threads: int
    model: str  # package, graph folder or GGUF file
    lengths: list[int]
    steps: int
    runs: list[dict] = field(default_factory=list)  # the child's JSON, per repeat
    errors: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)  # the first repeat's

    @property
    def name(self) -> str:
        return f"{self.engine}-{self.variant}-{self.role}-{self.threads}t"

    def command_for(self, args, out: Path) -> list[str]:
        common_args = {"threads": self.threads, "context": args.context,
                       "steps": self.steps, "lengths": self.lengths}
        if self.engine == "edgespec":
            return [sys.executable, str(Path(__file__).resolve()), "_time-edgespec", self.model,
                    "--role", self.role, "--threads", str(self.threads), "--context",
                    str(args.context), "--steps", str(self.steps), "--lengths",
                    ",".join(map(str, self.lengths)), "--json", str(out)]
        if self.engine == "onnxruntime-genai":
            return genai.time_command(args.work, Path(self.model), api=args.genai_api, out=out,
                                      **common_args)
        return llamacpp.time_command(args.work, Path(self.model), **common_args)


def run_job(job: Job, args, repeat: int) -> None:
    """One child: its JSON into job.runs, or its failure into job.errors."""
    out = args.out / "runs" / f"{job.name}-{repeat}.json"
    log = args.out / "logs" / f"{job.name}-{repeat}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    command = job.command_for(args, out)
    job.command = job.command or command
    started = time.perf_counter()
    with open(log, "w") as err:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=err, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        job.errors.append(f"repeat {repeat}: exit {done.returncode}: {tail} ({log})")
        print(f"    {job.name}: FAILED (exit {done.returncode}; {log})", flush=True)
        return
    if job.engine == "llama.cpp":  # llama-steps prints its JSON
        result = json.loads(done.stdout)
        result["load_s"] = result.pop("load_ms") / 1e3
        out.write_text(json.dumps(result, indent=2) + "\n")
    else:
        result = json.loads(out.read_text())
    result["child_s"] = seconds
    job.runs.append(result)
    ms = {n: statistics.median(v) for n, v in result["ms"].items()}
    shown = ", ".join(f"{n}: {v:.1f}" for n, v in ms.items())
    print(f"    {job.name}: {seconds:.0f} s; median ms {shown}", flush=True)


# --- edgespec: export and the timing child -------------------------------------------------------


def stamp(folder: Path) -> dict:
    return common.source_stamp(folder)


def edgespec_commit() -> str | None:
    """The repository's HEAD (and whether the work tree differs): which edgespec exported."""
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False)
    if head.returncode:
        return None
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                            "edgespec"], capture_output=True, text=True, check=False).stdout.strip()
    return head.stdout.strip() + (" + uncommitted changes under edgespec/" if dirty else "")


def export_edgespec(target: Path, draft: Path, variant: str, export_args: list[str],
                    folder: Path, args) -> dict:
    """``edgespec export`` of the pair into ``folder``, unless an earlier run exported the same
    checkpoints with the same command (--reexport: always)."""
    command = [sys.executable, "-m", "edgespec", "export", "--target", str(target), "--draft",
               str(draft), "--out", str(folder), "--overwrite", "--validate", args.validate,
               *export_args]
    record_file = folder.with_name(folder.name + ".export.json")
    info = common.machine_info()
    # --target-compute auto chooses by timing on the exporting machine: a package is reused
    # on the same kind of machine only
    want = {"command": command, "target": stamp(target), "draft": stamp(draft),
            "machine": [info.get("cpu_model"), info["cpu_count"]]}
    if not args.reexport and record_file.is_file() and (folder / "edgespec.json").is_file():
        record = json.loads(record_file.read_text())
        if {k: record.get(k) for k in want} == want:
            if record.get("edgespec_commit") != edgespec_commit():
                print(f"  note: {folder.name} was exported at {record.get('edgespec_commit')}; "
                      "pass --reexport after exporter changes", flush=True)
            return {**record, "cached": True}
    log = args.out / "logs" / f"export-edgespec-{variant}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  exporting edgespec {variant} (log {log}) ...", flush=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(["nice", "-n", str(args.nice), *command], stdout=out,
                              stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-10:])
        sys.exit(f"error: edgespec export {variant} failed; {log} ends:\n    {tail}")
    record = {**want, "seconds": time.perf_counter() - started,
              "edgespec_commit": edgespec_commit()}
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    return {**record, "cached": False}


def manifest_fields(package: Path) -> dict:
    """What the package says about each model: graph, dtype, quantization, compute, padding."""
    manifest = json.loads((package / "edgespec.json").read_text())
    keep = ("graph", "dtype", "quantization", "compute", "min_run_tokens", "parameters")
    fields = {}
    for role in ("target", "draft"):
        spec = manifest.get(role) or {}
        fields[role] = {k: spec[k] for k in keep if k in spec}
        fields[role]["validation_failures"] = (spec.get("validation") or {}).get("failures")
    fields["edgespec_version"] = manifest.get("edgespec_version")
    return fields


def time_edgespec(argv: list[str]) -> None:
    """The timing child: load a package as edgespec does and time one model's runs."""
    parser = argparse.ArgumentParser(prog="side_by_side.py _time-edgespec")
    parser.add_argument("package", type=Path)
    parser.add_argument("--role", choices=["target", "draft"], required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lengths", default="1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]

    import numpy as np

    import edgespec
    from edgespec.runtime.providers import SessionConfig

    # edgespec's own settings (providers.default_session_configs): the target spinning, a
    # real-sized draft not; the threads are the ones asked for
    target = SessionConfig("cpu", threads=args.threads if args.role == "target" else 1,
                           spin=True)
    draft = SessionConfig("cpu", threads=args.threads if args.role == "draft" else 1, spin=False)
    start = time.perf_counter()
    pipe = edgespec.load(args.package, target=target, draft=draft, calibration_cache=False,
                         prefix_cache_slots=0)  # every run prefills its whole prompt
    load_s = time.perf_counter() - start
    session = pipe.target if args.role == "target" else pipe.draft
    longest = max(lengths)
    ids = np.random.default_rng(args.seed).integers(0, pipe.manifest.vocab_size,
                                                    args.context + longest)
    cache = session.new_cache(args.context + longest)

    def forward(tokens, cache):  # an EAGLE-3 head's rows each read a feature row (zeros here)
        if not session.reads_features:
            return session.forward(tokens, cache)
        features = np.zeros((len(tokens), session.feature_size), np.float32)
        return session.forward_rows(tokens, cache, features)[0]
    start = time.perf_counter()
    forward(ids[: args.context], cache)
    prefill_ms = 1e3 * (time.perf_counter() - start)
    times: dict[str, list[float]] = {str(n): [] for n in lengths}
    for step in range(args.steps + 1):  # step 0 pays for allocations: not kept
        for n in lengths:
            start = time.perf_counter()
            logits = forward(ids[args.context : args.context + n], cache)
            elapsed = 1e3 * (time.perf_counter() - start)
            if logits.shape[0] != n:
                sys.exit(f"error: {logits.shape[0]} rows of logits for a run of {n} tokens")
            cache.crop(args.context)
            if step:
                times[str(n)].append(elapsed)
    result = {"load_s": load_s, "prefill_ms": prefill_ms, "ms": times,
              "threads": args.threads, "context": args.context,
              "spin": args.role == "target",
              "min_run_tokens": getattr(session, "min_run_tokens", None),
              "in_place_cache": getattr(session, "in_place", None),
              "providers": session.providers}
    args.json.write_text(json.dumps(result, indent=2) + "\n")


# --- preparing every engine's models -------------------------------------------------------------


def model_key(checkpoint: Path) -> str:
    """A cache folder name for a checkpoint: its name and a hash of its path."""
    return f"{checkpoint.name}-{hashlib.sha1(str(checkpoint).encode()).hexdigest()[:8]}"


def parse_variants(items: list[str] | None) -> dict[str, list[str]]:
    if not items:
        return dict(EDGESPEC_VARIANTS)
    variants = {}
    for item in items:
        name, _, rest = item.partition("=")
        if not name or not _:
            sys.exit(f"error: --edgespec-variant takes NAME=ARGS, got {item!r}")
        variants[name] = shlex.split(rest)
    return variants


def prepare(args) -> tuple[list[Job], dict]:
    """Set up each engine and make its models; the jobs to time and what was made, how."""
    target, draft = args.target, args.draft
    models = args.work / "models"
    made: dict = {}
    jobs: list[Job] = []
    lengths = list(range(1, args.kmax + 2))
    draft_threads = [int(t) for t in args.draft_threads.split(",") if t]

    def add(engine: str, variant: str, target_model: str, draft_model: str) -> None:
        jobs.append(Job(engine, variant, "target", args.threads, target_model, lengths,
                        args.steps))
        for threads in draft_threads:
            jobs.append(Job(engine, variant, "draft", threads, draft_model, [1],
                            args.draft_steps))

    if "edgespec" in args.engines:
        print("edgespec:", flush=True)
        extra = shlex.split(args.edgespec_export_args or "")
        made["edgespec"] = {"export_args_added": extra, "packages": {}}
        pair = models / f"{model_key(target)}--{model_key(draft)}" / "edgespec"
        def export(draft_path: Path, variant: str, export_args: list[str], package: Path):
            record = export_edgespec(target, draft_path, variant, [*export_args, *extra],
                                     package, args)
            made["edgespec"]["packages"][variant] = {
                "package": str(package), "export_command": shlex.join(record["command"]),
                "export_seconds": record.get("seconds"), "cached": record["cached"],
                "exported_at": record.get("edgespec_commit"),
                "manifest": manifest_fields(package)}
            add("edgespec", variant, str(package), str(package))

        for variant, export_args in parse_variants(args.edgespec_variant).items():
            export(draft, variant, export_args, pair / variant)
        if args.eagle_head:  # the int4 target with the head as its draft
            export(args.eagle_head, HEAD_VARIANT, ["--quantize", "int4"],
                   pair.with_name("edgespec-eagle3") / HEAD_VARIANT)

    if "onnxruntime-genai" in args.engines:
        print("onnxruntime-genai:", flush=True)
        made["onnxruntime-genai"] = {"setup": genai.setup(args.work), "graphs": {}}
        for variant in GENAI_VARIANTS:
            built = {role: genai.build(checkpoint, models / model_key(checkpoint) / "genai" /
                                       variant, variant, args.work)
                     for role, checkpoint in (("target", target), ("draft", draft))}
            made["onnxruntime-genai"]["graphs"][variant] = built
            add("onnxruntime-genai", variant, built["target"]["dir"], built["draft"]["dir"])

    if "llama.cpp" in args.engines:
        print("llama.cpp:", flush=True)
        made["llama.cpp"] = {"setup": llamacpp.setup(args.work, args.jobs), "gguf": {}}
        converted = {role: llamacpp.convert(checkpoint, models / model_key(checkpoint) /
                                            "llama.cpp", args.work)
                     for role, checkpoint in (("target", target), ("draft", draft))}
        made["llama.cpp"]["gguf"] = converted
        for variant in LLAMA_VARIANTS:
            add("llama.cpp", variant, converted["target"]["files"][variant],
                converted["draft"]["files"][variant])
    return jobs, made


# --- figures -------------------------------------------------------------------------------------


def pooled(job: Job, n: int) -> float | None:
    values = [v for run in job.runs for v in run["ms"].get(str(n), [])]
    return statistics.median(values) if values else None


def best_k(alpha: float, draft_ms: float, target_ms: dict[int, float | None],
           kmax: int) -> dict | None:
    """The k in 1..kmax (those timed) with the largest expected speedup over target-only: the
    runtime's cost model (edgespec/runtime/schedule.py), on the lengths timed from 1 up; None
    when fewer than two lengths were timed (no k to weigh)."""
    timed: list[float] = []
    for n in range(1, kmax + 2):
        if target_ms.get(n) is None:
            break
        timed.append(target_ms[n])
    if len(timed) < 2:
        return None
    costs = StepCosts(draft_ms, tuple(timed))
    k = schedule_best_k(costs, alpha, kmin=1)
    speedup = costs.tokens_per_ms(alpha, k) * target_ms[1]
    return {"k": k, "speedup": speedup, "ms_per_token": target_ms[1] / speedup}


def model_bytes(job: Job) -> int:
    """Bytes on disk of what the job loads: a GGUF file, a genai graph folder, or the model's
    folder in an edgespec package."""
    path = Path(job.model)
    if job.engine == "edgespec":
        manifest = json.loads((path / "edgespec.json").read_text())
        path = path / Path(manifest[job.role]["path"]).parent
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and
               not p.name.startswith(("peer_", "tokenizer", "special_tokens")))


def pairs(target_variant: str, draft_variant: str) -> bool:
    """A head drafts for its own package's target only (it reads that graph's features); the
    draft models of an engine pair with each of its targets but the head's."""
    head = HEAD_VARIANT in (target_variant, draft_variant)
    return target_variant == draft_variant if head else True


def figures(jobs: list[Job], kmax: int) -> dict:
    """Medians per job; v(k); expected speedups of each target with each draft of its engine."""
    rows: dict = {"targets": [], "drafts": [], "speedups": []}
    for job in jobs:
        if not job.runs:
            continue
        ms = {n: pooled(job, n) for n in job.lengths}
        row = {"engine": job.engine, "variant": job.variant, "threads": job.threads,
               "model": job.model, "model_bytes": model_bytes(job), "ms": ms,
               "repeats": len(job.runs),
               "timed_runs_per_length": len(job.runs) * job.steps,
               "load_s": statistics.median(r["load_s"] for r in job.runs),
               "prefill_ms": statistics.median(r["prefill_ms"] for r in job.runs)}
        if job.role == "target":
            row["v"] = {k: ms[k + 1] / ms[1] for k in range(1, kmax + 1) if ms.get(k + 1)}
            rows["targets"].append(row)
        else:
            rows["drafts"].append(row)
    for target in rows["targets"]:
        for alpha in ALPHAS:
            options = [{"draft_variant": d["variant"], "draft_threads": d["threads"],
                        "draft_ms": d["ms"][1], **weighed}
                       for d in rows["drafts"] if d["engine"] == target["engine"]
                       and pairs(target["variant"], d["variant"])
                       and (weighed := best_k(alpha, d["ms"][1], target["ms"], kmax))]
            if options:
                best = max(options, key=lambda o: o["speedup"])
                rows["speedups"].append({"engine": target["engine"],
                                         "variant": target["variant"], "alpha": alpha,
                                         "target_step_ms": target["ms"][1], "best": best,
                                         "every_draft": options})
    return rows


# --- report --------------------------------------------------------------------------------------


def machine() -> dict:
    info = common.machine_info()
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = set(next(line for line in text.splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
        info["cpu_flags"] = [f for f in CPU_FLAGS_SHOWN if f in flags]
        info["cpu_flags_absent"] = [f for f in CPU_FLAGS_SHOWN if f not in flags]
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_bytes"] = int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        pass
    info["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return info


def versions(made: dict) -> dict:
    found = {"edgespec_commit": edgespec_commit(),
             **common.versions(["edgespec", "onnxruntime", "numpy", "torch", "transformers",
                                "onnx"])}
    if "onnxruntime-genai" in made:
        found["onnxruntime-genai"] = made["onnxruntime-genai"]["setup"]
    if "llama.cpp" in made:
        found["llama.cpp"] = made["llama.cpp"]["setup"]
    return found


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(results: dict) -> str:
    info, rows, args = results["machine"], results["figures"], results["settings"]
    found = results["versions"]
    shown = [f"edgespec {found.get('edgespec')} ({found.get('edgespec_commit')})",
             f"onnxruntime {found.get('onnxruntime')}"]
    if "onnxruntime-genai" in found:
        g = found["onnxruntime-genai"]
        shown.append(f"onnxruntime-genai {g['runtime']} (onnxruntime {g['runtime_onnxruntime']}"
                     f"; graphs by builder {g['builder']})")
    if "llama.cpp" in found:
        shown.append(f"llama.cpp {found['llama.cpp']['llama_cpp_commit']} "
                     f"({found['llama.cpp']['source']})")
    lines = [
        f"{info.get('cpu_model', info['machine'])}, {info['cpu_count']} cores "
        f"({', '.join(info.get('cpu_flags', []))}), "
        f"{info.get('memory_bytes', 0) / 2**30:.0f} GiB; load average at start "
        f"{info.get('load_average_at_start', [float('nan')])[0]:.1f}; {info['date']}",
        "",
        "; ".join(shown),
        "",
        f"Target {args['target']}, draft {args['draft']}; context {args['context']} random "
        f"tokens; target on {args['threads']} threads; medians of {args['repeats']} repeats x "
        f"{args['steps']} runs (drafts: x {args['draft_steps']}).",
        "",
        "| engine | variant | 1 token ms | " + " | ".join(f"v({k})" for k in SHOWN_K)
        + " | MiB | load s | prefill ms |",
        "|---|---|---|" + "---|" * len(SHOWN_K) + "---|---|---|",
    ]
    packages = results["made"].get("edgespec", {}).get("packages", {})
    for t in rows["targets"]:
        v, variant = t["v"], t["variant"]
        if t["engine"] == "edgespec" and variant in packages:  # what the package runs
            spec = packages[variant]["manifest"]["target"]
            variant += (f" ({spec.get('quantization') or spec.get('dtype')}, compute "
                        f"{spec.get('compute', '?')}, min_run_tokens "
                        f"{spec.get('min_run_tokens', '?')})")
        lines.append(f"| {t['engine']} | {variant} | {_ms(t['ms'][1])} | "
                     + " | ".join(f"{v[k]:.2f}" if k in v else "-" for k in SHOWN_K)
                     + f" | {t['model_bytes'] / 2**20:,.0f} | {t['load_s']:.1f} | "
                     f"{t['prefill_ms']:.0f} |")
    lines += ["", "Draft step (1 token after the context):", "",
              "| engine | variant | threads | step ms | MiB |", "|---|---|---|---|---|"]
    for d in rows["drafts"]:
        lines.append(f"| {d['engine']} | {d['variant']} | {d['threads']} | {_ms(d['ms'][1])} | "
                     f"{d['model_bytes'] / 2**20:,.0f} |")
    lines += ["", "Expected speedup over the same target alone (Leviathan et al.: (1 - a^(k+1)) "
              "/ (1 - a) tokens per round of k draft steps + the target on k+1 tokens; best k "
              "and best draft of the engine), and ms per token:", "",
              "| engine | target | 1 token ms | "
              + " | ".join(f"alpha {a}" for a in ALPHAS) + " |",
              "|---|---|---|" + "---|" * len(ALPHAS)]
    by_row: dict = {}
    for s in rows["speedups"]:
        by_row.setdefault((s["engine"], s["variant"]), {})[s["alpha"]] = s
    for (engine, variant), cells in by_row.items():
        first = next(iter(cells.values()))
        shown = []
        for alpha in ALPHAS:
            b = cells[alpha]["best"] if alpha in cells else None
            shown.append("-" if b is None else
                         f"{b['speedup']:.2f}x, {_ms(b['ms_per_token'])} ms (k={b['k']}, draft "
                         f"{b['draft_variant']} {b['draft_threads']}t)")
        lines.append(f"| {engine} | {variant} | {_ms(first['target_step_ms'])} | "
                     + " | ".join(shown) + " |")
    failures = {name: errors for name, errors in results["errors"].items() if errors}
    if failures:
        lines += ["", "Failed children: " + "; ".join(
            f"{name}: {errors[0]}" for name, errors in failures.items())]
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------------


HEAD_VARIANT = "int4-eagle3"  # --eagle-head's package: the target int4 with the head


def main(argv: list[str]) -> None:
    if argv[:1] == ["_time-edgespec"]:
        time_edgespec(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="Hugging Face checkpoint")
    parser.add_argument("--draft", type=Path, required=True, help="Hugging Face checkpoint")
    parser.add_argument("--out", type=Path, default=Path("build/side-by-side"),
                        help="results, logs (default: %(default)s)")
    parser.add_argument("--work", type=Path, default=Path("build/peers-side"),
                        help="tools, environments and converted models, reused by later runs "
                             "(default: %(default)s)")
    parser.add_argument("--engines", default="edgespec,onnxruntime-genai,llama.cpp",
                        help="comma list (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of children, one per job each (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed runs of each length per target child (default: %(default)s)")
    parser.add_argument("--draft-steps", type=int, default=20,
                        help="timed steps per draft child (default: %(default)s)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--kmax", type=int, default=8,
                        help="k = 1..kmax: the target is timed on 1..kmax+1 tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="the target's threads, every engine (default: every core)")
    parser.add_argument("--draft-threads", default=str(os.cpu_count()),
                        help="comma list of the draft's threads (default: every core)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 1 repeat, 2 steps, 4 draft steps")
    parser.add_argument("--prepare-only", action="store_true",
                        help="set up, convert, build and export; time nothing")
    parser.add_argument("--edgespec-variant", action="append", metavar="NAME=ARGS",
                        help="an edgespec package to export and time: NAME=export arguments "
                             "(repeatable; default: fp32='--draft-quantize int4' and "
                             "int4='--quantize int4')")
    parser.add_argument("--eagle-head", type=Path,
                        help="an EAGLE-3 head for --target: edgespec also times the int4 target "
                             f"with it ({HEAD_VARIANT}; the head pairs with that target only)")
    parser.add_argument("--edgespec-export-args", default="",
                        help="more edgespec export arguments for every variant, e.g. "
                             "'--target-compute int8'")
    parser.add_argument("--validate", choices=["strict", "report", "skip"], default="report",
                        help="edgespec export --validate (default: %(default)s)")
    parser.add_argument("--reexport", action="store_true",
                        help="export the edgespec packages again (after exporter changes)")
    parser.add_argument("--genai-api", choices=["generator", "ort"], default="generator",
                        help="how genai's graphs are timed (peer_genai_steps.py)")
    parser.add_argument("--jobs", type=int, default=2, help="llama.cpp build jobs")
    parser.add_argument("--nice", type=int, default=15, help="niceness of exports")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.draft_steps = 1, 2, 4
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = set(args.engines) - {"edgespec", "onnxruntime-genai", "llama.cpp"}
    if unknown:
        sys.exit(f"error: unknown engines {sorted(unknown)}")
    for name in ("target", "draft"):
        folder = getattr(args, name).resolve()
        if not (folder / "config.json").is_file():
            sys.exit(f"error: no checkpoint at {folder}")
        setattr(args, name, folder)
    args.work, args.out = args.work.resolve(), args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    jobs, made = prepare(args)
    print(f"prepared in {time.perf_counter() - started:.0f} s", flush=True)
    if args.prepare_only:
        print(json.dumps(made, indent=2, default=str))
        return

    info = machine()
    if info.get("load_average_at_start", [0])[0] > 0.5:
        print(f"the machine is busy (load average {info['load_average_at_start'][0]:.1f}): "
              "the timings will be noisy", flush=True)
    started = time.perf_counter()
    for repeat in range(args.repeats):
        order = jobs[repeat % len(jobs):] + jobs[: repeat % len(jobs)]  # rotate: spread drift
        print(f"repeat {repeat + 1}/{args.repeats}:", flush=True)
        for job in order:
            run_job(job, args, repeat)
    if hasattr(os, "getloadavg"):
        info["load_average_at_end"] = os.getloadavg()
    results = {
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        "seconds_timing": time.perf_counter() - started,
        "machine": info,
        "versions": versions(made),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "made": made,
        "notes": NOTES,
        "figures": figures(jobs, args.kmax),
        "jobs": [asdict(job) for job in jobs],
        "errors": {job.name: job.errors for job in jobs},
    }
    (args.out / "side_by_side.json").write_text(json.dumps(results, indent=2, default=str)
                                                + "\n")
    table = markdown(results)
    (args.out / "side_by_side.md").write_text(table + "\n")
    print(f"\n{table}\n\nwrote {args.out / 'side_by_side.json'} and "
          f"{args.out / 'side_by_side.md'} ({results['seconds_timing']:.0f} s of timing)")


NOTES = [
    "Every engine is timed the same way: a fresh child process loads the model, runs the "
    "context (random token ids, one run), then, --steps times over, a run of each length "
    "n = 1..kmax+1 with logits at every position, each run's positions removed from the KV "
    "cache again; the first round is not kept (allocations). ms are medians over every kept "
    "run of every repeat.",
    "edgespec: pipe.target.forward / pipe.draft.forward after edgespec.load(); the runtime's "
    "own caches (cache.crop) and session settings (target spinning, draft not); a target with "
    "min_run_tokens > 1 pads short runs as the runtime does in decoding.",
    "onnxruntime-genai: --genai-api generator: Generator.append_tokens + get_output('logits') "
    "(every fed position) + rewind_to; ort: the same graph in a plain InferenceSession.",
    "llama.cpp: llama_decode with batch.logits set on every token, llama_get_logits_ith of "
    "every row, llama_memory_seq_rm back to the context; llama.cpp's default context settings "
    "(flash attention auto, f16 KV cache).",
    "Expected speedup: Leviathan et al. 2023, tokens per round (1 - a^(k+1)) / (1 - a), round "
    "cost k draft steps + the target on k+1 tokens, against the target's 1-token step; "
    "sampling, the loop's own cost and the draft's catch-up are not counted.",
]


if __name__ == "__main__":
    main(sys.argv[1:])
