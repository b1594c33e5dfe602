"""What the recipe is given: RecipeConfig (every setting) and ModelShape (one model's shape)."""

from dataclasses import dataclass

from edgespec.errors import ConfigError


EOS_TOKEN = "<|endoftext|>"  # the tokenizer's BOS, EOS and pad (tokenizer.py)
DISTILL_WORK = "work"  # the folder in distill's --out that holds its resumable stages


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
    """Everything the demo recipe depends on; its budgets (``target_minutes``,
    ``draft_minutes``) make the defaults a few hours on 2 cores.

    Target: 6 layers x 512, 2 KV heads, tied embeddings, 16.7M parameters. At this budget it is
    far from converged, and undertrained models gain more from tokens than from parameters
    (Hoffmann et al., 2022), so it stays small; its size is also bounded by the repository
    budget: fp16 checkpoint plus fp16-stored ONNX graph of both models under 100 MB.
    Draft: 3 layers x 256, 3.4M parameters, distilled from the target's top-64
    log-probabilities on the corpus and on the target's own continuations (teacher.py). What
    the choices gave is in benchmarks/RESULTS.md ("The demo's new draft"). The budgets are
    wall-clock: on a busy machine the models see fewer tokens, so quality drops, not time.
    """

    seed: int = 0
    vocab_size: int = 4096
    target: ModelShape = ModelShape(layers=6, hidden=512, heads=8, kv_heads=2, intermediate=1152)
    draft: ModelShape = ModelShape(layers=3, hidden=256, heads=4, kv_heads=2, intermediate=768)
    context_length: int = 512
    batch_size: int = 8
    target_lr: float = 1e-3
    draft_lr: float = 3e-3
    warmup_fraction: float = 0.05
    weight_decay: float = 0.1
    hard_loss_weight: float = 0.0  # draft loss = (1 - w) KL(p || q) + w cross-entropy
    distill_top_k: int = 64  # the target's likeliest tokens kept per position (teacher.py)
    distill_generated_tokens: int = 600_000  # the target's own continuations to distil on
    target_minutes: float = 72.0
    draft_minutes: float = 40.0
    heldout_fraction: float = 0.05
    threads: int = 0  # torch's threads; 0: every usable core (1 is steadier on a shared machine)

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
        _require(
            1 <= self.distill_top_k <= self.vocab_size,
            f"distill_top_k must be in 1..vocab_size, got {self.distill_top_k}",
        )
        _require(
            self.distill_generated_tokens >= 0,
            f"distill_generated_tokens must be >= 0, got {self.distill_generated_tokens}",
        )
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
        _require(self.threads >= 0, f"threads must be >= 0 (0: every core), got {self.threads}")
        _require(
            0 < self.heldout_fraction < 1,
            f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}",
        )


@dataclass(frozen=True)
class DistillConfig:
    """What ``edgespec distill`` trains an EAGLE-3 head with (eagle3_distill.py), besides the
    target and the head's folder; the command's options take their defaults from here."""

    data: str = "chat"  # what the target writes to learn from: "chat" replies or "code"
    minutes: float = 20.0  # the training budget (the target's texts and features come first)
    max_steps: int | None = None  # optimizer steps, if they should end training sooner
    draft_vocab: int = 8192  # tokens the head scores: the most frequent in the target's texts
    steps: int = 3  # training-time-test steps: how many chained drafts the loss covers
    prompts: tuple[int, int, int] = (300, 72, 96)  # chat: questions, functions, edits
    tokens: int = 150_000  # code: tokens of continuations
    new_tokens: int = 128  # the longest reply or continuation the target writes
    top_k: int = 32  # the target's likeliest tokens kept per position (teacher.py)
    lr: float = 1e-3
    seed: int = 0
    aux_layers: tuple[int, int, int] | None = None  # None: export/aux_layers.py's rule

    def __post_init__(self) -> None:
        _require(self.data in ("chat", "code"), f"data must be chat or code, got {self.data!r}")
        _require(self.minutes > 0, f"minutes must be > 0, got {self.minutes}")
        _require(self.max_steps is None or self.max_steps >= 1,
                 f"max_steps must be >= 1, got {self.max_steps}")
        _require(self.draft_vocab >= 1, f"draft_vocab must be >= 1, got {self.draft_vocab}")
        _require(1 <= self.steps <= 8, f"steps must be in 1..8, got {self.steps}")
        _require(len(self.prompts) == 3 and min(self.prompts) >= 1,
                 f"prompts must be three counts >= 1, got {self.prompts}")
        _require(self.tokens >= 1000, f"tokens must be >= 1000, got {self.tokens}")
        for name in ("new_tokens", "top_k"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")

    def check_paths(self, target, out) -> None:
        """What can be refused from the arguments alone, before torch loads: prompt counts the
        templates cannot make, an --out that is not a head being distilled (no
        DISTILL_WORK folder) or whose work folder is a link, repeated aux layers, a GGUF header that does
        not read (export/gguf_header.py)."""
        from pathlib import Path

        from edgespec.errors import EdgespecError
        from edgespec.export.aux_layers import check_aux_layers
        from edgespec.export.gguf_header import check_gguf
        from edgespec.models.training import chat_prompts

        most = chat_prompts.first_round_sizes()
        if self.data == "chat" and any(n > m for n, m in zip(self.prompts, most)):
            raise EdgespecError(f"--prompts {' '.join(map(str, self.prompts))} asks for more "
                                f"than the templates make; at most {' '.join(map(str, most))}")
        out, work = Path(out), Path(out) / DISTILL_WORK
        if out.exists() and not work.is_dir():
            raise EdgespecError(f"{out} exists and is not a head being distilled; choose "
                                "another --out")
        if work.is_symlink():  # its files would be written wherever it points
            raise EdgespecError(f"{work} is a link; a head being distilled keeps its work "
                                "in a folder of its own: remove the link, or choose another --out")
        if self.aux_layers is not None:  # repeats refused before any work (the depth once read)
            check_aux_layers(self.aux_layers, None)
        if Path(target).suffix == ".gguf":  # before OUT is made (load_target checks it too)
            check_gguf(Path(target), "target")
