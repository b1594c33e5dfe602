"""Distilling the draft from the target's logits, computed once and kept sparse.

The target runs once over the training stream, cut into windows of the context length, and
its top-K log-probabilities per position are kept (``distill_top_k`` of the vocabulary, ids and
fp16 values); the draft then trains on those windows for as many epochs as its budget allows,
at its own speed: the target's forward pass, many times the draft's, is not in its steps.

The loss is KL(p || q) on the partition {each of the top-K tokens, everything else}: with
P_j = p(top_j), Q_j = q(top_j) and the tails P_rest = 1 - sum_j P_j, Q_rest = 1 - sum_j Q_j,

    KL = sum_j P_j (log P_j - log Q_j) + P_rest (log P_rest - log Q_rest),

which equals the full KL(p || q) whenever the tail is negligible, and never drives q's tail to
zero as a top-K cross-entropy alone would (Hinton et al., 2015; the sparse-logit form as in
Shum et al., 2024, "FIRST: Faster Improved Listwise Reranking with Single Token Decoding", and
the top-K KD of many LLM distillation recipes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM


_BATCH = 8  # windows per teacher run
_GEN_BATCH = 32  # continuations generated together
Progress = Callable[[str], None]


@dataclass(frozen=True)
class TeacherTargets:
    """The target's top-K log-probabilities at every position of each window.

    windows: ``[N, T+1]`` token ids (window i is the stream's tokens i*T .. i*T + T);
    top_ids: ``[N, T, K]`` the K likeliest next tokens at each of the T positions;
    top_logp: ``[N, T, K]`` their log-probabilities under the target (float16).
    """

    windows: torch.Tensor
    top_ids: torch.Tensor
    top_logp: torch.Tensor
    seconds: float

    def __len__(self) -> int:
        return len(self.windows)


def teacher_targets(target: LlamaForCausalLM, stream: torch.Tensor, context_length: int,
                    top_k: int, progress: Progress | None = None) -> TeacherTargets:
    """Run the target once over ``stream`` in consecutive windows; keep each position's top K.

    bf16 autocast, as in training (faster than float32 on CPU); the log-softmax in
    float32.
    """
    report = progress or (lambda line: None)
    windows = stream.unfold(0, context_length + 1, context_length)  # [N, T+1], a view
    n, t = windows.shape[0], context_length
    top_ids, top_logp = _top_k_storage(n, t, top_k, target.config.vocab_size)
    report(f"draft: the target's top {top_k} at {n * t:,} positions ({n} windows of {t})")
    start = last = time.perf_counter()
    target.eval()
    with torch.inference_mode():
        for first in range(0, n, _BATCH):
            batch = windows[first : first + _BATCH, :-1]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = target(batch).logits
            logp = F.log_softmax(logits.float(), dim=-1)  # [B, T, V]
            values, ids = logp.topk(top_k, dim=-1)
            rows = slice(first, first + len(batch))
            top_ids[rows], top_logp[rows] = ids, values  # cast to the storage's types
            if (now := time.perf_counter()) - last > 60:
                done = first + len(batch)
                report(f"draft: target run over {done}/{n} windows, {(now - start) / 60:.1f} min")
                last = now
    seconds = time.perf_counter() - start
    report(f"draft: teacher targets in {seconds / 60:.1f} min")
    return TeacherTargets(windows.clone(), top_ids, top_logp, seconds)


def _top_k_storage(windows: int, length: int, top_k: int, vocab_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``[windows, length, top_k]`` ids (int16 where the vocabulary fits) and fp16
    log-probabilities: a few bytes a kept token, the whole corpus in memory."""
    ids_dtype = torch.int16 if vocab_size <= 2**15 else torch.int32
    return (torch.empty((windows, length, top_k), dtype=ids_dtype),
            torch.empty((windows, length, top_k), dtype=torch.float16))


def sparse_kl(q_logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
              keep: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions of KL(p || q) on {top-K tokens, the rest} (see the module docstring).

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


def warmup_cosine(lr: float, fraction: float) -> float:
    """The learning rate ``fraction`` of the way through a budget: 5% linear warmup, then
    cosine to 0 (the recipes' schedule over a wall-clock budget)."""
    return lr * min(1.0, fraction / 0.05) * 0.5 * (1 + math.cos(math.pi * fraction))


GENERATION_TEMPERATURES = (0.0, 0.7, 1.0)  # greedy and the bench's sampled settings


def target_continuations(target: LlamaForCausalLM, stream: torch.Tensor, tokens: int,
                         prompt_length: int, new_tokens: int, top_k: int, seed: int,
                         progress: Progress | None = None) -> TeacherTargets:
    """The target's own continuations of prompts from ``stream``, with its top K at every
    position: the text a draft is asked about when decoding (on-policy data, as in DistillSpec,
    Zhou et al. 2024, "DistillSpec: Improving Speculative Decoding via Knowledge Distillation").

    Prompts are random windows of ``prompt_length`` tokens; each continuation is ``new_tokens``
    long, drawn greedily or at temperature 0.7 or 1 (GENERATION_TEMPERATURES, in turn per
    batch), with the KV cache, in batches; about ``tokens`` tokens in all. The windows are
    prompt + continuation, so the draft also learns the switch from human text to the model's.
    """
    report = progress or (lambda line: None)
    generator = torch.Generator().manual_seed(seed)
    length = prompt_length + new_tokens - 1  # positions predicted: the last token's row is not
    count = max(_BATCH, tokens // length // _GEN_BATCH * _GEN_BATCH)
    windows = torch.empty((count, length + 1), dtype=torch.long)
    top_ids, top_logp = _top_k_storage(count, length, top_k, target.config.vocab_size)
    report(f"draft: {count} continuations of {new_tokens} tokens by the target")
    start = last = time.perf_counter()
    target.eval()
    for batch, first in enumerate(range(0, count, _GEN_BATCH)):
        rows = slice(first, first + _GEN_BATCH)
        starts = torch.randint(0, len(stream) - prompt_length, (_GEN_BATCH, 1), generator=generator)
        text = stream[starts + torch.arange(prompt_length)]  # [B, P]
        temperature = GENERATION_TEMPERATURES[batch % len(GENERATION_TEMPERATURES)]
        logps = []
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = target(text, use_cache=True)
            logp = F.log_softmax(out.logits.float(), dim=-1)  # [B, P, V]
            logps.append(logp)
            for _ in range(new_tokens):
                last_logp = logps[-1][:, -1]  # [B, V]
                if temperature == 0:
                    token = last_logp.argmax(-1, keepdim=True)
                else:
                    probs = torch.softmax(last_logp / temperature, dim=-1)
                    token = torch.multinomial(probs, 1, generator=generator)
                text = torch.cat([text, token], dim=1)
                out = target(token, past_key_values=out.past_key_values, use_cache=True)
                logps.append(F.log_softmax(out.logits.float(), dim=-1))
        logp = torch.cat(logps, dim=1)  # [B, P + new, V]: the last row predicts past the end
        windows[rows] = text
        values, ids = logp[:, :length].topk(top_k, dim=-1)
        top_ids[rows], top_logp[rows] = ids, values  # cast to the storage's types
        if (now := time.perf_counter()) - last > 60:
            report(f"draft: {first + _GEN_BATCH}/{count} continuations, {(now - start) / 60:.1f} min")
            last = now
    seconds = time.perf_counter() - start
    report(f"draft: continuations in {seconds / 60:.1f} min")
    return TeacherTargets(windows, top_ids, top_logp, seconds)
