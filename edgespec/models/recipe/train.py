"""Training on a wall-clock budget: the target on next-token loss, the draft distilled from it."""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from edgespec.models.recipe.config import RecipeConfig
from edgespec.runtime.machine import usable_cores
from edgespec.models.recipe.distill import sparse_kl, target_continuations, teacher_targets
from edgespec.models.recipe.model import new_model

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
        return _next_token_loss(target(windows[:, :-1]).logits, windows)

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
    """Distil a draft from the target for ``config.draft_minutes`` (distill.py).

    The target runs once over the training stream and its top ``distill_top_k`` log-
    probabilities are kept, and it writes ``distill_generated_tokens`` of continuations of its
    own (distill.py; neither counted in the budget); the draft then trains on both, a batch
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
        hard = _next_token_loss(q_logits, windows)
        return (1 - config.hard_loss_weight) * soft + config.hard_loss_weight * hard

    def sample(generator: torch.Generator) -> tuple[int, torch.Tensor]:
        """A batch of windows from one set: the corpus and the continuations in turn."""
        which = int(torch.randint(0, len(sets), (1,), generator=generator))
        return which, torch.randint(0, len(sets[which]), (config.batch_size,), generator=generator)

    stats = _train(draft, loss_fn, sample, config, phase="draft", progress=progress)
    return draft, replace(stats, setup_seconds=sum(t.seconds for t in sets))


def _next_token_loss(logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [B, T, V] against the next tokens windows[:, 1:] [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())


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

    AdamW with linear warmup then cosine decay to zero, both measured in fractions of the budget;
    bf16 autocast (faster than float32 on CPU). Reports every tenth of the budget
    and leaves the model in eval mode.
    """
    report = progress or _ignore
    peak_lr, minutes = getattr(config, f"{phase}_lr"), getattr(config, f"{phase}_minutes")
    torch.set_num_threads(config.threads or usable_cores())
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
        losses.append(_step(model, optimizer, loss_fn, sample(generator), lr))
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
    batch: torch.Tensor,
    lr: float,
) -> float:
    """One optimiser step at learning rate lr; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), _MAX_GRAD_NORM)
    optimizer.step()
    return loss.item()
