"""Streaming text: whole characters only, and stop strings cut exactly."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from edgespec.runtime.text import Detokenizer, StopMatcher


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges: every UTF-8 byte is its own token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


TEXT = "naïve café — 東京 🙂 done"


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_multibyte_characters_come_out_whole(byte_tokenizer, batch):
    ids = byte_tokenizer.encode(TEXT).ids
    assert len(ids) > len(TEXT)  # some characters really are split across tokens
    decoder = Detokenizer(byte_tokenizer)
    pieces = [decoder.add(ids[i : i + batch]) for i in range(0, len(ids), batch)]
    pieces.append(decoder.flush())
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)


def test_an_unfinished_character_is_flushed_at_the_end(byte_tokenizer):
    ids = byte_tokenizer.encode("ok 🙂").ids[:-1]  # the emoji's last byte never comes
    decoder = Detokenizer(byte_tokenizer)
    assert "".join(decoder.add([i]) for i in ids) == "ok "
    assert decoder.flush().startswith("\ufffd")


def feed_all(stops, pieces):
    matcher, out = StopMatcher(stops), []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_string_split_across_pieces():
    assert feed_all(("\n\n",), ["a\n", "\nb"]) == ("a", True)
    assert feed_all(("END",), ["xE", "N", "Dyy"]) == ("x", True)


def test_held_back_text_is_released_when_it_is_not_a_stop():
    matcher = StopMatcher(("END",))
    assert matcher.feed("xEN") == ("x", False)
    assert matcher.feed("Q") == ("ENQ", False)


def test_earliest_stop_wins_and_no_stop_passes_everything():
    assert feed_all(("b", "a"), ["xxab"]) == ("xx", True)
    assert feed_all((), ["ab", "c"]) == ("abc", False)
