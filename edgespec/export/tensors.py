"""A checkpoint's tensors, one at a time: what the fused builder and the layer-by-layer reference
read instead of a loaded model.

safetensors files are read with a plain read of each tensor's bytes, not memory-mapped: a mapping
counts every page it has touched in the exporter's resident memory until it is unmapped (a 15 GB
checkpoint read through ``safe_open`` ends at a 15 GB peak), while a read holds only the tensor
at hand. The format is a little-endian u64 header length, a JSON header (name -> dtype, shape,
byte range after the header), then the bytes.

``ModelTensors`` gives the same interface over a model already loaded (a checkpoint without
safetensors files, and the tests' oracle: the graph the builder made from a loaded model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgespec.errors import ExportError

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


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
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / shard for shard in json.loads(index.read_text())["weight_map"].values()})
    single = path / "model.safetensors"
    return [single] if single.is_file() else []


def _read_header(file: Path) -> dict[str, _Entry]:
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ExportError(f"{file}: tensor {name} has dtype {info['dtype']}, which edgespec "
                              "does not read")
        begin, end = info["data_offsets"]
        entries[name] = _Entry(file, _DTYPES[info["dtype"]], tuple(info["shape"]),
                               8 + length + begin, end - begin)
    return entries


def _tensor(buffer: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not buffer:  # torch.frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)
