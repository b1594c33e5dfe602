"""``edgespec distill``: an EAGLE-3 head for a target, trained on this machine (eagle3_head.py
says how). The stages' data lives in OUT/work/ and each stage resumes from it; the head is
written to OUT when training ends, and again on a second run (which trains on from the saved
state when given more minutes).

Any model family: chat prompts are rendered with the target's own chat template and its replies
end at its own end tokens (teacher.end_tokens: Llama 3's ``<|eot_id|>`` as ChatML's
``<|im_end|>``), which the head's vocabulary always keeps. A target that names no end token, or
(``--data chat``) has no chat template, is refused before anything is written.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from edgespec.errors import EdgespecError
from edgespec.export.aux_layers import check_aux_layers
from edgespec.export.destination import write_file
from edgespec.export.gguf_header import check_gguf
from edgespec.models.recipe import chat_prompts
from edgespec.models.recipe.config import DistillConfig
from edgespec.models.recipe.eagle3_head import (Example, TrainableHead, TrainSettings,
                                                feature_stage, head_config, train_head,
                                                write_head)
from edgespec.models.recipe.teacher import (EndTokens, check_chat_template, end_tokens,
                                            load_target, reply_vocabulary,
                                            target_continuations, teacher_stage)

WORK = "work"


def log(line: str) -> None:
    print(time.strftime("%H:%M:%S"), line, flush=True)


def chat_examples(target_path: Path, work: Path, config: DistillConfig, end: EndTokens,
                  report) -> list[Example]:
    """The target's replies to the chat prompts (teacher.teacher_stage)."""
    records = teacher_stage(target_path, work, config.seed, config.prompts, config.new_tokens,
                            config.top_k, 32, end, report)
    return [Example(torch.tensor(r["ids"]), r["start"], r["top_ids"], r["top_logp"])
            for r in records if len(r["top_ids"]) > 1]


def code_examples(target, tokenizer, work: Path, config: DistillConfig, report
                  ) -> list[Example]:
    """The target's continuations of windows of the demo's corpus (this Python's stdlib,
    train split), saved to ``work/teacher.pt``."""
    from edgespec.models.recipe.build import prepare_corpus
    from edgespec.models.recipe.config import RecipeConfig

    cached = work / "teacher.pt"
    if cached.is_file():
        report(f"teacher: reading {cached}")
        windows, top_ids, top_logp = torch.load(cached)
    else:
        corpus = prepare_corpus(RecipeConfig(seed=config.seed), tokenizer)
        targets = target_continuations(target, corpus.train_ids, config.tokens,
                                       prompt_length=64, new_tokens=config.new_tokens,
                                       top_k=config.top_k, seed=config.seed, progress=report)
        windows, top_ids, top_logp = targets.windows, targets.top_ids, targets.top_logp
        write_file(cached, lambda f: torch.save((windows, top_ids, top_logp), f))
    # row p of a window's targets predicts windows[p + 1]: start 1
    return [Example(w, 1, i, p) for w, i, p in zip(windows, top_ids, top_logp)]


def distill(target_path: Path, out: Path, config: DistillConfig = DistillConfig(),
            report=log) -> dict:
    """Every stage (module docstring); returns the training report."""
    from edgespec.export.pair import read_checkpoint

    out = Path(out)
    work = out / WORK
    most = chat_prompts.first_round_sizes()
    if config.data == "chat" and any(n > m for n, m in zip(config.prompts, most)):
        raise EdgespecError(f"--prompts {' '.join(map(str, config.prompts))} asks for more "
                            f"than the templates make; at most {' '.join(map(str, most))}")
    if out.exists() and not work.is_dir():
        raise EdgespecError(f"{out} exists and is not a head being distilled; choose another --out")
    if work.is_symlink():  # its files would be written wherever it points
        raise EdgespecError(f"{work} is a link; a head being distilled keeps its work in a "
                            "folder of its own: remove the link, or choose another --out")
    if config.aux_layers is not None:  # repeats refused before any work (the depth once read)
        check_aux_layers(config.aux_layers, None)
    if Path(target_path).suffix == ".gguf":  # before OUT is made (load_target checks it too)
        check_gguf(Path(target_path), "target")
    checkpoint = read_checkpoint(Path(target_path), "target")
    end = end_tokens(checkpoint)  # what ends a reply, and the draft vocabulary keeps
    if config.data == "chat":
        check_chat_template(checkpoint)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    if config.data == "chat":
        examples = chat_examples(target_path, work, config, end, report)
        target, tokenizer = load_target(target_path)
    else:
        target, tokenizer = load_target(target_path)
        examples = code_examples(target, tokenizer, work, config, report)
    vocab = target.config.vocab_size
    token_ids = reply_vocabulary(((e.ids.tolist(), e.start) for e in examples), vocab,
                                 min(config.draft_vocab, vocab), end.stop)
    head_cfg = head_config(target.config, out, len(token_ids), config.aux_layers)
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
    settings = TrainSettings(minutes=config.minutes, lr=config.lr, steps=config.steps,
                             seed=config.seed, max_steps=config.max_steps)
    result = train_head(head, token_ids, train, held, settings, work / "state.pt", report)
    result.update(data=config.data, target=str(target_path), draft_vocab=len(token_ids),
                  aux_layers=list(head_cfg.aux_layers))
    write_head(out, head, token_ids, result)
    report(f"wrote the head to {out}; export it with: edgespec export --target {target_path} "
           f"--draft {out} --out PACKAGE")
    return result
