"""Random checkpoints with the public shapes of the pairs users bring, and edgespec on them.

``run`` gives per pair and variant: export time and memory, package size, load time and memory,
step costs, the loop's sampling cost and the expected speedup (benchmarks/README.md).

No hub is reachable here, so the weights are random; the configs (sizes, vocabulary, tied
embeddings, rope, context) are those the public checkpoints declare, and the weights are saved
in bf16 as they ship. The tokenizer is a small byte-level BPE: the exporter only needs it to
fit in the vocabulary, and random weights make its merges irrelevant.

    python benchmarks/real_shapes.py make qwen2.5-1.5b build/shapes/qwen2.5-1.5b
    python benchmarks/real_shapes.py run --make                  # every pair, fp32 and int4
    python benchmarks/real_shapes.py run --pairs smollm2-135m:smollm2-360m --repeats 1

``run`` keeps torch out of its own process and each figure to one process: checkpoints are
made (``make``) and packages exported (``edgespec export``) in child processes, and every
measurement loads the package in a fresh child (``measure``), whose own peak memory comes from
a small launcher and os.wait4 (RUSAGE_CHILDREN would give the largest of all children so far).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from edgespec.runtime.schedule import StepCosts
from edgespec.runtime.schedule import best_k as schedule_best_k

if TYPE_CHECKING:
    import torch

# Public config.json values (hidden, intermediate, layers, heads, KV heads, vocabulary, tied
# embeddings, context, rope theta).
def _qwen2(hidden, intermediate, layers, heads, kv_heads, vocab=151936, tied=True) -> dict:
    return dict(model_type="qwen2", hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=32768,
                rope_theta=1000000.0, rms_norm_eps=1e-6)


def _llama3(hidden, intermediate, layers, heads, tied, rope_factor) -> dict:
    return dict(model_type="llama", hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                vocab_size=128256, tie_word_embeddings=tied, max_position_embeddings=131072,
                rope_theta=500000.0, rms_norm_eps=1e-5,
                rope_scaling={"factor": rope_factor, "high_freq_factor": 4.0,
                              "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
                              "rope_type": "llama3"})


def _qwen3(hidden, intermediate, layers, heads, tied) -> dict:
    """Qwen3's dense configs (https://huggingface.co/Qwen/Qwen3-{0.6B,1.7B,4B,8B}, config.json;
    the same figures in Lightning-AI/litgpt's litgpt/config.py): 8 KV heads of head_dim 128
    whatever hidden / heads is, q/k norms, tied embeddings up to 4B."""
    return dict(model_type="qwen3", hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                head_dim=128, vocab_size=151936, tie_word_embeddings=tied,
                max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)


def _smollm2(hidden, intermediate, layers, heads, kv_heads) -> dict:
    return dict(model_type="llama", hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
                rope_theta=100000.0, rms_norm_eps=1e-5)


SHAPES = {
    "smollm2-135m": _smollm2(576, 1536, layers=30, heads=9, kv_heads=3),
    "smollm2-360m": _smollm2(960, 2560, layers=32, heads=15, kv_heads=5),
    "qwen2.5-0.5b": _qwen2(896, 4864, layers=24, heads=14, kv_heads=2),
    "qwen2.5-1.5b": _qwen2(1536, 8960, layers=28, heads=12, kv_heads=2),
    "qwen2.5-3b": _qwen2(2048, 11008, layers=36, heads=16, kv_heads=2),
    "qwen2.5-7b": _qwen2(3584, 18944, layers=28, heads=28, kv_heads=4, vocab=152064, tied=False),
    "qwen3-0.6b": _qwen3(1024, 3072, layers=28, heads=16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, layers=28, heads=16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, layers=36, heads=32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, layers=36, heads=32, tied=False),
    "llama-3.2-1b": _llama3(2048, 8192, layers=16, heads=32, tied=True, rope_factor=32.0),
    "llama-3.2-3b": _llama3(3072, 8192, layers=28, heads=24, tied=True, rope_factor=32.0),
    "llama-3.1-8b": _llama3(4096, 14336, layers=32, heads=32, tied=False, rope_factor=8.0),
}
SHARD_BYTES = 2 * 10**9  # a checkpoint is written in shards of about this size
_ROWS = 4096  # rows of a tensor drawn at a time (bounds the float32 temporary)


def make_checkpoint(name: str, out: Path, seed: int = 0) -> Path:
    """Save a random ``name``-shaped model (bf16) with a small tokenizer into ``out``.

    Written shard by shard, a tensor at a time, as from_pretrained's initialisation draws
    them (Linear and Embedding weights normal(0, 0.02), norms 1, biases 0): the whole model
    is never in memory, so a 7B-8B checkpoint is made in ~2 GB. The names and shapes come
    from the model's modules on the meta device.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    shape = dict(SHAPES[name])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape, bos_token_id=0,
                                  eos_token_id=0, pad_token_id=0, initializer_range=0.02,
                                  dtype="bfloat16")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = skeleton.state_dict()  # a tied output layer is the embedding: saved once
    if skeleton.get_output_embeddings().weight is skeleton.get_input_embeddings().weight:
        names.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict] = [{}]  # tensors of the shard being filled; names only once written
    filled = total = 0
    for tensor_name, meta in names.items():
        size = meta.numel() * 2
        if filled and filled + size > SHARD_BYTES:
            _save_shard(shards, out, save_file)
            shards.append({})
            filled = 0
        shards[-1][tensor_name] = _draw(tensor_name, meta.shape, generator)
        filled, total = filled + size, total + size
    _save_shard(shards, out, save_file)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, file in enumerate(files):  # named once the count is known
        (out / f"shard-{i}.safetensors").rename(out / file)
    weight_map = {tensor: files[i] for i, shard in enumerate(shards) for tensor in shard}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0).save_pretrained(out)
    _save_tokenizer(out)
    return out


def _draw(name: str, shape, generator) -> "torch.Tensor":
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    tensor = torch.empty(shape, dtype=torch.bfloat16)
    for start in range(0, shape[0], _ROWS):
        rows = tensor[start : start + _ROWS]
        rows.copy_(torch.randn(rows.shape, generator=generator).mul_(0.02))
    return tensor


def _save_shard(shards: list[dict], out: Path, save_file) -> None:
    """Write the last shard (as shard-<i>) and drop its tensors, keeping their names."""
    i = len(shards) - 1
    save_file(shards[i], str(out / f"shard-{i}.safetensors"), metadata={"format": "pt"})
    shards[i] = dict.fromkeys(shards[i])


# The tokenizer's training text: fixed, so that checkpoints made at different times pair (it was
# this script's own text, so a checkpoint made after an edit of the script did not pair with one
# made before; copy tokenizer*.json and special_tokens_map.json from one of those to pair them).
TOKENIZER_TEXT = [
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)\nprint(x.shape)\n",
    "The quick brown fox jumps over the lazy dog. One, two, three, four, five.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
]


def _save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TOKENIZER_TEXT * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>", pad_token="<|endoftext|>").save_pretrained(out)


# --- what is run -------------------------------------------------------------------------------

# export flags per variant: int4 / int8 let export pick the target's compute and run shape
# (export/runs.py); -float and -int8 fix the compute (-float: as before that choice existed)
VARIANT_FLAGS = {"fp32": [], "int8": ["--quantize", "int8"], "int4": ["--quantize", "int4"],
                 "int4-float": ["--quantize", "int4", "--target-compute", "float"],
                 "int4-int8": ["--quantize", "int4", "--target-compute", "int8"]}
SELF_VARIANT = "fp32+int4"  # self-speculation: the target fp32, the same checkpoint int4 as draft
ALPHAS = (0.6, 0.7, 0.8)
KMAX = 8  # k = 1..KMAX drafted tokens per round; the target is timed on 1..KMAX+1 tokens
PROMPT = "def fibonacci(n):\n    "
SAMPLINGS = {  # name -> generate() settings; the names are the JSON's keys
    "greedy": {"temperature": 0.0},
    "T0.7 top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
}


@dataclass(frozen=True)
class Pair:
    """A draft and a target, SHAPES names. The same name twice is self-speculation: one row,
    the target exported fp32 and the same checkpoint exported int4 as the draft."""

    draft: str
    target: str

    @property
    def is_self(self) -> bool:
        return self.draft == self.target

    @property
    def name(self) -> str:
        return self.target if self.is_self else f"{self.draft}:{self.target}"

    def variants(self, asked: list[str]) -> list[str]:
        return [SELF_VARIANT] if self.is_self else asked


PAIRS = (Pair("smollm2-135m", "smollm2-360m"), Pair("qwen2.5-0.5b", "qwen2.5-1.5b"),
         Pair("llama-3.2-1b", "llama-3.2-1b"))


def parse_pairs(text: str) -> list[Pair]:
    """``DRAFT:TARGET`` or ``NAME`` (self-speculation), comma-separated."""
    pairs = [Pair(*item.split(":", 1)) if ":" in item else Pair(item, item)
             for item in text.split(",") if item.strip()]
    unknown = {n for p in pairs for n in (p.draft, p.target)} - set(SHAPES)
    if unknown or not pairs:
        sys.exit(f"error: --pairs takes DRAFT:TARGET or NAME from {', '.join(SHAPES)}; "
                 f"got {text!r}")
    return pairs


@dataclass(frozen=True)
class Setting:
    """How one measuring child loads the package, and what it times.

    draft_threads: 0 is every core. The target always has every core.
    """

    name: str
    draft_threads: int
    target_spin: bool
    target_tokens: tuple[int, ...]  # the target is timed on each of these numbers of tokens
    sampling: bool  # also time the loop's sampling in generate()


SETTINGS = (
    # a tiny draft's defaults (providers.default_session_configs): target spinning, draft on 1
    # thread; the costs of every run length and the sampling are measured here
    Setting("default", 1, True, tuple(range(1, KMAX + 2)), True),
    # a large draft's defaults: the draft on every core, not spinning, the target spinning
    Setting("draft-all-cores", 0, True, (1,), False),
    # both on every core, neither spinning (the draft's step when nothing spins beside it)
    Setting("target-no-spin", 0, False, (1,), False),
)


# --- child processes ---------------------------------------------------------------------------

RSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux


@dataclass
class Child:
    seconds: float
    peak_bytes: int  # this child's peak resident memory (and its own children's)
    returncode: int


# Linux keeps a process's peak memory across exec, and a child forked from this (large) process
# starts with this process's pages counted: so the command is started by a small launcher,
# which forks it from its own small image and writes its peak (ru_maxrss) to a file.
_LAUNCHER = """import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as peak:
    peak.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_child(command: list[str], log: Path) -> Child:
    """Run ``command`` with its output in ``log``; its wall time and its own peak memory."""
    log.parent.mkdir(parents=True, exist_ok=True)
    peak = log.with_suffix(".peak")
    with open(log, "wb") as out:
        start = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(peak), *command],
                                   stdout=out, stderr=subprocess.STDOUT)
        try:
            returncode = process.wait()
        except BaseException:  # Ctrl-C reached the child too: let it clean up (export does)
            process.terminate()
            process.wait()
            raise
        seconds = time.perf_counter() - start
    peak_bytes = int(peak.read_text()) * RSS_UNIT if peak.exists() else 0
    return Child(seconds, peak_bytes, returncode)


class Skipped(Exception):
    """A pair that cannot be measured; the message says why and what to do."""


def failed(what: str, child: Child, log: Path) -> Skipped:
    tail = log.read_text(errors="replace").strip().splitlines()[-5:]
    return Skipped(f"{what} failed (exit {child.returncode}); {log} ends:\n    "
                   + "\n    ".join(tail))


# --- checkpoints and packages ------------------------------------------------------------------


def checkpoint(name: str, folder: Path, make: bool, logs: Path) -> Path:
    """The checkpoint folder of ``name``, made in a child process if asked and missing."""
    path = folder / name
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():  # saved last
        return path
    if not make:
        raise Skipped(f"no checkpoint {path}; pass --make, or: "
                      f"python {__file__} make {name} {path}")
    print(f"  making {path} ...", flush=True)
    log = logs / f"make-{name}.log"
    child = run_child([sys.executable, __file__, "make", name, str(path)], log)
    if child.returncode:
        raise failed(f"making {name}", child, log)
    return path


def export(pair: Pair, variant: str, checkpoints: dict[str, Path], folder: Path,
           args, logs: Path) -> dict:
    """Export one package with ``edgespec export`` in a child; its time and peak memory.

    A package that an earlier run exported with the same command (its record beside it) is
    reused, unless --reexport.
    """
    command = [sys.executable, "-m", "edgespec", "export", "--target",
               str(checkpoints[pair.target]), "--draft", str(checkpoints[pair.draft]),
               "--out", str(folder), "--overwrite", "--validate", args.validate]
    command += VARIANT_FLAGS[variant]
    record_path = folder.with_name(folder.name + ".export.json")
    if not args.reexport and record_path.is_file() and (folder / "edgespec.json").is_file():
        record = json.loads(record_path.read_text())
        if record["command"] == command:
            print(f"  {folder.name}: exported by an earlier run, reused", flush=True)
            return record
    print(f"  exporting {folder.name} ...", flush=True)
    log = logs / f"export-{folder.name}.log"
    child = run_child(command, log)
    if child.returncode:
        raise failed(f"exporting {folder.name}", child, log)
    record = {"seconds": child.seconds, "peak_bytes": child.peak_bytes, "command": command,
              "validation_failures": validation_failures(folder)}
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"    {child.seconds:.0f} s, peak {child.peak_bytes / 2**30:.1f} GiB", flush=True)
    return record


def validation_failures(package: Path) -> dict[str, list[str]]:
    """What ``--validate report`` recorded as failed, per model."""
    from edgespec.manifest import Manifest

    manifest = Manifest.read(package)
    return {role: getattr(manifest, role).validation.get("failures", [])
            for role in ("target", "draft")}


def assemble_self(fp32: Path, int4: Path, out: Path) -> Path:
    """One package: the target of ``fp32`` and the draft of ``int4`` (same checkpoint).

    Both were exported as (checkpoint, checkpoint) pairs; the model folders are hard-linked (no
    copy of the weights; Manifest.read refuses symbolic links out of a package) and the
    manifests combined. Made afresh each run: a re-export replaces the files it would link.
    """
    from edgespec.manifest import Manifest

    target, draft = Manifest.read(fp32), Manifest.read(int4)
    if out.exists():
        remove_assembled(out)
    out.mkdir(parents=True)
    for source, spec in ((fp32, target.target), (int4, draft.draft)):
        folder = Path(spec.path).parent  # the model's folder in both packages
        shutil.copytree(source / folder, out / folder, copy_function=link_or_copy)
    shutil.copy2(fp32 / target.tokenizer, out / target.tokenizer)
    replace(target, draft=draft.draft).write(out)
    return out


def link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # another file system
        shutil.copy2(source, destination)


def remove_assembled(folder: Path) -> None:
    """Remove a package this script assembled before; refuse a folder holding anything else."""
    from edgespec.manifest import MANIFEST_NAME, PACKAGE_ENTRIES

    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    if MANIFEST_NAME not in names or names - PACKAGE_ENTRIES:
        raise Skipped(f"{folder} exists and is not a package this script made; move it away")
    shutil.rmtree(folder)


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def package_bytes(package: Path) -> dict[str, int]:
    """Bytes on disk of each model's folder in the package."""
    from edgespec.manifest import Manifest

    manifest = Manifest.read(package)
    return {role: tree_bytes(package / Path(getattr(manifest, role).path).parent)
            for role in ("target", "draft")}


# --- one measuring child: load, step costs, sampling --------------------------------------------


def resident_bytes() -> int:
    """Resident memory of this process now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RSS_UNIT


def anonymous_bytes() -> int:
    """This process's anonymous resident memory (Linux RssAnon; 0 elsewhere): what the system
    cannot take back without swap. File-backed pages are the rest of RSS, e.g. the int4 scales
    onnxruntime keeps mapped after packing them for int8 compute (x86)."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("RssAnon:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return 0


def measure(package: Path, setting: Setting, context: int, steps: int,
            sampling_tokens: int) -> dict:
    """Load ``package`` as ``setting`` says and time it; every time in milliseconds."""
    import edgespec
    from edgespec.runtime.providers import SessionConfig

    cores = os.cpu_count() or 1
    target = SessionConfig("cpu", threads=cores, spin=setting.target_spin)
    draft = SessionConfig("cpu", threads=setting.draft_threads or cores)
    before = resident_bytes()
    start = time.perf_counter()
    pipe = edgespec.load(package, target=target, draft=draft, prefix_cache_slots=0)  # cold runs
    result = {"setting": asdict(setting), "cores": cores, "draft_threads": draft.threads,
              "load_s": time.perf_counter() - start, "rss_before_load": before,
              "rss_after_load": resident_bytes(), "rss_anon_after_load": anonymous_bytes()}
    result.update(time_steps(pipe, context, steps, setting.target_tokens))
    if setting.sampling and sampling_tokens:
        result["sampling"] = {name: sampling_costs(pipe, sampling_tokens, KMAX, settings)
                              for name, settings in SAMPLINGS.items()}
    result["rss_at_end"] = resident_bytes()
    return result


def time_steps(pipe, context: int, steps: int, target_tokens: tuple[int, ...]) -> dict:
    """Milliseconds of target runs on n tokens (each n in target_tokens) and of draft steps.

    All after the same ``context`` random tokens (each run's positions cropped off again, as
    a rejected round does), interleaved: one of each per step, in the order a round runs them;
    one untimed step first.
    """
    import numpy as np

    longest = max(target_tokens)
    ids = np.random.default_rng(0).integers(0, pipe.manifest.vocab_size, context + longest)
    runs = [(pipe.target, n, f"target_{n}") for n in target_tokens] + [(pipe.draft, 1, "draft_1")]
    caches = {}
    for session in (pipe.target, pipe.draft):
        caches[id(session)] = session.new_cache(context + longest)
        session.forward(ids[:context], caches[id(session)])
    times = {name: [] for _, _, name in runs}
    for step in range(steps + 1):
        for session, n, name in runs:
            cache = caches[id(session)]
            start = time.perf_counter()
            session.forward(ids[context : context + n], cache)
            elapsed = time.perf_counter() - start
            cache.crop(context)
            if step:
                times[name].append(1e3 * elapsed)
    return {"target_ms": {n: times[f"target_{n}"] for n in target_tokens},
            "draft_ms": times["draft_1"]}


def sampling_costs(pipe, tokens: int, draft_length: int, settings: dict) -> dict:
    """The loop's NumPy time (GenerationStats.sampling_s): per round drafting ``draft_length``, and
    per token of target-only decoding; so it measures whatever sampler the loop uses."""
    common = dict(max_new_tokens=tokens, ignore_eos=True, seed=0, **settings)
    spec = pipe.generate(PROMPT, draft_length=draft_length, schedule="fixed", **common).stats
    base = pipe.generate(PROMPT, drafter="none", **common).stats
    return {
        "per_round_ms": 1e3 * spec.sampling_s / spec.rounds,
        # a round of k processes about k draft rows and k+1 target rows: per row of (k + 1)
        "per_row_ms": 1e3 * spec.sampling_s / (spec.drafted + spec.rounds),
        "per_token_ms": 1e3 * base.sampling_s / base.new_tokens,
        "rounds": spec.rounds, "drafted": spec.drafted, "alpha": spec.alpha,
        "speculative_tokens_per_s": spec.tokens_per_s, "target_tokens_per_s": base.tokens_per_s,
    }


def measure_in_child(package: Path, setting: Setting, args, sampling_tokens: int,
                     log: Path) -> dict:
    """``measure`` in a fresh process; its result with the child's peak memory."""
    out = log.with_suffix(".json")
    command = [sys.executable, __file__, "measure", str(package), "--setting", setting.name,
               "--context", str(args.context), "--steps", str(args.steps),
               "--sampling-tokens", str(sampling_tokens), "--json", str(out)]
    child = run_child(command, log)
    if child.returncode:
        raise failed(f"measuring {package.name} ({setting.name})", child, log)
    return {**json.loads(out.read_text()), "peak_bytes": child.peak_bytes}


# --- from measurements to figures --------------------------------------------------------------


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def pooled_median(lists) -> float:
    """The median of every value in ``lists`` (the timed runs of several children)."""
    return median(value for values in lists for value in values)


def costs(runs: dict[str, list[dict]]) -> dict:
    """Medians over every timed run of every child of a setting; milliseconds.

    target_ms[n]: the target on n tokens (n = 1: a step; k+1: verifying k), default setting.
    """
    default, every = runs["default"], [r for rs in runs.values() for r in rs]
    figures = {
        "target_ms": {int(n): pooled_median(r["target_ms"][n] for r in default)
                      for n in default[0]["target_ms"]},
        "target_step_no_spin_ms": pooled_median(r["target_ms"]["1"]
                                                for r in runs["target-no-spin"]),
        "draft_step_ms": {"1": pooled_median(r["draft_ms"] for r in default),
                          "all": pooled_median(r["draft_ms"] for r in runs["draft-all-cores"])},
        "draft_step_no_spin_ms": pooled_median(r["draft_ms"] for r in runs["target-no-spin"]),
        "load_s": median(r["load_s"] for r in every),
        "rss_after_load": median(r["rss_after_load"] for r in every),
        "rss_anon_after_load": median(r.get("rss_anon_after_load", 0) for r in every),
        "peak_bytes": max(r["peak_bytes"] for r in every),
        "children": {name: len(rs) for name, rs in runs.items()},
    }
    sampled = [r["sampling"] for r in default if "sampling" in r]
    if sampled:
        figures["sampling"] = {name: {key: median(s[name][key] for s in sampled)
                                      for key in sampled[0][name]} for name in SAMPLINGS}
    return figures


def best_k(alpha: float, draft_ms: float, target_ms: dict[int, float], row_sampling_ms: float,
           token_sampling_ms: float) -> tuple[int, float]:
    """The k in 1..KMAX with the largest expected speedup, and that speedup: the runtime's cost
    model (edgespec/runtime/schedule.py) with the sampling of the n rows a target run on n
    tokens yields counted in that run, against a target step and its sampling per token."""
    costs = StepCosts(draft_ms, tuple(target_ms[n] + n * row_sampling_ms
                                      for n in range(1, KMAX + 2)))
    k = schedule_best_k(costs, alpha, kmin=1)
    return k, costs.tokens_per_ms(alpha, k) * (target_ms[1] + token_sampling_ms)


NO_SAMPLING = {"sampling not timed": {"per_row_ms": 0.0, "per_token_ms": 0.0}}


def speedups(figures: dict) -> dict:
    """[sampling][draft threads][alpha]: the best k and its expected speedup."""
    return {name: {threads: {str(alpha): best_k(alpha, draft_ms, figures["target_ms"],
                                                sampling["per_row_ms"], sampling["per_token_ms"])
                             for alpha in ALPHAS}
                   for threads, draft_ms in figures["draft_step_ms"].items()}
            for name, sampling in (figures.get("sampling") or NO_SAMPLING).items()}


# --- one pair ----------------------------------------------------------------------------------


def package_folder(root: Path, pair: Pair, variant: str) -> Path:
    name = pair.target if pair.is_self else f"{pair.draft}--{pair.target}"
    return root / f"{name}--{variant}"


def run_pair(pair: Pair, args) -> dict:
    """Checkpoints, exports, measurements and figures of one pair, one row per variant."""
    logs = args.out / "logs"
    checkpoints = {name: checkpoint(name, args.checkpoints, args.make, logs)
                   for name in {pair.draft, pair.target}}
    result = {"checkpoint_bytes": {n: checkpoint_bytes(p) for n, p in checkpoints.items()},
              "checkpoints": {n: str(p) for n, p in checkpoints.items()}, "rows": {}}
    measured = {}
    for variant in pair.variants(args.variants):
        exports, package = export_row(pair, variant, checkpoints, args, logs)
        result["rows"][variant] = {"package": str(package), "exports": exports,
                                   "package_bytes": package_bytes(package)}
        measured[variant] = package
    runs = measure_interleaved(measured, args, logs)
    for variant, row in result["rows"].items():
        row["runs"] = runs[variant]
        row["figures"] = costs(runs[variant])
        row["expected"] = speedups(row["figures"])
    return result


def export_row(pair: Pair, variant: str, checkpoints: dict, args, logs: Path):
    """The export records of a row and the package to measure.

    Self-speculation: the (checkpoint, checkpoint) pair exported fp32 and int4, and a package
    made of the fp32 target and the int4 draft.
    """
    root = args.out / "packages"
    if not pair.is_self:
        folder = package_folder(root, pair, variant)
        return {variant: export(pair, variant, checkpoints, folder, args, logs)}, folder
    folders = {v: package_folder(root, pair, v) for v in ("fp32", "int4")}
    exports = {v: export(pair, v, checkpoints, f, args, logs) for v, f in folders.items()}
    return exports, assemble_self(folders["fp32"], folders["int4"],
                                  package_folder(root, pair, SELF_VARIANT))


def measure_interleaved(packages: dict[str, Path], args, logs: Path) -> dict:
    """``--repeats`` rounds, each a child per package and setting, so drift hits all alike.

    The sampling (generate(), the slowest part) is timed in the first --sampling-repeats rounds.
    """
    runs = {v: {s.name: [] for s in SETTINGS} for v in packages}
    for repeat in range(args.repeats):
        tokens = args.sampling_tokens if repeat < args.sampling_repeats else 0
        for variant, package in packages.items():
            for setting in SETTINGS:
                print(f"  measuring {package.name}, {setting.name} ({repeat + 1}/{args.repeats})",
                      flush=True)
                log = logs / f"measure-{package.name}-{setting.name}-{repeat}.log"
                runs[variant][setting.name].append(
                    measure_in_child(package, setting, args, tokens, log))
    return runs


# --- report --------------------------------------------------------------------------------------


def machine() -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    import common  # benchmarks/common.py: platform, CPU model, load average

    info = common.machine_info()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    info["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    info["versions"] = common.versions(["edgespec", "onnxruntime", "numpy", "torch",
                                        "transformers", "optimum-onnx", "onnx"])
    return info


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _pair(*values: str) -> str:
    return " / ".join(values)


def cost_row(pair: Pair, variant: str, pair_result: dict) -> str:
    row, ckpt = pair_result["rows"][variant], pair_result["checkpoint_bytes"]
    f, exports = row["figures"], row["exports"]
    t = f["target_ms"]
    sampling = f.get("sampling", {})
    cells = [
        pair.name, variant,
        " + ".join(f"{e['seconds']:.0f}" for e in exports.values()),
        _pair(*(_gib(e["peak_bytes"]) for e in exports.values())),
        _pair(_mib(ckpt[pair.draft]), _mib(ckpt[pair.target])),
        _pair(_mib(row["package_bytes"]["draft"]), _mib(row["package_bytes"]["target"])),
        f"{f['load_s']:.1f}", _gib(f["rss_after_load"]), _gib(f["peak_bytes"]),
        _pair(f"{t[1]:.1f}", f"{f['target_step_no_spin_ms']:.1f}"),
        _pair(f"{t[5]:.1f}", f"{t[9]:.1f}"),
        _pair(f"{f['draft_step_ms']['1']:.1f}", f"{f['draft_step_ms']['all']:.1f}"),
        _pair(*(f"{sampling[n]['per_round_ms']:.2f}" for n in sampling)) or "-",
        _pair(*(f"{sampling[n]['per_token_ms']:.2f}" for n in sampling)) or "-",
    ]
    return "| " + " | ".join(cells) + " |"


COST_HEADER = [
    "pair (draft:target)", "variant", "export s", "export peak GiB",
    "bf16 checkpoint MiB (draft / target)", "package MiB (draft / target)", "load s",
    "RSS after load GiB", "peak RSS GiB", "target step ms (spin / no spin)",
    "verify ms (k=4 / k=8)", "draft step ms (1 thread / all cores)",
    "sampling ms per round, k=8 (greedy / T0.7 top-p 0.9)",
    "sampling ms per target-only token (greedy / T0.7 top-p 0.9)",
]


def speedup_rows(pair: Pair, variant: str, expected: dict) -> list[str]:
    """A row per sampling: the best k's speedup at each alpha, draft on 1 thread then all."""
    lines = []
    for name, by_threads in expected.items():
        cells = [pair.name, variant, name] + [
            f"{speedup:.2f}x (k={k})" for threads in ("1", "all")
            for k, speedup in (by_threads[threads][str(alpha)] for alpha in ALPHAS)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


SPEEDUP_HEADER = ["pair (draft:target)", "variant", "sampling",
                  *(f"alpha {a}, draft 1 thread" for a in ALPHAS),
                  *(f"alpha {a}, draft all cores" for a in ALPHAS)]


def markdown(results: dict, pairs: list[Pair], info: dict) -> str:
    """The two tables for RESULTS.md: costs per pair and variant, then expected speedups."""
    done = [(p, v) for p in pairs if p.name in results.get("pairs", {})
            for v in results["pairs"][p.name]["rows"]]
    header = lambda names: ["| " + " | ".join(names) + " |",  # noqa: E731
                            "|" + "---|" * len(names)]
    costs_table = header(COST_HEADER) + [cost_row(p, v, results["pairs"][p.name]) for p, v in done]
    speed_table = header(SPEEDUP_HEADER) + [
        line for p, v in done
        for line in speedup_rows(p, v, results["pairs"][p.name]["rows"][v]["expected"])]
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    return "\n".join([
        f"{info.get('cpu_model', info['machine'])}, {info['cpu_count']} cores, "
        f"{_gib(info.get('memory_bytes', 0))} GiB; {versions}; {info['date']}",
        "",
        *costs_table,
        "",
        "Expected speedup at the best k in 1..8 (Leviathan et al.: (1 - a^(k+1)) / (1 - a) "
        "tokens per round of k draft steps + the target on k+1 tokens + the sampling of k+1 "
        "rows, against a target step + its sampling per token)",
        "",
        *speed_table,
    ])


NOTES = [
    "Random bf16 weights with the public configs; exported by `edgespec export` (fused graph "
    "where the model allows it), one child process per export, whose peak memory is its own.",
    f"{SELF_VARIANT}: self-speculation. The checkpoint is exported twice as a (checkpoint, "
    "checkpoint) pair, fp32 and int4 (each package holds the model twice, so its export time "
    "is that of both graphs); the measured package hard-links the fp32 package's target and "
    "the int4 package's draft.",
    "Load and memory: a fresh child per measurement (package files in the page cache). RSS "
    "after load: edgespec.load() done, nothing run; peak RSS: the measuring child's peak.",
    "Step costs: medians over every timed run, after a context of --context random tokens, "
    "each run's tokens cropped off again; target every core spinning, draft 1 thread "
    "(edgespec's defaults) unless the column says otherwise.",
    "Sampling: GenerationStats.sampling_s of pipe.generate(max_new_tokens=--sampling-tokens, "
    f"draft_length={KMAX}, schedule='fixed', ignore_eos=True), in the first "
    "--sampling-repeats repeats: per round (sampling_s / rounds, what the table shows) and per "
    "row (sampling_s / (drafted + rounds)); the expected speedup charges a round of k with "
    "k+1 rows. Random weights give flat distributions: top-p keeps most of the vocabulary, "
    "more than a trained model would.",
]


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_shapes.json").write_text(json.dumps(results, indent=2) + "\n")


# --- command line ------------------------------------------------------------------------------


def run(args) -> None:
    pairs = parse_pairs(args.pairs)
    results = {"command": [sys.executable, *sys.argv], "machine": machine(), "notes": NOTES,
               "settings": {k: str(v) for k, v in vars(args).items()},
               "pairs": {}, "skipped": {}}
    load = results["machine"].get("load_average_at_start", [0])[0]
    if load > 0.5:
        print(f"the machine is busy (load average {load:.1f}): the timings will be noisy")
    for pair in pairs:
        print(f"{pair.name}:", flush=True)
        started = time.perf_counter()
        try:
            results["pairs"][pair.name] = run_pair(pair, args)
            results["pairs"][pair.name]["seconds"] = time.perf_counter() - started
        except Skipped as e:
            print(f"  skipped: {e}", flush=True)
            results["skipped"][pair.name] = str(e)
        write(results, args.out)
    if hasattr(os, "getloadavg"):
        results["machine"]["load_average_at_end"] = os.getloadavg()
        write(results, args.out)
    if not results["pairs"]:
        sys.exit(f"nothing measured; see above (and {args.out / 'real_shapes.json'})")
    table = markdown(results, pairs, results["machine"])
    (args.out / "real_shapes.md").write_text(table + "\n")
    print(f"\n{table}\n\nwrote {args.out / 'real_shapes.json'} and {args.out / 'real_shapes.md'}")
    for name, why in results["skipped"].items():
        print(f"skipped {name}: {why.splitlines()[0]}")


# --- EAGLE-3 heads: the head's step against the target's and a draft model's ------------------

EAGLE_DRAFT_VOCAB = 32000  # the published Llama-3.1-8B head's (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)


def make_head(target: Path, out: Path, draft_vocab: int) -> Path:
    """A random EAGLE-3 head for the checkpoint ``target`` (export/eagle3.py's writer, bf16 as
    heads ship), scoring ``draft_vocab`` of its tokens."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from edgespec.export.eagle3 import D2T, T2D, write_random_head

    write_random_head(out, AutoConfig.from_pretrained(target), draft_vocab=draft_vocab)
    weights = load_file(str(out / "model.safetensors"))
    save_file({k: v if k in (D2T, T2D) else v.to(torch.bfloat16) for k, v in weights.items()},
              str(out / "model.safetensors"))
    return out


def eagle_steps(package: Path, context: int, steps: int, threads: int = 0) -> dict:
    """Median ms of one-token runs after ``context`` tokens: the target's, and the draft's
    (a head's with a row of features, as the chain runs it). ``threads``: each session's
    (0: onnxruntime's default, every core)."""
    import numpy as np

    import edgespec
    from edgespec.runtime.providers import SessionConfig

    config = SessionConfig("cpu", threads=threads)
    pipe = edgespec.load(package, target=config, draft=config, calibration_cache=False)
    ids = np.random.default_rng(0).integers(0, pipe.manifest.vocab_size, context + steps + 1)
    result = {}
    for role, session in (("target", pipe.target), ("draft", pipe.draft)):
        cache = session.new_cache(context + steps + 2)

        def features(n):
            return (np.zeros((n, session.feature_size), np.float32) if session.reads_features
                    else None)

        session.forward_rows(ids[:context], cache, features(context))
        times = []
        for i in range(steps + 1):  # the first pays for allocations: dropped
            start = time.perf_counter()
            session.forward_rows(ids[context + i : context + i + 1], cache, features(1))
            times.append(time.perf_counter() - start)
            cache.crop(context)
        result[f"{role}_step_ms"] = 1e3 * statistics.median(times[1:])
    result["draft_parameters"] = pipe.manifest.draft.parameters
    return result


def eagle_command(args) -> None:
    """Export (int4) the target with a random head and, if given, with a draft model; time
    the steps of each in a fresh child, side by side; print c = draft step / target step."""
    out, logs = args.out, args.out / "logs"
    names = [args.target, *([args.draft] if args.draft else [])]
    checkpoints = {n: checkpoint(n, args.checkpoints, args.make, logs) for n in names}
    head = out / f"head-{args.target}"
    if not (head / "config.json").is_file():
        child = run_child([sys.executable, __file__, "make-head", str(checkpoints[args.target]),
                           str(head), "--draft-vocab", str(args.draft_vocab)], logs / "head.log")
        if child.returncode:
            raise failed("making the head", child, logs / "head.log")
    drafts = {"eagle3": head, **({args.draft: checkpoints[args.draft]} if args.draft else {})}
    results = {"uptime": os.getloadavg(), "context": args.context, "steps": args.steps,
               "threads": args.threads}
    packages = {name: out / "packages" / f"{args.target}+{name}-int4" for name in drafts}
    for name, draft in drafts.items():
        package = packages[name]
        if not (package / "edgespec.json").is_file():
            command = [sys.executable, "-m", "edgespec", "export", "--target",
                       str(checkpoints[args.target]), "--draft", str(draft), "--out", str(package),
                       "--quantize", "int4", "--target-compute", "float", "--validate", "skip"]
            child = run_child(command, logs / f"export-{name}.log")
            if child.returncode:
                raise failed(f"exporting {name}", child, logs / f"export-{name}.log")
    runs: dict[str, list] = {name: [] for name in drafts}
    for _ in range(args.repeats):  # interleaved: the machine's load drifts over both alike
        for name, package in packages.items():
            json_out = logs / f"steps-{name}.json"
            child = run_child([sys.executable, __file__, "eagle-steps", str(package),
                               "--context", str(args.context), "--steps", str(args.steps),
                               "--threads", str(args.threads), "--json", str(json_out)],
                              logs / f"steps-{name}.log")
            if child.returncode:
                raise failed(f"timing {name}", child, logs / f"steps-{name}.log")
            runs[name].append(json.loads(json_out.read_text()))
    for name, rows in runs.items():
        target = statistics.median(r["target_step_ms"] for r in rows)
        draft_ms = statistics.median(r["draft_step_ms"] for r in rows)
        results[name] = {"target_step_ms": target, "draft_step_ms": draft_ms,
                         "c": draft_ms / target, "draft_parameters": rows[0]["draft_parameters"],
                         "runs": rows}
        print(f"{args.target} int4 + {name}: target step {target:.1f} ms, draft step "
              f"{draft_ms:.1f} ms, c = {draft_ms / target:.3f}", flush=True)
    results["uptime_after"] = os.getloadavg()
    (out / f"eagle-{args.target}-threads{args.threads}.json").write_text(json.dumps(results, indent=2) + "\n")


def measure_command(args) -> None:
    setting = next(s for s in SETTINGS if s.name == args.setting)
    result = measure(args.package, setting, args.context, args.steps, args.sampling_tokens)
    args.json.write_text(json.dumps(result) + "\n")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="save one random checkpoint")
    make.add_argument("shape", choices=sorted(SHAPES))
    make.add_argument("out", type=Path)

    bench = sub.add_parser("run", help="export, load and time every pair; print the tables")
    bench.add_argument("--pairs", default=",".join(p.name for p in PAIRS),
                       help="DRAFT:TARGET, or NAME for self-speculation (fp32 target, int4 "
                            "draft), comma-separated (default: %(default)s)")
    bench.add_argument("--variants", default="fp32,int4",
                       help="comma list of " + ", ".join(VARIANT_FLAGS) + " (default: %(default)s)")
    bench.add_argument("--checkpoints", type=Path, default=Path("build/shapes"),
                       help="folder of checkpoints named as in SHAPES (default: %(default)s)")
    bench.add_argument("--make", action="store_true", help="make missing checkpoints")
    bench.add_argument("--out", type=Path, default=Path("build/real-shapes"),
                       help="JSON, table, logs and packages/ go here (default: %(default)s)")
    bench.add_argument("--repeats", type=int, default=3,
                       help="measuring rounds: a fresh child per package and setting each")
    bench.add_argument("--steps", type=int, default=10, help="timed runs of each kind per child")
    bench.add_argument("--context", type=int, default=256, help="tokens before each timed run")
    bench.add_argument("--sampling-tokens", type=int, default=64,
                       help="new tokens of each generate() timing the sampling (0: skip)")
    bench.add_argument("--sampling-repeats", type=int, default=1,
                       help="repeats that also time the sampling (default: %(default)s)")
    bench.add_argument("--validate", choices=["strict", "report", "skip"], default="report",
                       help="passed to edgespec export (default: %(default)s)")
    bench.add_argument("--reexport", action="store_true",
                       help="export again packages an earlier run made (after exporter changes)")

    one = sub.add_parser("measure", help="load one package and time it (a child of run)")
    one.add_argument("package", type=Path)
    one.add_argument("--setting", choices=[s.name for s in SETTINGS], default="default")
    one.add_argument("--context", type=int, default=256)
    one.add_argument("--steps", type=int, default=10)
    one.add_argument("--sampling-tokens", type=int, default=64)
    one.add_argument("--json", type=Path, required=True)

    eagle = sub.add_parser("eagle", help="c of a random EAGLE-3 head (and of a draft model) "
                                         "against the int4 target's step")
    eagle.add_argument("--target", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    eagle.add_argument("--draft", choices=sorted(SHAPES), help="a draft model to compare with")
    eagle.add_argument("--draft-vocab", type=int, default=EAGLE_DRAFT_VOCAB)
    eagle.add_argument("--checkpoints", type=Path, default=Path("build/shapes"))
    eagle.add_argument("--make", action="store_true", help="make missing checkpoints")
    eagle.add_argument("--out", type=Path, default=Path("build/eagle-shapes"))
    eagle.add_argument("--repeats", type=int, default=3, help="a fresh child each")
    eagle.add_argument("--steps", type=int, default=20)
    eagle.add_argument("--context", type=int, default=256)
    eagle.add_argument("--threads", type=int, default=0, help="per session (0: every core)")
    head = sub.add_parser("make-head", help="write a random EAGLE-3 head (a child of eagle)")
    head.add_argument("target", type=Path)
    head.add_argument("out", type=Path)
    head.add_argument("--draft-vocab", type=int, default=EAGLE_DRAFT_VOCAB)
    steps = sub.add_parser("eagle-steps", help="time one package's steps (a child of eagle)")
    steps.add_argument("package", type=Path)
    steps.add_argument("--context", type=int, default=256)
    steps.add_argument("--steps", type=int, default=20)
    steps.add_argument("--threads", type=int, default=0)
    steps.add_argument("--json", type=Path, required=True)

    args = parser.parse_args(argv)
    if args.command == "make":
        print(make_checkpoint(args.shape, args.out))
    elif args.command == "make-head":
        print(make_head(args.target, args.out, args.draft_vocab))
    elif args.command == "eagle-steps":
        args.json.write_text(json.dumps(eagle_steps(args.package, args.context, args.steps,
                                                    args.threads)))
    elif args.command == "eagle":
        eagle_command(args)
    elif args.command == "measure":
        measure_command(args)
    else:
        args.variants = [v for v in args.variants.split(",") if v]
        if not args.variants or set(args.variants) - set(VARIANT_FLAGS):
            sys.exit(f"error: --variants takes {', '.join(VARIANT_FLAGS)}; got {args.variants}")
        if min(args.repeats, args.steps) < 1 or args.sampling_repeats < 0:
            sys.exit("error: --repeats and --steps must be >= 1, --sampling-repeats >= 0")
        if args.sampling_tokens < 0 or args.sampling_tokens == 1:
            sys.exit("error: --sampling-tokens must be 0 (no sampling timed) or >= 2")
        run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
