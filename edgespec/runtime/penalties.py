"""Repetition penalties: the target's logits of tokens already in the text, changed before a row
is processed (temperature, top-k, top-p, min-p: sampling.py), in greedy decoding too.

- ``repetition_penalty`` r (transformers' RepetitionPenaltyLogitsProcessor, after Keskar et al.
  2019, CTRL): every token in the text so far, prompt included: l / r if l > 0, else l * r.
- ``presence_penalty`` a_p and ``frequency_penalty`` a_f (OpenAI's): l - a_p [c > 0] - a_f c,
  c the token's count among the generated tokens (the prompt's do not count), after r.

Row n (the token at position n) is penalized for the text before n, drafts included, so p_n is
still a function of the prefix alone: the acceptance rule (acceptance.py) and the uniforms keyed
by position are unchanged, and speculative output stays the target's. Drafts are drawn from
the draft's own rows: any q keeps the output exact; only acceptance differs.
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
            in_text, generated = set(self.in_text), dict(self.generated)
            for position, token in enumerate(drafted[:i], start=len(committed)):
                self._add(in_text, generated, position, token)
            self._penalize(row, in_text, generated)
        return out

    def _count(self, committed: list[int]) -> None:
        for position in range(self.known, len(committed)):
            self._add(self.in_text, self.generated, position, committed[position])
        self.known = len(committed)

    def _add(self, in_text: set[int], generated: dict[int, int], position: int,
             token: int) -> None:
        in_text.add(token)
        if position >= self.prompt_tokens:
            generated[token] = generated.get(token, 0) + 1

    def _penalize(self, row: np.ndarray, in_text: set[int], generated: dict[int, int]) -> None:
        """Row ``[V]`` in place: l -> l / r or l * r for the tokens in the text, then
        l - a_p [c > 0] - a_f c for the generated ones."""
        if self.r != 1 and in_text:
            ids = np.fromiter(in_text, np.int64, len(in_text))
            ids = ids[ids < len(row)]
            values = row[ids]
            row[ids] = np.where(values > 0, values / self.r, values * self.r)
        if (self.presence or self.frequency) and generated:
            ids = np.fromiter(generated, np.int64, len(generated))
            counts = np.fromiter(generated.values(), np.float32, len(generated))
            keep = ids < len(row)
            row[ids[keep]] -= self.presence + self.frequency * counts[keep]
