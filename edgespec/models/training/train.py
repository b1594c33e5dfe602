"""The demo pair's training on a wall-clock budget: the target on next-token loss, the draft
distilled from it (both through loop.train_loop)."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import repeat

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from edgespec.models.training.config import RecipeConfig
from edgespec.models.training.loop import Budget, LoopState, train_loop, warmup_then_cosine
from edgespec.models.training.losses import next_token_loss, sparse_kl
from edgespec.models.training.model import new_model
from edgespec.models.training.teacher import target_continuations, teacher_targets
from edgespec.runtime.machine import usable_cores

Progress = Callable[[str], None]

_REPORTS_PER_PHASE = 10
_ADAM_BETAS = (0.9, 0.95)
_MAX_GRAD_NORM = 1.0
_PROMPT_TOKENS = 64  # the start of a continuation the target writes for the draft


@dataclass(frozen=True)
class PhaseStats:
    """What one training phase did."""

    steps: int
    tokens: int
    seconds: float
    train_loss: float  # mean training loss over the last tenth of the steps
    setup_seconds: float = 0.0  # before the budget started (the draft: the target's pass)


def train_target(
    train_ids: torch.Tensor,
    tokenizer: PreTrainedTokenizerFast,
    config: RecipeConfig,
    progress: Progress | None = None,
) -> tuple[LlamaForCausalLM, PhaseStats]:
    """Train the target from scratch on next-token loss for ``config.target_minutes``."""
    target = new_model(config.target, tokenizer, config)

    def loss_fn(windows: torch.Tensor) -> torch.Tensor:
        return next_token_loss(target(windows[:, :-1]).logits, windows)

    def sample(generator: torch.Generator) -> torch.Tensor:
        return _random_windows(train_ids, config.batch_size, config.context_length, generator)

    stats = _train(target, loss_fn, sample, config, phase="target", progress=progress)
    return target, stats


def distill_draft(
    target: LlamaForCausalLM,
    train_ids: torch.Tensor,
    tokenizer: PreTrainedTokenizerFast,
    config: RecipeConfig,
    progress: Progress | None = None,
) -> tuple[LlamaForCausalLM, PhaseStats]:
    """Distil a draft from the target for ``config.draft_minutes`` (losses.py).

    The target runs once over the training stream and its top ``distill_top_k`` log-
    probabilities are kept, and it writes ``distill_generated_tokens`` of continuations of its
    own (teacher.py; neither counted in the budget); the draft then trains on both, a batch
    from each in turn at random, minimising (1 - w) * KL(p || q) + w * next-token cross-entropy of q,
    w = hard_loss_weight, with p the target's distribution at temperature 1 (Hinton et al.,
    2015, "Distilling the Knowledge in a Neural Network"). Minimising KL(p || q) raises
    sum_x min(p, q), the rate at which speculative decoding accepts the draft's tokens.
    """
    sets = [teacher_targets(target, train_ids, config.context_length, config.distill_top_k,
                            progress)]
    if config.distill_generated_tokens:
        sets.append(target_continuations(
            target, train_ids, config.distill_generated_tokens, _PROMPT_TOKENS,
            config.context_length - _PROMPT_TOKENS + 1, config.distill_top_k, config.seed,
            progress))
    draft = new_model(config.draft, tokenizer, config)

    def loss_fn(batch: tuple[int, torch.Tensor]) -> torch.Tensor:
        which, index = batch
        targets = sets[which]
        windows = targets.windows[index]
        q_logits = draft(windows[:, :-1]).logits  # [B, T, V]
        soft = sparse_kl(q_logits, targets.top_ids[index], targets.top_logp[index])
        if not config.hard_loss_weight:
            return soft
        hard = next_token_loss(q_logits, windows)
        return (1 - config.hard_loss_weight) * soft + config.hard_loss_weight * hard

    def sample(generator: torch.Generator) -> tuple[int, torch.Tensor]:
        """A batch of windows from one set: the corpus and the continuations in turn."""
        which = int(torch.randint(0, len(sets), (1,), generator=generator))
        return which, torch.randint(0, len(sets[which]), (config.batch_size,), generator=generator)

    stats = _train(draft, loss_fn, sample, config, phase="draft", progress=progress)
    return draft, replace(stats, setup_seconds=sum(t.seconds for t in sets))


def _train(
    model: LlamaForCausalLM,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    sample: Callable[[torch.Generator], torch.Tensor],
    config: RecipeConfig,
    *,
    phase: str,
    progress: Progress | None,
) -> PhaseStats:
    """Minimise loss_fn on batches from ``sample`` until the phase's time budget is spent
    (``phase`` "target" or "draft": the config's ``<phase>_lr`` and ``<phase>_minutes``).

    AdamW with linear warmup then cosine decay to zero, both measured in fractions of the
    budget (loop.py). Reports every tenth of the budget and leaves the model in eval mode.
    """
    report = progress or _ignore
    peak_lr, minutes = getattr(config, f"{phase}_lr"), getattr(config, f"{phase}_minutes")
    torch.set_num_threads(config.threads or usable_cores())
    optimizer = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=peak_lr,
                                  betas=_ADAM_BETAS)
    generator = torch.Generator().manual_seed(config.seed)
    tokens_per_step = config.batch_size * config.context_length
    budget = minutes * 60
    report(f"{phase}: training {model.num_parameters():,} parameters for {minutes:g} min")
    reported = LoopState()  # the state at the last report

    def tick(state: LoopState) -> None:
        rate = (state.step - reported.step) * tokens_per_step / (state.seconds - reported.seconds)
        report(
            f"{phase}: step {state.step}, loss {_mean(state.losses[reported.step:]):.3f}, "
            f"{rate:,.0f} tokens/s, {state.seconds / 60:.1f}/{minutes:g} min"
        )
        reported.step, reported.seconds = state.step, state.seconds

    model.train()
    batches = map(sample, repeat(generator))
    state = train_loop(loss_fn, batches, optimizer,
                       warmup_then_cosine(peak_lr, config.warmup_fraction), Budget(minutes),
                       max_grad_norm=_MAX_GRAD_NORM, every_s=budget / _REPORTS_PER_PHASE,
                       on_tick=tick)
    model.eval()
    stats = PhaseStats(
        steps=state.step,
        tokens=state.step * tokens_per_step,
        seconds=state.seconds,
        train_loss=_mean(state.losses[-max(1, state.step // 10) :]),
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


def _random_windows(
    stream: torch.Tensor, batch_size: int, context_length: int, generator: torch.Generator
) -> torch.Tensor:
    """Windows [B, T+1] of consecutive tokens starting at uniformly random offsets."""
    starts = torch.randint(0, len(stream) - context_length, (batch_size, 1), generator=generator)
    return stream[starts + torch.arange(context_length + 1)]
