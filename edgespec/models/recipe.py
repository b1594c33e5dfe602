"""The recipe that rebuilds the bundled demo pair: a small Python code model and its draft.

Both models are trained from scratch on this machine's CPU, on the standard library sources of
the running interpreter, so the recipe needs no download:

1. find the corpus (stdlib ``.py`` files, no tests) and split it by file into train / held-out;
2. train a byte-level BPE tokenizer on the train split;
3. train the target (``LlamaForCausalLM``) on next-token loss for ``target_minutes``;
4. distil the draft from the target, minimising KL(p || q) on its logits, for ``draft_minutes``;
5. measure both on the held-out split, with the draft's expected acceptance rate
   sum_x min(p(x), q(x)) (Leviathan et al., 2023, "Fast Inference from Transformers via
   Speculative Decoding", section 3);
6. save both as float16 Hugging Face checkpoints next to a training report.

As everywhere in edgespec, p is the target's distribution and q the draft's.
Each training phase stops on a wall-clock budget: two runs with the same seed draw the same
batches in the same order, but not necessarily the same number of them.
"""

import ast
import copy
import hashlib
import json
import math
import os
import platform
import shutil
import sysconfig
import textwrap
import time
import tokenize
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from edgespec.errors import ConfigError, EdgespecError
from edgespec.export import export_pair
from edgespec.export.destination import atomic_folder
from edgespec.manifest import PROMPTS_NAME, REPORT_NAME

Progress = Callable[[str], None]

EOS_TOKEN = "<|endoftext|>"
PROMPT_COUNT = 24
ACCEPTANCE_TEMPERATURES = (0.7, 1.0)
# Tests, third-party packages, and generated data: codec tables (encodings/) and pydoc's topic
# texts (pydoc_data/), which are 18% of the stdlib's bytes but neither hand-written nor code.
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"}
)
_REPORTS_PER_PHASE = 10
_ADAM_BETAS = (0.9, 0.95)
_MAX_GRAD_NORM = 1.0


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelShape:
    """The shape of one Llama decoder; vocabulary and context length come from RecipeConfig."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _require(
            self.hidden % (2 * self.heads) == 0,
            f"hidden must be an even multiple of heads (rotary embeddings rotate pairs), "
            f"got hidden={self.hidden}, heads={self.heads}",
        )
        _require(
            self.heads % self.kv_heads == 0,
            f"heads must be a multiple of kv_heads, got heads={self.heads}, "
            f"kv_heads={self.kv_heads}",
        )


@dataclass(frozen=True)
class RecipeConfig:
    """Everything the demo recipe depends on. The defaults take about 50 minutes on 2 cores.

    Target: 8 layers x 512, 2 KV heads, tied embeddings, 21.5M parameters, ~2,200-2,500
    tokens/s of training on an idle 2-core machine (bf16 autocast). Its size is bounded by the
    repository budget: fp16 checkpoint plus fp16-stored ONNX graph of both models under 100 MB.
    Draft: 2 layers x 192, 1.6M parameters, the fewest layers that can form induction heads
    (copy an earlier identifier); at batch 1 it costs a few percent of a target step.
    Distillation runs at ~4,500 tokens/s, bound by the target's forward pass. The budgets are
    wall-clock: on a busy machine the models see fewer tokens, so quality drops, not time.
    """

    seed: int = 0
    vocab_size: int = 4096
    target: ModelShape = ModelShape(layers=8, hidden=512, heads=8, kv_heads=2, intermediate=1152)
    draft: ModelShape = ModelShape(layers=2, hidden=192, heads=6, kv_heads=2, intermediate=512)
    context_length: int = 512
    batch_size: int = 8
    target_lr: float = 1e-3
    draft_lr: float = 3e-3
    warmup_fraction: float = 0.05
    weight_decay: float = 0.1
    hard_loss_weight: float = 0.0  # draft loss = (1 - w) KL(p || q) + w cross-entropy
    target_minutes: float = 33.0
    draft_minutes: float = 14.0
    heldout_fraction: float = 0.05

    def __post_init__(self) -> None:
        _require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        _require(
            self.vocab_size > 256,
            f"vocab_size must be > 256 (256 bytes and {EOS_TOKEN}), got {self.vocab_size}",
        )
        _require(
            self.context_length >= 2, f"context_length must be >= 2, got {self.context_length}"
        )
        _require(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        for name in ("target_lr", "draft_lr", "target_minutes", "draft_minutes"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _require(
            0 <= self.warmup_fraction < 1,
            f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}",
        )
        _require(
            0 <= self.hard_loss_weight <= 1,
            f"hard_loss_weight must be in [0, 1], got {self.hard_loss_weight}",
        )
        _require(
            0 < self.heldout_fraction < 1,
            f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}",
        )


@dataclass(frozen=True)
class Corpus:
    """The trained tokenizer and the token streams of both splits (see encode_files)."""

    tokenizer: PreTrainedTokenizerFast
    train_ids: torch.Tensor  # [N_train]
    heldout_ids: torch.Tensor  # [N_heldout]
    train_files: int
    heldout_files: tuple[Path, ...]


@dataclass(frozen=True)
class PhaseStats:
    """What one training phase did."""

    steps: int
    tokens: int
    seconds: float
    train_loss: float  # mean training loss over the last tenth of the steps


@dataclass(frozen=True)
class Evaluation:
    """Held-out metrics of a pair, each averaged over every predicted position."""

    target_loss: float
    draft_loss: float
    greedy_agreement: float  # fraction of positions where argmax q == argmax p
    expected_acceptance: dict[str, float]  # str(temperature) -> mean sum_x min(p(x), q(x))


# --- corpus ---------------------------------------------------------------------------------


def stdlib_dir() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def find_corpus(root: Path | None = None) -> list[Path]:
    """The ``.py`` files under root (default: the stdlib), sorted.

    Leaves out tests (test/, tests/, idle_test/, test_*.py), site-packages and generated data.
    """
    root = stdlib_dir() if root is None else root
    files = sorted(path for path in root.rglob("*.py") if _is_source(path.relative_to(root)))
    if not files:
        raise EdgespecError(f"no Python sources under {root}; is the standard library installed?")
    return files


def _is_source(relative: Path) -> bool:
    if relative.name.startswith("test_"):
        return False
    return _EXCLUDED_DIRS.isdisjoint(relative.parts[:-1])


def split_corpus(
    files: Sequence[Path], heldout_fraction: float, root: Path | None = None
) -> tuple[list[Path], list[Path]]:
    """Split files into (train, held-out) by a hash of each path relative to root.

    The split depends only on the relative path: it is the same on every machine, and adding or
    removing a file moves no other file across the split.
    """
    root = stdlib_dir() if root is None else root
    train: list[Path] = []
    heldout: list[Path] = []
    for path in files:
        (heldout if _unit_hash(path.relative_to(root)) < heldout_fraction else train).append(path)
    if not train or not heldout:
        raise EdgespecError(
            f"{len(files)} files split into {len(train)} train and {len(heldout)} held-out; "
            "both must be non-empty: use more files or change heldout_fraction"
        )
    return train, heldout


def _unit_hash(relative: Path) -> float:
    """A number in [0, 1) fixed by the path."""
    digest = hashlib.sha256(relative.as_posix().encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _read_source(path: Path) -> str:
    """Read a Python source file in the encoding its PEP 263 cookie declares (default UTF-8)."""
    with tokenize.open(path) as source:
        return source.read()


def train_tokenizer(files: Sequence[Path], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (GPT-2 style) on files; ``<|endoftext|>`` is BOS, EOS and pad."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator((_read_source(path) for path in files), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def encode_files(tokenizer: PreTrainedTokenizerFast, files: Sequence[Path]) -> torch.Tensor:
    """One token stream [N]: every file preceded by EOS, so EOS separates files (and is BOS)."""
    texts = [_read_source(path) for path in files]
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    return torch.cat([torch.tensor([eos, *encoding.ids]) for encoding in encodings])


def prepare_corpus(config: RecipeConfig) -> Corpus:
    """Find and split the stdlib, train the tokenizer on the train split, encode both splits."""
    root = stdlib_dir()
    train_files, heldout_files = split_corpus(find_corpus(root), config.heldout_fraction, root)
    tokenizer = train_tokenizer(train_files, config.vocab_size)
    return Corpus(
        tokenizer=tokenizer,
        train_ids=encode_files(tokenizer, train_files),
        heldout_ids=encode_files(tokenizer, heldout_files),
        train_files=len(train_files),
        heldout_files=tuple(heldout_files),
    )


def heldout_prompts(files: Sequence[Path], count: int, max_chars: int = 400) -> list[str]:
    """Code-completion prompts from held-out files: a function's signature and docstring.

    The models never trained on these files, so a benchmark on them measures generalisation,
    not recall. Functions are taken in file order, round-robin over files, for variety.
    """
    per_file = [_documented_functions(_read_source(path), max_chars) for path in files]
    prompts: list[str] = []
    for round_ in range(max(map(len, per_file), default=0)):
        prompts += [functions[round_] for functions in per_file if round_ < len(functions)]
    return prompts[:count]


def _documented_functions(source: str, max_chars: int) -> list[str]:
    """The text of each documented function from ``def`` to the end of its docstring."""
    lines = source.splitlines(keepends=True)
    prompts = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or ast.get_docstring(node) is None:
            continue
        start = node.lineno - 1 if not node.decorator_list else node.decorator_list[0].lineno - 1
        text = "".join(lines[start : node.body[0].end_lineno])
        if len(text) <= max_chars:
            prompts.append(textwrap.dedent(text))
    return prompts


# --- training -------------------------------------------------------------------------------


def new_model(
    shape: ModelShape, tokenizer: PreTrainedTokenizerFast, config: RecipeConfig
) -> LlamaForCausalLM:
    """A randomly initialised Llama of the given shape, seeded, with tied embeddings."""
    torch.manual_seed(config.seed)
    llama_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=config.context_length,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(llama_config)


def train_target(
    train_ids: torch.Tensor,
    tokenizer: PreTrainedTokenizerFast,
    config: RecipeConfig,
    progress: Progress | None = None,
) -> tuple[LlamaForCausalLM, PhaseStats]:
    """Train the target from scratch on next-token loss for ``config.target_minutes``."""
    target = new_model(config.target, tokenizer, config)

    def loss_fn(windows: torch.Tensor) -> torch.Tensor:
        return _next_token_loss(target(windows[:, :-1]).logits, windows)

    stats = _train(
        target,
        loss_fn,
        train_ids,
        config,
        phase="target",
        peak_lr=config.target_lr,
        minutes=config.target_minutes,
        progress=progress,
    )
    return target, stats


def distill_draft(
    target: LlamaForCausalLM,
    train_ids: torch.Tensor,
    tokenizer: PreTrainedTokenizerFast,
    config: RecipeConfig,
    progress: Progress | None = None,
) -> tuple[LlamaForCausalLM, PhaseStats]:
    """Distil a draft from the target for ``config.draft_minutes``.

    The loss is (1 - w) * KL(p || q) + w * next-token cross-entropy of q, w = hard_loss_weight,
    with p the target's distribution at temperature 1 (Hinton et al., 2015, "Distilling the
    Knowledge in a Neural Network"). Minimising KL(p || q) raises sum_x min(p, q), the rate at
    which speculative decoding accepts the draft's tokens.
    """
    draft = new_model(config.draft, tokenizer, config)
    target.eval()

    def loss_fn(windows: torch.Tensor) -> torch.Tensor:
        inputs = windows[:, :-1]
        with torch.no_grad():
            p_logits = target(inputs).logits  # [B, T, V]
        q_logits = draft(inputs).logits  # [B, T, V]
        soft = _kl_p_q(p_logits, q_logits)
        hard = _next_token_loss(q_logits, windows)
        return (1 - config.hard_loss_weight) * soft + config.hard_loss_weight * hard

    stats = _train(
        draft,
        loss_fn,
        train_ids,
        config,
        phase="draft",
        peak_lr=config.draft_lr,
        minutes=config.draft_minutes,
        progress=progress,
    )
    return draft, stats


def _next_token_loss(logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [B, T, V] against the next tokens windows[:, 1:] [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())


def _kl_p_q(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p || q) = sum_x p(x) (log p(x) - log q(x)); logits [B, T, V]."""
    log_p = F.log_softmax(p_logits.flatten(0, 1).float(), dim=-1)
    log_q = F.log_softmax(q_logits.flatten(0, 1).float(), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


def _train(
    model: LlamaForCausalLM,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    stream: torch.Tensor,
    config: RecipeConfig,
    *,
    phase: str,
    peak_lr: float,
    minutes: float,
    progress: Progress | None,
) -> PhaseStats:
    """Minimise loss_fn on random windows [B, T+1] of stream until the time budget is spent.

    AdamW with linear warmup then cosine decay to zero, both measured in fractions of the budget;
    bf16 autocast, which about doubles training speed on CPU. Reports every tenth of the budget
    and leaves the model in eval mode.
    """
    report = progress or _ignore
    torch.set_num_threads(os.cpu_count() or 1)
    params = _param_groups(model, config.weight_decay)
    optimizer = torch.optim.AdamW(params, lr=peak_lr, betas=_ADAM_BETAS)
    generator = torch.Generator().manual_seed(config.seed)
    tokens_per_step = config.batch_size * config.context_length
    budget = minutes * 60
    report(f"{phase}: training {model.num_parameters():,} parameters for {minutes:g} min")
    model.train()
    losses: list[float] = []
    reported = 0
    start = last_report = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget:
        lr = _learning_rate(elapsed / budget, peak_lr, config.warmup_fraction)
        windows = _random_windows(stream, config.batch_size, config.context_length, generator)
        losses.append(_step(model, optimizer, loss_fn, windows, lr))
        if (now := time.perf_counter()) - last_report >= budget / _REPORTS_PER_PHASE:
            rate = (len(losses) - reported) * tokens_per_step / (now - last_report)
            report(
                f"{phase}: step {len(losses)}, loss {_mean(losses[reported:]):.3f}, "
                f"{rate:,.0f} tokens/s, {(now - start) / 60:.1f}/{minutes:g} min"
            )
            reported, last_report = len(losses), now
    model.eval()
    stats = PhaseStats(
        steps=len(losses),
        tokens=len(losses) * tokens_per_step,
        seconds=time.perf_counter() - start,
        train_loss=_mean(losses[-max(1, len(losses) // 10) :]),
    )
    report(
        f"{phase}: done, {stats.steps} steps, {stats.tokens:,} tokens "
        f"in {stats.seconds / 60:.1f} min"
    )
    return stats


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _ignore(message: str) -> None:
    """The progress callback used when the caller passes none."""


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings, not norm gains (as nanoGPT does)."""
    params = [param for param in model.parameters() if param.requires_grad]
    return [
        {"params": [param for param in params if param.dim() >= 2], "weight_decay": weight_decay},
        {"params": [param for param in params if param.dim() < 2], "weight_decay": 0.0},
    ]


def _learning_rate(fraction: float, peak: float, warmup: float) -> float:
    """Linear warmup over the first `warmup` of the budget, then cosine decay to 0 at its end."""
    if fraction < warmup:
        return peak * fraction / warmup
    decay = (fraction - warmup) / (1 - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(decay, 1.0)))


def _random_windows(
    stream: torch.Tensor, batch_size: int, context_length: int, generator: torch.Generator
) -> torch.Tensor:
    """Windows [B, T+1] of consecutive tokens starting at uniformly random offsets."""
    starts = torch.randint(0, len(stream) - context_length, (batch_size, 1), generator=generator)
    return stream[starts + torch.arange(context_length + 1)]


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    windows: torch.Tensor,
    lr: float,
) -> float:
    """One optimiser step at learning rate lr; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(windows)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), _MAX_GRAD_NORM)
    optimizer.step()
    return loss.item()


# --- evaluation -----------------------------------------------------------------------------


def evaluate(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    heldout_ids: torch.Tensor,
    config: RecipeConfig,
) -> Evaluation:
    """Score the pair on consecutive held-out windows, predicting every held-out token once.

    Runs in float32, without autocast, to measure the models as they will be exported.
    """
    if len(heldout_ids) <= config.context_length:
        raise EdgespecError(
            f"the held-out split has {len(heldout_ids)} tokens, fewer than one window of "
            f"{config.context_length + 1}: raise heldout_fraction or lower context_length"
        )
    windows = heldout_ids.unfold(0, config.context_length + 1, config.context_length)  # [N, T+1]
    totals: Counter[str] = Counter()
    with torch.inference_mode():
        for batch in windows.split(config.batch_size):
            inputs = batch[:, :-1]
            totals.update(_batch_sums(target(inputs).logits, draft(inputs).logits, batch[:, 1:]))
    positions = windows[:, 1:].numel()
    return Evaluation(
        target_loss=totals["target_loss"] / positions,
        draft_loss=totals["draft_loss"] / positions,
        greedy_agreement=totals["greedy_agreement"] / positions,
        expected_acceptance={
            str(temperature): totals[f"acceptance@{temperature}"] / positions
            for temperature in ACCEPTANCE_TEMPERATURES
        },
    )


def _batch_sums(
    p_logits: torch.Tensor, q_logits: torch.Tensor, labels: torch.Tensor
) -> dict[str, float]:
    """Per-position metrics summed over a batch; logits [B, T, V], labels [B, T]."""
    p_logits = p_logits.flatten(0, 1)  # [B*T, V]
    q_logits = q_logits.flatten(0, 1)  # [B*T, V]
    labels = labels.flatten()  # [B*T]
    sums = {
        "target_loss": F.cross_entropy(p_logits, labels, reduction="sum").item(),
        "draft_loss": F.cross_entropy(q_logits, labels, reduction="sum").item(),
        "greedy_agreement": (p_logits.argmax(-1) == q_logits.argmax(-1)).sum().item(),
    }
    for temperature in ACCEPTANCE_TEMPERATURES:
        acceptance = expected_acceptance(p_logits, q_logits, temperature)  # [B*T]
        sums[f"acceptance@{temperature}"] = acceptance.sum().item()
    return sums


def expected_acceptance(
    p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """sum_x min(p(x), q(x)) per position [N] for logits [N, V], both taken at the temperature.

    This is the probability that speculative sampling accepts the draft's token
    (Leviathan et al., 2023, section 3, where it is called beta).
    """
    p = torch.softmax(p_logits / temperature, dim=-1)  # [N, V]
    q = torch.softmax(q_logits / temperature, dim=-1)  # [N, V]
    return torch.minimum(p, q).sum(dim=-1)


# --- the demo pair --------------------------------------------------------------------------


def save_checkpoint(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, directory: Path
) -> None:
    """Write a Hugging Face checkpoint: float16 safetensors weights, config and tokenizer."""
    copy.deepcopy(model).to(torch.float16).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def build_demo(out_dir: Path, config: RecipeConfig, progress: Progress | None = None) -> dict:
    """Train the demo pair and write it to out_dir, then return the report it also writes.

    Writes out_dir/target/ and out_dir/draft/ (Hugging Face checkpoints sharing one tokenizer)
    and out_dir/training_report.json. Takes target_minutes + draft_minutes plus about a minute
    for data and evaluation. progress, if given, receives one short line per event.
    """
    report = progress or _ignore
    seconds: dict[str, float] = {}
    report(f"data: tokenizing the Python {platform.python_version()} standard library")
    with _stopwatch(seconds, "data"):
        corpus = prepare_corpus(config)
    report(
        f"data: {len(corpus.train_ids):,} train and {len(corpus.heldout_ids):,} held-out tokens"
    )
    target, target_stats = train_target(corpus.train_ids, corpus.tokenizer, config, progress)
    draft, draft_stats = distill_draft(target, corpus.train_ids, corpus.tokenizer, config, progress)
    seconds.update(target=target_stats.seconds, draft=draft_stats.seconds)
    report("evaluate: scoring both models on the held-out split")
    with _stopwatch(seconds, "evaluate"):
        evaluation = evaluate(target, draft, corpus.heldout_ids, config)
    with _stopwatch(seconds, "save"):
        save_checkpoint(target, corpus.tokenizer, out_dir / "target")
        save_checkpoint(draft, corpus.tokenizer, out_dir / "draft")
    training_report = {
        "python_version": platform.python_version(),
        "config": asdict(config),
        "corpus": _corpus_report(corpus),
        "target": _model_report(target, target_stats, evaluation.target_loss),
        "draft": _model_report(draft, draft_stats, evaluation.draft_loss),
        "greedy_agreement": evaluation.greedy_agreement,
        "expected_acceptance": evaluation.expected_acceptance,
        "seconds": {**seconds, "total": sum(seconds.values())},
    }
    (out_dir / REPORT_NAME).write_text(json.dumps(training_report, indent=2) + "\n")
    write_prompts(out_dir / PROMPTS_NAME, heldout_prompts(corpus.heldout_files, PROMPT_COUNT))
    report(f"done: wrote {out_dir}")
    return training_report


def write_prompts(path: Path, prompts: Sequence[str]) -> None:
    """JSON Lines, one prompt string a line (the format ``edgespec bench --prompts`` reads)."""
    path.write_text("".join(json.dumps(prompt) + "\n" for prompt in prompts))


def build_demo_package(out: Path, config: RecipeConfig, progress: Progress | None = None) -> dict:
    """The whole recipe: train the pair, then export it with ``edgespec export``.

    Writes out/checkpoints/{target,draft} (Hugging Face, float16) and out/package (the edgespec
    package, with the training report and held-out prompts). Atomic: nothing is left at out if
    any step fails or is interrupted.
    """
    with atomic_folder(out) as tmp:
        training_report = build_demo(tmp / "checkpoints", config, progress)
        package_demo(tmp / "checkpoints", tmp / "package", progress)
    return training_report


def package_demo(checkpoints: Path, package: Path, progress: Progress | None = None) -> None:
    """Export trained checkpoints into an edgespec package carrying the report and prompts."""
    export_pair(checkpoints / "target", checkpoints / "draft", package, progress=progress)
    for name in (REPORT_NAME, PROMPTS_NAME):
        shutil.copyfile(checkpoints / name, package / name)


@contextmanager
def _stopwatch(seconds: dict[str, float], phase: str) -> Iterator[None]:
    """Record the wall time of the block in seconds[phase]."""
    start = time.perf_counter()
    yield
    seconds[phase] = time.perf_counter() - start


def _corpus_report(corpus: Corpus) -> dict:
    return {
        "train_files": corpus.train_files,
        "heldout_files": len(corpus.heldout_files),
        "train_tokens": len(corpus.train_ids),
        "heldout_tokens": len(corpus.heldout_ids),
        "vocab_size": len(corpus.tokenizer),
    }


def _model_report(model: LlamaForCausalLM, stats: PhaseStats, heldout_loss: float) -> dict:
    return {
        "parameters": model.num_parameters(),
        "steps": stats.steps,
        "tokens_seen": stats.tokens,
        "train_loss": stats.train_loss,
        "heldout_loss": heldout_loss,
        "heldout_perplexity": math.exp(heldout_loss),
    }
