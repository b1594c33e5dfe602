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
   sparse KL to the target's top K (distill.sparse_kl), weighted 0.8^s over the steps (EAGLE-3's
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

from edgespec.export.destination import write_file
from edgespec.export.aux_layers import check_aux_layers, default_aux_layers
from edgespec.export.eagle3 import ARCHITECTURES, D2T, T2D, Eagle3Head, HeadConfig, _rotate
from edgespec.models.recipe.distill import sparse_kl, warmup_cosine

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
    done = torch.load(cache) if cache.is_file() else []
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


def _batches(examples: list[Example], size: int, rng: random.Random):
    order = list(range(len(examples)))
    rng.shuffle(order)
    for first in range(0, len(order), size):
        yield [examples[i] for i in order[first:first + size]]


def _step_losses(head: TrainableHead, chunk: list[Example], remap: torch.Tensor, steps: int,
                 measure: bool = False):
    """Each step's sparse KL over the rows that have a target distribution and a chain (and
    with ``measure``, each step's summed sum_x min(p, q) and its row count)."""
    width = max(len(e.ids) for e in chunk)
    ids = torch.zeros((len(chunk), width), dtype=torch.long)
    aux = torch.zeros((len(chunk), width, chunk[0].features.shape[-1]))
    for b, e in enumerate(chunk):
        ids[b, : len(e.ids)], aux[b, : len(e.ids)] = e.ids, e.features.float()
    outputs = head.unroll(ids, aux, steps)
    losses, measured = [], []
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
        if not rows:  # texts too short for a chain this long
            losses.append(hidden.sum() * 0)
            measured.append((0.0, 0))
            continue
        logits = head.lm_head(torch.cat(rows))
        sub = remap[torch.cat(top_ids)]
        keep = sub >= 0
        top_logp = torch.cat(top_logp)
        losses.append(sparse_kl(logits, sub.clamp_min(0), top_logp, keep))
        if measure:
            q = torch.softmax(logits.float(), -1).gather(-1, sub.clamp_min(0)) * keep
            alpha = torch.minimum(top_logp.exp(), q).sum(-1)
            measured.append((float(alpha.sum()), len(alpha)))
    return (losses, measured) if measure else losses


def evaluate(head: TrainableHead, remap: torch.Tensor, examples: list[Example], steps: int
             ) -> list[float]:
    """Each step's mean sum_x min(p, q) on ``examples``: the expected acceptance at T = 1 of
    the step's token given the ones before it were accepted (Leviathan et al. 2023)."""
    totals = [[0.0, 0] for _ in range(steps)]
    head.eval()
    with torch.inference_mode():
        for chunk in _batches(examples, 8, random.Random(0)):
            _, measured = _step_losses(head, chunk, remap, steps, measure=True)
            for total, (alpha, n) in zip(totals, measured):
                total[0] += alpha
                total[1] += n
    head.train()
    return [a / max(n, 1) for a, n in totals]


@dataclass(frozen=True)
class TrainSettings:
    minutes: float = 20.0
    lr: float = 1e-3
    batch: int = 8
    steps: int = 3  # training-time-test steps (EAGLE-3 uses 7 on GPUs)
    seed: int = 0
    max_steps: int | None = None  # stop after this many optimizer steps (tests: deterministic)


def train_head(head: TrainableHead, token_ids: np.ndarray, examples: list[Example],
               held: list[Example], settings: TrainSettings, state_path: Path,
               report: Progress) -> dict:
    """AdamW on everything but the embedding, 5% warmup then cosine over the wall-clock budget;
    checkpoints (head, optimizer, time spent) to ``state_path`` a minute, resumed from it."""
    remap = torch.full((head.config.vocab,), -1, dtype=torch.long)
    remap[torch.from_numpy(np.asarray(token_ids, dtype=np.int64))] = torch.arange(len(token_ids))
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.01)
    spent, step, before = 0.0, 0, None
    if state_path.is_file():
        saved = torch.load(state_path)
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        spent, step, before = saved["seconds"], saved["step"], saved["before"]
        report(f"train: resuming at step {step}, {spent / 60:.1f} of {settings.minutes} min")
    if before is None:
        before = evaluate(head, remap, held, settings.steps)
        report(f"train: before: held-out sum min(p,q) by step {_fmt(before)}")

    def save() -> None:
        state = {"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                 "seconds": spent, "step": step, "before": before}
        write_file(state_path, lambda f: torch.save(state, f))

    budget = settings.minutes * 60
    rng = random.Random(settings.seed + step)
    weights = [STEP_WEIGHT ** s for s in range(settings.steps)]
    head.train()
    begun, last = time.perf_counter() - spent, time.perf_counter()
    limit = settings.max_steps or math.inf

    def progress() -> float:  # the schedule's clock: time, or steps when they are the limit
        return step / limit if settings.max_steps else spent / budget

    while spent < budget and step < limit:
        for chunk in _batches(examples, settings.batch, rng):
            spent = time.perf_counter() - begun
            if spent >= budget or step >= limit:
                break
            fraction = progress()
            for group in optimizer.param_groups:
                group["lr"] = warmup_cosine(settings.lr, fraction)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = _step_losses(head, chunk, remap, settings.steps)
            loss = sum(w * s for w, s in zip(weights, losses)) / sum(weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step()
            step += 1
            if time.perf_counter() - last > 60:
                last = time.perf_counter()
                report(f"train: step {step}, loss by step "
                       f"{_fmt([float(x) for x in losses])}, {spent / 60:.1f}/{settings.minutes} min")
                save()
    spent = min(spent, budget)
    save()
    after = evaluate(head, remap, held, settings.steps)
    report(f"train: after {step} steps: held-out sum min(p,q) by step {_fmt(after)}")
    return {"steps": step, "minutes": round(spent / 60, 2), "heldout_min_pq_before": before,
            "heldout_min_pq_after": after, "train_texts": len(examples),
            "heldout_texts": len(held), "lr": settings.lr, "batch": settings.batch,
            "ttt_steps": settings.steps}


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)
