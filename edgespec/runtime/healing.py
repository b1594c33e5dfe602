"""Token healing: back the prompt off its last token and let the first generated token regrow it.

A prompt that ends where training text rarely cuts a token puts the model somewhere it has
seldom been: a trailing space is a token of its own, where text has " x" merged; a trailing
newline is "\\n", where code has "\\n    " with the indentation; "):" ends a token where a
vocabulary merges it with the newline after it (a GPT-2-style pre-tokenizer never does, so the
demo's "def fibonacci(n):" is not healed: no token extends "):"). Healing (guidance's token
healing, transformers' ``token_healing``) removes the prompt's last token and lets the first
generated token be any token whose text starts with the removed text, so the model chooses the
split it knows itself.

Here: ``heal`` finds the back-off (the shorter prompt, the removed text, the allowed ids) and
``PrefixIndex`` the allowed ids, by one bisect into the vocabulary's texts, sorted once per
pipeline. The constrained position is drawn by the decoding loop (speculative.py,
``constrained_step``) from the target's row alone.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from edgespec.runtime.text import INCOMPLETE

# Tokens of the prompt decoded before its last one when working out the removed text: enough
# for a decoder's context (a space it joins with, a character split over byte tokens); the
# stream decodes the generated tokens after the same ones, so the two texts agree.
CONTEXT = 4


@dataclass(frozen=True)
class Healing:
    """A prompt backed off its last token.

    prompt: the prompt without its last token (what the models are prefilled with).
    removed: the text that token contributed (generation's first token regrows it; the
        returned text starts after it, as the user's prompt already holds it).
    allowed: the ids whose text starts with ``removed``, ascending (the removed token too).
    context: the last tokens of ``prompt``, after which the generated ones are decoded.
    """

    prompt: list[int]
    removed: str
    allowed: np.ndarray  # [m] int64
    context: list[int]


class PrefixIndex:
    """Every token's text, sorted: the tokens whose text starts with a string are one bisect away.

    ``texts[i]`` is token i's text (None: never allowed, e.g. a special token). Built once per
    pipeline, on first use (most of the time goes to the tokenizer's decoding of every token,
    not the sort). A query is two bisects, O(log V) string comparisons, and a sort of the m ids
    it returns.
    """

    def __init__(self, texts: Sequence[str | None]):
        order = sorted((i for i, t in enumerate(texts) if t), key=texts.__getitem__)
        self.texts: list[str] = [texts[i] for i in order]
        self.ids = np.array(order, dtype=np.int64)  # [n], the token of each sorted text

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, special: Collection[int]) -> PrefixIndex:
        return cls(token_texts(tokenizer, special))

    def extending(self, prefix: str) -> np.ndarray:
        """Ids (ascending) of the tokens whose text starts with ``prefix``.

        In sorted order those texts are one run starting at ``prefix``'s place: a text >= prefix
        that does not start with it differs from it first by a larger character, so it sorts
        after every text that does.
        """
        lo = bisect.bisect_left(self.texts, prefix)
        hi = bisect.bisect_left(self.texts, True, lo=lo,
                                key=lambda text: not text.startswith(prefix))
        return np.sort(self.ids[lo:hi])


def token_texts(tokenizer: Tokenizer, special: Collection[int]) -> list[str | None]:
    """Each token's text as it reads after another token (None for special and missing ids).

    Decoded after an anchor token and cut after the anchor's text, as the removed text is cut
    after the prompt's (``heal``): decoders that join tokens with a space (WordPiece) or drop a
    first token's leading space (Metaspace) then give the same text in both places.
    """
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    present = [i for i in range(size)
               if i not in special and tokenizer.id_to_token(i) is not None]
    anchor = next((i for i in present if _plain(tokenizer.decode([i]))), None)
    texts: list[str | None] = [None] * size
    if anchor is None:
        return texts
    base = tokenizer.decode([anchor])
    pairs = tokenizer.decode_batch([[anchor, i] for i in present], skip_special_tokens=False)
    for i, pair in zip(present, pairs):
        if pair.startswith(base) and len(pair) > len(base):
            texts[i] = pair[len(base) :]
    return texts


def _plain(text: str) -> bool:
    """A text to anchor on: whole characters, and no space for a decoder to join or strip."""
    return bool(text) and INCOMPLETE not in text and text == text.strip()


def heal(
    ids: list[int], tokenizer: Tokenizer, special: Collection[int],
    index: Callable[[], PrefixIndex],
) -> Healing | None:
    """The back-off of a prompt ``ids``, or None where healing does not apply.

    Not healed: a prompt of one token (nothing would be left to condition on), one ending in a
    special token, one whose last token adds no text or an incomplete character (then the text
    before it is not a prefix of the whole), and one whose last token no longer token extends
    (healing would spend a target step to give the same token back). ``index`` is called
    (and may build the index) only when the rest applies.
    """
    if len(ids) < 2 or ids[-1] in special:
        return None
    context = ids[max(0, len(ids) - 1 - CONTEXT) : -1]
    before = tokenizer.decode(context)
    after = tokenizer.decode([*context, ids[-1]])
    if not after.startswith(before) or len(after) == len(before):
        return None
    removed = after[len(before) :]
    if INCOMPLETE in removed:
        return None
    allowed = np.union1d(index().extending(removed), [ids[-1]]).astype(np.int64)
    if len(allowed) == 1:
        return None
    return Healing(ids[:-1], removed, allowed, context)
