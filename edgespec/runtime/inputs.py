"""What a package's tokenizer and a prompt must be before anything runs: checks that refuse
in one line, shared by the Pipeline and the server (serve/prompts.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from edgespec.config import is_int
from edgespec.errors import GenerationError, ManifestError, one_line
from edgespec.manifest import Manifest
from edgespec.runtime.package_checks import check_tokenizer


def load_tokenizer(folder: Path, manifest: Manifest) -> Tokenizer:
    """The package's tokenizer, refused unless it fits the manifest: no more tokens than the
    shared vocabulary (a token past it has no logit), and every special id one of its tokens."""
    path = folder / manifest.tokenizer
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:
        if type(e) is not Exception:  # tokenizers raises plain Exceptions for unreadable files
            raise
        raise ManifestError(f"cannot read {path} ({one_line(e, limit=None)}); "
                            "re-export the pair") from None
    size = tokenizer.get_vocab_size()
    if size > manifest.vocab_size:
        raise ManifestError(
            f"{path} has {size} tokens but the models share only {manifest.vocab_size} rows of "
            "logits; re-export the pair"
        )
    specials = {"eos_token_ids": manifest.eos_token_ids, "bos_token_id": [manifest.bos_token_id],
                "pad_token_id": [manifest.pad_token_id]}
    for name, ids in specials.items():
        for i in ids:
            if i is not None and tokenizer.id_to_token(i) is None:
                raise ManifestError(f"{name} {i} is not a token of {path}; re-export the pair")
    check_tokenizer(path, tokenizer, manifest.tokenizer_fingerprint)
    return tokenizer


def encode_text(tokenizer: Tokenizer, manifest: Manifest, text: str,
                rendered: bool = False) -> list[int]:
    """The one rule for a text's token ids as the models read them, plain prompts and rendered
    chat templates alike: the tokenizer's own special tokens are never added, then BOS first
    (Manifest.with_bos) for plain text only. A rendered template writes every special token it
    wants, BOS included (transformers' ``apply_chat_template`` tokenizes with
    ``add_special_tokens=False`` for this reason): another would read ``[bos, bos, ...]``.
    Run in the bounded child (bounded_text.py) for the Pipeline and the server alike."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return ids if rendered else manifest.with_bos(ids)


def check_text(prompt: str) -> None:
    """Refuse a prompt that is not a str, or holds lone surrogates: what Python makes of bytes
    that are not UTF-8 (a shell argument ``$'\\xff'``), which no tokenizer can encode."""
    if not isinstance(prompt, str):
        raise GenerationError(
            f"the prompt must be a str, got {type(prompt).__name__}; decode bytes to text first"
        )
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(
            f"the prompt is not valid UTF-8: character {e.start} is {prompt[e.start]!r}, from "
            "bytes that are not UTF-8 or half a surrogate pair; pass UTF-8 text"
        ) from None


def check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """A prompt given as token ids: at least one, each an integer id below ``vocab_size``."""
    ids = list(ids)
    if not ids:
        raise GenerationError("the prompt is empty; give at least one token id")
    for i in ids:
        if not (is_int(i) and 0 <= i < vocab_size):
            raise GenerationError(
                f"the prompt must be a str or a list of token ids (integers in "
                f"0..{vocab_size - 1}), got {i!r} in the list"
            )
    return [int(i) for i in ids]


# The most a Unicode normalization (NFKC, a case fold) shrinks one character's UTF-8: a 4-byte
# mathematical letter to an ASCII one
NORMALIZED_SHRINK = 4


def text_bounds(tokenizer: Tokenizer, window: int) -> tuple[int, int]:
    """The longest text, in characters and in UTF-8 bytes, that some tokenization could fit
    in a context ``window``: the window times the most one token of the vocabulary stands for.
    A token's string takes at least as many UTF-8 bytes as the text it covers (a byte-level
    token's characters are one byte each, 1 or 2 in UTF-8; a piece's "▁" is one space), so
    the bytes catch a text of few characters and many bytes (emoji: 4 bytes, 4 tokens each)
    before it is tokenized. A tokenizer that normalizes may shrink the text first: its bytes
    bound is NORMALIZED_SHRINK times looser. (The server refuses prompts by them; the
    tokenizing child bounds its replies and renders by them.)"""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    chars = max(1, max((len(token) for token in vocab), default=1))
    utf8 = max(1, max((len(token.encode("utf-8")) for token in vocab), default=1))
    if tokenizer.normalizer is not None:
        utf8 *= NORMALIZED_SHRINK
    return window * chars, window * utf8
