"""Files from strangers: GGUF files, EAGLE-3 head folders and folders being resumed, made
hostile by hand. Each is answered by one line naming the problem (an EdgespecError, exit 1 from
the CLI, no traceback), within bounded time and memory, and nothing is written outside the
output folder. Each test's docstring says what happened before the checks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgespec.cli import main
from edgespec.errors import EdgespecError, ExportError
from edgespec.export.gguf_header import check_gguf

# -- GGUF headers written by hand (llama.cpp's docs/gguf.md) ------------------------------------

U32, I32, F32, BOOL, STRING, ARRAY, U64 = 4, 5, 6, 7, 8, 9, 10


def _str(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str | bytes, kind: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", kind) + payload


def _u32(key: str, value: int) -> bytes:
    return _kv(key, U32, struct.pack("<I", value))


def _strings(key: str, items: list[str]) -> bytes:
    return _kv(key, ARRAY, struct.pack("<IQ", STRING, len(items)) + b"".join(map(_str, items)))


LLAMA = {
    "general.architecture": _kv("general.architecture", STRING, _str("llama")),
    "llama.block_count": _u32("llama.block_count", 1),
    "llama.context_length": _u32("llama.context_length", 128),
    "llama.embedding_length": _u32("llama.embedding_length", 4),
    "llama.attention.head_count": _u32("llama.attention.head_count", 2),
    "llama.attention.head_count_kv": _u32("llama.attention.head_count_kv", 1),
    "tokenizer.ggml.tokens": _strings("tokenizer.ggml.tokens", ["a", "b", "c"]),
}


def gguf_file(path: Path, version: int = 3, tensors: int = 1, **changes: bytes | None) -> Path:
    """A GGUF file of LLAMA's metadata (``changes``: key with dots as "__" -> its encoded
    pair, or None to leave the key out) and ``tensors`` tensor infos of 4 floats (the tensors'
    bytes are not written: the header is what is checked)."""
    fields = {**LLAMA, **{k.replace("__", "."): v for k, v in changes.items()}}
    pairs = [v for v in fields.values() if v is not None]
    infos = b"".join(_str(f"t{i}.weight") + struct.pack("<IQIQ", 1, 4, 0, 16 * i)
                     for i in range(tensors))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, tensors, len(pairs))
                     + b"".join(pairs) + infos + bytes(16 * tensors))
    return path


def assert_one_line(args: list[str], match: str, out: Path | None = None) -> None:
    """The CLI answers ``args`` with exit 1 and one line holding ``match``, no traceback."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and match in errors[0], result.output
    assert "Traceback" not in result.output and "\x1b" not in result.output
    assert out is None or not out.exists()


def test_the_hand_made_header_passes(tmp_path):
    """The writer's own file is accepted: the cases below fail for their one change."""
    header = check_gguf(gguf_file(tmp_path / "ok.gguf"), "target")
    assert header.architecture == "llama" and header.fields["llama.block_count"] == 1


GGUF_CASES = {
    # Before: GGUFReader looped to the end of the file, 6 GB in 61 s.
    "huge_array": (dict(general__name=_kv("general.name", ARRAY,
                                          struct.pack("<IQ", STRING, 1 << 40))),
                   "declares 1,099,511,627,776 items"),
    "huge_numeric_array": (dict(general__name=_kv("general.name", ARRAY,
                                                  struct.pack("<IQ", U32, 1 << 40))),
                           "declares 1,099,511,627,776 items"),
    # Before: a meta model of ten million layers, 3.4 GB, no end in sight.
    "block_count": (dict(llama__block_count=_u32("llama.block_count", 10_000_000)),
                    "llama.block_count is 10,000,000"),
    "blocks_over_tensors": (dict(llama__block_count=_u32("llama.block_count", 2)),
                            "the file holds 1 tensors"),
    # Before: the rotary table's positions, 34 GB asked for.
    "context_length": (dict(llama__context_length=_u32("llama.context_length", 2**32 - 1)),
                       "llama.context_length is 4,294,967,295"),
    # Before: ZeroDivisionError (hidden // heads).
    "head_count": (dict(llama__attention__head_count=_u32("llama.attention.head_count", 0)),
                   "llama.attention.head_count is 0"),
    "kv_heads": (dict(llama__attention__head_count_kv=_u32("llama.attention.head_count_kv", 3)),
                 "3 key/value heads do not divide 2"),
    "embedding_float": (dict(llama__embedding_length=_kv("llama.embedding_length", F32,
                                                         struct.pack("<f", 4.0))),
                        "is a float, not an integer"),
    "vocab_size": (dict(llama__vocab_size=_u32("llama.vocab_size", 2**31)),
                   "llama.vocab_size is 2,147,483,648"),
    "eos_id": (dict(tokenizer__ggml__eos_token_id=_u32("tokenizer.ggml.eos_token_id", 7)),
               "eos_token_id 7 is not one of its 3 tokens"),
    # Before: IndexError from transformers' read_field.
    "no_architecture": (dict(general__architecture=None), "no general.architecture"),
    "no_blocks": (dict(llama__block_count=None), "no llama.block_count"),
    # Before: UnicodeDecodeError.
    "not_utf8": (dict(general__name=_kv("general.name", STRING, _str(b"\xff\xfe"))),
                 "is not UTF-8 text"),
    # Before: RecursionError.
    "nested": (dict(general__name=_kv("general.name", ARRAY,
                                      struct.pack("<IQ", ARRAY, 1) * 5000)),
               "nests arrays deeper than"),
    # Before: the escape sequence reached the terminal raw.
    "escape": (dict(general__architecture=_kv("general.architecture", STRING,
                                              _str("\x1b[2J\x1b[31mllama"))),
               "'\\x1b[2J\\x1b[31mllama' is not a name"),
    "bad_type": (dict(general__name=_kv("general.name", 77, b"")), "value type 77"),
    "alignment_zero": (dict(general__alignment=_u32("general.alignment", 0)),
                       "general.alignment is 0"),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_hostile_gguf_headers_are_one_line_errors(tmp_path, case):
    """Each header fault above, through `edgespec export` (before: see each case)."""
    changes, match = GGUF_CASES[case]
    bad = gguf_file(tmp_path / f"{case}.gguf", **changes)
    with pytest.raises(ExportError, match=None) as error:
        check_gguf(bad, "target")
    assert match in str(error.value) and "\x1b" not in str(error.value)
    out = tmp_path / "out"
    assert_one_line(["export", "--target", str(bad), "--out", str(out)], match, out)


@pytest.mark.parametrize("data,match", [
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 50), "1,125,899,906,842,624 metadata entries"),
    (b"GGUF" + struct.pack("<IQQ", 3, 1 << 50, 0), "1,125,899,906,842,624 tensors declared"),
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "GGUF version 1"),
    (b"GGML" + bytes(20), "does not start with GGUF"),
    (b"GGUF", "shorter than a GGUF header"),
])
def test_hostile_gguf_counts_are_one_line_errors(tmp_path, data, match):
    """Counts past what the file can hold and wrong magic or version (before: GGUFReader
    read or allocated as the counts said)."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(ExportError, match=None) as error:
        check_gguf(bad, "target")
    assert match in str(error.value)


def test_a_tensor_larger_than_its_file_is_refused(tmp_path):
    """A tensor info declaring 2^60 elements in a file of a few hundred bytes."""
    bad = gguf_file(tmp_path / "big.gguf")
    data = bad.read_bytes()
    shape_at = data.index(b"t0.weight") + len(b"t0.weight") + 4
    bad.write_bytes(data[:shape_at] + struct.pack("<Q", 1 << 60) + data[shape_at + 8:])
    with pytest.raises(ExportError, match="larger than the file"):
        check_gguf(bad, "target")
