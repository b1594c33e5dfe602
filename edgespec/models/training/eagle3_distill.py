"""``edgespec distill``: an EAGLE-3 head for a target, trained on this machine (eagle3_head.py
says how). The stages' data lives in OUT/work/ and each stage resumes from it; the head is
written to OUT when training ends, and again on a second run (which trains on from the saved
state when given more minutes).

Any model family: chat prompts are rendered with the target's own chat template and its replies
end at its own end tokens (teacher.end_tokens: Llama 3's ``<|eot_id|>`` as ChatML's
``<|im_end|>``), which the head's vocabulary always keeps. A target that names no end token, or
(``--data chat``) has no chat template or one that does not render a prompt in bounded time and
memory, or (a GGUF target) lacks transformers' GGUF loader, is refused before anything is
written; a run refused or stopped before its first stage file removes the folders it made.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch

from edgespec.errors import EdgespecError
from edgespec.export.destination import write_file
from edgespec.models.training.chat_prompts import first_round
from edgespec.models.training.config import DISTILL_WORK as WORK, DistillConfig
from edgespec.models.training.eagle3_head import (Example, TrainableHead, TrainSettings,
                                                  feature_stage, head_config, train_head,
                                                  write_head)
from edgespec.models.training.saved import load_saved
from edgespec.models.training.teacher import (EndTokens, check_chat_template, end_tokens,
                                              load_target, needs_gguf_loader,
                                              reply_vocabulary, target_continuations,
                                              teacher_stage)


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
    from edgespec.models.training.build import prepare_corpus
    from edgespec.models.training.config import RecipeConfig

    cached = work / "teacher.pt"
    if cached.is_file():
        report(f"teacher: reading {cached}")
        windows, top_ids, top_logp = load_saved(cached, "the target's continuations",
                                                _is_continuations)
    else:
        corpus = prepare_corpus(RecipeConfig(seed=config.seed), tokenizer)
        targets = target_continuations(target, corpus.train_ids, config.tokens,
                                       prompt_length=64, new_tokens=config.new_tokens,
                                       top_k=config.top_k, seed=config.seed, progress=report)
        windows, top_ids, top_logp = targets.windows, targets.top_ids, targets.top_logp
        write_file(cached, lambda f: torch.save((windows, top_ids, top_logp), f))
    # row p of a window's targets predicts windows[p + 1]: start 1
    return [Example(w, 1, i, p) for w, i, p in zip(windows, top_ids, top_logp)]


def _is_continuations(saved: object) -> bool:
    """Whether ``saved`` is code_examples' (windows [N, L], top ids and log-probabilities
    [N, L - 1, K])."""
    if not (isinstance(saved, tuple) and len(saved) == 3
            and all(isinstance(t, torch.Tensor) for t in saved)):
        return False
    windows, top_ids, top_logp = saved
    return (windows.dim() == 2 and top_ids.dim() == 3 and top_ids.shape == top_logp.shape
            and top_ids.shape[:2] == (windows.shape[0], windows.shape[1] - 1)
            and not windows.is_floating_point())


def _check_token_ids(examples: list[Example], vocab: int, saved: Path) -> None:
    """Every text's ids and teacher ids in the target's vocabulary (a saved file may be
    another target's)."""
    for e in examples:
        for ids in (e.ids, e.top_ids):
            if ids is not None and len(ids) and not (0 <= int(ids.min()) and
                                                     int(ids.max()) < vocab):
                raise EdgespecError(f"{saved} holds token ids outside this target's vocabulary "
                                    f"of {vocab:,} (another target's?); delete it to ask this "
                                    "target again, or give another --out")


def distill(target_path: Path, out: Path, config: DistillConfig = DistillConfig(),
            report=log) -> dict:
    """Every stage (module docstring); returns the training report."""
    from edgespec.export.source import read_checkpoint

    out = Path(out)
    work = out / WORK
    config.check_paths(target_path, out)
    needs_gguf_loader(Path(target_path))
    checkpoint = read_checkpoint(Path(target_path), "target")
    end = end_tokens(checkpoint)  # what ends a reply, and the draft vocabulary keeps
    if config.data == "chat":  # rendered once (bounded) before anything is written
        check_chat_template(checkpoint, first_round(config.seed, *config.prompts)[0])
    made = not out.exists()
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _stages(target_path, out, config, end, report)
    except BaseException:
        if made:  # a run refused before its first stage file leaves no folder behind
            for folder in (work, out):
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only if empty: a stage's file is resumable work
        raise


def _stages(target_path: Path, out: Path, config: DistillConfig, end: EndTokens,
            report) -> dict:
    work = out / WORK
    torch.manual_seed(config.seed)
    if config.data == "chat":
        examples = chat_examples(target_path, work, config, end, report)
        target, tokenizer = load_target(target_path)
    else:
        target, tokenizer = load_target(target_path)
        examples = code_examples(target, tokenizer, work, config, report)
    vocab = target.config.vocab_size
    _check_token_ids(examples, vocab, work / "teacher.pt")
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
