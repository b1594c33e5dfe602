"""The draft's output vocabulary restricted to the most frequent tokens (FR-Spec).

A 135M-0.5B draft over a 49k-152k vocabulary spends a large share of its step in its output
layer (Qwen2.5-0.5B: 136M of its 494M weights are the 151,936 x 896 table). FR-Spec (Zhao et
al., 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
Speculative Sampling") lets the draft score only the most frequent tokens. The draft's q is then
0 outside the subset, which the acceptance rule handles exactly as it is: a token outside the
subset is never proposed, and the residual norm(max(0, p - q)) gives it all of p's mass at a
rejection. Output stays distributed as the target's; only acceptance can drop, when the target
wants a token the draft cannot propose.

The subset: the tokens most frequent in a calibration text, tokenized by the package's
tokenizer; ties and the rest by id (a BPE vocabulary numbers its tokens in merge order, roughly
by frequency in the tokenizer's training corpus, which is the whole ranking when no text is
given). Special tokens the package ends on (EOS) are always in, so the draft can propose the end.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from edgespec.errors import ExportError

TOKEN_IDS_NAME = "token_ids.npy"  # in the draft's folder: int32, ascending


def frequent_tokens(tokenizer, vocab_size: int, size: int, texts: list[Path],
                    always: list[int]) -> np.ndarray:
    """The ``size`` token ids (ascending) the draft will score; ``always`` are included first."""
    counts: Counter[int] = Counter()
    for path in texts:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ExportError(f"cannot read the calibration text {path} ({e}); pass a UTF-8 "
                              "text file (draft_vocab_texts)") from None
        counts.update(tokenizer(text, add_special_tokens=False).input_ids)
    return rank_tokens(counts, vocab_size, size, always)


def rank_tokens(counts: Counter[int], vocab_size: int, size: int, always: list[int]
                ) -> np.ndarray:
    """The ranking (module docstring): ``always`` first, then the ids by count, ties and the
    rest by id; the first ``size`` of them, ascending int32. The one ranking of draft
    vocabularies, here and for drafts trained on the target's texts (models/training/)."""
    if not 0 < size <= vocab_size:
        raise ExportError(f"draft_vocab must be in 1..{vocab_size} (the vocabulary), got {size}")
    ranked = sorted((i for i in counts if i < vocab_size), key=lambda i: (-counts[i], i))
    chosen = dict.fromkeys(i for i in always if i is not None and i < vocab_size)
    for i in ranked:
        if len(chosen) >= size:
            break
        chosen.setdefault(i)
    next_id = 0
    while len(chosen) < size:  # the rest by id: merge order
        chosen.setdefault(next_id)
        next_id += 1
    return np.array(sorted(list(chosen)[:size]), dtype=np.int32)


def coverage(tokenizer, token_ids: np.ndarray, texts: list[Path]) -> float | None:
    """Share of the calibration text's tokens inside the subset (None without a text)."""
    inside = total = 0
    allowed = set(token_ids.tolist())
    for path in texts:
        ids = tokenizer(Path(path).read_text(encoding="utf-8"), add_special_tokens=False).input_ids
        inside += sum(i in allowed for i in ids)
        total += len(ids)
    return inside / total if total else None


def given_tokens(token_ids, vocab_size: int) -> np.ndarray:
    """A subset given as ids (a draft trained on it): checked, ascending int32."""
    ids = np.asarray(token_ids)
    if (ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer)
            or ids.min() < 0 or ids.max() >= vocab_size or len(np.unique(ids)) != len(ids)):
        raise ExportError(f"draft_token_ids must be distinct token ids in 0..{vocab_size - 1}; "
                          "pass the token_ids.npy the draft was trained with")
    return np.sort(ids).astype(np.int32)
