"""Teacher data: what the target writes and predicts, kept sparse, for any model family.

Three kinds, each the target's top-K log-probabilities (ids and fp16 values) at the positions
a draft learns from (losses.py says how it learns):

- ``teacher_targets``: the target run once over a token stream cut into windows; the draft
  then trains on them for as many epochs as its budget allows, at its own speed: the target's
  forward pass, many times the draft's, is not in its steps (the demo's draft);
- ``target_continuations``: the target's own continuations of windows of a stream;
- ``teacher_stage``: the target's replies to chat prompts (chat_prompts.py), two rounds,
  rendered with its own chat template and ended by its own end-of-turn tokens
  (``end_tokens``), saved batch by batch so that a run stopped part way resumes.

Generated text is on-policy data, as in DistillSpec (Zhou et al., 2024, "DistillSpec:
Improving Speculative Decoding via Knowledge Distillation"): greedy or at temperature 0.7 or
1 in turn per batch (GENERATION_TEMPERATURES).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from edgespec.errors import EdgespecError
from edgespec.export.destination import write_file
from edgespec.export.gguf_header import check_gguf
from edgespec.models.training import chat_prompts
from edgespec.models.training.saved import is_list_of, is_tensor, load_saved

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
    count = max(_GEN_BATCH, tokens // length // _GEN_BATCH * _GEN_BATCH)  # whole batches
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


@dataclass(frozen=True)
class EndTokens:
    """The tokens that end the target's replies, and the one it pads batches with."""

    stop: tuple[int, ...]
    pad: int


def end_tokens(checkpoint) -> EndTokens:
    """The end tokens of a target read by export/source.py's read_checkpoint, as the exporter
    takes them (generation_config's eos_token_id, one or several, else config.json's, else the
    tokenizer's eos_token; a GGUF file's EOS and EOT ids), and its pad: the tokenizer's pad
    token, else the first end token.

    So a Llama-3 target ends a reply at ``<|eot_id|>`` and a ChatML one at ``<|im_end|>``,
    whatever the tokenizer calls them. Refuses a target that names none."""
    stop = tuple(checkpoint.eos_token_ids)
    if not stop:
        raise EdgespecError(
            f"--target {checkpoint.path} names no end-of-sequence token, so its replies cannot "
            "end; set eos_token_id in its generation_config.json (or eos_token in its "
            "tokenizer_config.json)")
    pad = checkpoint.tokenizer.pad_token_id
    return EndTokens(stop, stop[0] if pad is None else pad)


_LOADER_FLOORS = {"gguf": ">=0.10", "accelerate": ">=0.26"}  # pyproject.toml's


def check_chat_template(checkpoint, prompt: dict | None = None) -> None:
    """Refuse a target whose tokenizer has no chat template (chat prompts need one), or whose
    template does not render ``prompt`` (a first_round record) within the bounded child's time
    and memory (chat_ids): a hostile or looping template is refused before any work starts."""
    if not getattr(checkpoint.tokenizer, "chat_template", None):
        raise EdgespecError(f"--target {checkpoint.path} has no chat template to ask it chat "
                            "prompts with; use --data code, or a target with a chat template")
    if prompt is not None:
        chat_ids(checkpoint.tokenizer, [prompt["messages"]])


def needs_gguf_loader(path: Path) -> None:
    """A GGUF target is read by transformers' GGUF loader, which needs the gguf and accelerate
    packages: refused before any work when either is missing, with the command that adds it."""
    import importlib.util

    if path.suffix != ".gguf":
        return
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        wanted = " ".join(f"'{name}{_LOADER_FLOORS[name]}'" for name in missing)
        raise EdgespecError(f"--target {path}: transformers reads a GGUF file with "
                            f"{' and '.join(missing)}, not installed; pip install {wanted} "
                            "(edgespec's export extra has them)")


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
    (runtime/bounded_text.py): the template comes with the checkpoint, so it may loop or
    allocate gigabytes (transformers' Jinja even does so while compiling it). The text is then
    tokenized without special tokens, as apply_chat_template tokenizes it."""
    from edgespec.runtime.bounded_text import LIBRARY_TIMEOUT_S, BoundedText

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
           seed: int, end: EndTokens, report: Progress, first_batch: int = 0) -> list[dict]:
    """The target's replies to ``prompts`` with its top K at each reply position.

    Each record: ``ids`` (prompt then reply, ending at the first of ``end.stop`` or after
    ``new_tokens``), ``start`` (the prompt's length: row j of ``top_ids``/``top_logp``
    predicts ``ids[start + j]``), ``top_ids`` int32 and ``top_logp`` float16
    ``[reply length, K]``, ``text``, ``kind``. Prompts are batched by length (less padding),
    left-padded with ``end.pad``; temperature turns per batch, batch ``first_batch`` first.
    """
    rendered = chat_ids(tokenizer, [p["messages"] for p in prompts])
    order = sorted(range(len(prompts)), key=lambda i: len(rendered[i]))
    records = [None] * len(prompts)
    stop = torch.tensor(end.stop)
    start_time = time.perf_counter()
    for b, first in enumerate(range(0, len(order), batch)):
        rows = order[first:first + batch]
        width = max(len(rendered[i]) for i in rows)
        ids = torch.full((len(rows), width), end.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(rendered[i]):] = torch.tensor(rendered[i])
            mask[r, width - len(rendered[i]):] = 1
        temperature = GENERATION_TEMPERATURES[(first_batch + b) % len(GENERATION_TEMPERATURES)]
        torch.manual_seed(seed + b)
        sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                    if temperature else {"do_sample": False})
        eos = end.stop[0] if len(end.stop) == 1 else list(end.stop)
        with torch.inference_mode():  # float32: bf16 autocast slows a CPU decode step
            out = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  pad_token_id=end.pad, eos_token_id=eos, output_logits=True,
                                  return_dict_in_generate=True, **sampling)
        logp = F.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)  # [B, N, V]
        values, top = logp.topk(top_k, dim=-1)
        reply = out.sequences[:, width:]  # [B, N]
        for r, i in enumerate(rows):
            ended = torch.isin(reply[r], stop).nonzero()
            n = int(ended[0]) + 1 if len(ended) else reply.shape[1]
            records[i] = {"ids": rendered[i] + reply[r, :n].tolist(), "start": len(rendered[i]),
                          "top_ids": top[r, :n].to(torch.int32),
                          "top_logp": values[r, :n].to(torch.float16),
                          "text": tokenizer.decode(reply[r, :n], skip_special_tokens=True),
                          "kind": prompts[i]["kind"], "temperature": temperature}
        report(f"teacher: {first + len(rows)}/{len(prompts)} replies (T={temperature}, "
               f"{(time.perf_counter() - start_time) / 60:.1f} min)")
    return records


def teacher_data(target, tokenizer, seed: int, sizes: tuple[int, int, int], new_tokens: int,
                 top_k: int, batch: int, end: EndTokens, done: list[list[dict]], save,
                 report: Progress) -> list[dict]:
    """Both rounds of replies (round 2 summarizes and edits round 1's answers), a batch at a
    time: each batch of round 1 is followed by a batch of round 2 over its replies, and
    ``save`` receives the batches after each one, so that a run stopped part way resumes after
    its ``done`` batches (the prompts are seeded and round 2 is built from the saved
    replies)."""
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
                report(f"teacher: batch {b} ({'round 1' if step == 0 else 'round 2'}), "
                       f"{len(prompts)} prompts")
            records = answer(target, tokenizer, prompts, new_tokens, top_k, batch, seed + b,
                             end, report, first_batch=b) if prompts else []
            batches.append(records)
            save(batches)
    return [r for records in batches for r in records]


def teacher_stage(target_path: Path, out: Path, seed: int, sizes: tuple[int, int, int],
                  new_tokens: int, top_k: int, batch: int, end: EndTokens, report: Progress,
                  partial: bool = False) -> list[dict]:
    """The target's replies to the chat prompts (teacher_data), ended by ``end``, saved batch
    by batch into ``out/teacher.pt``: a second run resumes where the first stopped, and goes
    straight to training when it is complete (or, with ``partial``, on the batches saved so
    far)."""
    cached = out / "teacher.pt"
    done = load_saved(cached, "the teacher's replies", _is_batches) if cached.is_file() else []
    expected = 2 * -(-sum(sizes) // batch)
    if len(done) >= expected or (partial and done):
        report(f"teacher: reading {cached}")
        return [r for records in done for r in records]
    if done:
        report(f"teacher: resuming after {len(done)} of {expected} batches")
    target, tokenizer = load_target(target_path)
    out.mkdir(parents=True, exist_ok=True)

    def save(batches: list[list[dict]]) -> None:
        write_file(cached, lambda f: torch.save(batches, f))  # never a half-written file

    records = teacher_data(target, tokenizer, seed, sizes, new_tokens, top_k, batch, end,
                           done, save, report)
    report(f"teacher: {sum(len(r['top_ids']) for r in records):,} reply positions in {cached}")
    return records


def _is_batches(saved: object) -> bool:
    """Whether ``saved`` is teacher_data's batches: lists of records as ``answer`` makes them."""
    def is_record(r: object) -> bool:
        return (isinstance(r, dict) and is_list_of(r["ids"], lambda i: type(i) is int)
                and type(r["start"]) is int and 0 <= r["start"] <= len(r["ids"])
                and is_tensor(r["top_ids"], 2) and is_tensor(r["top_logp"], 2)
                and len(r["top_ids"]) == len(r["top_logp"]) == len(r["ids"]) - r["start"])
    return is_list_of(saved, lambda batch: is_list_of(batch, is_record))


def reply_vocabulary(texts: Iterable[tuple[list[int], int]], vocab_size: int, size: int,
                     always: Sequence[int]) -> np.ndarray:
    """The ``size`` ids a draft trained on these texts scores: the most frequent among the
    generated tokens (``ids[start:]`` of each ``(ids, start)``), ``always`` included, ranked
    as export/vocab.py ranks (FR-Spec); ascending int32."""
    from edgespec.export.vocab import rank_tokens

    counts = Counter(t for ids, start in texts for t in ids[start:])
    return rank_tokens(counts, vocab_size, size, list(always))
