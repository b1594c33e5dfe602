"""Turning a growing list of token ids into text pieces: whole characters only, a healed prompt's
regrown text left out, cut at stop strings (``TextAssembler`` ties the three together)."""

from __future__ import annotations

from tokenizers import Tokenizer

INCOMPLETE = "\ufffd"  # what a byte-level decoder shows for a partial UTF-8 sequence


class Detokenizer:
    """Emit the text added by each new batch of tokens, never half a character.

    Decoding tokens one at a time breaks multi-byte characters split across tokens and drops
    the spaces some decoders attach between tokens, so each step decodes a short window that
    starts a few tokens back and emits only what the window adds past the text already emitted
    (the scheme of Hugging Face text-generation-inference's ``decode_token``). A window ending in
    U+FFFD is held back until the character completes.

    Not ``tokenizers.decoders.DecodeStream`` (tokenizers >= 0.21), which runs the same scheme
    and gives the same text while characters complete, but has no flush: it holds back a
    character still incomplete when generation ends and offers no way to get it, nor its ids
    (``step`` is its only method; checked with 0.22). ``flush`` here returns it (as U+FFFD),
    so the streamed text always equals the decoded tokens.
    """

    def __init__(self, tokenizer: Tokenizer, context: list[int] | None = None):
        """``context``: tokens whose text is not emitted, decoded before the new ones so that
        those read as they do after them (the prompt's last tokens, for token healing)."""
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context or [])
        self.prefix_start = 0  # window start: a few tokens before the first unemitted one
        self.emit_start = len(self.ids)  # first token whose text has not been emitted

    def add(self, new_ids: list[int]) -> str:
        """The text the new tokens complete ("" while a character is still partial)."""
        self.ids += new_ids
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back when generation ends, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_start : self.emit_start], skip_special_tokens=True)
        window = decode(self.ids[self.prefix_start :], skip_special_tokens=True)
        if len(window) <= len(prefix) or (window.endswith(INCOMPLETE) and not final):
            return ""
        self.prefix_start, self.emit_start = self.emit_start, len(self.ids)
        return window[len(prefix) :]


class StopMatcher:
    """Cut a text stream at the first stop string, holding back what might begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was reached)."""
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            text, self.pending = self.pending[: min(hits)], ""
            return text, True
        hold = max((_overlap(self.pending, s) for s in self.stops), default=0)
        text = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(text) :]
        return text, False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


class Unprefix:
    """Drop ``prefix`` from the start of a text stream, however it is cut into pieces.

    Token healing's first token starts with the healed text by construction (its allowed
    set), so anything else is a bug, raised as one.
    """

    def __init__(self, prefix: str):
        self.rest = prefix

    def __call__(self, piece: str) -> str:
        if not self.rest:
            return piece
        n = min(len(piece), len(self.rest))
        if piece[:n] != self.rest[:n]:
            raise RuntimeError(f"token healing: the generated text {piece!r} does not start "
                               f"with the healed text {self.rest!r}")
        self.rest = self.rest[n:]
        return piece[n:]


class TextAssembler:
    """Generated token ids to the text a caller sees, round by round.

    Detokenized as they come (Detokenizer), the healed text left out (it is in the prompt
    already: Unprefix), cut before the first stop string (StopMatcher). ``tokens``: the ids
    kept, ending at the token that completes a stop string; ``stopped``: one was met.
    ``context``: the prompt's last tokens a healed first token reads after; ``healed``: the
    text it regrows.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (),
                 context: list[int] | None = None, healed: str = ""):
        self.detokenizer = Detokenizer(tokenizer, context)
        self.stops = StopMatcher(stop)
        self.unhealed = Unprefix(healed)
        self.tokens: list[int] = []
        self.stopped = False

    def add(self, new: list[int]) -> str:
        """The text one round's tokens add ("" while a character or a possible stop string is
        incomplete). With stop strings, token by token: the tokens after a stop are not kept."""
        if not self.stops.stops:
            self.tokens += new
            return self.unhealed(self.detokenizer.add(new))
        text = ""
        for token in new:
            self.tokens.append(token)
            piece, self.stopped = self.stops.feed(self.unhealed(self.detokenizer.add([token])))
            text += piece
            if self.stopped:
                break
        return text

    def finish(self) -> str:
        """What is still held back when generation ends: a character left incomplete, the
        start of a stop string that never completed."""
        text, self.stopped = self.stops.feed(self.unhealed(self.detokenizer.flush()))
        return text + self.stops.flush()
