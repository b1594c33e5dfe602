"""``edgespec distill``: an EAGLE-3 head for a target, trained on this machine (eagle3_head.py
says how). The stages' data lives in OUT/work/ and each stage resumes from it; the head is
written to OUT when training ends, and again on a second run (which trains on from the saved
state when given more minutes).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from edgespec.errors import EdgespecError
from edgespec.export.destination import write_file
from edgespec.export.aux_layers import check_aux_layers
from edgespec.export.gguf_header import check_gguf
from edgespec.models.recipe import chat_prompts
from edgespec.models.recipe.eagle3_head import (Example, TrainableHead, TrainSettings,
                                                feature_stage, head_config, train_head,
                                                write_head)

WORK = "work"


def log(line: str) -> None:
    print(time.strftime("%H:%M:%S"), line, flush=True)


def chat_examples(target_path: Path, work: Path, prompts: tuple[int, int, int],
                  new_tokens: int, top_k: int, seed: int) -> list[Example]:
    """The target's replies to the chat prompts (the SmolLM2 draft recipe's teacher stage)."""
    from edgespec.models.recipe.smollm2_draft import teacher_stage

    records = teacher_stage(target_path, work, seed, prompts, new_tokens, top_k, batch=32)
    return [Example(torch.tensor(r["ids"]), r["start"], r["top_ids"], r["top_logp"])
            for r in records if len(r["top_ids"]) > 1]


def code_examples(target, tokenizer, work: Path, tokens: int, new_tokens: int, top_k: int,
                  seed: int, report) -> list[Example]:
    """The target's continuations of windows of the demo's corpus (this Python's stdlib,
    train split), saved to ``work/teacher.pt``."""
    from edgespec.models.recipe.build import prepare_corpus
    from edgespec.models.recipe.config import RecipeConfig
    from edgespec.models.recipe.distill import target_continuations

    cached = work / "teacher.pt"
    if cached.is_file():
        report(f"teacher: reading {cached}")
        windows, top_ids, top_logp = torch.load(cached)
    else:
        corpus = prepare_corpus(RecipeConfig(seed=seed), tokenizer)
        targets = target_continuations(target, corpus.train_ids, tokens, prompt_length=64,
                                       new_tokens=new_tokens, top_k=top_k, seed=seed,
                                       progress=report)
        windows, top_ids, top_logp = targets.windows, targets.top_ids, targets.top_logp
        write_file(cached, lambda f: torch.save((windows, top_ids, top_logp), f))
    # row p of a window's targets predicts windows[p + 1]: start 1
    return [Example(w, 1, i, p) for w, i, p in zip(windows, top_ids, top_logp)]


def draft_vocabulary(examples: list[Example], vocab: int, size: int, always: list[int]
                     ) -> np.ndarray:
    """The ``size`` ids most frequent in the generated tokens (always including ``always``)."""
    from edgespec.models.recipe.smollm2_draft import frequent_ids

    records = [{"ids": e.ids.tolist(), "start": e.start} for e in examples]
    return frequent_ids(records, vocab, min(size, vocab), always)


def distill(target_path: Path, out: Path, data: str, minutes: float, draft_vocab: int,
            steps: int = 3, prompts: tuple[int, int, int] = (300, 72, 96), tokens: int = 150_000,
            new_tokens: int = 128, top_k: int = 32, lr: float = 1e-3, seed: int = 0,
            aux_layers: tuple[int, int, int] | None = None, report=log) -> dict:
    """Every stage (module docstring); returns the training report."""
    from edgespec.models.recipe.smollm2_draft import load_target

    out = Path(out)
    work = out / WORK
    most = chat_prompts.first_round_sizes()
    if data == "chat" and any(n > m for n, m in zip(prompts, most)):
        raise EdgespecError(f"--prompts {' '.join(map(str, prompts))} asks for more than the "
                            f"templates make; at most {' '.join(map(str, most))}")
    if out.exists() and not work.is_dir():
        raise EdgespecError(f"{out} exists and is not a head being distilled; choose another --out")
    if work.is_symlink():  # its files would be written wherever it points
        raise EdgespecError(f"{work} is a link; a head being distilled keeps its work in a "
                            "folder of its own: remove the link, or choose another --out")
    if aux_layers is not None:  # repeats refused before any work (the depth once it is read)
        check_aux_layers(aux_layers, None)
    if Path(target_path).suffix == ".gguf":  # before OUT is made (load_target checks it too)
        check_gguf(Path(target_path), "target")
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if data == "chat":
        examples = chat_examples(target_path, work, prompts, new_tokens, top_k, seed)
        target, tokenizer = load_target(target_path)
    else:
        target, tokenizer = load_target(target_path)
        examples = code_examples(target, tokenizer, work, tokens, new_tokens, top_k, seed, report)
    config = target.config
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    if data == "chat":  # the chat template's end of turn
        eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    token_ids = draft_vocabulary(examples, config.vocab_size, draft_vocab,
                                 [e for e in eos if e is not None])
    head_cfg = head_config(config, out, len(token_ids), aux_layers)
    report(f"head: aux layers {list(head_cfg.aux_layers)}, {len(token_ids):,} draft tokens, "
           f"{len(examples):,} texts ({sum(len(e.ids) for e in examples):,} tokens)")
    feature_stage(target, examples, head_cfg.aux_layers, work / "features.pt", report)

    embedding = target.get_input_embeddings().weight.detach().float()
    head = TrainableHead(head_cfg, embedding)
    rows = torch.from_numpy(token_ids.astype(np.int64))
    with torch.no_grad():  # lm_head and final norm start as the target's
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[rows].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
    del target
    held = examples[::10]
    train = [e for i, e in enumerate(examples) if i % 10]
    settings = TrainSettings(minutes=minutes, lr=lr, steps=steps, seed=seed)
    result = train_head(head, token_ids, train, held, settings, work / "state.pt", report)
    result.update(data=data, target=str(target_path), draft_vocab=len(token_ids),
                  aux_layers=list(head_cfg.aux_layers))
    write_head(out, head, token_ids, result)
    report(f"wrote the head to {out}; export it with: edgespec export --target {target_path} "
           f"--draft {out} --out PACKAGE")
    return result
