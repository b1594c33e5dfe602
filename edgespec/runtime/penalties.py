"""Repetition penalties: the target's logits of tokens already in the text, changed before a row
is processed (temperature, top-k, top-p, min-p: sampling.py), in greedy decoding too.

- ``repetition_penalty`` r (transformers' RepetitionPenaltyLogitsProcessor, after Keskar et al.
  2019, CTRL): every token in the text so far, prompt included: l / r if l > 0, else l * r.
- ``presence_penalty`` a_p and ``frequency_penalty`` a_f (OpenAI's): l - a_p [c > 0] - a_f c,
  c the token's count among the generated tokens (the prompt's do not count), after r.

Row n (the token at position n) is penalized for the text before n, drafts included, so p_n is
still a function of the prefix alone: the acceptance rule (acceptance.py) and the uniforms keyed
by position are unchanged, and speculative output stays the target's. A draft model's rows
are penalized the same way (``row``), so that q stays near p: any q keeps the output exact,
only acceptance would differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgespec.config import SamplingConfig


class Penalties:
    """One generation's counts: which tokens its text holds, how often each was generated.

    Counts cover ``committed`` as the rounds give it (``rows`` catches up on what it has not
    seen), never drafts: those are added row by row and forgotten.
    """

    def __init__(self, sampling: SamplingConfig, prompt_tokens: int):
        self.r = sampling.repetition_penalty
        self.presence, self.frequency = sampling.presence_penalty, sampling.frequency_penalty
        self.prompt_tokens = prompt_tokens  # positions before it are the prompt's
        self.known = 0  # tokens of the text counted so far
        self.in_text: set[int] = set()  # every token of the text (for r)
        self.generated: dict[int, int] = {}  # token -> count among the generated (for a_p, a_f)

    @property
    def active(self) -> bool:
        return self.r != 1 or self.presence != 0 or self.frequency != 0

    def rows(self, logits: np.ndarray, committed: list[int], drafted: Sequence[int] = ()
             ) -> np.ndarray:
        """``logits [n, V]``, row i scoring the token after ``committed + drafted[:i]``
        (n <= len(drafted) + 1), penalized for that text; the array itself when no penalty
        is set, else a float32 copy."""
        if not self.active:
            return logits
        self._count(committed)
        out = np.array(logits, dtype=np.float32)  # [n, V]
        for i, row in enumerate(out):
            self._penalize(row, *self._with(committed, drafted[:i]))
        return out

    def row(self, logits: np.ndarray, committed: list[int], drafted: Sequence[int],
            token_ids: np.ndarray | None = None) -> np.ndarray:
        """A draft's row scoring the token after ``committed + drafted``, penalized for that
        text as the target's is: ``[V]``, or ``[N]`` whose column j is token ``token_ids[j]``
        (a subset draft; tokens outside it have no logit to change). The row itself when no
        penalty is set, else a float32 copy."""
        if not self.active:
            return logits
        self._count(committed)
        out = np.array(logits, dtype=np.float32)  # [V] or [N]
        self._penalize(out, *self._with(committed, drafted), token_ids)
        return out

    def _with(self, committed: list[int], drafted: Sequence[int]
              ) -> tuple[set[int], dict[int, int]]:
        """The counts of ``committed`` (counted) and then ``drafted``, as copies."""
        in_text, generated = set(self.in_text), dict(self.generated)
        for position, token in enumerate(drafted, start=len(committed)):
            self._add(in_text, generated, position, token)
        return in_text, generated

    def _count(self, committed: list[int]) -> None:
        for position in range(self.known, len(committed)):
            self._add(self.in_text, self.generated, position, committed[position])
        self.known = len(committed)

    def _add(self, in_text: set[int], generated: dict[int, int], position: int,
             token: int) -> None:
        in_text.add(token)
        if position >= self.prompt_tokens:
            generated[token] = generated.get(token, 0) + 1

    def _penalize(self, row: np.ndarray, in_text: set[int], generated: dict[int, int],
                  token_ids: np.ndarray | None = None) -> None:
        """Row ``[V]`` (or ``[N]``, column j token ``token_ids[j]``) in place: l -> l / r or
        l * r for the tokens in the text, then l - a_p [c > 0] - a_f c for the generated."""
        if self.r != 1 and in_text:
            columns, _ = _columns(np.fromiter(in_text, np.int64, len(in_text)), len(row),
                                  token_ids)
            values = row[columns]
            row[columns] = np.where(values > 0, values / self.r, values * self.r)
        if (self.presence or self.frequency) and generated:
            columns, kept = _columns(np.fromiter(generated, np.int64, len(generated)),
                                     len(row), token_ids)
            counts = np.fromiter(generated.values(), np.float32, len(generated))[kept]
            row[columns] -= self.presence + self.frequency * counts


def _columns(ids: np.ndarray, width: int, token_ids: np.ndarray | None
             ) -> tuple[np.ndarray, np.ndarray]:
    """The columns of a row ``[width]`` holding tokens ``ids`` (column j: token j, or
    ``token_ids[j]``, ascending), and which of ``ids`` have one (a mask over ids)."""
    if token_ids is None:
        kept = ids < width
        return ids[kept], kept
    j = np.minimum(np.searchsorted(token_ids, ids), len(token_ids) - 1)
    kept = token_ids[j] == ids
    return j[kept], kept
