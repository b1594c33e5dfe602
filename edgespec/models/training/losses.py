"""The recipes' losses: next-token cross-entropy, and KL(p || q) to the target's top K.

The target's distribution is kept sparse (teacher.py): its top-K log-probabilities per
position, ids and fp16 values. The loss is KL(p || q) on the partition {each of the top-K
tokens, everything else}: with P_j = p(top_j), Q_j = q(top_j) and the tails
P_rest = 1 - sum_j P_j, Q_rest = 1 - sum_j Q_j,

    KL = sum_j P_j (log P_j - log Q_j) + P_rest (log P_rest - log Q_rest),

which equals the full KL(p || q) whenever the tail is negligible, and never drives q's tail to
zero as a top-K cross-entropy alone would (Hinton et al., 2015; the sparse-logit form as in
Shum et al., 2024, "FIRST: Faster Improved Listwise Reranking with Single Token Decoding", and
the top-K KD of many LLM distillation recipes). Minimising it raises sum_x min(p, q), the rate
at which speculative decoding accepts the draft's tokens (evaluate.py).

A draft that scores only a subset of the vocabulary (FR-Spec, export/vocab.py) gives q = 0
outside it: those top-K tokens join the tail P_rest (``keep``), still a partition.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def next_token_loss(logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [B, T, V] against the next tokens windows[:, 1:] [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())


def sparse_kl(q_logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
              keep: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions of KL(p || q) on {top-K tokens, the rest} (module docstring).

    q_logits: ``[..., V]``; top_ids, top_logp: ``[..., K]``. keep: ``[..., K]`` bool, False
    for top-K tokens that q cannot give (a draft head restricted to a token subset, FR-Spec;
    their ids are then ignored): their p joins the tail P_rest, which is still a partition.
    """
    log_q = F.log_softmax(q_logits.float(), dim=-1)
    ids = top_ids.long() if keep is None else top_ids.long().where(keep, 0)  # 0: masked below
    log_q_top = log_q.gather(-1, ids)  # [..., K]
    log_p_top = top_logp.float()
    p_top, q_top = log_p_top.exp(), log_q_top.exp()
    if keep is not None:
        p_top, q_top = p_top * keep, q_top * keep
    p_rest = (1 - p_top.sum(-1)).clamp_min(0)
    q_rest = (1 - q_top.sum(-1)).clamp_min(1e-12)
    kl_top = (p_top * (log_p_top - log_q_top)).sum(-1)
    kl_rest = p_rest * (torch.log(p_rest.clamp_min(1e-12)) - torch.log(q_rest))
    return (kl_top + kl_rest).mean()


def subset_index(token_ids: np.ndarray, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]``: each token's row in a head restricted to ``token_ids``, -1 outside."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[torch.from_numpy(np.asarray(token_ids, dtype=np.int64))] = torch.arange(len(token_ids))
    return index


@dataclass(frozen=True)
class TopKRows:
    """Rows a draft scored with a head restricted to a token subset, and the target's top K
    at each: ``q_logits`` [N, S] over the subset, ``top_ids`` [N, K] as rows of the subset,
    ``top_logp`` [N, K] float32, ``keep`` [N, K] False where the token is outside it."""

    q_logits: torch.Tensor
    top_ids: torch.Tensor
    top_logp: torch.Tensor
    keep: torch.Tensor

    @classmethod
    def of(cls, q_logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
           index: torch.Tensor) -> TopKRows:
        """From the target's top K as vocabulary ids, through ``index`` (subset_index)."""
        rows = index[top_ids.long()]
        return cls(q_logits, rows.clamp_min(0), top_logp.float(), rows >= 0)

    def kl(self) -> torch.Tensor:
        return sparse_kl(self.q_logits, self.top_ids, self.top_logp, self.keep)
