"""llama.cpp for the side-by-side benchmark: built from source, its own GGUF conversion, and
timed runs with logits at every position (as speculative verification needs).

llama.cpp's source is the copy vendored in llama-cpp-python's source package (PyPI), built with
cmake: portable (GGML_NATIVE off) with each instruction set this CPU has turned on explicitly
(/proc/cpuinfo), AMX off. The timing is a small C++ program (LLAMA_STEPS below, compiled against
the built libllama): after a context of random token ids it runs llama_decode on n tokens with
logits requested at every position, reads every row, and removes the n positions from the KV
cache again (llama_memory_seq_rm), as a rejected round does.

    python benchmarks/peer_llamacpp.py setup --work build/peers-side     # source, build, venv
    python benchmarks/peer_llamacpp.py convert CKPT OUT --work build/peers-side  # f32, q8_0, q4_0
    python benchmarks/peer_llamacpp.py time OUT/q4_0.gguf --work build/peers-side --json t.json

Standard library only: benchmarks/side_by_side.py imports it. The conversion runs
convert_hf_to_gguf.py in a virtual environment of its own (torch, transformers, the vendored
gguf-py), through ``_convert`` below.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

PACKAGE = "llama-cpp-python"  # its source package vendors llama.cpp (vendor/llama.cpp)
TYPES = ("f32", "q8_0", "q4_0")  # f32 by convert_hf_to_gguf.py, the others by llama-quantize
CONVERT_PACKAGES = ["torch==2.13.0", "transformers==4.57.*", "numpy>=2.2.6", "sentencepiece",
                    "tqdm", "pyyaml", "requests", "protobuf>=4.21,<5", "safetensors"]

# /proc/cpuinfo flag -> ggml's cmake option: each is set ON when the CPU has the flag, else OFF
CPU_OPTIONS = {
    "sse4_2": "GGML_SSE42", "avx": "GGML_AVX", "avx2": "GGML_AVX2", "bmi2": "GGML_BMI2",
    "fma": "GGML_FMA", "f16c": "GGML_F16C", "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
}
FIXED_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF",
    # AMX crashes in the VMs this was written on; the Xeons that have it would otherwise use it
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
]
TARGETS = ["llama-quantize", "llama-bench"]  # libllama comes with them

LLAMA_STEPS = r"""
// llama-steps: ms of llama_decode on n tokens, logits at every position, after a context.
// usage: llama-steps MODEL THREADS CONTEXT STEPS LENGTHS(comma list) SEED
// stdout: one JSON object; llama.cpp's own log goes to stderr.
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

static double now_ms() {
    using clock = std::chrono::steady_clock;
    return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

static void fill(llama_batch & batch, const std::vector<llama_token> & ids, int from, int n,
                 bool every_row) {
    batch.n_tokens = n;
    for (int i = 0; i < n; i++) {
        batch.token[i] = ids[from + i];
        batch.pos[i] = from + i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = every_row || i == n - 1;
    }
}

int main(int argc, char ** argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s MODEL THREADS CONTEXT STEPS LENGTHS SEED\n", argv[0]);
        return 2;
    }
    const char * path = argv[1];
    const int threads = atoi(argv[2]), context = atoi(argv[3]), steps = atoi(argv[4]);
    std::vector<int> lengths;
    std::stringstream list(argv[5]);
    for (std::string item; std::getline(list, item, ',');) lengths.push_back(atoi(item.c_str()));
    const int longest = *std::max_element(lengths.begin(), lengths.end());

    llama_backend_init();
    double start = now_ms();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(path, mparams);
    if (!model) { fprintf(stderr, "cannot load %s\n", path); return 1; }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = context + longest + 16;
    cparams.n_batch = std::max(context, longest);
    cparams.n_ubatch = cparams.n_batch;
    cparams.n_seq_max = 1;
    cparams.n_threads = threads;
    cparams.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) { fprintf(stderr, "cannot make a context\n"); return 1; }
    const double load_ms = now_ms() - start;

    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::mt19937 rng(atoi(argv[6]));
    std::uniform_int_distribution<int> pick(0, vocab - 1);
    std::vector<llama_token> ids(context + longest);
    for (auto & id : ids) id = pick(rng);
    llama_memory_t memory = llama_get_memory(ctx);
    llama_batch batch = llama_batch_init(std::max(context, longest), 0, 1);

    fill(batch, ids, 0, context, false);
    start = now_ms();
    if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "prefill failed\n"); return 1; }
    llama_synchronize(ctx);
    const double prefill_ms = now_ms() - start;

    std::vector<std::vector<double>> times(lengths.size());
    double checksum = 0;
    for (int step = 0; step <= steps; step++) {  // step 0 pays for allocations: not kept
        for (size_t j = 0; j < lengths.size(); j++) {
            const int n = lengths[j];
            fill(batch, ids, context, n, true);
            start = now_ms();
            if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
            for (int i = 0; i < n; i++) {  // every row exists (and waits for the run to end)
                const float * row = llama_get_logits_ith(ctx, i);
                if (!row) { fprintf(stderr, "no logits at position %d\n", i); return 1; }
                checksum += row[vocab - 1];
            }
            const double elapsed = now_ms() - start;
            if (!llama_memory_seq_rm(memory, 0, context, -1)) {
                fprintf(stderr, "cannot remove positions %d.. from the cache\n", context);
                return 1;
            }
            if (step > 0) times[j].push_back(elapsed);
        }
    }

    char desc[256];
    llama_model_desc(model, desc, sizeof desc);
    printf("{\"load_ms\": %.3f, \"prefill_ms\": %.3f, \"n_vocab\": %d, \"n_params\": %llu, "
           "\"model_bytes\": %llu, \"desc\": \"%s\", \"threads\": %d, \"context\": %d, "
           "\"checksum\": %.6g, \"system_info\": \"%s\", \"ms\": {",
           load_ms, prefill_ms, vocab, (unsigned long long) llama_model_n_params(model),
           (unsigned long long) llama_model_size(model), desc, threads, context, checksum,
           llama_print_system_info());
    for (size_t j = 0; j < lengths.size(); j++) {
        printf("%s\"%d\": [", j ? ", " : "", lengths[j]);
        for (size_t i = 0; i < times[j].size(); i++) printf("%s%.4f", i ? ", " : "", times[j][i]);
        printf("]");
    }
    printf("}}\n");
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
"""


# --- paths ---------------------------------------------------------------------------------------


class Tools:
    """Where llama.cpp's source, build and converter environment live under ``work``."""

    def __init__(self, work: Path):
        self.work = Path(work).resolve()
        self.downloads = self.work / "src"
        self.build = self.work / "llama.cpp-build"
        self.bin = self.build / "bin"
        self.steps = self.bin / "llama-steps"
        self.quantize = self.bin / "llama-quantize"
        self.venv = self.work / "llama-convert-venv"
        self.python = self.venv / "bin" / "python"
        self.record = self.build / "peer_build.json"

    @property
    def source(self) -> Path:
        """vendor/llama.cpp of the unpacked source package (the newest, if several)."""
        found = sorted(self.downloads.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
        if not found:
            raise FileNotFoundError(f"no llama-cpp-python source under {self.downloads}")
        return found[-1].parent

    def ready(self) -> bool:
        return self.steps.is_file() and self.quantize.is_file() and self.python.is_file()


def run(command: list, log: Path | None = None, **kwargs) -> None:
    """Run ``command`` at low priority (the machine is shared); its output to ``log``."""
    command = ["nice", "-n", "15", *map(str, command)]
    print("  $ " + " ".join(command), file=sys.stderr, flush=True)
    if log is None:
        subprocess.run(command, check=True, **kwargs)
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, **kwargs, check=False)
    if done.returncode:
        tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-15:])
        sys.exit(f"error: {command[3]} failed (exit {done.returncode}); {log} ends:\n    {tail}")


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cmake_options() -> list[str]:
    flags = cpu_flags()
    return FIXED_OPTIONS + [f"-D{option}={'ON' if flag in flags else 'OFF'}"
                            for flag, option in CPU_OPTIONS.items()]


# --- setup: source, build, converter -------------------------------------------------------------


def setup(work: Path, jobs: int = 2) -> dict:
    """Download and unpack the source package, build llama.cpp and llama-steps, make the
    converter's environment: each step skipped when done before with the same settings (a
    changed CPU means other cmake options, and so a rebuild)."""
    tools = Tools(work)
    logs = tools.work / "logs"
    if not list(tools.downloads.glob("llama_cpp_python-*.tar.gz")):
        run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             PACKAGE, "-d", tools.downloads], logs / "llama-download.log")
    archive = max(tools.downloads.glob("llama_cpp_python-*.tar.gz"))
    if not (tools.downloads / archive.name.removesuffix(".tar.gz")).is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(tools.downloads, filter="data")
    source = tools.source

    record = {"archive": archive.name, "cmake": cmake_options(), "targets": TARGETS}
    previous = json.loads(tools.record.read_text()) if tools.record.is_file() else None
    if previous != record or not tools.quantize.is_file():
        tools.record.unlink(missing_ok=True)
        log = logs / "llama-build.log"
        print(f"building llama.cpp (log {log}; ~10-20 min on 2 cores)", file=sys.stderr)
        run(["cmake", "-S", source, "-B", tools.build, *record["cmake"]], log)
        run(["cmake", "--build", tools.build, "--config", "Release", "-j", jobs,
             "--target", *TARGETS], log)
        tools.steps.unlink(missing_ok=True)
    if not tools.steps.is_file():
        program = tools.build / "llama_steps.cpp"
        program.write_text(LLAMA_STEPS)
        run(["g++", "-O2", "-std=c++17", program, "-I", source / "include",
             "-I", source / "ggml" / "include", "-L", tools.bin, "-lllama", "-lggml",
             "-lggml-base", f"-Wl,-rpath,{tools.bin}", "-o", tools.steps], logs / "llama-build.log")
    tools.record.write_text(json.dumps(record, indent=2) + "\n")

    if not tools.python.is_file() or subprocess.run(
            [tools.python, "-c", "import torch, transformers, numpy"],
            capture_output=True, check=False).returncode:
        log = logs / "llama-convert-venv.log"
        run([sys.executable, "-m", "venv", "--clear", tools.venv], log)
        run([tools.python, "-m", "pip", "install", *CONVERT_PACKAGES], log)
    return info(tools)


def info(tools: Tools) -> dict:
    """What was built, from what: for the results' versions."""
    source = tools.source
    record = json.loads(tools.record.read_text()) if tools.record.is_file() else {}
    git = subprocess.run(["git", "-C", str(source), "rev-parse", "--show-toplevel", "HEAD"],
                         capture_output=True, text=True, check=False).stdout.split()
    # the sdist keeps vendor/llama.cpp's .git; not a repository around it
    commit = git[1] if len(git) == 2 and Path(git[0]).resolve() == source.resolve() else None
    build_info = tools.build / "common" / "build-info.cpp"  # what the build says it is
    if commit is None and build_info.is_file():
        for line in build_info.read_text().splitlines():
            if "LLAMA_COMMIT" in line and "=" in line:
                commit = line.split("=", 1)[1].strip(' ";')
    versions = subprocess.run(
        [tools.python, "-c", "import torch, transformers, numpy; print(torch.__version__, "
                             "transformers.__version__, numpy.__version__)"],
        capture_output=True, text=True, check=False).stdout.split()
    return {
        "source": f"{record.get('archive')} (vendor/llama.cpp)", "source_dir": str(source),
        "build_dir": str(tools.build), "cmake_options": record.get("cmake"),
        "llama_cpp_commit": commit,
        "converter_env": dict(zip(["torch", "transformers", "numpy"], versions)),
        "compiler": subprocess.run(["c++", "--version"], capture_output=True,
                                   text=True, check=False).stdout.splitlines()[0],
    }


# --- conversion ----------------------------------------------------------------------------------


def stamp(checkpoint: Path) -> dict:
    """What identifies a checkpoint for the cache: path, file sizes and times."""
    files = sorted(p for p in checkpoint.iterdir() if p.is_file())
    return {"source": str(checkpoint),
            "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}}


def convert(checkpoint: Path, out: Path, work: Path, types=TYPES) -> dict:
    """``out/{type}.gguf`` for each type: f32 by convert_hf_to_gguf.py (bf16 weights upcast),
    the others from it by llama-quantize. Reused while the checkpoint's files are unchanged."""
    tools = Tools(work)
    checkpoint, out = Path(checkpoint).resolve(), Path(out).resolve()
    record_file = out / "peer_source.json"
    want = {"checkpoint": stamp(checkpoint), "build": json.loads(tools.record.read_text())}
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    if record.get("checkpoint") != want["checkpoint"]:
        shutil.rmtree(out, ignore_errors=True)
        record = {}
    out.mkdir(parents=True, exist_ok=True)
    record.update(want)
    commands = record.setdefault("commands", {})
    log = out / "convert.log"
    f32 = out / "f32.gguf"
    if not f32.is_file():
        command = [tools.python, Path(__file__).resolve(), "_convert", tools.source, checkpoint,
                   "--outfile", out / "f32.tmp.gguf", "--outtype", "f32"]
        print(f"converting {checkpoint.name} to f32 GGUF ...", file=sys.stderr, flush=True)
        run(command, log)
        (out / "f32.tmp.gguf").rename(f32)
        commands["f32"] = " ".join(map(str, command))
    for kind in types:
        path = out / f"{kind}.gguf"
        if kind == "f32" or path.is_file():
            continue
        command = [tools.quantize, f32, out / f"{kind}.tmp.gguf", kind.upper(), "2"]
        print(f"quantizing {checkpoint.name} to {kind} ...", file=sys.stderr, flush=True)
        run(command, log)
        (out / f"{kind}.tmp.gguf").rename(path)
        commands[kind] = " ".join(map(str, command))
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    return {"files": {kind: str(out / f"{kind}.gguf") for kind in types},
            "bytes": {kind: (out / f"{kind}.gguf").stat().st_size for kind in types},
            "commands": commands}


def convert_child(source: Path, argv: list[str]) -> None:
    """convert_hf_to_gguf.py's main, in the converter's environment, with one change: a
    tokenizer whose BPE pre-tokenizer it does not know (the random checkpoints' small one) is
    written as "default" instead of stopping the conversion. Timing feeds token ids, so the
    pre-tokenizer never runs."""
    import runpy

    sys.path[:0] = [str(source), str(source / "gguf-py")]
    from conversion import base  # the vendored converter's package

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            print("peer_llamacpp: unknown BPE pre-tokenizer, written as 'default'",
                  file=sys.stderr)
            return "default"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *argv]
    runpy.run_path(str(source / "convert_hf_to_gguf.py"), run_name="__main__")


# --- timing --------------------------------------------------------------------------------------


def time_command(work: Path, gguf: Path, threads: int, context: int, steps: int,
                 lengths: list[int], seed: int = 0) -> list[str]:
    return [str(Tools(work).steps), str(gguf), str(threads), str(context), str(steps),
            ",".join(map(str, lengths)), str(seed)]


def time_model(work: Path, gguf: Path, threads: int, context: int, steps: int,
               lengths: list[int], seed: int = 0) -> dict:
    """Run llama-steps; its JSON (ms lists per run length) with load_s added."""
    command = time_command(work, gguf, threads, context, steps, lengths, seed)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"error: llama-steps failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout)
    result["load_s"] = result.pop("load_ms") / 1e3
    result["command"] = command
    return result


def main(argv: list[str]) -> None:
    if argv[:1] == ["_convert"]:  # in the converter's environment
        convert_child(Path(argv[1]), argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("build/peers-side"),
                        help="source, build and converter environment (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("setup", help="download, build, make the converter's environment")
    make.add_argument("--jobs", type=int, default=2)
    conv = sub.add_parser("convert", help="a checkpoint to GGUF f32, q8_0 and q4_0")
    conv.add_argument("checkpoint", type=Path)
    conv.add_argument("out", type=Path)
    conv.add_argument("--types", default=",".join(TYPES))
    timed = sub.add_parser("time", help="ms of runs with logits at every position")
    timed.add_argument("gguf", type=Path)
    timed.add_argument("--threads", type=int, default=os.cpu_count())
    timed.add_argument("--context", type=int, default=256)
    timed.add_argument("--steps", type=int, default=10)
    timed.add_argument("--lengths", default="1,2,3,5,9")
    timed.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.command == "setup":
        print(json.dumps(setup(args.work, args.jobs), indent=2))
    elif args.command == "convert":
        print(json.dumps(convert(args.checkpoint, args.out, args.work,
                                 [t for t in args.types.split(",") if t]), indent=2))
    else:
        started = time.perf_counter()
        result = time_model(args.work, args.gguf, args.threads, args.context, args.steps,
                            [int(n) for n in args.lengths.split(",")])
        result["wall_s"] = time.perf_counter() - started
        text = json.dumps(result, indent=2)
        if args.json:
            args.json.write_text(text + "\n")
        print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
