"""Training an EAGLE-3 head for a target, on CPU, from the target's own continuations.

    edgespec distill --target TARGET --out HEAD_DIR [--data chat|code] [--minutes N]

writes HEAD_DIR in the published EAGLE-3 format (export/eagle3.py reads it), ready for
``edgespec export --target TARGET --draft HEAD_DIR``. Three stages, each saved as it goes so
that a run stopped part way resumes where it stopped (HEAD_DIR/work/):

1. **Continuations** (``teacher.pt``): the target answers prompts (``chat``: the chat prompts
   of chat_prompts.py, as the SmolLM2 draft's recipe asks them; ``code``: windows of the demo
   corpus, this Python's stdlib) greedily or at T = 0.7 or 1 in turn, keeping its top-K
   log-probabilities at every position it generated: on-policy data, as EAGLE-3 regenerates
   its training answers with the target.
2. **Features** (``features.pt``): the target's three aux residual streams (the layers the
   head reads, export/eagle3.py) at every position of those texts, float16.
3. **Training** (``state.pt``, a checkpoint a minute): the head learns the target's
   distribution one token past each feature, with EAGLE-3's training-time test: step 0 reads
   the target's features, step s the head's own hidden_out of the row before at step s - 1,
   attending to the true rows up to where its chain began and to its own chain rows, exactly
   the rows Eagle3Drafter's cache holds when it drafts token s + 1 of a round. The loss is the
   sparse KL to the target's top K (losses.sparse_kl), weighted 0.8^s over the steps (EAGLE-3's
   weights). The head scores the ``draft_vocab`` tokens most frequent in the continuations
   (EAGLE-3's draft vocabulary: d2t/t2d); its lm_head starts from the target's rows of those
   tokens and its final norm from the target's; the embedding is the target's, frozen.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save as safetensors_bytes

from edgespec.errors import EdgespecError, one_line
from edgespec.export.destination import write_file
from edgespec.export.aux_layers import check_aux_layers, default_aux_layers
from edgespec.export.eagle3 import ARCHITECTURES, D2T, T2D, Eagle3Head, HeadConfig, _rotate
from edgespec.models.training.config import DistillConfig
from edgespec.models.training.saved import is_list_of, is_tensor, load_saved
from edgespec.models.training.evaluate import HeldOut, held_out
from edgespec.models.training.loop import (Budget, LoopState, shuffled_batches, train_loop,
                                           warmup_cosine)
from edgespec.models.training.losses import TopKRows, subset_index

Progress = Callable[[str], None]
STEP_WEIGHT = 0.8  # EAGLE-3's weight of step s's loss: 0.8 ** s


@dataclass
class Example:
    """One text: ``ids`` [L]; rows ``start - 1 + j`` of the target predict ``ids[start + j]``
    with top-K ``top_ids``/``top_logp`` [n, K] (n = L - start); ``features`` [L, 3h]."""

    ids: torch.Tensor
    start: int
    top_ids: torch.Tensor
    top_logp: torch.Tensor
    features: torch.Tensor | None = None


def head_config(target_config, folder: Path, draft_vocab: int,
                aux_layers: tuple[int, int, int] | None = None) -> HeadConfig:
    """A head of the target's width, heads and MLP size, reading ``aux_layers`` (three layers
    of the target, checked; default: aux_layers.default_aux_layers)."""
    layers = target_config.num_hidden_layers
    aux_layers = (default_aux_layers(layers) if aux_layers is None
                  else check_aux_layers(aux_layers, layers, repeats=True))
    heads = target_config.num_attention_heads
    rope = {"rope_theta": getattr(target_config, "rope_theta", 10000.0),
            "max_position_embeddings": target_config.max_position_embeddings}
    if getattr(target_config, "rope_scaling", None):
        rope["rope_scaling"] = target_config.rope_scaling
    return HeadConfig(
        path=Path(folder), hidden=target_config.hidden_size, heads=heads,
        kv_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        intermediate=target_config.intermediate_size,
        eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        vocab=target_config.vocab_size, draft_vocab=draft_vocab,
        aux_layers=tuple(aux_layers), rope=rope)


class TrainableHead(Eagle3Head):
    """The reference head (export/eagle3.py) with a batched, differentiable training-time-test
    unroll; its parameters are the reference's, so it saves in the published format."""

    def unroll(self, ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Rows 0..L-2 of texts ``ids`` [B, L] with aux streams ``aux`` [B, L, 3h]: row t reads
        token ids[t + 1] and scores ids[t + 2]. Returns each step's final hidden state
        ``[B, L - 1, h]`` (normed, before lm_head); at step s rows t < s have no chain and are
        meaningless."""
        cfg = self.config
        b, rows = ids.shape[0], ids.shape[1] - 1
        heads, kv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        groups = heads // kv
        emb = self.input_norm(self.embedding[ids[:, 1:]])  # [B, R, h]
        g = self.fc(aux[:, :rows])
        positions = torch.arange(rows)[None].expand(b, rows)
        cos, sin = self.rotary(emb, positions)
        t = torch.arange(rows)
        keys, values, outputs = [], [], []
        for step in range(steps):
            hidden = self.hidden_norm(g)
            z = torch.cat([emb, hidden], -1)
            q = _rotate(self.q(z).view(b, rows, heads, d).transpose(1, 2), cos, sin)
            k = _rotate(self.k(z).view(b, rows, kv, d).transpose(1, 2), cos, sin)
            v = self.v(z).view(b, rows, kv, d).transpose(1, 2)
            keys.append(k.repeat_interleave(groups, 1))
            values.append(v.repeat_interleave(groups, 1))
            # the true rows s <= t - step (where this row's chain began) ...
            scores = [(q @ keys[0].transpose(2, 3)).masked_fill(
                t[None, :] > (t - step)[:, None], float("-inf"))]
            # ... then chain row t - step + i of step i, i = 1..step (the diagonal at i = step)
            chain = [_shift(keys[i], step - i) for i in range(1, step + 1)]
            scores += [(q * key).sum(-1, keepdim=True) for key in chain]
            weights = (torch.cat(scores, -1) / math.sqrt(d)).softmax(-1)
            context = weights[..., :rows] @ values[0]
            for i in range(1, step + 1):
                context = context + weights[..., rows + i - 1 : rows + i] * _shift(
                    values[i], step - i)
            residual = hidden if cfg.norm_before_residual else g
            r = residual + self.o(context.transpose(1, 2).reshape(b, rows, heads * d))
            r = r + self.down(F.silu(self.gate(x := self.post_norm(r))) * self.up(x))
            outputs.append(self.norm(r))
            g = _shift(r, 1, dim=1)  # row t + 1 of the next step reads row t's hidden_out
        return outputs

    def published_state(self, token_ids: np.ndarray) -> dict[str, torch.Tensor]:
        """The weights by their checkpoint names, d2t and t2d from the draft vocabulary."""
        state = {name: getattr(self, module).weight.detach().float().contiguous()
                 for module, name in ((m, f"{n}.weight") for m, n in self._NAMES.items())}
        ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))
        state[D2T] = ids - torch.arange(len(ids))
        t2d = torch.zeros(self.config.vocab, dtype=torch.bool)
        t2d[ids] = True
        state[T2D] = t2d
        return state


def _shift(x: torch.Tensor, by: int, dim: int = 2) -> torch.Tensor:
    """``x`` moved ``by`` rows later along ``dim`` (zeros first): result[t] = x[t - by]."""
    if by == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, by))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - by)], dim)


def write_head(folder: Path, head: TrainableHead, token_ids: np.ndarray,
               report: dict | None = None) -> None:
    """The head in the published format: config.json and model.safetensors (atomically)."""
    cfg = head.config
    config = {
        "architectures": [ARCHITECTURES[0]], "model_type": "llama",
        "hidden_size": cfg.hidden, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate, "rms_norm_eps": cfg.eps,
        **{k: v for k, v in cfg.rope.items()}, "num_hidden_layers": 1,
        "vocab_size": cfg.vocab, "draft_vocab_size": cfg.draft_vocab,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers)},
        "torch_dtype": "float32",
    }
    folder.mkdir(parents=True, exist_ok=True)
    weights = safetensors_bytes(head.published_state(token_ids))
    write_file(folder / "model.safetensors", lambda f: f.write(weights))
    files = {"config.json": config, "training_report.json": report}
    for name, content in files.items():
        if content is not None:
            text = (json.dumps(content, indent=2) + "\n").encode()
            write_file(folder / name, lambda f: f.write(text))


def aux_streams(target, ids: torch.Tensor, aux_layers: tuple[int, int, int]) -> torch.Tensor:
    """The target's residual streams entering ``aux_layers`` for texts ``ids`` [B, L]:
    [B, L, 3h] float32 (hidden_states[i] enters layer i)."""
    with torch.inference_mode():
        states = target.model(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i].float() for i in aux_layers], -1)


def feature_stage(target, examples: list[Example], aux_layers: tuple[int, int, int],
                  cache: Path, report: Progress, batch: int = 8) -> None:
    """Fill each example's ``features`` (float16), saved to ``cache`` every few batches; a
    second run reads the saved ones and computes the rest."""
    width = 3 * target.config.hidden_size
    done = load_saved(cache, "the target's features", lambda saved: is_list_of(
        saved, lambda f: is_tensor(f, 2) and f.shape[1] == width)) if cache.is_file() else []
    if len(done) > len(examples) or any(len(f) != len(e.ids) for f, e in zip(done, examples)):
        raise EdgespecError(f"{cache} holds the features of other texts than this run's (its "
                            "teacher file was replaced?); delete it to compute them again")
    for example, features in zip(examples, done):
        example.features = features
    start = last = time.perf_counter()
    order = sorted(range(len(done), len(examples)), key=lambda i: len(examples[i].ids))
    for first in range(0, len(order), batch):
        chunk = order[first:first + batch]
        width = max(len(examples[i].ids) for i in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, i in enumerate(chunk):  # right-padded: causal rows never read the padding
            ids[r, : len(examples[i].ids)] = examples[i].ids
        features = aux_streams(target, ids, aux_layers).to(torch.float16)
        for r, i in enumerate(chunk):
            examples[i].features = features[r, : len(examples[i].ids)].clone()
        if (now := time.perf_counter()) - last > 60 or first + batch >= len(order):
            last = now
            held = [e.features for e in examples]
            held = held[: next((i for i, f in enumerate(held) if f is None), len(held))]
            write_file(cache, lambda f: torch.save(held, f))
            report(f"features: {first + len(chunk)}/{len(order)} texts, "
                   f"{(now - start) / 60:.1f} min")


def _step_rows(head: TrainableHead, chunk: list[Example], index: torch.Tensor, steps: int
               ) -> list[TopKRows | None]:
    """Each step's rows that have a target distribution and a chain, scored by the head
    (None for a step no text of the chunk is long enough for)."""
    width = max(len(e.ids) for e in chunk)
    ids = torch.zeros((len(chunk), width), dtype=torch.long)
    aux = torch.zeros((len(chunk), width, chunk[0].features.shape[-1]))
    for b, e in enumerate(chunk):
        ids[b, : len(e.ids)], aux[b, : len(e.ids)] = e.ids, e.features.float()
    outputs = head.unroll(ids, aux, steps)
    scored: list[TopKRows | None] = []
    for step, hidden in enumerate(outputs):
        rows, top_ids, top_logp = [], [], []
        for b, e in enumerate(chunk):
            # row t scores ids[t + 2]: the target's row t + 1, top row j = t + 2 - start
            first = max(step, e.start - 2)
            last = len(e.ids) - 2  # rows 0..L-2 exist; row t needs ids[t + 2] < L
            if last <= first:
                continue
            rows.append(hidden[b, first:last])
            j = torch.arange(first, last) + 2 - e.start
            top_ids.append(e.top_ids[j].long())
            top_logp.append(e.top_logp[j].float())
        scored.append(TopKRows.of(head.lm_head(torch.cat(rows)), torch.cat(top_ids),
                                  torch.cat(top_logp), index) if rows else None)
    return scored


def evaluate(head: TrainableHead, index: torch.Tensor, examples: list[Example], steps: int
             ) -> HeldOut:
    """Each step's held-out scores (evaluate.held_out): its acceptance is that of the step's
    token given that the ones before it were accepted."""
    head.eval()
    batches = (examples[i:i + 8] for i in range(0, len(examples), 8))
    scores = held_out(lambda chunk: _step_rows(head, chunk, index, steps), batches)
    head.train()
    return scores


_DISTILL = DistillConfig()  # `edgespec distill`'s defaults, the one home of those it shares


@dataclass(frozen=True)
class TrainSettings:
    minutes: float = _DISTILL.minutes
    lr: float = _DISTILL.lr
    batch: int = 8
    steps: int = _DISTILL.steps  # training-time-test steps (EAGLE-3 uses 7 on GPUs)
    seed: int = _DISTILL.seed
    # stop after this many optimizer steps (tests: deterministic)
    max_steps: int | None = _DISTILL.max_steps


def _is_state(saved: object) -> bool:
    """Whether ``saved`` is what train_head's ``save`` writes."""
    return (isinstance(saved, dict) and isinstance(saved["head"], dict)
            and all(isinstance(k, str) and is_tensor(v) for k, v in saved["head"].items())
            and isinstance(saved["optimizer"], dict) and type(saved["step"]) is int
            and saved["step"] >= 0 and isinstance(saved["seconds"], (int, float))
            and math.isfinite(saved["seconds"]) and saved["seconds"] >= 0)


def train_head(head: TrainableHead, token_ids: np.ndarray, examples: list[Example],
               held: list[Example], settings: TrainSettings, state_path: Path,
               report: Progress) -> dict:
    """AdamW on everything but the embedding, warmup then cosine over the budget (loop.py);
    checkpoints (head, optimizer, time spent) to ``state_path`` a minute, resumed from it."""
    index = subset_index(token_ids, head.config.vocab)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.01)
    resume, before = LoopState(), None
    if state_path.is_file():
        saved = load_saved(state_path, "a training state", _is_state)
        try:
            head.load_state_dict(saved["head"])
            optimizer.load_state_dict(saved["optimizer"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise EdgespecError(f"{state_path} is the state of another head than this run's "
                                f"({one_line(e, 160)}); delete it to train from the start, or "
                                "give the options of the run that saved it") from None
        resume, before = LoopState(saved["step"], saved["seconds"]), saved["before"]
        report(f"train: resuming at step {resume.step}, {resume.seconds / 60:.1f} of "
               f"{settings.minutes} min")
    if before is None:
        before = evaluate(head, index, held, settings.steps).acceptance
        report(f"train: before: held-out sum min(p,q) by step {_fmt(before)}")

    def save(state: LoopState) -> None:
        saved = {"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                 "seconds": state.seconds, "step": state.step, "before": before}
        write_file(state_path, lambda f: torch.save(saved, f))

    weights = [STEP_WEIGHT ** s for s in range(settings.steps)]

    def loss_fn(chunk: list[Example]) -> torch.Tensor:
        rows = _step_rows(head, chunk, index, settings.steps)
        zero = head.lm_head.weight.sum() * 0  # a step without rows: no loss, the graph kept
        return sum(w * (r.kl() if r is not None else zero)
                   for w, r in zip(weights, rows)) / sum(weights)

    def tick(state: LoopState) -> None:
        recent = state.losses[-10:]
        report(f"train: step {state.step}, loss {sum(recent) / len(recent):.3f}, "
               f"{state.seconds / 60:.1f}/{settings.minutes} min")
        save(state)

    budget = Budget(settings.minutes, settings.max_steps)
    batches = shuffled_batches(examples, settings.batch, random.Random(settings.seed + resume.step))
    head.train()
    state = train_loop(loss_fn, batches, optimizer, lambda f: warmup_cosine(settings.lr, f),
                       budget, max_grad_norm=0.5, on_tick=tick, resume=resume)
    state.seconds = min(state.seconds, budget.minutes * 60)
    save(state)
    after = evaluate(head, index, held, settings.steps).acceptance
    report(f"train: after {state.step} steps: held-out sum min(p,q) by step {_fmt(after)}")
    return {"steps": state.step, "minutes": round(state.seconds / 60, 2),
            "heldout_min_pq_before": before, "heldout_min_pq_after": after,
            "train_texts": len(examples), "heldout_texts": len(held), "lr": settings.lr,
            "batch": settings.batch, "ttt_steps": settings.steps}


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)
