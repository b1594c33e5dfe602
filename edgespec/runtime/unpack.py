"""Weights a package stores in about a GGUF file's bytes, put together with NumPy when a graph loads.

A GGUF file's blocks hold 5- and 6-bit values, float16 scales and 6-bit sub-block scales;
onnxruntime's MatMulNBits reads bytes and float32 scales. Stored as MatMulNBits reads them, a
Q5_0 file would grow by half and a Q6_K one by a quarter; stored as the file has them and
unpacked by constant operators in the graph, onnxruntime's constant folding keeps every
intermediate it made (several times the file's size resident). So the export
(export/fused.py) writes the file's parts to the graph's data file and declares each tensor
MatMulNBits reads as an initializer at the external location ``LOCATION``, and ``read``
computes them here from the recipes in ``UNPACK_NAME``, handed to onnxruntime as external
initializers: one tensor at a time, nothing kept but the results.

A recipe is a small JSON tree (the names: export/fused.py's ``_Recipes``):

    {"op": "part", "offset", "length", "dtype", "shape"}   bytes of the data file, as stored
    {"op": "bits", "of", "width", "shape"}                 8 / width fields a byte, low first
    {"op": "values", "low", "high", "offset"}              low + 16 high + offset (uint8)
    {"op": "factors", "unit", "steps"}                     float(unit) per group * float(steps)
    {"op": "transpose", "of"}                              a 2-D transpose
    {"op": "zeros", "shape"}                               uint8 zeros
    {"op": "dequantize", "values", "scales", "minimums", "zero"}
                                  (values - zero) * scales (+ minimums), [N, K] float32
    {"op": "rotary", "frequencies", "positions", "scale", "fn"}
                                  fn(p * frequencies) * scale, [positions, F] float32

The rotary tables (cos and sin at every position, 4 of 16 MB for Gemma 3's two rope bases over
32,768 positions) are made here too: a GGUF package keeps its file's size.

A package comes from anyone: every offset, length, shape and type is checked against the data
file before anything is read or allocated, and a recipe is at most a few levels deep.

A pure interpreter: recipes and a data file in, arrays out. Handing them to onnxruntime, and
letting go of those it no longer reads, is runtime/loader.py's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from edgespec.errors import ManifestError
from edgespec.manifest import DATA_NAME, LOCATION, UNPACK_NAME

_DTYPES = {"uint8": np.uint8, "int8": np.int8, "float16": np.float16, "float32": np.float32}
_DEPTH = 6
_GROWTH = 16  # a recipe makes at most this many bytes from a byte of the data file
_ROTARY = {"cos": np.cos, "sin": np.sin}
# rotary tables' own budget, whatever the data file's size: a small model's tables over a long
# context (Gemma 3 4B's: 4 of 64 MB at 131,072 positions)
_TABLE_BYTES = 1 << 28


def read(folder: Path) -> dict[str, np.ndarray]:
    """The tensors ``folder/UNPACK_NAME`` describes, by initializer name ({} without one)."""
    return read_with_recipes(folder)[0]


def read_with_recipes(folder: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(``read``'s tensors, the recipes that made them)."""
    path = Path(folder) / UNPACK_NAME
    if not path.is_file():
        return {}, {}
    recipes = _recipes(path)
    data_path = Path(folder) / DATA_NAME
    if not data_path.is_file() or data_path.is_symlink():
        raise ManifestError(f"{path} needs {data_path}, which is missing; re-export the pair")
    out = {}
    with open(data_path, "rb") as f:  # read part by part: a memory map's pages would count
        data = _DataFile(f)  # as the process's memory until the last tensor made from it went
        budget = {"made": _GROWTH * len(data), "rotary": _TABLE_BYTES}
        for name, recipe in recipes.items():
            try:
                value = _make(recipe, data, 0)
                kind = "rotary" if isinstance(recipe, dict) and recipe.get("op") == "rotary" \
                    else "made"
                budget[kind] -= value.nbytes
                if budget[kind] < 0:
                    raise ValueError("its recipes make far more bytes than its data file holds")
            except (ValueError, TypeError, KeyError, IndexError, OSError) as e:
                raise ManifestError(f"{path}: {name[:80]!r} cannot be made ({str(e)[:200]}); "
                                    "re-export the pair") from None
            out[str(name)] = value
    return out, recipes


def _recipes(path: Path) -> dict:
    try:
        recipes = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"cannot read {path} ({e}); re-export the pair") from None
    if not isinstance(recipes, dict):
        raise ManifestError(f"{path} must hold an object of recipes; re-export the pair")
    return recipes


class _DataFile:
    """A package's data file, read a part at a time into memory of its own."""

    def __init__(self, f):
        self.file, self.size = f, os.fstat(f.fileno()).st_size

    def __len__(self) -> int:
        return self.size

    def part(self, offset: int, length: int) -> np.ndarray:
        out = np.empty(length, np.uint8)
        self.file.seek(offset)
        if self.file.readinto(memoryview(out)) != length:
            raise ValueError(f"part [{offset}, +{length}) could not be read whole")
        return out


def _fields(width: int) -> np.ndarray:
    """For each byte value, its 8 / width fields of ``width`` bits (low first) as the bytes of
    one little-endian integer: indexing by the packed bytes then viewing as bytes unpacks them
    in one pass."""
    count = 8 // width
    fields = (np.arange(256)[:, None] >> (width * np.arange(count))) & ((1 << width) - 1)
    return (fields << (8 * np.arange(count))).sum(axis=1).astype(f"<u{count}")


_FIELDS = {width: _fields(width) for width in (1, 2, 4)}


def _make(recipe: dict, data: _DataFile, depth: int) -> np.ndarray:
    if depth > _DEPTH or not isinstance(recipe, dict):
        raise ValueError("a recipe must be an object, at most a few levels deep")
    op = recipe["op"]
    make = lambda key: _make(recipe[key], data, depth + 1)  # noqa: E731
    if op == "part":
        dtype = np.dtype(_DTYPES[recipe["dtype"]])
        shape = _shape(recipe["shape"], len(data))
        offset, length = int(recipe["offset"]), int(recipe["length"])
        if offset < 0 or length != int(np.prod(shape)) * dtype.itemsize or \
                offset + length > len(data):
            raise ValueError(f"part [{offset}, +{length}) of {dtype.name} {shape} does not lie "
                             f"in the data file's {len(data)} bytes")
        return data.part(offset, length).view(dtype).reshape(shape)
    if op == "bits":
        packed, width = make("of"), int(recipe["width"])
        shape = _shape(recipe["shape"], _GROWTH * len(data))
        if width not in (1, 2, 4) or packed.dtype != np.uint8 or \
                packed.size * (8 // width) != np.prod(shape):
            raise ValueError(f"{packed.size} bytes of {width}-bit fields are not {shape}")
        return _FIELDS[width][packed].view(np.uint8).reshape(shape)
    if op == "values":
        low, high = make("low"), make("high")
        if low.shape != high.shape or low.dtype != np.uint8 or high.dtype != np.uint8:
            raise ValueError("a value's two planes differ in shape or type")
        high <<= np.uint8(4)  # in place (made just now): one tensor less to allocate
        high |= low
        high += np.uint8(int(recipe["offset"]) & 255)
        return high
    if op == "factors":
        unit = make("unit").astype(np.float32)
        if recipe.get("steps") is None:
            return unit
        steps = make("steps")
        if unit.ndim != 2 or steps.ndim != 2 or len(unit) != len(steps) or \
                steps.shape[1] % unit.shape[1]:
            raise ValueError(f"factors {unit.shape} and {steps.shape} do not match")
        group = steps.shape[1] // unit.shape[1]
        out = steps.astype(np.float32).reshape(len(unit), -1, group)
        out *= unit[..., None]
        return out.reshape(steps.shape)
    if op == "transpose":
        value = make("of")
        if value.ndim != 2:
            raise ValueError("only 2-D tensors are transposed")
        return np.ascontiguousarray(value.T)
    if op == "zeros":
        return np.zeros(_shape(recipe["shape"], _GROWTH * len(data)), np.uint8)
    if op == "dequantize":
        values, scales = make("values"), make("scales")
        if values.ndim != 3 or scales.shape != values.shape[:2]:
            raise ValueError(f"values {values.shape} and scales {scales.shape} do not match")
        w = values.astype(np.float32)
        w -= np.float32(int(recipe["zero"]))
        w *= scales[..., None]
        if recipe.get("minimums") is not None:
            lows = make("minimums")
            if lows.shape != scales.shape:
                raise ValueError("minimums and scales differ in shape")
            w += lows[..., None]
        return w.reshape(len(w), -1)
    if op == "rotary":
        return _rotary(recipe, make("frequencies"))
    raise ValueError(f"unknown op {str(op)[:40]!r}")


def _rotary(recipe: dict, frequencies: np.ndarray) -> np.ndarray:
    """A rotary table [positions, F] as transformers' rotary embedding computes it: the angle
    p * f a float32 product, its cos or sin (here in float64, rounded once), times the
    module's attention scaling in float32."""
    positions, fn = int(recipe["positions"]), _ROTARY[recipe["fn"]]
    if frequencies.dtype != np.float32 or frequencies.ndim != 1:
        raise ValueError("rotary frequencies must be a float32 vector")
    _shape([positions, len(frequencies)], _TABLE_BYTES // 4)
    angles = np.arange(positions, dtype=np.float32)[:, None] * frequencies  # [P, F]
    table = fn(angles.astype(np.float64)).astype(np.float32)
    table *= np.float32(float(recipe["scale"]))
    return table


def _shape(value, limit: int) -> tuple[int, ...]:
    """A recipe's shape, of at most ``limit`` elements."""
    if not isinstance(value, list) or len(value) > 4 or \
            not all(isinstance(v, int) and 0 <= v < 2**31 for v in value):
        raise ValueError(f"a shape must be a list of at most 4 sizes, got {str(value)[:60]}")
    if int(np.prod(value, dtype=np.float64)) > limit:
        raise ValueError(f"{value} makes far more bytes than its data file holds")
    return tuple(value)
