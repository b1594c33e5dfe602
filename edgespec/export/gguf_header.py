"""A GGUF file's header read within bounds, before gguf-py or transformers see the file.

gguf-py's ``GGUFReader`` and transformers' GGUF config trust the counts a file declares: an
array of 2^40 items is read item by item to the end of the file and beyond, a block count of
ten million builds a model of ten million layers, a context length of 2^32 becomes a rotary
table of that many rows. GGUF files come from strangers, so this reader goes first: every count
and length is checked against the bytes left in the file before anything is read or allocated,
arrays nest at most ``MAX_DEPTH`` deep, strings must be UTF-8, names printable, and the model's
config values (``CONFIG_RANGES``) must lie in ranges a real model's do.

The layout (the GGUF specification in ggml-org/ggml's docs, versions 2 and 3, little-endian): magic ``GGUF``; u32
version; u64 tensor count; u64 key/value count; the pairs (a string key, a u32 value type, the
value); then per tensor a string name, u32 dims, u64 per dim, u32 type, u64 offset. A string is
a u64 length and its bytes; an array a u32 element type, a u64 count, the elements.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import ExportError, shown

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DEPTH = 3  # an array of arrays of arrays; llama.cpp's own files nest none
MAX_DIMS = 4  # GGML_MAX_DIMS
# at most 8 elements per byte: no llama.cpp type stores fewer than 1.5 bits an element
ELEMENTS_PER_BYTE = 8

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
_SMALLEST = {**{t: struct.calcsize(f) for t, f in _SCALARS.items()}, STRING: 8, ARRAY: 12}

# "{arch}." keys of the model's config: (lowest, highest) a real model's value lies in. A block
# count is also at most the file's tensor count, and kv heads divide heads.
CONFIG_RANGES = {
    "block_count": (1, 1024),
    "context_length": (1, 1 << 20),
    "embedding_length": (1, 1 << 17),
    "feed_forward_length": (1, 1 << 20),
    "attention.head_count": (1, 1024),
    "attention.head_count_kv": (1, 1024),
    "attention.key_length": (1, 1024),
    "attention.value_length": (1, 1024),
    "rope.dimension_count": (1, 1024),
    "attention.sliding_window": (0, 1 << 20),  # 0: none (llama.cpp's reading)
    "vocab_size": (1, 1 << 22),
}
# the general.architecture values read (llama.cpp writes Mistral models as "llama")
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
REQUIRED = ("block_count", "embedding_length", "attention.head_count")
MAX_VOCAB = 1 << 22
TOKEN_IDS = ("bos", "eos", "eot", "padding", "unknown")


@dataclass(frozen=True)
class Array:
    """An array value's element type and length (its items are checked, not kept)."""

    kind: int
    count: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    tensor_count: int
    fields: dict  # key -> int, float, bool, str or Array
    architecture: str


def refuse_early(path: Path | None, role: str) -> None:
    """A .gguf file named by ``--role`` with a bad header or of a family edgespec cannot read,
    refused in a second (before torch and transformers load: export checks it again)."""
    if path is None or Path(path).suffix.lower() != ".gguf" or not Path(path).is_file():
        return
    header = check_gguf(Path(path), role)
    if header.architecture not in FAMILIES:
        raise ExportError(
            f"--{role} {path} is a GGUF of architecture {header.architecture}; "  # printable
            f"edgespec reads GGUF files of {', '.join(FAMILIES)} models (Mistral's are llama); "
            "export others from their Hugging Face folder")


def check_gguf(file: Path, role: str) -> GGUFHeader:
    """The header of ``file``, every count, length and config value checked; an ExportError
    naming the first problem otherwise (``role``: the option that named the file)."""
    file = Path(file)
    try:
        with open(file, "rb") as f:
            size = _size(f, file, role)
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as data:
                header = _Cursor(data, file, role).header()
    except OSError as e:
        raise ExportError(f"--{role} {file} cannot be read ({e})") from None
    _check_config(header, file, role)
    return header


def _size(f, file: Path, role: str) -> int:
    info = os.fstat(f.fileno())
    if not stat.S_ISREG(info.st_mode):
        raise ExportError(f"--{role} {file} is not a regular file; pass a .gguf file")
    if info.st_size < 24:
        raise ExportError(f"--{role} {file} is truncated or not a GGUF file ({info.st_size} "
                          "bytes, shorter than a GGUF header); download or copy it again")
    return info.st_size


class _Cursor:
    """Reads forward through ``data`` (a mapping: slices of it are copies), refusing any read
    past its end."""

    def __init__(self, data: mmap.mmap, file: Path, role: str):
        self.data, self.pos, self.file, self.role = data, 0, file, role

    def fail(self, problem: str) -> ExportError:
        return ExportError(f"--{self.role} {self.file} is truncated or not a GGUF file "
                           f"({problem}); download or copy it again")

    def left(self) -> int:
        return len(self.data) - self.pos

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.fail(f"{what} needs {n:,} bytes at offset {self.pos:,}, {self.left():,} "
                            "left")
        self.pos += n

    def take(self, n: int, what: str) -> bytes:
        self.skip(n, what)
        return self.data[self.pos - n: self.pos]

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, printable: bool = False) -> str:
        raw = self.take(self.unpack("<Q", what), what)
        try:
            text = str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {self.pos - len(raw)} is not UTF-8 text") from None
        if printable and not text.isprintable():
            raise self.fail(f"{what} {shown(text)} holds control characters")
        return text

    def count(self, kind: int, what: str) -> int:
        """An array's declared length, checked against the bytes left for its items."""
        n = self.unpack("<Q", f"{what}'s length")
        if n * _SMALLEST[kind] > self.left():
            raise self.fail(f"{what} declares {n:,} items, more than the {self.left():,} bytes "
                            "left can hold")
        return n

    def value(self, kind: int, what: str, depth: int = 0):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind], what)
        if kind == STRING:
            return self.string(what)
        if kind != ARRAY:
            raise self.fail(f"{what} is of value type {kind}, which GGUF does not have")
        if depth >= MAX_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {MAX_DEPTH}")
        item = self.unpack("<I", f"{what}'s item type")
        if item not in _SMALLEST:
            raise self.fail(f"{what} holds items of value type {item}, which GGUF does not have")
        n = self.count(item, what)
        if item in _SCALARS:  # fixed size: the count check above covers them
            self.skip(n * _SMALLEST[item], what)
        else:
            label = f"an item of {what}"  # one label: a vocabulary has 10^5 strings
            for _ in range(n):
                self.value(item, label, depth + 1)
        return Array(item, n)

    def header(self) -> GGUFHeader:
        if bytes(self.take(4, "the magic")) != MAGIC:
            raise self.fail("it does not start with GGUF")
        version = self.unpack("<I", "the version")
        if version not in VERSIONS:
            raise self.fail(f"GGUF version {version}; edgespec reads versions 2 and 3")
        tensors = self.unpack("<Q", "the tensor count")
        pairs = self.unpack("<Q", "the metadata count")
        fields = {}
        if pairs * (8 + 4 + 1) > self.left():
            raise self.fail(f"{pairs:,} metadata entries declared, more than the file holds")
        for _ in range(pairs):
            key = self.string("a metadata key", printable=True)
            if key in fields:
                raise self.fail(f"metadata key {shown(key)} appears twice")
            fields[key] = self.value(self.unpack("<I", f"{shown(key)}'s type"), shown(key))
        self._tensor_infos(tensors)
        architecture = fields.get("general.architecture")
        if not isinstance(architecture, str):
            raise self.fail("no general.architecture string in its metadata")
        if not architecture.isprintable() or not 0 < len(architecture) <= 64:
            raise self.fail(f"general.architecture {shown(architecture)} is not a name")
        return GGUFHeader(version, tensors, fields, architecture)

    def _tensor_infos(self, count: int) -> None:
        # name (8 + 1), dims (4 + 8), type (4), offset (8) at the least
        if count * 33 > self.left():
            raise self.fail(f"{count:,} tensors declared, more than the file holds")
        size = len(self.data)
        for _ in range(count):
            name = self.string("a tensor name", printable=True)
            dims = self.unpack("<I", f"tensor {shown(name)}'s dimension count")
            if not 1 <= dims <= MAX_DIMS:
                raise self.fail(f"tensor {shown(name)} has {dims} dimensions (1 to {MAX_DIMS})")
            shape = struct.unpack(f"<{dims}Q", self.take(8 * dims, f"tensor {shown(name)}"))
            if math.prod(shape) > ELEMENTS_PER_BYTE * size:
                raise self.fail(f"tensor {shown(name)} of shape {list(shape)} is larger than "
                                "the file")
            self.unpack("<I", f"tensor {shown(name)}'s type")
            if self.unpack("<Q", f"tensor {shown(name)}'s offset") > size:
                raise self.fail(f"tensor {shown(name)} starts past the end of the file")


def _check_config(header: GGUFHeader, file: Path, role: str) -> None:
    """The config values transformers builds the model from, in ``CONFIG_RANGES``, and the
    alignment gguf-py pads by. ``arch`` is a printable name of at most 64 characters."""
    fields, arch = header.fields, header.architecture

    def fail(problem: str) -> ExportError:
        return ExportError(f"--{role} {file}: {problem}; this is not a model edgespec can "
                           "export (a damaged or hand-made file?)")

    def integer(key: str):
        value = fields.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise fail(f"{shown(key)} is {_kind(value)}, not an integer")
        return value

    alignment = fields.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 \
            or alignment & (alignment - 1):
        shown_value = alignment if isinstance(alignment, int) else _kind(alignment)
        raise fail(f"general.alignment is {shown_value}, not a power of two")
    for name, (low, high) in CONFIG_RANGES.items():
        value = integer(f"{arch}.{name}")
        if value is None and name in REQUIRED:
            raise fail(f"its metadata has no {arch}.{name}")
        if value is not None and not low <= value <= high:
            raise fail(f"{arch}.{name} is {value:,}; a model's lies in "
                       f"{low:,}..{high:,}")
    blocks = fields[f"{arch}.block_count"]
    if blocks > header.tensor_count:
        raise fail(f"{arch}.block_count is {blocks:,} but the file holds "
                   f"{header.tensor_count:,} tensors")
    heads = fields[f"{arch}.attention.head_count"]
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise fail(f"{kv_heads} key/value heads do not divide {heads} attention heads")
    for key in (f"{arch}.rope.freq_base", f"{arch}.attention.layer_norm_rms_epsilon"):
        value = fields.get(key)
        if value is not None and (isinstance(value, (bool, str, Array))
                                  or not math.isfinite(value) or value <= 0):
            raise fail(f"{shown(key)} is {shown(value)}, not a positive number")
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is not None and (not isinstance(tokens, Array) or tokens.kind != STRING
                               or not 1 <= tokens.count <= MAX_VOCAB):
        raise fail(f"tokenizer.ggml.tokens must be 1 to {MAX_VOCAB:,} strings")
    for name in TOKEN_IDS:
        token = integer(f"tokenizer.ggml.{name}_token_id")
        if token is not None and tokens is not None and not 0 <= token < tokens.count:
            raise fail(f"tokenizer.ggml.{name}_token_id {token} is not one of its "
                       f"{tokens.count:,} tokens")


def _kind(value) -> str:
    if isinstance(value, Array):
        return f"an array of {value.count:,}"
    return f"a {type(value).__name__}"
