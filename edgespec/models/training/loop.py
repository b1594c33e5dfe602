"""The one training loop: AdamW steps on a loss until a budget is spent.

Every recipe trains here: the demo's target and draft (train.py), the SmolLM2 draft
(smollm2_draft.py) and EAGLE-3 heads (eagle3_head.py). What differs is passed in: the loss of
a batch, the batches, the optimizer (its parameters and weight decay), the learning rate as a
function of the share of the budget done, the gradient clip, and what to do every so often
(report, checkpoint). Each step runs under bf16 autocast (faster than float32 on CPU).

The budget is wall-clock minutes, optimizer steps, or both. The schedule's clock is the steps
when they bound the run (a busy machine then does the same steps, later: what tests rely on),
else the time.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from edgespec.errors import ConfigError

Batch = TypeVar("Batch")
Item = TypeVar("Item")


@dataclass(frozen=True)
class Budget:
    """When a run stops: after ``minutes`` of training or ``max_steps`` optimizer steps, the
    first reached (a run resumed counts the steps and time of the runs before it)."""

    minutes: float = math.inf
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ConfigError(f"a training budget must be > 0 minutes, got {self.minutes}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")
        if math.isinf(self.minutes) and self.max_steps is None:
            raise ConfigError("a training budget needs minutes or max_steps")

    def spent(self, state: LoopState) -> bool:
        return (state.seconds >= self.minutes * 60
                or (self.max_steps is not None and state.step >= self.max_steps))

    def fraction(self, state: LoopState) -> float:
        """The share of the budget done: the schedule's clock (module docstring)."""
        if self.max_steps is not None:
            return state.step / self.max_steps
        return state.seconds / (self.minutes * 60)


@dataclass
class LoopState:
    """Where a run stands: optimizer steps and training seconds so far (those of the runs it
    resumes included), and this run's loss at each of its steps."""

    step: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)


def train_loop(
    loss_fn: Callable[[Batch], torch.Tensor],
    batches: Iterator[Batch],
    optimizer: torch.optim.Optimizer,
    lr_at: Callable[[float], float],
    budget: Budget,
    *,
    max_grad_norm: float,
    every_s: float = 60.0,
    on_tick: Callable[[LoopState], None] | None = None,
    resume: LoopState | None = None,
) -> LoopState:
    """Minimise ``loss_fn`` on ``batches`` until ``budget`` is spent.

    Before each step the learning rate is ``lr_at(budget.fraction)``; gradients are clipped
    to ``max_grad_norm`` (the norm over the optimizer's parameters). ``on_tick`` is called
    with the state every ``every_s`` seconds of training. ``resume``: the step and seconds
    of the runs before this one. Returns the state at the end; the models' train/eval mode
    is the caller's.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = LoopState(resume.step, resume.seconds) if resume else LoopState()
    begun = last = time.perf_counter()
    begun -= state.seconds
    while True:
        state.seconds = time.perf_counter() - begun
        if budget.spent(state):
            return state
        lr = lr_at(budget.fraction(state))
        state.losses.append(_step(params, optimizer, loss_fn, next(batches), lr, max_grad_norm))
        state.step += 1
        if on_tick is not None and (now := time.perf_counter()) - last >= every_s:
            state.seconds = now - begun
            on_tick(state)
            last = now


def _step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
          loss_fn: Callable[[Batch], torch.Tensor], batch: Batch, lr: float,
          max_grad_norm: float) -> float:
    """One optimizer step at learning rate ``lr``; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    return loss.item()


def shuffled_batches(items: Sequence[Item], size: int, rng: random.Random
                     ) -> Iterator[list[Item]]:
    """Batches of ``size`` items (the last of an epoch may be smaller), each epoch in a new
    order drawn from ``rng``, for ever."""
    while True:
        order = list(range(len(items)))
        rng.shuffle(order)
        for first in range(0, len(order), size):
            yield [items[i] for i in order[first:first + size]]


def warmup_cosine(lr: float, fraction: float) -> float:
    """The learning rate ``fraction`` of the way through a budget: a cosine from ``lr`` to 0
    over the whole budget, ramped up linearly over its first 5% (the SmolLM2 draft's and the
    EAGLE-3 heads' schedule)."""
    return lr * min(1.0, fraction / 0.05) * 0.5 * (1 + math.cos(math.pi * fraction))


def warmup_then_cosine(peak: float, warmup: float) -> Callable[[float], float]:
    """Linear warmup to ``peak`` over the first ``warmup`` of the budget, then a cosine decay
    to 0 at its end (the demo recipe's schedule)."""

    def lr_at(fraction: float) -> float:
        if fraction < warmup:
            return peak * fraction / warmup
        decay = (fraction - warmup) / (1 - warmup)
        return peak * 0.5 * (1 + math.cos(math.pi * min(decay, 1.0)))

    return lr_at
