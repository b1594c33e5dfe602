"""The draft for SmolLM2-135M-Instruct: its first layers, distilled on its own chat answers.

    python -m edgespec.models.recipe.smollm2_draft --target FILE.gguf --out DIR

writes ``DIR/layers.safetensors`` and ``DIR/token_ids.npy`` (what edgespec/models/smollm2_draft/
commits), the teacher data ``DIR/teacher.pt`` (kept: a second run skips straight to training)
and the draft as a whole Hugging Face folder ``DIR/hf`` (for llama.cpp's converter).

1. The target (the GGUF file read by transformers: its blocks dequantized) answers the chat
   prompts of chat_prompts.py, two rounds (round 2 summarizes and edits round 1's answers),
   greedily or at temperature 0.7 or 1 in turn per batch (distill.GENERATION_TEMPERATURES),
   keeping its top-K log-probabilities at each reply position: on-policy data as in DistillSpec
   (Zhou et al., 2024).
2. The draft scores only the ``draft_vocab`` tokens most frequent in those answers (FR-Spec,
   export/vocab.py), so it trains with the head it will run with: its q is a softmax over the
   subset, and the loss is distill.sparse_kl with the top-K tokens outside the subset folded
   into the tail (the partition {each kept top-K token, everything else} is still a partition).
3. The draft is a LlamaForCausalLM of the target's width with ``layers`` layers, initialised
   from the target's first layers and its final norm (the "early exit" of the target), with the
   target's embedding as input table and, rows restricted to the subset, as its head; the
   embedding is frozen, so only the layers and the norm train (~3.5M parameters a layer).
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save as safetensors_bytes
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from edgespec.export.destination import write_file
from edgespec.export.gguf_header import check_gguf
from edgespec.models.recipe import chat_prompts
from edgespec.models.recipe.distill import GENERATION_TEMPERATURES, sparse_kl, warmup_cosine

LAYERS_NAME = "layers.safetensors"
TOKEN_IDS_NAME = "token_ids.npy"


def log(line: str) -> None:
    print(time.strftime("%H:%M:%S"), line, flush=True)


def load_target(path: Path) -> tuple[LlamaForCausalLM, object]:
    """The target and its tokenizer from a .gguf file (dequantized by transformers) or an HF
    folder."""
    path = Path(path)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    if kwargs:  # transformers' GGUF loader trusts the file's counts (gguf_header.py)
        check_gguf(path, "target")
    folder = path.parent if kwargs else path
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, **kwargs)
    return model.eval(), tokenizer


def chat_ids(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """Each conversation as ``tokenizer.apply_chat_template(..., add_generation_prompt=True,
    tokenize=True)`` makes it, but rendered in edgespec's bounded child process
    (serve/text_process.py): the template comes with the checkpoint, so it may loop or
    allocate gigabytes (transformers' Jinja even does so while compiling it). The text is then
    tokenized without special tokens, as apply_chat_template tokenizes it."""
    from edgespec.serve.text_process import LIBRARY_TIMEOUT_S, BoundedText

    source = tokenizer.get_chat_template()  # a ValueError naming the problem if none
    text = BoundedText(None, source, "of the target's tokenizer", LIBRARY_TIMEOUT_S,
                       max_chars=1 << 20, max_ids=0,
                       special_tokens=dict(tokenizer.special_tokens_map))
    try:
        return [tokenizer(text.render_text(messages), add_special_tokens=False).input_ids
                for messages in conversations]
    finally:
        text.close()


def answer(target, tokenizer, prompts: list[dict], new_tokens: int, top_k: int, batch: int,
           seed: int, eos: int, first_batch: int = 0) -> list[dict]:
    """The target's replies to ``prompts`` with its top K at each reply position.

    Each record: ``ids`` (prompt then reply, ending at EOS or after ``new_tokens``), ``start``
    (the prompt's length: row j of ``top_ids``/``top_logp`` predicts ``ids[start + j]``),
    ``top_ids`` int32 and ``top_logp`` float16 ``[reply length, K]``, ``text``, ``kind``.
    Prompts are batched by length (less padding), left-padded; temperature turns per batch,
    batch ``first_batch`` first.
    """
    rendered = chat_ids(tokenizer, [p["messages"] for p in prompts])
    order = sorted(range(len(prompts)), key=lambda i: len(rendered[i]))
    records = [None] * len(prompts)
    start_time = time.perf_counter()
    for b, first in enumerate(range(0, len(order), batch)):
        rows = order[first:first + batch]
        width = max(len(rendered[i]) for i in rows)
        ids = torch.full((len(rows), width), eos, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(rendered[i]):] = torch.tensor(rendered[i])
            mask[r, width - len(rendered[i]):] = 1
        temperature = GENERATION_TEMPERATURES[(first_batch + b) % len(GENERATION_TEMPERATURES)]
        torch.manual_seed(seed + b)
        sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                    if temperature else {"do_sample": False})
        with torch.inference_mode():  # float32: bf16 autocast halves a CPU decode step's speed
            out = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  pad_token_id=eos, eos_token_id=eos, output_logits=True,
                                  return_dict_in_generate=True, **sampling)
        logp = F.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)  # [B, N, V]
        values, top = logp.topk(top_k, dim=-1)
        reply = out.sequences[:, width:]  # [B, N]
        for r, i in enumerate(rows):
            ended = (reply[r] == eos).nonzero()
            n = int(ended[0]) + 1 if len(ended) else reply.shape[1]
            records[i] = {"ids": rendered[i] + reply[r, :n].tolist(), "start": len(rendered[i]),
                          "top_ids": top[r, :n].to(torch.int32),
                          "top_logp": values[r, :n].to(torch.float16),
                          "text": tokenizer.decode(reply[r, :n], skip_special_tokens=True),
                          "kind": prompts[i]["kind"], "temperature": temperature}
        log(f"teacher: {first + len(rows)}/{len(prompts)} replies (T={temperature}, "
            f"{(time.perf_counter() - start_time) / 60:.1f} min)")
    return records


def teacher_data(target, tokenizer, seed: int, sizes: tuple[int, int, int], new_tokens: int,
                 top_k: int, batch: int, eos: int, done: list[list[dict]], save) -> list[dict]:
    """Both rounds of replies (module docstring, step 1), a batch at a time: each batch of
    round 1 is followed by a batch of round 2 over its replies, and ``save`` receives the
    batches after each one, so that a run stopped part way resumes after its ``done``
    batches (the prompts are seeded and round 2 is built from the saved replies)."""
    questions, functions, edits = sizes
    first = chat_prompts.first_round(seed, questions, functions, edits)
    batches = list(done)
    for c, start in enumerate(range(0, len(first), batch)):
        chunk = first[start:start + batch]
        for step in range(2):
            b = 2 * c + step
            if b < len(batches):
                continue
            if step == 0:
                prompts = chunk
            else:  # round 2 over this chunk's replies
                replies = [(p, r["text"]) for p, r in zip(chunk, batches[b - 1])]
                prompts = chat_prompts.second_round(replies, seed + b, len(chunk))
            if prompts:
                log(f"teacher: batch {b} ({'round 1' if step == 0 else 'round 2'}), "
                    f"{len(prompts)} prompts")
            records = answer(target, tokenizer, prompts, new_tokens, top_k, batch, seed + b,
                             eos, first_batch=b) if prompts else []
            batches.append(records)
            save(batches)
    return [r for records in batches for r in records]


def frequent_ids(records: list[dict], vocab_size: int, size: int, always: list[int]
                 ) -> np.ndarray:
    """The ``size`` ids most frequent among the replies' tokens (ties and the rest by id, as
    export/vocab.py ranks), ``always`` included; ascending int32."""
    counts = Counter(t for r in records for t in r["ids"][r["start"]:])
    ranked = dict.fromkeys(always)
    for i in sorted(counts, key=lambda i: (-counts[i], i)):
        ranked.setdefault(i)
    i = 0
    while len(ranked) < size:
        ranked.setdefault(i)
        i += 1
    return np.array(sorted(list(ranked)[:size]), dtype=np.int32)


def teacher_stage(target_path: Path, out: Path, seed: int, sizes: tuple[int, int, int],
                  new_tokens: int, top_k: int, batch: int, partial: bool = False) -> list[dict]:
    """The teacher data, saved batch by batch into ``out/teacher.pt``: a second run resumes
    where the first stopped, and goes straight to training when it is complete (or, with
    ``partial``, on the batches saved so far)."""
    cached = out / "teacher.pt"
    done = torch.load(cached) if cached.is_file() else []
    expected = 2 * -(-sum(sizes) // batch)
    if len(done) >= expected or (partial and done):
        log(f"teacher: reading {cached}")
        return [r for records in done for r in records]
    if done:
        log(f"teacher: resuming after {len(done)} of {expected} batches")
    target, tokenizer = load_target(target_path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out.mkdir(parents=True, exist_ok=True)

    def save(batches: list[list[dict]]) -> None:
        write_file(cached, lambda f: torch.save(batches, f))  # never a half-written file

    records = teacher_data(target, tokenizer, seed, sizes, new_tokens, top_k, batch, eos,
                           done, save)
    log(f"teacher: {sum(len(r['top_ids']) for r in records):,} reply positions in {cached}")
    return records


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


def _batches(records: list[dict], size: int, rng: random.Random):
    """Shuffled batches: ids ``[B, L]`` right-padded, and per record the rows of its reply
    positions (position ``start - 1 + j`` predicts reply token j)."""
    order = list(range(len(records)))
    rng.shuffle(order)
    for first in range(0, len(order), size):
        chunk = [records[i] for i in order[first:first + size]]
        width = max(len(r["ids"]) - 1 for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        for b, r in enumerate(chunk):
            ids[b, :len(r["ids"]) - 1] = torch.tensor(r["ids"][:-1])
        yield ids, chunk


def _loss(draft, embedding_rows, remap, ids, chunk, measure: bool = False):
    """sparse_kl over the reply positions of a batch, the head restricted to the subset; with
    ``measure`` also sum_x min(p, q) over each position's kept top K (a lower bound of the
    expected acceptance at T = 1, Leviathan et al. 2023) summed, and the positions."""
    hidden = draft.model(ids).last_hidden_state  # [B, L, H]
    rows = torch.cat([hidden[b, r["start"] - 1:r["start"] - 1 + len(r["top_ids"])]
                      for b, r in enumerate(chunk)])  # [N, H]
    logits = rows @ embedding_rows.T  # [N, S]
    top_ids = torch.cat([r["top_ids"] for r in chunk]).long()  # [N, K]
    top_logp = torch.cat([r["top_logp"].float() for r in chunk])
    sub = remap[top_ids]  # [N, K], -1 outside the subset
    keep = sub >= 0
    loss = sparse_kl(logits, sub.clamp_min(0), top_logp, keep)
    if not measure:
        return loss
    q = torch.softmax(logits.float(), -1).gather(-1, sub.clamp_min(0)) * keep
    alpha = torch.minimum(top_logp.float().exp(), q).sum(-1)
    return loss, float(alpha.sum()), len(alpha)


def evaluate(draft, embedding_rows, remap, records: list[dict]) -> tuple[float, float]:
    """(mean sparse KL, mean sum_x min(p, q)) on ``records``."""
    total_alpha = total_loss = count = 0.0
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for ids, chunk in _batches(records, 8, random.Random(0)):
            loss, alpha, n = _loss(draft, embedding_rows, remap, ids, chunk, measure=True)
            total_loss += float(loss) * n
            total_alpha += alpha
            count += n
    return total_loss / count, total_alpha / count


def train(draft, token_ids: np.ndarray, records: list[dict], held: list[dict], minutes: float,
          lr: float, batch: int, seed: int, checkpoint: Path) -> LlamaForCausalLM:
    """AdamW on the layers and norm (embedding frozen), cosine over the wall-clock budget,
    bf16 autocast; a progress line a minute and the held-out figures at the end."""
    embedding = draft.model.embed_tokens.weight
    embedding.requires_grad_(False)
    remap = torch.full((embedding.shape[0],), -1, dtype=torch.long)
    remap[torch.from_numpy(token_ids).long()] = torch.arange(len(token_ids))
    rows = embedding[torch.from_numpy(token_ids).long()]  # [S, H], the restricted head
    params = [p for n, p in draft.named_parameters() if n.startswith(("model.layers.", "model.norm."))]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    rng = random.Random(seed)
    kl, alpha = evaluate(draft, rows, remap, held)
    log(f"train: before (early exit): held-out KL {kl:.3f}, sum min(p,q) {alpha:.3f}")
    start = last = time.perf_counter()
    step = epoch = 0
    draft.train()
    while (elapsed := time.perf_counter() - start) < minutes * 60:
        for ids, chunk in _batches(records, batch, rng):
            elapsed = time.perf_counter() - start
            if elapsed >= minutes * 60:
                break
            fraction = elapsed / (minutes * 60)
            for group in optimizer.param_groups:
                group["lr"] = warmup_cosine(lr, fraction)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(draft, rows, remap, ids, chunk)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            if time.perf_counter() - last > 60:
                last = time.perf_counter()
                log(f"train: epoch {epoch} step {step}, loss {float(loss):.3f}, "
                    f"{(last - start) / 60:.1f}/{minutes} min")
                _save_layers(draft, checkpoint)
        epoch += 1
    draft.eval()
    kl, alpha = evaluate(draft, rows, remap, held)
    log(f"train: after {step} steps ({epoch} epochs): held-out KL {kl:.3f}, sum min(p,q) {alpha:.3f}")
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
    records = teacher_stage(args.target, args.out, args.seed, tuple(args.prompts),
                            args.new_tokens, args.top_k, args.batch, args.partial)
    if args.teacher_only:
        return
    target, tokenizer = load_target(args.target)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    token_ids = frequent_ids(records, target.config.vocab_size, args.draft_vocab, eos)
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
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
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
