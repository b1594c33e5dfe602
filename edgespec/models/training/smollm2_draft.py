"""The draft for SmolLM2-135M-Instruct: its first layers, distilled on its own chat answers.

    python -m edgespec.models.training.smollm2_draft --target FILE.gguf --out DIR

writes ``DIR/layers.safetensors`` and ``DIR/token_ids.npy`` (what edgespec/models/smollm2_draft/
commits), the teacher data ``DIR/teacher.pt`` (kept: a second run skips straight to training)
and the draft as a whole Hugging Face folder ``DIR/hf`` (for llama.cpp's converter).

1. The target (the GGUF file read by transformers: its blocks dequantized) answers the chat
   prompts of chat_prompts.py, two rounds (round 2 summarizes and edits round 1's answers),
   greedily or at temperature 0.7 or 1 in turn per batch (teacher.GENERATION_TEMPERATURES),
   keeping its top-K log-probabilities at each reply position, replies ended by its own end
   tokens: on-policy data as in DistillSpec (Zhou et al., 2024; teacher.py).
2. The draft scores only the ``draft_vocab`` tokens most frequent in those answers (FR-Spec,
   export/vocab.py), so it trains with the head it will run with: its q is a softmax over the
   subset, and the loss is losses.sparse_kl with the top-K tokens outside the subset folded
   into the tail (the partition {each kept top-K token, everything else} is still a partition).
3. The draft is a LlamaForCausalLM of the target's width with ``layers`` layers, initialised
   from the target's first layers and its final norm (the "early exit" of the target), with the
   target's embedding as input table and, rows restricted to the subset, as its head; the
   embedding is frozen, so only the layers and the norm train (~3.5M parameters a layer), in
   the recipes' one loop (loop.py), scored by their one evaluator (evaluate.py).
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes
from transformers import LlamaForCausalLM

from edgespec.export.destination import write_file
from edgespec.export.source import read_checkpoint
from edgespec.export.vocab import TOKEN_IDS_NAME  # a package's name for the ids a draft scores
from edgespec.models.training.evaluate import held_out
from edgespec.models.training.loop import (Budget, LoopState, shuffled_batches, train_loop,
                                           warmup_cosine)
from edgespec.models.training.losses import TopKRows, subset_index
from edgespec.models.training.teacher import (end_tokens, load_target, reply_vocabulary,
                                              teacher_stage)

LAYERS_NAME = "layers.safetensors"


def log(line: str) -> None:
    print(time.strftime("%H:%M:%S"), line, flush=True)


def _save_layers(draft, path: Path) -> None:
    weights = safetensors_bytes(trained_state(draft))
    write_file(path, lambda f: f.write(weights))


def draft_config(target_config, layers: int, eos: list[int]):
    """The target's config with ``layers`` layers: the draft's width, heads and rotary."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = layers
    config.tie_word_embeddings = True
    config.eos_token_id = eos if len(eos) > 1 else eos[0]
    config.architectures = ["LlamaForCausalLM"]
    return config


def early_exit(target: LlamaForCausalLM, layers: int, eos: list[int]) -> LlamaForCausalLM:
    """The target's first ``layers`` layers, final norm and embedding as a model of its own."""
    draft = LlamaForCausalLM(draft_config(target.config, layers, eos))
    kept = {k: v for k, v in target.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    draft.load_state_dict(kept, strict=False)  # lm_head is tied to the embedding
    return draft


def trained_state(draft: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """What training changes, the committed weights: the layers and the final norm (float16)."""
    return {k: v.detach().to(torch.float16).contiguous() for k, v in draft.state_dict().items()
            if k.startswith(("model.layers.", "model.norm."))}


def assemble(config, layers: dict[str, torch.Tensor], embedding: torch.Tensor
             ) -> LlamaForCausalLM:
    """The draft from its committed layers and norm and the target's embedding table (tied)."""
    draft = LlamaForCausalLM(config)
    missing, unexpected = draft.load_state_dict(
        {**{k: v.float() for k, v in layers.items()}, "model.embed_tokens.weight": embedding},
        strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"the draft's weights do not fit its config: missing {missing}, "
                         f"unexpected {unexpected}")
    draft.tie_weights()
    return draft.eval()


def _ids(chunk: list[dict]) -> torch.Tensor:
    """The texts of a batch as ids ``[B, L]``, right-padded (causal rows never read padding)."""
    width = max(len(r["ids"]) - 1 for r in chunk)
    ids = torch.zeros((len(chunk), width), dtype=torch.long)
    for b, r in enumerate(chunk):
        ids[b, :len(r["ids"]) - 1] = torch.tensor(r["ids"][:-1])
    return ids


def _rows(draft, head_rows: torch.Tensor, index: torch.Tensor, chunk: list[dict]) -> TopKRows:
    """The reply positions of a batch (position ``start - 1 + j`` predicts reply token j),
    scored by the draft's head restricted to the subset (``head_rows`` [S, H])."""
    hidden = draft.model(_ids(chunk)).last_hidden_state  # [B, L, H]
    rows = torch.cat([hidden[b, r["start"] - 1:r["start"] - 1 + len(r["top_ids"])]
                      for b, r in enumerate(chunk)])  # [N, H]
    return TopKRows.of(rows @ head_rows.T, torch.cat([r["top_ids"].long() for r in chunk]),
                       torch.cat([r["top_logp"].float() for r in chunk]), index)


def evaluate(draft, head_rows, index, records: list[dict]) -> tuple[float, float]:
    """(mean sparse KL, mean sum_x min(p, q) over the kept top K) on ``records``
    (evaluate.held_out)."""
    batches = (records[i:i + 8] for i in range(0, len(records), 8))
    scores = held_out(lambda chunk: [_rows(draft, head_rows, index, chunk)], batches)
    return scores.kl[0], scores.acceptance[0]


def train(draft, token_ids: np.ndarray, records: list[dict], held: list[dict], minutes: float,
          lr: float, batch: int, seed: int, checkpoint: Path) -> LlamaForCausalLM:
    """AdamW on the layers and norm (embedding frozen), warmup then cosine over the wall-clock
    budget (loop.py); a progress line and a checkpoint a minute, the held-out figures at the
    end."""
    embedding = draft.model.embed_tokens.weight
    embedding.requires_grad_(False)
    index = subset_index(token_ids, embedding.shape[0])
    head_rows = embedding[torch.from_numpy(token_ids).long()]  # [S, H], the restricted head
    params = [p for n, p in draft.named_parameters()
              if n.startswith(("model.layers.", "model.norm."))]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    kl, alpha = evaluate(draft, head_rows, index, held)
    log(f"train: before (early exit): held-out KL {kl:.3f}, sum min(p,q) {alpha:.3f}")

    def tick(state: LoopState) -> None:
        log(f"train: epoch {state.step * batch // len(records)} step {state.step}, loss "
            f"{state.losses[-1]:.3f}, {state.seconds / 60:.1f}/{minutes} min")
        _save_layers(draft, checkpoint)

    draft.train()
    state = train_loop(lambda chunk: _rows(draft, head_rows, index, chunk).kl(),
                       shuffled_batches(records, batch, random.Random(seed)), optimizer,
                       lambda f: warmup_cosine(lr, f), Budget(minutes), max_grad_norm=1.0,
                       on_tick=tick)
    draft.eval()
    kl, alpha = evaluate(draft, head_rows, index, held)
    log(f"train: after {state.step} steps: held-out KL {kl:.3f}, sum min(p,q) {alpha:.3f}")
    return draft


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True,
                        help="SmolLM2-135M-Instruct: the .gguf file or a Hugging Face folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--minutes", type=float, default=20.0, help="training budget")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, nargs=3, default=(48, 24, 24),
                        metavar=("QUESTIONS", "FUNCTIONS", "EDITS"),
                        help="round 1's prompts (round 2 asks as many again, over the answers)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="replies generated together")
    parser.add_argument("--partial", action="store_true",
                        help="train on the teacher batches saved so far (a budget cut short)")
    parser.add_argument("--teacher-only", action="store_true",
                        help="stop after the teacher data (train later with the same --out)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    end = end_tokens(read_checkpoint(args.target, "target"))
    records = teacher_stage(args.target, args.out, args.seed, tuple(args.prompts),
                            args.new_tokens, args.top_k, args.batch, end, log, args.partial)
    if args.teacher_only:
        return
    target, tokenizer = load_target(args.target)
    eos = list(end.stop)
    token_ids = reply_vocabulary(((r["ids"], r["start"]) for r in records),
                                 target.config.vocab_size, args.draft_vocab, eos)
    write_file(args.out / TOKEN_IDS_NAME, lambda f: np.save(f, token_ids))
    held = records[::10]  # every tenth reply held out
    train_records = [r for i, r in enumerate(records) if i % 10]
    draft = early_exit(target, args.layers, eos)
    del target
    draft = train(draft, token_ids, train_records, held, args.minutes, args.lr, 4, args.seed,
                  args.out / LAYERS_NAME)
    _save_layers(draft, args.out / LAYERS_NAME)
    draft.generation_config.eos_token_id = eos[0]
    draft.to(torch.float16).save_pretrained(args.out / "hf", safe_serialization=True)
    # the GGUF's own ids (transformers' GGUF tokenizer names BOS as EOS too; export/gguf.py)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos[0])
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(end.pad)
    tokenizer.save_pretrained(args.out / "hf")
    log(f"wrote {args.out / LAYERS_NAME}, {args.out / TOKEN_IDS_NAME} and {args.out / 'hf'}")



def write_draft(gguf: Path, weights: Path, out: Path) -> np.ndarray:
    """The draft as a Hugging Face folder ``out`` (fp32 weights, the target's tokenizer):
    the committed layers and norm in ``weights`` with the embedding of the target's GGUF file
    (the only tensor read from it); returns the token ids its head scores."""
    from safetensors.torch import load_file

    from edgespec.export.gguf import GGUFTensors, read_gguf_checkpoint

    ckpt = read_gguf_checkpoint(gguf, "target")
    layers = load_file(weights / LAYERS_NAME)
    count = 1 + max(int(k.split(".")[2]) for k in layers if k.startswith("model.layers."))
    with torch.device("meta"):  # names the GGUF's tensors; holds no memory
        shell = LlamaForCausalLM(ckpt.config)
    embedding = GGUFTensors(gguf, shell).read("model.embed_tokens.weight")
    draft = assemble(draft_config(ckpt.config, count, ckpt.eos_token_ids), layers, embedding)
    draft.save_pretrained(out, safe_serialization=True)
    ckpt.tokenizer.save_pretrained(out)
    return np.load(weights / TOKEN_IDS_NAME)


if __name__ == "__main__":
    main()
