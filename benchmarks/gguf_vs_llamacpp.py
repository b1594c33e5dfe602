"""Any GGUF file (and a draft GGUF beside it) in edgespec and in llama.cpp, side by side: the
same files, the same prompts, taken in turns in one run (issue 28, item 5; issue 35, item 3).
Written for SmolLM2-135M-Instruct (Q4_1), used for the Qwen2.5-Coder 1.5B/0.5B pair.

Three measurements, each a subcommand that writes one JSON file:

    perplexity  the package's perplexity over one fixed text, by llama-perplexity's own rule
                (non-overlapping chunks of c tokens from the text tokenized once; a BOS put at
                each chunk's start only where the GGUF says add_bos; the second half of each
                chunk scored: positions c/2 .. c-2 predicting the next token; one running mean
                of the negative log-likelihood over all chunks), and llama-perplexity's number
                on the same file and text; the token ids of both sides compared (llama-tokenize).
    decode      plain greedy decoding speed: llama-bench (-p 0 -n N -t T, one repetition per
                turn) and edgespec target-only (drafter="none", ignore_eos, N new tokens after
                a short prompt; and the bare target step: one-token forward passes at the same
                positions), taken in turns, medians of the repeats.
    lookup      llama-lookup against edgespec's n-gram drafting, greedy, on the package's task
                prompts (edgespec/bench_prompts.jsonl) rendered with the chat template.
    speculative every drafter of both, per task prompt, at each temperature: llama.cpp's plain
                decoding (llama-bench tg, the same number of tokens), llama-lookup and
                llama-speculative (its draft-model decoding, with --draft-gguf: the package's
                draft converted by llama.cpp's convert_hf_to_gguf.py), and edgespec target-only,
                n-gram (adaptive), the package's draft model (fixed k for each --ks, and
                adaptive) and its default drafter (auto: both, chosen per round); tokens/s, acceptance, and whether greedy tokens equal target-only's;
                the summary's "headline": per temperature, llama.cpp's best against edgespec's
                best (median tokens/s over the prompts). With --genai-python, onnxruntime-genai
                too, after the turns, on the same rendered prompts (benchmarks/peer_genai.py:
                its builder's int4 graphs of the two files dequantized, target-only and its
                draft-model speculation at each --ks).
    hf          a GGUF file as a Hugging Face folder (transformers dequantizes its blocks), for
                onnxruntime-genai's builder, which reads float GGUF files only.

Run from the repository root with the package built by ``edgespec export --target FILE.gguf``:

    python benchmarks/gguf_vs_llamacpp.py perplexity --pkg PKG --gguf FILE --llama BIN \
        --text benchmarks/prompts/perplexity_text.txt --json OUT.json
    python benchmarks/gguf_vs_llamacpp.py decode --pkg PKG --gguf FILE --llama BIN --json OUT.json
    python benchmarks/gguf_vs_llamacpp.py lookup --pkg PKG --gguf FILE --llama BIN --json OUT.json
    python benchmarks/gguf_vs_llamacpp.py speculative --pkg PKG --gguf FILE --llama BIN \
        --draft-gguf DRAFT.gguf --json OUT.json \
        [--genai-python GENAI_VENV/bin/python --genai-target HF --genai-draft DRAFT_HF]
    python benchmarks/gguf_vs_llamacpp.py hf --gguf FILE --out HF

BIN is llama.cpp's build/bin. Every record holds the load average at its start (the machine is
shared; ratios taken in one run, in turns, are what count).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_line() -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def gguf_add_bos(gguf_path: str) -> tuple[bool, int]:
    """The GGUF's tokenizer.ggml.add_bos_token (llama.cpp's default when absent: True for
    SPM vocabularies, False for GPT-2 BPE ones; the key is present in the SmolLM2 file) and its
    BOS id."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)

    def value(key):
        field = reader.fields.get(key)
        return None if field is None else field.parts[field.data[0]][0]

    add_bos = value("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        model = bytes(reader.fields["tokenizer.ggml.model"].parts[-1]).decode()
        add_bos = model == "llama"
    return bool(add_bos), int(value("tokenizer.ggml.bos_token_id"))


def load_pipeline(pkg: str, threads: int, spin: bool = True, shared_pool: bool = False):
    """The package on the CPU as edgespec.load sets a target up (every core given, spinning
    workers: runtime/providers.py), with the thread count given; ``shared_pool``: as the
    ``edgespec`` command sets a pair with a real draft up, both on one pool of ``threads``
    spinning workers (then every later load of the process is on it too)."""
    import edgespec
    from edgespec.runtime.providers import SessionConfig

    target = SessionConfig(provider="cpu", threads=threads, spin=spin, shared_pool=shared_pool)
    return edgespec.load(pkg, provider="cpu", target=target,
                         draft=target if shared_pool else None,
                         calibration_cache=False,
                         prefix_cache_slots=0)  # every run prefills its prompt, as llama-cli


# ----------------------------------------------------------------------------- perplexity


def edgespec_perplexity(pipe, tokens: list[int], n_ctx: int, add_bos: bool, bos_id: int) -> dict:
    """llama-perplexity's perplexity() rule on the package's target graph."""
    n_chunk = len(tokens) // n_ctx
    first = n_ctx // 2
    nll, count, running = 0.0, 0, []
    start_s = time.perf_counter()
    for i in range(n_chunk):
        chunk = np.asarray(tokens[i * n_ctx:(i + 1) * n_ctx], dtype=np.int64)
        if add_bos:
            chunk = chunk.copy()
            chunk[0] = bos_id
        cache = pipe.target.new_cache(n_ctx)
        logits = pipe.target.forward(chunk, cache).astype(np.float64)  # [n_ctx, V]
        rows = logits[first:n_ctx - 1]
        rows = rows - rows.max(axis=1, keepdims=True)
        logp = rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))
        targets = np.asarray(tokens[i * n_ctx + first + 1:(i + 1) * n_ctx])
        nll += float(-logp[np.arange(len(targets)), targets].sum())
        count += len(targets)
        running.append(round(float(np.exp(nll / count)), 4))
    return {"ppl": float(np.exp(nll / count)), "chunks": n_chunk, "scored_tokens": count,
            "running": running, "seconds": round(time.perf_counter() - start_s, 2)}


def llama_tokens(bin_dir: Path, gguf_path: str, text_path: str) -> list[int]:
    """The ids llama.cpp gives the text (common_tokenize(ctx, text, add_special=true), as
    llama-perplexity calls it: BOS only where the vocabulary adds one)."""
    out = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", gguf_path, "-f", text_path,
                          "--ids", "--log-disable"], capture_output=True, text=True, check=True)
    line = [l for l in out.stdout.splitlines() if l.startswith("[")][-1]
    return json.loads(line)


def llama_perplexity(bin_dir: Path, gguf_path: str, text_path: str, n_ctx: int,
                     threads: int) -> dict:
    cmd = [str(bin_dir / "llama-perplexity"), "-m", gguf_path, "-f", text_path, "-c", str(n_ctx),
           "-t", str(threads)]
    start_s = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    log = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"llama-perplexity failed ({out.returncode}):\n{log[-3000:]}")
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    running = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+)", log)]
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    return {"ppl": float(final.group(1)), "ppl_stderr": float(final.group(2)),
            "chunks": int(chunks.group(1)) if chunks else None, "running": running,
            "command": " ".join(cmd), "seconds": round(time.perf_counter() - start_s, 2)}


def cmd_perplexity(args) -> dict:
    text = Path(args.text).read_text()
    pipe = load_pipeline(args.pkg, args.threads)
    add_bos, bos_id = gguf_add_bos(args.gguf)
    # the package's tokenizer.json; the BOS rule is the GGUF's (llama-perplexity's), not the
    # manifest's with_bos: both sides must score the same ids
    ids = pipe.tokenizer.encode(text, add_special_tokens=False).ids
    if add_bos:
        ids = [bos_id, *ids]
    record = {"text": args.text, "n_ctx": args.ctx, "threads": args.threads,
              "gguf_add_bos": add_bos, "tokens_edgespec": len(ids)}
    bin_dir = Path(args.llama)
    if (bin_dir / "llama-tokenize").exists():
        ref = llama_tokens(bin_dir, args.gguf, args.text)
        record["tokens_llamacpp"] = len(ref)
        record["token_ids_identical"] = ref == ids
        if ref != ids:
            first_diff = next((i for i, (a, b) in enumerate(zip(ref, ids)) if a != b),
                              min(len(ref), len(ids)))
            record["first_difference_at"] = first_diff
    record["load_average_start"] = load_average()
    record["edgespec"] = edgespec_perplexity(pipe, ids, args.ctx, add_bos, bos_id)
    record["load_average_llamacpp"] = load_average()
    record["llamacpp"] = llama_perplexity(bin_dir, args.gguf, args.text, args.ctx, args.threads)
    e, l = record["edgespec"]["ppl"], record["llamacpp"]["ppl"]
    record["relative_difference"] = (e - l) / l
    print(f"perplexity c={args.ctx}: edgespec {e:.4f}  llama.cpp {l:.4f}  "
          f"({100 * (e - l) / l:+.3f}%), {record['edgespec']['scored_tokens']} tokens scored")
    return record


# ----------------------------------------------------------------------------- decode


def llama_bench_tg(bin_dir: Path, gguf_path: str, n: int, threads: int) -> dict:
    cmd = [str(bin_dir / "llama-bench"), "-m", gguf_path, "-p", "0", "-n", str(n),
           "-t", str(threads), "-r", "1", "-o", "json"]
    before = children_cpu_s()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    row = [r for r in rows if r.get("n_gen") == n][0]
    return {"tokens_per_s": row["avg_ts"], "build_commit": row.get("build_commit"),
            "build_number": row.get("build_number"), "command": " ".join(cmd),
            "cpu_s": children_cpu_s() - before}


def children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def llama_cpu_per_token(bin_dir: Path, gguf_path: str, n: int, threads: int, tg: dict) -> float:
    """llama-bench's CPU ms a generated token: the CPU time of its tg n run less that of a
    tg 16 run (loading and warm-up cancel), over n - 16 tokens. On a loaded machine CPU time
    holds where wall time does not: waiting for a core costs no CPU."""
    short = llama_bench_tg(bin_dir, gguf_path, 16, threads)
    return 1e3 * (tg["cpu_s"] - short["cpu_s"]) / (n - 16)


def edgespec_generate(pipe, prompt: str, n: int) -> dict:
    result = pipe.generate(prompt, max_new_tokens=n, drafter="none", ignore_eos=True,
                           temperature=0.0, token_healing=False)
    s = result.stats
    return {"tokens_per_s": s.new_tokens / s.decode_s if s.decode_s else None,
            "tokens_per_s_stats": s.tokens_per_s, "new_tokens": s.new_tokens,
            "decode_s": s.decode_s, "prefill_s": s.prefill_s, "target_s": s.target_s,
            "target_calls": s.target_calls, "total_s": s.total_s}


def edgespec_steps(pipe, n: int) -> dict:
    """The bare target step, as llama-bench's tg times it: n one-token forward passes from
    position 0 on (one token per pass), logits for it read back."""
    cache = pipe.target.new_cache(n + 1)
    token = np.asarray([1], dtype=np.int64)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        logits = pipe.target.forward(token, cache)
        token = np.asarray([int(logits[-1].argmax())], dtype=np.int64)
    seconds = time.perf_counter() - start
    # the process's CPU time: with one thread all of it is the step's (spinning pool threads
    # would count their spinning too)
    return {"tokens_per_s": n / seconds, "ms_per_step": 1e3 * seconds / n,
            "cpu_ms_per_step": 1e3 * (time.process_time() - cpu) / n}


def cmd_decode(args) -> dict:
    bin_dir = Path(args.llama)
    pipes = {"spin": load_pipeline(args.pkg, args.threads, spin=True)}  # load()'s default
    if args.no_spin:
        pipes["nospin"] = load_pipeline(args.pkg, args.threads, spin=False)
    for also in args.also:  # more packages, timed in the same turns (before/after)
        label, _, path = also.partition("=")
        pipes[label] = load_pipeline(path, args.threads, spin=True)
    for pipe in pipes.values():  # warm-up
        edgespec_generate(pipe, args.prompt, 16)
    turns = []
    for r in range(args.repeats):
        turn = {"load_average_start": load_average(),
                "llamacpp_tg": llama_bench_tg(bin_dir, args.gguf, args.n, args.threads)}
        if args.cpu:
            turn["llamacpp_tg"]["cpu_ms_per_token"] = llama_cpu_per_token(
                bin_dir, args.gguf, args.n, args.threads, turn["llamacpp_tg"])
        for name, pipe in pipes.items():
            turn[f"edgespec_{name}_generate"] = edgespec_generate(pipe, args.prompt, args.n)
            turn[f"edgespec_{name}_steps"] = edgespec_steps(pipe, args.n)
        turns.append(turn)
        print(f"turn {r + 1}/{args.repeats} load {turn['load_average_start']}: " + ", ".join(
            f"{k} {v['tokens_per_s']:.1f}" for k, v in turn.items() if isinstance(v, dict)))
    keys = [k for k in turns[0] if k != "load_average_start"]
    medians = {k: statistics.median(t[k]["tokens_per_s"] for t in turns) for k in keys}
    ratios = {k: medians["llamacpp_tg"] / medians[k] for k in keys if k != "llamacpp_tg"}
    print("medians tokens/s: " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()))
    print("llama.cpp / edgespec: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    record = {"prompt": args.prompt, "new_tokens": args.n, "threads": args.threads,
              "repeats": args.repeats, "median_tokens_per_s": medians,
              "llamacpp_over_edgespec": ratios, "turns": turns,
              "goal": "edgespec step no slower than llama.cpp's x 1.1 (ratio >= 1/1.1 = 0.909)"}
    if args.cpu:  # CPU ms a token: edgespec's step over llama.cpp's (goal <= 1.1)
        llama = statistics.median(t["llamacpp_tg"]["cpu_ms_per_token"] for t in turns)
        cpu = {k: statistics.median(t[k]["cpu_ms_per_step"] for t in turns)
               for k in keys if k.endswith("_steps")}
        record["median_cpu_ms_per_token"] = {"llamacpp_tg": llama, **cpu}
        record["edgespec_over_llamacpp_cpu"] = {k: v / llama for k, v in cpu.items()}
        print(f"CPU ms a token: llama.cpp {llama:.2f}; " + ", ".join(
            f"{k} {v:.2f} ({v / llama:.2f}x)" for k, v in cpu.items()))
    return record


# ----------------------------------------------------------------------------- lookup


def lookup_command(bin_dir: Path, gguf_path: str, prompt_text: str, n: int, threads: int,
                   draft: int, temperature: float = 0.0, seed: int = 1) -> list[str]:
    return [str(bin_dir / "llama-lookup"), "-m", gguf_path, "-p", prompt_text, "-n", str(n),
            "-t", str(threads), "--spec-draft-n-max", str(draft), "-c", "2048", "--seed",
            str(seed), *_llama_sampling(temperature)]


def llama_lookup(bin_dir: Path, gguf_path: str, prompt_text: str, n: int, threads: int,
                 draft: int) -> dict:
    grab = _llama_log(lookup_command(bin_dir, gguf_path, prompt_text, n, threads, draft),
                      "llama-lookup")
    return {"tokens_per_s": grab(r"decoded\s+\d+ tokens in\s+[0-9.]+ seconds, speed:\s+([0-9.]+)"),
            "decoded": grab(r"decoded\s+(\d+) tokens", int),
            "n_drafted": grab(r"n_drafted\s+=\s+(\d+)", int),
            "n_accept": grab(r"n_accept\s+=\s+(\d+)", int),
            "accept_percent": grab(r"accept\s+=\s+([0-9.]+)%")}


def run_record(result) -> dict:
    """What one edgespec generation records: speed, drafting and its tokens."""
    s = result.stats
    return {"tokens_per_s": s.tokens_per_s, "new_tokens": s.new_tokens, "drafted": s.drafted,
            "accepted": s.accepted, "acceptance": s.acceptance_rate if s.drafted else None,
            "token_ids": result.token_ids}


def cmd_lookup(args) -> dict:
    bin_dir = Path(args.llama)
    pipe = load_pipeline(args.pkg, args.threads, shared_pool=True)
    prompts = [json.loads(l) for l in Path(args.prompts).read_text().splitlines() if l.strip()]
    rows = []
    for p in prompts[: args.limit]:
        ids = pipe.encode_chat(p["messages"])
        # llama-lookup tokenizes its -p text with special tokens parsed: the rendered template
        text = pipe.tokenizer.decode(ids, skip_special_tokens=False)
        row = {"kind": p.get("kind"), "prompt_tokens": len(ids), "load_average_start": load_average()}
        configs = {"edgespec_none": dict(drafter="none"),
                   "edgespec_ngram_fixed": dict(drafter="ngram", schedule="fixed"),
                   "edgespec_ngram_adaptive": dict(drafter="ngram", schedule="adaptive")}
        runs = {"llamacpp_lookup": [], **{k: [] for k in configs}}
        for _ in range(args.repeats):
            runs["llamacpp_lookup"].append(llama_lookup(bin_dir, args.gguf, text, args.n,
                                                        args.threads, int(args.draft)))
            for name, settings in configs.items():
                r = pipe.generate(ids, max_new_tokens=args.n, temperature=0.0,
                                  draft_length=int(args.draft), token_healing=False,
                                  **settings)
                runs[name].append(run_record(r))
        row["runs"] = runs
        row["median_tokens_per_s"] = {k: statistics.median(x["tokens_per_s"] for x in v)
                                      for k, v in runs.items()}
        row["greedy_identical"] = all(runs[k][0]["token_ids"] == runs["edgespec_none"][0]["token_ids"]
                                      for k in configs)
        rows.append(row)
        print(p.get("kind"), row["median_tokens_per_s"],
              "lookup accept", runs["llamacpp_lookup"][0]["accept_percent"],
              "ngram accept", runs["edgespec_ngram_fixed"][0]["acceptance"])
    return {"new_tokens": args.n, "threads": args.threads, "draft_max": int(args.draft),
            "repeats": args.repeats, "rows": rows}


# ----------------------------------------------------------------------------- speculative


def llama_speculative(bin_dir: Path, gguf_path: str, draft_gguf: str, prompt_text: str, n: int,
                      threads: int, draft: int, temperature: float, seed: int) -> dict:
    """llama-speculative (draft-model decoding) on one prompt; the full distribution at T > 0
    (top-k, top-p and min-p off, as edgespec samples here)."""
    cmd = [str(bin_dir / "llama-speculative"), "-m", gguf_path, "-md", draft_gguf,
           "-p", prompt_text, "-n", str(n), "-t", str(threads), "-td", str(threads),
           "--spec-draft-n-max", str(draft), "-c", "2048", "--seed", str(seed),
           *_llama_sampling(temperature)]
    return _llama_run(cmd, "llama-speculative")


def _llama_sampling(temperature: float) -> list[str]:
    if temperature == 0:
        return ["--temp", "0", "--top-k", "1"]
    return ["--temp", str(temperature), "--top-k", "0", "--top-p", "1", "--min-p", "0"]


def _llama_log(cmd: list[str], name: str):
    """Run a llama.cpp example; a function reading a number from its log (None if absent)."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    log = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"{name} failed ({out.returncode}):\n{log[-3000:]}")

    def grab(pattern, cast=float):
        m = re.search(pattern, log)
        return cast(m.group(1)) if m else None

    return grab


def _llama_run(cmd: list[str], name: str) -> dict:
    grab = _llama_log(cmd, name)
    drafted, accepted = grab(r"n_drafted\s+=\s+(\d+)", int), grab(r"n_accept\s+=\s+(\d+)", int)
    return {"tokens_per_s": grab(r"decoded\s+\d+ tokens in\s+[0-9.]+ seconds, speed:\s+([0-9.]+)"),
            "new_tokens": grab(r"decoded\s+(\d+) tokens", int), "drafted": drafted,
            "accepted": accepted, "acceptance": accepted / drafted if drafted else None}


def cmd_speculative(args) -> dict:
    labels = [a.partition("=")[0] for a in args.also]  # they name columns beside edgespec_*
    bad = [label for label in labels
           if not label.isidentifier() or label.startswith(("edgespec", "llamacpp", "genai"))]
    if bad or len(set(labels)) < len(labels):
        raise SystemExit(f"--also LABEL=PKG: each label once, a name not starting with edgespec, "
                         f"llamacpp or genai (got {', '.join(labels)})")
    bin_dir = Path(args.llama)
    pipe = load_pipeline(args.pkg, args.threads, shared_pool=True)
    ks = [int(k) for k in args.ks.split(",")]
    configs = {"edgespec_none": dict(drafter="none"),
               "edgespec_ngram_adaptive": dict(drafter="ngram", schedule="adaptive",
                                               draft_length=max(ks))}
    pipes = {name: pipe for name in configs}
    greedy_reference = {name: "edgespec_none" for name in configs}  # whose tokens to equal
    # the package's draft, and those of --also packages (another export of the pair: its
    # target-only run too, the reference its greedy tokens must equal): each drafter at
    # every fixed k and adaptive, in the same turns
    for label, path in [("edgespec", None), *(a.partition("=")[::2] for a in args.also)]:
        other = pipe if path is None else load_pipeline(path, args.threads, shared_pool=True)
        if other.manifest.draft is None:
            print(f"{label}: {path or args.pkg} has no draft model; its drafters are not timed")
            continue
        settings = {} if path is None else {f"{label}_none": dict(drafter="none")}
        settings.update({f"{label}_model_k{k}": dict(drafter="model", schedule="fixed",
                                                     draft_length=k) for k in ks})
        settings[f"{label}_model_adaptive"] = dict(drafter="model", schedule="adaptive",
                                                   draft_length=max(ks))
        settings[f"{label}_auto"] = dict(drafter="auto")  # the default: both, chosen per round
        configs.update(settings)
        pipes.update({name: other for name in settings})
        greedy_reference.update({name: "edgespec_none" if path is None else f"{label}_none"
                                 for name in settings})
    prompts = [json.loads(l) for l in Path(args.prompts).read_text().splitlines() if l.strip()]
    if args.kinds:
        prompts = [p for p in prompts if p.get("kind") in args.kinds.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    draft_max = [int(n) for n in str(args.draft).split(",")]  # llama.cpp's, each run
    rows, rendered = [], []
    for p in prompts[: args.limit]:
        ids = pipe.encode_chat(p["messages"])
        text = pipe.tokenizer.decode(ids, skip_special_tokens=False)  # llama.cpp parses specials
        rendered.append(text)
        for temperature in temperatures:
            row = {"kind": p.get("kind"), "temperature": temperature, "prompt_tokens": len(ids),
                   "load_average_start": load_average()}
            runs = {"llamacpp_plain": [],
                    **{f"llamacpp_lookup_n{n}": [] for n in draft_max},
                    **{f"llamacpp_speculative_n{n}": [] for n in draft_max if args.draft_gguf},
                    **{k: [] for k in configs}}
            for repeat in range(args.repeats):
                seed = args.seed + repeat
                runs["llamacpp_plain"].append(llama_bench_tg(bin_dir, args.gguf, args.n,
                                                             args.threads))
                for n in draft_max:
                    lookup = lookup_command(bin_dir, args.gguf, text, args.n, args.threads,
                                            n, temperature, seed)
                    runs[f"llamacpp_lookup_n{n}"].append(_llama_run(lookup, "llama-lookup"))
                    if args.draft_gguf:
                        runs[f"llamacpp_speculative_n{n}"].append(llama_speculative(
                            bin_dir, args.gguf, args.draft_gguf, text, args.n, args.threads,
                            n, temperature, seed))
                for name, settings in configs.items():
                    r = pipes[name].generate(ids, max_new_tokens=args.n, temperature=temperature,
                                      top_k=0, top_p=1.0, seed=seed, token_healing=False,
                                      **settings)
                    runs[name].append(run_record(r))
            row["runs"] = runs
            row["median_tokens_per_s"] = {k: statistics.median(x["tokens_per_s"] for x in v)
                                          for k, v in runs.items()}
            if temperature == 0:
                row["greedy_identical"] = all(
                    runs[k][0]["token_ids"] == runs[greedy_reference[k]][0]["token_ids"]
                    for k in configs)
            rows.append(row)
            print(f"{p.get('kind')} T={temperature}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in row["median_tokens_per_s"].items()), flush=True)
    record = {"new_tokens": args.n, "threads": args.threads, "llamacpp_draft_max": draft_max,
              "ks": ks, "temperatures": temperatures, "repeats": args.repeats, "rows": rows}
    if args.genai_python:  # the turns are written first: a failing peer loses none of them
        partial = Path(args.json).with_suffix(".turns.json")
        partial.write_text(json.dumps({**record, "summary": summarize_speculative(rows)},
                                      indent=1) + "\n")
        print("wrote", partial, "(onnxruntime-genai next)", flush=True)
    genai = run_genai(args, rendered, ks, temperatures) if args.genai_python else None
    return {**record, "summary": summarize_speculative(rows, genai),
            **({"genai": genai} if genai else {})}


def run_genai(args, prompts: list[str], ks: list[int], temperatures: list[float]) -> dict:
    """onnxruntime-genai on the same rendered prompts, by benchmarks/peer_genai.py run with
    --genai-python: its builder's graphs of --genai-target and --genai-draft (cached in
    --genai-work), target-only and speculative at each k; its JSON record."""
    work = Path(args.genai_work)
    work.mkdir(parents=True, exist_ok=True)
    prompts_file, out = work / "prompts.jsonl", work / "run.json"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    command = [args.genai_python, str(Path(__file__).with_name("peer_genai.py")),
               "--target", args.genai_target, "--prompts", str(prompts_file),
               "--max-new-tokens", str(args.n), "--repeats", str(args.repeats),
               "--temperature", ",".join(map(str, temperatures)),
               "--threads", str(args.threads), "--seed", str(args.seed),
               "--precision", args.genai_precision, "--builder-python", args.genai_python,
               "--work-dir", str(work / "graphs"), "--json", str(out)]
    if args.genai_draft:
        command += ["--draft", args.genai_draft, "--draft-length", ",".join(map(str, ks))]
    print("onnxruntime-genai: " + " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def summarize_speculative(rows: list[dict], genai: dict | None = None) -> dict:
    """Per temperature and kind (and all kinds): each configuration's median tokens/s, its
    speedup against edgespec target-only (median over prompts of the per-prompt ratio) and its
    acceptance (accepted / drafted over all runs). onnxruntime-genai's configurations (``genai``,
    peer_genai.py's record) join "all" with their decode tokens/s (median over its runs) and
    speedup as the ratio of medians to edgespec target-only's."""
    summary = {}
    for temperature in sorted({r["temperature"] for r in rows}):
        at_t = [r for r in rows if r["temperature"] == temperature]
        for kind in sorted({r["kind"] for r in at_t}) + ["all"]:
            group = [r for r in at_t if kind in ("all", r["kind"])]
            out = {}
            for name in group[0]["median_tokens_per_s"]:
                drafted = sum(x.get("drafted") or 0 for r in group for x in r["runs"][name])
                accepted = sum(x.get("accepted") or 0 for r in group for x in r["runs"][name])
                out[name] = {
                    "tokens_per_s": statistics.median(r["median_tokens_per_s"][name] for r in group),
                    "speedup_vs_edgespec_none": statistics.median(
                        r["median_tokens_per_s"][name] / r["median_tokens_per_s"]["edgespec_none"]
                        for r in group),
                    "acceptance": accepted / drafted if drafted else None}
            summary[f"T={temperature} {kind}"] = out
        every = summary[f"T={temperature} all"]
        for row in (genai or {}).get("rows", []):
            if row["temperature"] == temperature:
                name = "genai_none" if row["mode"] == "target" else f"genai_model_k{row['gamma']}"
                every[name] = {
                    "tokens_per_s": row["decode_tokens_per_s"],
                    "speedup_vs_edgespec_none":
                        row["decode_tokens_per_s"] / every["edgespec_none"]["tokens_per_s"],
                    "acceptance": row.get("acceptance_rate")}
        llama = max((k for k in every if k.startswith("llamacpp")),
                    key=lambda k: every[k]["tokens_per_s"])
        ours = max((k for k in every if k.startswith("edgespec")),  # --pkg's, not --also's
                   key=lambda k: every[k]["tokens_per_s"])
        peer = max((k for k in every if k.startswith("genai")),
                   key=lambda k: every[k]["tokens_per_s"], default=None)
        summary[f"T={temperature} headline"] = {
            "llamacpp_best": llama, "llamacpp_tokens_per_s": every[llama]["tokens_per_s"],
            "edgespec_best": ours, "edgespec_tokens_per_s": every[ours]["tokens_per_s"],
            "edgespec_over_llamacpp": every[ours]["tokens_per_s"] / every[llama]["tokens_per_s"],
            "edgespec_best_over_target_only": every[ours]["speedup_vs_edgespec_none"],
            **({"genai_best": peer, "genai_tokens_per_s": every[peer]["tokens_per_s"],
                "edgespec_over_genai": every[ours]["tokens_per_s"] / every[peer]["tokens_per_s"]}
               if peer else {})}
        print(f"T={temperature}: llama.cpp's best {llama} {every[llama]['tokens_per_s']:.1f} "
              f"tok/s, edgespec's best {ours} {every[ours]['tokens_per_s']:.1f} tok/s "
              f"({every[ours]['tokens_per_s'] / every[llama]['tokens_per_s']:.2f}x; "
              f"{every[ours]['speedup_vs_edgespec_none']:.2f}x edgespec target-only)"
              + (f"; onnxruntime-genai's best {peer} {every[peer]['tokens_per_s']:.1f} tok/s"
                 if peer else ""))
    return summary


def gguf_as_hf(gguf_path: str, out: str) -> None:
    """The GGUF file as a Hugging Face folder: transformers' GGUF load (its blocks dequantized
    to float32) saved with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf_path).resolve()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    hf = sub.add_parser("hf")
    hf.add_argument("--gguf", required=True)
    hf.add_argument("--out", required=True)
    for name in ("perplexity", "decode", "lookup", "speculative"):
        p = sub.add_parser(name)
        p.add_argument("--pkg", required=True)
        p.add_argument("--gguf", required=True)
        p.add_argument("--llama", required=True, help="llama.cpp's build/bin")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--json", required=True)
        if name == "perplexity":
            p.add_argument("--text", default="benchmarks/prompts/perplexity_text.txt")
            p.add_argument("--ctx", type=int, default=512)
        elif name == "decode":
            p.add_argument("--prompt", default="The town of Alder Ford grew up where")
            p.add_argument("-n", type=int, default=128)
            p.add_argument("--repeats", type=int, default=5)
            p.add_argument("--no-spin", action="store_true",
                           help="also time a session whose workers do not spin")
            p.add_argument("--also", action="append", default=[], metavar="LABEL=PKG",
                           help="another package timed in the same turns (repeatable)")
            p.add_argument("--cpu", action="store_true",
                           help="also CPU time a token (one thread: holds on a loaded machine)")
        else:
            p.add_argument("--prompts", default="edgespec/bench_prompts.jsonl")
            p.add_argument("-n", type=int, default=128)
            p.add_argument("--draft", default="4", help="llama.cpp's --spec-draft-n-max "
                           "(speculative: a comma list, llama-lookup and llama-speculative "
                           "run at each)")
            p.add_argument("--repeats", type=int, default=1)
            p.add_argument("--limit", type=int, default=12)
        if name == "speculative":
            p.add_argument("--draft-gguf", help="the package's draft as a GGUF file, for "
                           "llama-speculative (without it: llama-lookup only)")
            p.add_argument("--ks", default="1,2,3,4", help="edgespec's fixed draft lengths")
            p.add_argument("--temperatures", default="0,0.7")
            p.add_argument("--seed", type=int, default=1)
            p.add_argument("--kinds", help="only these prompt kinds (comma list: code, "
                                           "question, summarize; edit, new, turns)")
            p.add_argument("--also", action="append", default=[], metavar="LABEL=PKG",
                           help="another package of the same target whose draft is timed in "
                                "the same turns (LABEL_model_k...; repeatable)")
            p.add_argument("--genai-python", help="a python with onnxruntime-genai (and its "
                           "model builder): time it too, on --genai-target/--genai-draft")
            p.add_argument("--genai-target", help="the target GGUF as a Hugging Face folder "
                           "(the hf subcommand)")
            p.add_argument("--genai-draft", help="the draft GGUF as a Hugging Face folder")
            p.add_argument("--genai-precision", default="int4", help="its builder's precision")
            p.add_argument("--genai-work", default="build/peer-cache/gguf-genai",
                           help="where its graphs and run files are kept")
    args = parser.parse_args()
    if args.command == "hf":
        return gguf_as_hf(args.gguf, args.out)
    if getattr(args, "genai_python", None) and not args.genai_target:
        parser.error("--genai-python needs --genai-target (a folder the hf subcommand wrote)")
    record = {"machine": machine_line(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "gguf": args.gguf, "package": args.pkg, "subcommand": args.command}
    record.update({"perplexity": cmd_perplexity, "decode": cmd_decode,
                   "lookup": cmd_lookup, "speculative": cmd_speculative}[args.command](args))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", args.json)


if __name__ == "__main__":
    main()
