"""Held-out scores of the pair: both losses, greedy agreement and expected acceptance."""

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from edgespec.errors import EdgespecError
from edgespec.models.recipe.config import RecipeConfig

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
