"""GGUF files in: a llama.cpp model file read as a checkpoint, its quantized blocks repacked.

A GGUF file (llama.cpp, Ollama, LM Studio) holds the model's config, tokenizer and chat template
as metadata and its weights as tensors in llama.cpp's block formats. Config and tokenizer are
built by transformers' GGUF integration (``AutoConfig`` / ``AutoTokenizer`` with ``gguf_file``);
the special tokens are then set from the file's own ids (transformers 4.57's Llama converter
names the BOS token as EOS too).

The weights are read a tensor at a time with plain reads of their bytes (``gguf.GGUFReader``
maps the file for the metadata and tensor table; tensors.py says why a mapping is not read
through), under the Hugging Face names the fused builder asks for. llama.cpp's converter
permutes the rows of a Llama model's q and k weights for its rotary layout
(convert_hf_to_gguf.py's ``permute``); the inverse row permutation is applied here, to float
weights and to repacked blocks alike.

**Repacked, not re-quantized** where onnxruntime's MatMulNBits holds the same numbers (``repack``):

    Q4_0  w = d (q - 8)        4 bits, block 32, the default zero point 8
    Q4_1  w = d q + m          4 bits, block 32, scale d, zero point 0, the block's minimum m
    Q4_K  w = d sc q - dmin m  4 bits, blocks of 32 (its sub-blocks), zero point 0, minimums
    Q8_0  w = d q              8 bits, block 32, q + 128 against the default zero point 128
    Q6_K  w = d sc (q - 32)    8 bits, block 16 (its sub-blocks), q + 96, zero point 128

8-bit blocks are handed over only to graphs whose MatMuls compute with int8 activations (a
draft): in float compute they are read as floats (fused.py says why), the same numbers.

A block with a minimum is computed as llama.cpp computes it: x . w = d (x . q) + m sum(x), the
MatMulNBits with zero point 0 plus the block sums of x times the minimums (a float MatMul of
K / 32 columns; fused.py). MatMulNBits' float zero points (-m / d) would hold the same numbers,
but onnxruntime 1.32's CPU kernel takes a path about 20x slower for them. The graph then equals
llama.cpp's dequantization exactly for the types without a minimum, and to float rounding (the
order of a sum) with one. F32/F16/BF16
tensors are read as stored; every other type llama.cpp's Python package can dequantize is
dequantized to float32 (and quantized again only as ``--quantize`` asks).
``GGUFTensors.record`` says which tensor went which way; the manifest keeps it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from edgespec.errors import ExportError
from edgespec.export.pair import Checkpoint

# the general.architecture values read (llama.cpp writes Mistral models as "llama")
FAMILIES = ("llama", "qwen2")
PERMUTED = ("llama",)  # architectures whose q/k rows llama.cpp's converter permutes
KEPT = ("F32", "F16", "BF16")
REPACKED = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q6_K": 8}  # -> MatMulNBits bits
_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_QK_K = 256  # a K-quant super-block


@dataclass(frozen=True)
class Packed:
    """A weight ``[N, K]`` as MatMulNBits stores it: ``data`` uint8 ``[N, K / block_size,
    block_size * bits / 8]`` (4 bits: two values a byte, low nibble first), ``scales`` float32
    ``[N, K / block_size]``, ``minimums`` float32 like the scales, or None. Each weight is
    scale * (q - 2^(bits - 1)) (MatMulNBits' default zero point), or with minimums
    scale * q + minimum (zero point 0)."""

    bits: int
    block_size: int
    data: np.ndarray
    scales: np.ndarray
    minimums: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, blocks, _ = self.data.shape
        return n, blocks * self.block_size

    def rows(self, ids: np.ndarray) -> "Packed":
        """Rows ``ids`` only (an output layer restricted to some tokens; a row permutation)."""
        take = lambda a: None if a is None else np.ascontiguousarray(a[ids])  # noqa: E731
        return Packed(self.bits, self.block_size, take(self.data), take(self.scales),
                      take(self.minimums))

    def dequantize(self) -> np.ndarray:
        """float32 ``[N, K]``: what MatMulNBits computes with (the tests' check)."""
        q = self.data
        if self.bits == 4:
            q = np.stack([q & 15, q >> 4], -1).reshape(*q.shape[:2], -1)
        if self.minimums is None:
            w = (q.astype(np.float32) - np.float32(1 << (self.bits - 1))) * self.scales[..., None]
        else:
            w = q.astype(np.float32) * self.scales[..., None] + self.minimums[..., None]
        return w.reshape(self.shape)


def concat(parts: list[Packed]) -> Packed | None:
    """Weights stacked along N (q|k|v, gate|up) if they share one layout, else None."""
    first = parts[0]
    layouts = {(p.bits, p.block_size, p.minimums is None, p.shape[1]) for p in parts}
    if len(layouts) > 1:
        return None
    if len(parts) == 1:
        return first
    lows = None if first.minimums is None else np.concatenate([p.minimums for p in parts])
    return Packed(first.bits, first.block_size, np.concatenate([p.data for p in parts]),
                  np.concatenate([p.scales for p in parts]), lows)


def repack(raw: np.ndarray, qtype: str) -> Packed:
    """llama.cpp blocks ``raw`` (uint8 ``[N, bytes a row]``) of type ``qtype`` (one of
    REPACKED) as MatMulNBits blocks holding the same numbers."""
    n = len(raw)
    half = lambda a: a.view(np.float16).astype(np.float32)[..., 0]  # noqa: E731
    if qtype in ("Q4_0", "Q4_1"):
        head = 2 if qtype == "Q4_0" else 4
        blocks = raw.reshape(n, -1, head + 16)
        d = half(blocks[..., :2].copy())
        qs = blocks[..., head:]
        q = np.concatenate([qs & 15, qs >> 4], -1)  # [N, B, 32]: low nibbles are the first 16
        if qtype == "Q4_0":
            return Packed(4, 32, _pack4(q), d)
        return Packed(4, 32, _pack4(q), d, half(blocks[..., 2:4].copy()))
    if qtype == "Q8_0":
        blocks = raw.reshape(n, -1, 34)
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128
        return Packed(8, 32, q.astype(np.uint8), half(blocks[..., :2].copy()))
    if qtype == "Q4_K":
        blocks = raw.reshape(n * (raw.shape[1] // 144), 144)  # super-blocks of 256
        d, dmin = half(blocks[:, 0:2].copy()), half(blocks[:, 2:4].copy())
        sc, m = _q4k_scale_min(blocks[:, 4:16])  # [S, 8] 6-bit each
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        q = (qs & 15).reshape(n, -1, 32)  # sub-block 2c: low nibbles of chunk c, 2c+1: high
        scale = (d[:, None] * sc.astype(np.float32)).reshape(n, -1)
        minimum = -(dmin[:, None] * m.astype(np.float32)).reshape(n, -1)
        return Packed(4, 32, _pack4(q), scale, minimum)
    if qtype == "Q6_K":
        blocks = raw.reshape(-1, 210)
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        d = half(blocks[:, 208:210].copy())
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 15
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = low.reshape(-1, 2, 4, 32) | (high.reshape(-1, 2, 4, 32) << 4)  # 0..63, in order
        data = (q.reshape(n, -1, 16).astype(np.uint16) + 96).astype(np.uint8)  # q - 32 + 128
        return Packed(8, 16, data, (d[:, None] * sc).reshape(n, -1))
    raise ValueError(f"{qtype} is not repacked")


def _pack4(q: np.ndarray) -> np.ndarray:
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's twelve bytes of 6-bit scales and minimums -> ([S, 8], [S, 8]) (gguf-py's layout)."""
    d, m, m_d = np.split(scales.reshape(-1, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(-1, 8), mn.reshape(-1, 8)


# -- the file -----------------------------------------------------------------------------------

def find_gguf(path: Path, role: str) -> Path | None:
    """The GGUF file ``path`` names: itself, or the one .gguf in a folder without config.json;
    None for anything else (a Hugging Face folder)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise ExportError(f"--{role} {path} does not exist; pass a .gguf file or a model "
                              "folder")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ExportError(f"--{role} {path} holds {len(found)} .gguf files; pass the one to "
                          "export (--" + role + " FOLDER/NAME.gguf)")
    return found[0] if found else None


@dataclass(frozen=True)
class GGUFCheckpoint(Checkpoint):
    """A GGUF file read as a checkpoint: ``path`` is the file."""

    eos_ids: tuple[int, ...] = ()
    architecture: str = "llama"  # general.architecture

    @property
    def weight_bytes(self) -> int:
        return self.path.stat().st_size

    @property
    def sampling_defaults(self) -> tuple[dict, list[str]]:
        return {}, []  # a GGUF file has no generation_config.json

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(set(self.eos_ids))


def read_gguf_checkpoint(file: Path, role: str) -> GGUFCheckpoint:
    """Config and tokenizer of a GGUF file, after checking all the exporter will need: a family
    the fused builder writes, tokenizer metadata, tensors of types that can be read, and every
    tensor's bytes present."""
    from transformers import AutoConfig, AutoTokenizer

    from edgespec.export.graph import quiet

    reader = _reader(file, role)
    architecture = _field(reader, "general.architecture")
    if architecture not in FAMILIES:
        raise ExportError(
            f"--{role} {file} is a GGUF of architecture {architecture}; edgespec reads GGUF "
            f"files of {' and '.join(FAMILIES)} models (Mistral's are llama); export others "
            "from their Hugging Face folder")
    if "tokenizer.ggml.tokens" not in reader.fields or "tokenizer.ggml.model" not in reader.fields:
        raise ExportError(f"--{role} {file} has no tokenizer (no tokenizer.ggml.* metadata); "
                          "export a GGUF file written with its tokenizer")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ExportError(f"--{role} {file} scales its rotary frequencies per dimension "
                          "(rope_freqs: Llama 3.1-style), which edgespec does not read from GGUF "
                          "files; export the model's Hugging Face folder instead")
    _check_tensors(reader, file, role)
    try:
        with quiet("transformers"):
            config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
            tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except (ValueError, OSError, KeyError, TypeError, IndexError) as e:
        raise ExportError(f"--{role} {file}: transformers cannot read its config or tokenizer "
                          f"({e})") from None
    if len(tokenizer) > config.vocab_size:
        raise ExportError(f"--{role} {file}: its tokenizer has {len(tokenizer)} tokens but the "
                          f"model scores {config.vocab_size}; the file's vocabulary is "
                          "incomplete")
    eos = [_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in reader.fields]
    _set_special_tokens(tokenizer, reader)
    return GGUFCheckpoint(file, config, tokenizer, eos_ids=tuple(eos), architecture=architecture)


def _reader(file: Path, role: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(file)
    except (ValueError, OSError, KeyError, IndexError, TypeError) as e:
        raise ExportError(f"--{role} {file} is truncated or not a GGUF file (reading it: {e}); "
                          "download or copy it again") from None


def _field(reader, key: str):
    """A scalar or string metadata value (transformers' parser: gguf-py's own ``contents`` is
    newer than the gguf versions transformers accepts)."""
    from transformers.modeling_gguf_pytorch_utils import read_field

    return read_field(reader, key)[0]


def _check_tensors(reader, file: Path, role: str) -> None:
    from gguf.quants import _type_traits

    size = file.stat().st_size
    readable = set(KEPT) | {t.name for t in _type_traits}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in readable:
            raise ExportError(
                f"--{role} {file}: tensor {tensor.name} is of type {kind}, which edgespec can "
                f"neither repack nor dequantize; use a file quantized to one of "
                f"{', '.join(REPACKED)} (or F16/F32)")
        if tensor.data_offset + int(tensor.n_bytes) > size:
            raise ExportError(f"--{role} {file} is truncated (tensor {tensor.name} ends past its "
                              f"{size} bytes); download or copy it again")


def _set_special_tokens(tokenizer, reader) -> None:
    """BOS, EOS, padding and unknown tokens from the file's ids."""
    for key, attribute in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"),
                           ("unknown", "unk_token")):
        name = f"tokenizer.ggml.{key}_token_id"
        if name in reader.fields:
            token_id = int(_field(reader, name))
            if token_id < len(tokenizer):
                setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))


@dataclass(frozen=True)
class _Tensor:
    gguf_name: str
    kind: str  # F32, Q4_1, ...
    shape: tuple[int, ...]  # PyTorch's order ([out, in])
    start: int
    length: int


class GGUFTensors:
    """The tensors of a GGUF file under the Hugging Face names, read one at a time
    (tensors.py's interface), and repacked MatMulNBits blocks for the fused builder (``packed``).

    ``record``: per tensor read, how ("repacked", "kept" as stored, "dequantized"), and its
    type; ``requantizable``: whether a matrix was handed over as floats (which --quantize
    then quantizes again).
    """

    def __init__(self, file: Path, model):
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

        self.path = Path(file)
        reader = GGUFReader(self.path)
        self.config = model.config
        architecture = _field(reader, "general.architecture")
        self._permuted = architecture in PERMUTED
        names = get_gguf_hf_weights_map(model, "llama" if architecture == "llama" else
                                        architecture, model.config.num_hidden_layers)
        self._entries: dict[str, _Tensor] = {}
        for t in reader.tensors:
            if t.name in names:
                self._entries[names[t.name]] = _Tensor(
                    t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                    int(t.data_offset), int(t.n_bytes))
        self.record: dict[str, dict] = {}
        del reader

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    @property
    def nbytes(self) -> int:
        return sum(e.length for e in self._entries.values())

    @property
    def summary(self) -> dict:
        """{"repacked": {type: tensors}, "kept": ..., "dequantized": ...} of what was read."""
        counts: dict[str, Counter] = {}
        for entry in self.record.values():
            counts.setdefault(entry["how"], Counter())[entry["type"]] += 1
        return {how: dict(sorted(c.items())) for how, c in sorted(counts.items())}

    @property
    def repacked_bits(self) -> set[int]:
        """The bit widths of the blocks handed over (4, 8)."""
        return {e["bits"] for e in self.record.values() if e["how"] == "repacked"}

    @property
    def requantizable(self) -> bool:
        """Whether a matrix was read as floats (a --quantize export quantizes it again)."""
        return any(e["how"] != "repacked" and e["matrix"] for e in self.record.values())

    def read(self, name: str) -> torch.Tensor:
        """The tensor as float: as stored (F32/F16/BF16), else llama.cpp's dequantization."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        entry = self._entry(name)
        raw = self._bytes(entry)
        if entry.kind in KEPT:
            dtype = _TORCH[entry.kind]
            tensor = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(entry.shape)
            how = "kept"
        else:
            values = dequantize(raw.reshape(entry.shape[0] if len(entry.shape) > 1 else 1, -1),
                                GGMLQuantizationType[entry.kind])
            tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)
                                      .reshape(entry.shape))
            how = "dequantized"
        self._note(name, entry, how)
        return self._unpermute(name, tensor)

    def rows(self, name: str, ids: np.ndarray) -> torch.Tensor:
        """Rows ``ids`` of a 2-D tensor (not q/k), only their bytes read and dequantized."""
        entry = self._entry(name)
        ids = np.asarray(ids, dtype=np.int64)
        if len(entry.shape) != 2 or entry.kind in KEPT or self._permuted and name.endswith(
                ("q_proj.weight", "k_proj.weight")):
            return self.read(name)[torch.from_numpy(ids)]
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        row_bytes = entry.length // entry.shape[0]
        raw = np.stack([self._bytes(replace(entry, start=entry.start + int(i) * row_bytes,
                                            length=row_bytes)) for i in ids])
        return torch.from_numpy(np.ascontiguousarray(
            dequantize(raw, GGMLQuantizationType[entry.kind]), dtype=np.float32))

    def packed(self, names: list[str], widths: tuple[int, ...] = (4, 8)) -> Packed | None:
        """The weights ``names`` (``[N_i, K]`` each) stacked along N as MatMulNBits blocks, if
        each is of a repacked type of one of ``widths`` bits and they share a layout; else
        None (read them as floats)."""
        entries = [self._entry(name) for name in names]
        if any(REPACKED.get(e.kind) not in widths or len(e.shape) != 2 for e in entries):
            return None
        parts = []
        for name, entry in zip(names, entries):
            part = repack(self._bytes(entry).reshape(entry.shape[0], -1), entry.kind)
            parts.append(self._unpermute(name, part))
        joined = concat(parts)
        if joined is not None:
            for name, entry in zip(names, entries):
                self._note(name, entry, "repacked", joined.bits)
        return joined

    # -- helpers --------------------------------------------------------------------------

    def _entry(self, name: str) -> _Tensor:
        try:
            return self._entries[name]
        except KeyError:
            raise ExportError(f"{self.path} has no tensor for {name}; is it a complete GGUF "
                              f"file of a {self.config.model_type} model?") from None

    def _bytes(self, entry: _Tensor) -> np.ndarray:
        buffer = bytearray(entry.length)
        with open(self.path, "rb") as f:
            f.seek(entry.start)
            if f.readinto(buffer) != entry.length:
                raise ExportError(f"{self.path} is truncated at {entry.gguf_name}; download it "
                                  "again")
        return np.frombuffer(buffer, dtype=np.uint8)

    def _note(self, name: str, entry: _Tensor, how: str, bits: int | None = None) -> None:
        self.record[name] = {"type": entry.kind, "how": how, "matrix": len(entry.shape) == 2,
                             "bits": bits}

    def _unpermute(self, name: str, value):
        """Undo llama.cpp's q/k row permutation (its rotary layout) on a tensor or Packed."""
        if not self._permuted or not name.endswith(
                ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            return value
        heads = (self.config.num_attention_heads if ".q_proj." in name
                 else self.config.num_key_value_heads)
        rows = value.shape[0]
        # as transformers' GGUF loader (LlamaTensorProcessor): the checkpoint's row (h, a, b)
        # of head h, half a, index b is the file's row (h, b, a)
        order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
        if isinstance(value, Packed):
            return value.rows(order)
        return value[torch.from_numpy(order)]
