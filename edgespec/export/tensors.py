"""A checkpoint's tensors, one at a time: what the fused builder and the layer-by-layer reference
read instead of a loaded model.

safetensors files are read with a plain read of each tensor's bytes, not memory-mapped: a mapping
counts every page it has touched in the exporter's resident memory until it is unmapped (a 15 GB
checkpoint read through ``safe_open`` ends at a 15 GB peak), while a read holds only the tensor
at hand. The format is a little-endian u64 header length, a JSON header (name -> dtype, shape,
byte range after the header), then the bytes.

``ModelTensors`` gives the same interface over a model already loaded (a checkpoint without
safetensors files, and the tests' oracle: the graph the builder made from a loaded model).

Folders come from strangers (an EAGLE-3 head, a model folder), so a file is read only if it is
the folder's own (``folder_file``: no index naming a file elsewhere, no link leading out of the
folder), JSON only up to ``MAX_JSON`` bytes, and a safetensors header's every entry is checked
against the file's size before a tensor's bytes are allocated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgespec.errors import ExportError, shown

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
MAX_JSON = 16 << 20  # config.json, an index: a real one is well under a megabyte
MAX_HEADER = 100 << 20  # a safetensors header (the safetensors library's own limit)
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in ``file``
    length: int


class TensorIndex:
    """What a file-backed tensor source knows before reading: its entries by the names the
    builder asks for (``_entries``: each with a ``shape`` and its stored ``length`` in bytes)."""

    _entries: dict

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor, as stored."""
        return sum(e.length for e in self._entries.values())

    def _entry(self, name: str):
        try:
            return self._entries[name]
        except KeyError:
            raise ExportError(f"{self.path} has no tensor {name}; {self._missing_hint}") from None

    _missing_hint = "is it a checkpoint of the architecture its config.json names?"


class CheckpointTensors(TensorIndex):
    """The tensors of a Hugging Face checkpoint folder's safetensors files, read on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._entries: dict[str, _Entry] = {}
        for file in safetensors_files(self.path):
            self._entries.update(_read_header(file))

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` in its stored dtype (a fresh copy, owned by the caller)."""
        entry = self._entry(name)
        buffer = bytearray(entry.length)
        with open(entry.file, "rb") as f:
            f.seek(entry.start)
            if f.readinto(buffer) != entry.length:
                raise ExportError(f"{entry.file} is truncated at {name}; download it again")
        return _tensor(buffer, entry.dtype, entry.shape)

    def rows(self, name: str, ids: np.ndarray) -> torch.Tensor:
        """Rows ``ids`` of the 2-D tensor ``name`` ([len(ids), columns]), each read on its own:
        an embedding lookup without the table."""
        entry = self._entry(name)
        row_bytes = entry.length // entry.shape[0]
        buffer = bytearray(row_bytes * len(ids))
        with open(entry.file, "rb") as f:
            for i, row in enumerate(np.asarray(ids).tolist()):
                f.seek(entry.start + row * row_bytes)
                f.readinto(memoryview(buffer)[i * row_bytes : (i + 1) * row_bytes])
        return _tensor(buffer, entry.dtype, (len(ids), *entry.shape[1:]))


class ModelTensors:
    """The same interface over a loaded model's parameters (no copies)."""

    def __init__(self, model):
        self._state = {name: t.detach() for name, t in model.state_dict(keep_vars=True).items()}

    def __contains__(self, name: str) -> bool:
        return name in self._state

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._state[name].shape)

    @property
    def nbytes(self) -> int:
        unique = {t.data_ptr(): t for t in self._state.values()}  # a tied table once
        return sum(t.numel() * t.element_size() for t in unique.values())

    def read(self, name: str) -> torch.Tensor:
        return self._state[name]

    def rows(self, name: str, ids: np.ndarray) -> torch.Tensor:
        return self._state[name][torch.from_numpy(np.asarray(ids, dtype=np.int64))]


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files (one, or the shards its index names); [] if none."""
    path = Path(path)
    if (path / INDEX).is_file():
        index = read_json(path, INDEX)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise ExportError(f"{path / INDEX} has no weight_map of tensor names to file names; "
                              "download the checkpoint again")
        return [folder_file(path, shard, f"{INDEX} names")
                for shard in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    return [folder_file(path, single.name, "its weights")] if single.is_file() else []


def folder_file(folder: Path, name: str, what: str) -> Path:
    """``folder / name`` if it is a plain file of the folder: ``name`` a bare file name, and
    the file, links followed, inside ``folder``, or in the blobs/ folder of a Hugging Face
    cache whose snapshot ``folder`` is (its files are links to ../../blobs/). ``what`` says
    who named it, for the message. Else an ExportError."""
    folder = Path(folder)
    file = folder / name
    if not name or Path(name).name != name or name in (".", ".."):
        raise ExportError(f"{folder}: {what} {shown(name)}, which is not a file name in the "
                          "folder; edgespec reads only the folder's own files")
    real, home = file.resolve(), folder.resolve()
    cache_blobs = home.parent.parent / "blobs" if home.parent.name == "snapshots" else None
    if home not in real.parents and real.parent != cache_blobs:
        raise ExportError(f"{folder}: {what} {shown(name)}, a link to {shown(str(real))} "
                          "outside the folder; edgespec reads only the folder's own files")
    if not real.is_file():
        raise ExportError(f"{folder}: {what} {shown(name)}, which is not a plain file")
    return file


def read_json(folder: Path, name: str):
    """The JSON of the folder's file ``name`` (``folder_file``), at most MAX_JSON bytes."""
    file = folder_file(folder, name, "its")
    try:
        with open(file, "rb") as f:
            raw = f.read(MAX_JSON + 1)
        if len(raw) > MAX_JSON:
            raise ExportError(f"{file} is over {MAX_JSON >> 20} MB; is it really a {name}?")
        return json.loads(raw)
    except (OSError, ValueError, RecursionError) as e:
        raise ExportError(f"cannot read {file} ({shown(str(e), 120)}); download it "
                          "again") from None


def _read_header(file: Path) -> dict[str, _Entry]:
    """The entries of a safetensors file's header, each checked against the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or length > min(size - 8, MAX_HEADER):
            raise ExportError(f"{file} is truncated or not a safetensors file (a header of "
                              f"{length:,} bytes in a file of {size:,}); download it again")
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError):
            header = None
    if not isinstance(header, dict):
        raise ExportError(f"{file}: its safetensors header is not a JSON object of tensors; "
                          "download it again")
    header.pop("__metadata__", None)
    start = 8 + length
    return {name: _checked_entry(file, name, info, start, size - start)
            for name, info in header.items()}


def _checked_entry(file: Path, name: str, info, start: int, data: int) -> _Entry:
    """One header entry: a dtype edgespec reads, a shape of sizes, and byte offsets within the
    ``data`` bytes that hold exactly the shape's elements."""
    def fail(problem: str) -> ExportError:
        return ExportError(f"{file}: tensor {shown(name)} {problem}; download or convert the "
                           "checkpoint again")

    if not isinstance(info, dict):
        raise fail("has no dtype, shape and data_offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise fail(f"has dtype {shown(dtype)}, which edgespec does not read")
    if not isinstance(shape, list) or len(shape) > 8 or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise fail(f"has shape {shown(shape)}, not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise fail(f"has data_offsets {shown(offsets)}, not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data:
        raise fail(f"has bytes {begin:,}..{end:,}, outside the file's {data:,} bytes of data")
    if end - begin != math.prod(shape) * _DTYPES[dtype].itemsize:
        raise fail(f"of shape {shape} and dtype {dtype} has {end - begin:,} bytes")
    return _Entry(file, _DTYPES[dtype], tuple(shape), start + begin, end - begin)


def _tensor(buffer: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not buffer:  # torch.frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)
