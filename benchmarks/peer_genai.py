"""Peer benchmark: onnxruntime-genai (CPU), target-only against its speculative decoding.

1. Builds target and draft graphs with genai's model builder (fp32, CPU), run by
   --builder-python (the onnxruntime-genai 0.15.2 builder works with transformers 4.57; later
   builders fail to import there), into --work-dir; cached until the checkpoint changes.
2. Writes a composite genai_config.json beside them (``model.draft``, the draft's decoder block)
   for genai's draft-model speculative decoding (onnxruntime-genai >= 0.18; genai refuses ".."
   in model paths, so the composite lives in the folder above target/ and draft/).
3. Runs, with the onnxruntime_genai this interpreter imports, target-only generation and, where
   the runtime has ``GeneratorParams.set_speculative_options``, speculative decoding with each
   --draft-length as max_draft_tokens (and n-gram speculation with --ngram-size N).

EOS: ``min_length`` = ``max_length`` masks EOS until the last token, so every run makes
--max-new-tokens tokens (genai refuses an eos_token_id outside the vocabulary, and an empty
list does not turn it off). Sampling is top_k=0, top_p=1: the full distribution at T.
Timing as in common.py: the loop is append_tokens (prefill), then generate_next_token.

    build/genai18-venv/bin/python benchmarks/peer_genai.py \\
        --builder-python build/genai-venv/bin/python \\
        --target checkpoints/demo/target --draft checkpoints/demo/draft \\
        --prompts edgespec/models/demo/prompts.jsonl --json build/peers/genai.json
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime_genai as og

import common

PACKAGES = ["onnxruntime-genai", "onnxruntime", "numpy"]
DEFAULT_CACHE = Path(__file__).resolve().parent.parent / "build" / "peer-cache" / "genai"
HAS_SPECULATIVE = hasattr(og.GeneratorParams, "set_speculative_options")


# --- graphs --------------------------------------------------------------------------------------


def builder_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import onnxruntime_genai as og; print(og.__version__)"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() if out.returncode == 0 else f"unknown ({out.stderr.strip()[-200:]})"


def build(hf_dir: Path, out: Path, python: str, precision: str, rebuild: bool) -> list[str] | None:
    """Run genai's model builder on hf_dir into out unless a build of the same files is there.

    Returns the builder's command line, or None when the cached build was reused.
    """
    stamp = {**common.source_stamp(hf_dir), "precision": precision}
    stamp_file = out / "peer_source.json"
    if not rebuild and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return None
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    command = [python, "-m", "onnxruntime_genai.models.builder", "-m", str(hf_dir), "-o", str(out),
               "-p", precision, "-e", "cpu", "-c", str(out.parent / "hf-cache")]
    print(f"building {out.name}: {' '.join(command)}", file=sys.stderr)
    log = out.parent / f"{out.name}.build.log"
    with open(log, "w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0 or not (out / "genai_config.json").is_file():
        tail = log.read_text()[-3000:]
        sys.exit(f"error: the model builder failed on {hf_dir} (log {log}):\n{tail}")
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return command


def write_composite(work: Path, max_draft_tokens: int) -> Path:
    """genai_config.json in ``work`` joining work/target and work/draft for speculative decoding."""
    target = json.loads((work / "target" / "genai_config.json").read_text())
    draft = json.loads((work / "draft" / "genai_config.json").read_text())
    if target["model"]["vocab_size"] != draft["model"]["vocab_size"]:
        sys.exit(f"error: genai needs one vocabulary size; target {target['model']['vocab_size']}"
                 f", draft {draft['model']['vocab_size']}")
    model = copy.deepcopy(target["model"])
    model["type"] = "speculative"
    model["decoder"]["filename"] = f"target/{target['model']['decoder']['filename']}"
    model["draft"] = copy.deepcopy(draft["model"]["decoder"])
    model["draft"]["filename"] = f"draft/{draft['model']['decoder']['filename']}"
    config = {"model": model, "search": target["search"],
              "speculative": {"max_draft_tokens": max_draft_tokens}}
    for item in (work / "target").iterdir():  # tokenizer files: genai reads them beside the config
        if item.is_file() and not item.name.startswith(("model.onnx", "genai_config", "peer_")):
            shutil.copyfile(item, work / item.name)
    (work / "genai_config.json").write_text(json.dumps(config, indent=4) + "\n")
    return work


def load(folder: Path, threads: int, draft_threads: int | None) -> og.Model:
    """The model in folder, with its sessions' intra-op threads set by a config overlay."""
    config = og.Config(str(folder))
    overlay: dict = {"decoder": {"session_options": {"intra_op_num_threads": threads}}}
    if draft_threads is not None:
        overlay["draft"] = {"session_options": {"intra_op_num_threads": draft_threads}}
    config.overlay(json.dumps({"model": overlay}))
    return og.Model(config)


# --- one run -------------------------------------------------------------------------------------


def timed_generate(model: og.Model, ids: np.ndarray, max_new_tokens: int, temperature: float,
                   seed: int, speculative: dict | None) -> common.Timing:
    """append_tokens (prefill), then generate_next_token until max_length."""
    params = og.GeneratorParams(model)
    length = ids.shape[-1] + max_new_tokens
    search = {"max_length": length, "min_length": length, "do_sample": temperature > 0}
    if temperature > 0:
        search.update(temperature=temperature, top_k=0, top_p=1.0, random_seed=seed)
    params.set_search_options(**search)
    if speculative:
        params.set_speculative_options(**speculative)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(ids)
    first_length = generator.token_count()  # waits for prefill to finish
    generator.generate_next_token()
    first_at = time.perf_counter()
    while not generator.is_done():
        generator.generate_next_token()
    total = time.perf_counter() - start
    extra = {}
    if speculative:
        stats = dict(generator.get_speculative_stats())
        keep = ("rounds", "draft_tokens_proposed", "draft_tokens_evaluated",
                "draft_tokens_accepted", "correction_tokens", "bonus_tokens",
                "draft_forward_passes", "target_forward_passes", "acceptance_rate")
        extra = {k: stats[k] for k in keep if k in stats}
    return common.Timing(prompt_tokens=int(ids.shape[-1]),
                         new_tokens=generator.token_count() - first_length,
                         total_s=total, ttft_s=first_at - start, extra=extra)


# --- the benchmark -------------------------------------------------------------------------------


def parse_gammas(text: str) -> list[int]:
    try:
        gammas = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"error: --draft-length takes integers 1..16, got {text!r}")
    if any(not 1 <= g <= 16 for g in gammas):
        sys.exit(f"error: genai's max_draft_tokens is 1..16, got {gammas}")
    return gammas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser, draft_length_default="1,2,4")
    parser.add_argument("--builder-python", default=sys.executable,
                        help="python whose onnxruntime_genai.models.builder builds the graphs")
    parser.add_argument("--work-dir", help="where graphs are built and kept "
                                           f"(default: under {DEFAULT_CACHE})")
    parser.add_argument("--precision", default="fp32", help="builder precision (fp32, int4, ...)")
    parser.add_argument("--rebuild", action="store_true", help="build again even if cached")
    parser.add_argument("--draft-threads", type=int,
                        help="intra-op threads of the draft session (default: --threads)")
    parser.add_argument("--ngram-size", type=int, default=0,
                        help="also run genai's n-gram speculation with this n-gram size (0: no)")
    args = parser.parse_args()
    prompts = common.check_common(args)
    temperatures = common.comma_floats(args.temperature)
    gammas = parse_gammas(args.draft_length) if (args.draft or args.ngram_size) else []
    notes = []

    target_dir = Path(args.target).resolve()
    key = hashlib.sha1(f"{target_dir}|{args.draft and Path(args.draft).resolve()}".encode())
    work = Path(args.work_dir or DEFAULT_CACHE / f"{target_dir.name}-{key.hexdigest()[:10]}")
    work = work.resolve()
    builds = {"builder_python": args.builder_python,
              "builder_version": builder_version(args.builder_python)}
    builds["target"] = build(target_dir, work / "target", args.builder_python, args.precision,
                             args.rebuild) or "cached"
    speculative = bool(args.draft) and HAS_SPECULATIVE and bool(gammas)
    if (args.draft or args.ngram_size) and not HAS_SPECULATIVE:
        notes.append(f"onnxruntime-genai {og.__version__} has no speculative decoding in its "
                     "Python API (GeneratorParams.set_speculative_options): target-only runs")
    if speculative:
        builds["draft"] = build(Path(args.draft).resolve(), work / "draft", args.builder_python,
                                args.precision, args.rebuild) or "cached"
        write_composite(work, gammas[0])
    draft_threads = args.draft_threads or args.threads

    base = load(work / "target", args.threads, None)
    spec = load(work, args.threads, draft_threads) if speculative else None
    tokenizer = og.Tokenizer(base)
    ids = [np.asarray(tokenizer.encode(p), dtype=np.int32)[None, :] for p in prompts]
    context = json.loads((work / "target" / "genai_config.json").read_text())["model"]
    common.check_context([x.shape[-1] for x in ids], args.max_new_tokens,
                         context.get("context_length"))

    def runner(model: og.Model, options: dict | None) -> common.Generate:
        def generate(i: int, temperature: float, seed: int) -> common.Timing:
            return timed_generate(model, ids[i], args.max_new_tokens, temperature, seed, options)
        return generate

    variants = []
    if speculative:
        variants += [("speculative", g, runner(spec, {"max_draft_tokens": g})) for g in gammas]
    if args.ngram_size and HAS_SPECULATIVE:
        variants += [(f"ngram{args.ngram_size}", g,
                      runner(base, {"ngram_size": args.ngram_size, "max_draft_tokens": g}))
                     for g in gammas]
    baseline = runner(base, None)
    runs, rows = common.measure(
        args, prompts, temperatures, baseline, variants,
        f"onnxruntime-genai {og.__version__} (graphs by builder {builds['builder_version']}, "
        f"{args.precision}), {args.threads} intra-op threads",
    )
    settings = {
        "n_prompts": len(prompts),
        "temperatures": temperatures,
        "gammas": gammas,
        "work_dir": str(work),
        "builds": builds,
        "runtime_version": og.__version__,
        "speculative_api": HAS_SPECULATIVE,
        "intra_op_num_threads": {"target": args.threads,
                                 "draft": draft_threads if speculative else None},
        "genai_config_target": json.loads((work / "target" / "genai_config.json").read_text()),
        "genai_config_speculative": (json.loads((work / "genai_config.json").read_text())
                                     if speculative else None),
        "eos": "min_length = max_length: EOS masked until the last token",
        "sampling": "temperature T > 0: do_sample, top_k=0, top_p=1 (full distribution)",
    }
    common.write_results(args.json, "onnxruntime-genai", args, settings, PACKAGES, runs, rows,
                         notes)


if __name__ == "__main__":
    main()
