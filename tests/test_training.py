"""The recipes' shared training pieces (models/training/): the one loop's budget and schedule
clock, and the one acceptance estimate in its dense and top-K forms."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from edgespec.errors import ConfigError  # noqa: E402
from edgespec.models.training.evaluate import (expected_acceptance, held_out,  # noqa: E402
                                               top_k_acceptance)
from edgespec.models.training.loop import Budget, LoopState, train_loop  # noqa: E402
from edgespec.models.training.losses import TopKRows, subset_index  # noqa: E402


def _run(budget: Budget, resume: LoopState | None = None):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    fractions = []

    def lr_at(fraction: float) -> float:
        fractions.append(fraction)
        return 0.1

    def batches():
        while True:
            yield torch.randn(4, 3)

    state = train_loop(lambda x: model(x).pow(2).mean(), batches(), optimizer, lr_at, budget,
                       max_grad_norm=1.0, resume=resume)
    return state, fractions


def test_a_loop_bounded_by_steps_runs_them_on_the_steps_clock_and_resumes():
    state, fractions = _run(Budget(minutes=math.inf, max_steps=5))
    assert state.step == 5 and len(state.losses) == 5
    assert fractions == [0.0, 0.2, 0.4, 0.6, 0.8]  # the schedule's clock is the steps
    resumed, fractions = _run(Budget(max_steps=5), resume=LoopState(step=3, seconds=1.0))
    assert resumed.step == 5 and len(resumed.losses) == 2 and fractions == [0.6, 0.8]
    assert resumed.seconds >= 1.0  # the time of the run before counts


def test_a_budget_needs_a_bound():
    with pytest.raises(ConfigError, match="needs minutes or max_steps"):
        Budget()
    with pytest.raises(ConfigError, match="max_steps must be >= 1"):
        Budget(minutes=1, max_steps=0)


def test_the_top_k_estimate_is_the_dense_one_when_it_sees_everything():
    """Over the whole vocabulary (K = V, no subset) top_k_acceptance is sum_x min(p, q) as
    expected_acceptance computes it at T = 1; with a subset head, q is 0 outside it (the
    estimate drops by p's mass there, checked against the dense sum by hand)."""
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(5, 12), torch.randn(5, 12)
    top_logp, top_ids = torch.log_softmax(p_logits, -1).topk(12, -1)
    rows = TopKRows.of(q_logits, top_ids, top_logp, subset_index(torch.arange(12).numpy(), 12))
    dense = expected_acceptance(p_logits, q_logits, 1.0)
    torch.testing.assert_close(top_k_acceptance(rows), dense)

    subset = torch.tensor([0, 2, 3, 5, 7, 11])
    rows = TopKRows.of(q_logits[:, subset], top_ids, top_logp, subset_index(subset.numpy(), 12))
    q = torch.zeros(5, 12)
    q[:, subset] = torch.softmax(q_logits[:, subset], -1)
    dense = torch.minimum(torch.softmax(p_logits, -1), q).sum(-1)
    torch.testing.assert_close(top_k_acceptance(rows), dense)
    scores = held_out(lambda batch: [rows, None], [0])
    assert scores.acceptance == pytest.approx([float(dense.mean()), 0.0])
