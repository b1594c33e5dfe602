"""Held-out scores: the one estimate of a draft's acceptance, sum_x min(p(x), q(x)), for every
recipe; the demo pair's losses and greedy agreement; the top-K scores of drafts trained on the
target's sparse distribution (the SmolLM2 draft, EAGLE-3 heads).

sum_x min(p(x), q(x)) is the probability that speculative sampling accepts the draft's token
(Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding",
section 3, where it is called beta). Scores are computed in float32, without autocast, to
measure the models as they will be exported.
"""

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from edgespec.errors import EdgespecError
from edgespec.models.training.config import RecipeConfig
from edgespec.models.training.losses import TopKRows

Batch = TypeVar("Batch")

ACCEPTANCE_TEMPERATURES = (0.7, 1.0)


@dataclass(frozen=True)
class Evaluation:
    """Held-out metrics of a pair, each averaged over every predicted position."""

    target_loss: float
    draft_loss: float
    greedy_agreement: float  # fraction of positions where argmax q == argmax p
    expected_acceptance: dict[str, float]  # str(temperature) -> mean sum_x min(p(x), q(x))


def evaluate(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    heldout_ids: torch.Tensor,
    config: RecipeConfig,
) -> Evaluation:
    """Score the pair on consecutive held-out windows, predicting every held-out token once."""
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


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) over the last axis: the probability of accepting the draft's token
    (module docstring); p, q ``[..., V]`` (or both restricted to the same tokens)."""
    return torch.minimum(p, q).sum(dim=-1)


def expected_acceptance(
    p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """sum_x min(p(x), q(x)) per position [N] for logits [N, V], both taken at the temperature."""
    p = torch.softmax(p_logits / temperature, dim=-1)  # [N, V]
    q = torch.softmax(q_logits / temperature, dim=-1)  # [N, V]
    return acceptance(p, q)


def top_k_acceptance(rows: TopKRows) -> torch.Tensor:
    """sum_x min(p(x), q(x)) over the target's kept top K, per row [N]: a lower bound of the
    expected acceptance at T = 1 (the rest of p is not kept); q is 0 outside the draft's
    token subset."""
    q = torch.softmax(rows.q_logits.float(), -1).gather(-1, rows.top_ids) * rows.keep  # [N, K]
    return acceptance(rows.top_logp.exp(), q)


@dataclass(frozen=True)
class HeldOut:
    """Held-out top-K scores, one per output of the draft (an EAGLE-3 head's chain steps)."""

    kl: list[float]  # mean sparse KL(p || q) (losses.py)
    acceptance: list[float]  # mean top_k_acceptance


def held_out(rows_of: Callable[[Batch], Sequence[TopKRows | None]], batches: Iterable[Batch]
             ) -> HeldOut:
    """Mean scores over every row of ``batches``; ``rows_of(batch)`` gives the rows of each
    output (None: none in this batch). In inference mode and float32 (module docstring)."""
    sums: list[list[float]] = []
    with torch.inference_mode():
        for batch in batches:
            for output, rows in enumerate(rows_of(batch)):
                if output == len(sums):
                    sums.append([0.0, 0.0, 0])
                if rows is not None:
                    n = len(rows.q_logits)
                    sums[output][0] += float(rows.kl()) * n
                    sums[output][1] += float(top_k_acceptance(rows).sum())
                    sums[output][2] += n
    return HeldOut(kl=[kl / max(n, 1) for kl, _, n in sums],
                   acceptance=[alpha / max(n, 1) for _, alpha, n in sums])
