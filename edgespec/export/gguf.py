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
weights and to repacked blocks alike. Its Gemma converter stores every RMSNorm weight with
Gemma's + 1 added (the file's scale is the ``1 + w`` Gemma3RMSNorm multiplies by); the 1 is taken
off here, as transformers' GGUF loader does, and the builder adds it back.

Gemma 3's config is completed as llama.cpp's loader completes it (src/llama-model.cpp,
LLM_ARCH_GEMMA3, in ``gemma3_config``): what transformers' GGUF config leaves at
Gemma3TextConfig's defaults.

**Repacked, not re-quantized** where onnxruntime's MatMulNBits holds the same numbers
(gguf_blocks.py: Q4_0, Q4_1, Q4_K, Q8_0, Q6_K). F32/F16/BF16
tensors are read as stored; every other type llama.cpp's Python package can dequantize is
dequantized to float32 (and quantized again only as ``--quantize`` asks).
``GGUFTensors.record`` says which tensor went which way; the manifest keeps it.
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from edgespec.errors import ExportError, one_line
from edgespec.export.checkpoint import Checkpoint
from edgespec.export.gguf_blocks import REPACKED, Packed, concat, repack
from edgespec.export.gguf_header import refuse_early
from edgespec.export.tensors import TensorIndex

PERMUTED = ("llama",)  # architectures whose q/k rows llama.cpp's converter permutes
NORM_PLUS_ONE = ("gemma3",)  # architectures whose norm weights llama.cpp's converter stores + 1
KEPT = ("F32", "F16", "BF16")
_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


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

    refuse_early(file, role)  # the header checked, the family one edgespec reads
    reader = _reader(file, role)
    architecture = _field(reader, "general.architecture")
    if "tokenizer.ggml.tokens" not in reader.fields or "tokenizer.ggml.model" not in reader.fields:
        raise ExportError(f"--{role} {file} has no tokenizer (no tokenizer.ggml.* metadata); "
                          "export a GGUF file written with its tokenizer")
    _check_tensors(reader, file, role)
    try:
        with quiet("transformers"), _one_parse():
            config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
            tokenizer = (sentencepiece_bpe(reader, file, role) if architecture in SPM_BPE
                         and _field(reader, "tokenizer.ggml.model") == "llama" else
                         AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name))
    except (ValueError, OSError, KeyError, TypeError, IndexError) as e:
        raise ExportError(f"--{role} {file}: transformers cannot read its config or tokenizer "
                          f"({one_line(e)})") from None
    config.head_dim = _head_dim(reader, architecture, config, file, role)
    if architecture == "gemma3":
        gemma3_config(reader, config, file, role)
    factors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if factors is not None:
        config.rope_scaling = llama3_scaling(_rope_factors(factors, file, role), config, file, role)
    if len(tokenizer) > config.vocab_size:
        raise ExportError(f"--{role} {file}: its tokenizer has {len(tokenizer)} tokens but the "
                          f"model scores {config.vocab_size}; the file's vocabulary is "
                          "incomplete")
    eos = [_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in reader.fields]
    if architecture == "gemma3" and "tokenizer.ggml.eot_token_id" not in reader.fields:
        # a turn ends with <end_of_turn> (llama.cpp's vocabulary takes it as end of generation
        # by its text; Gemma's generation_config.json lists it beside <eos>)
        turn_end = tokenizer.convert_tokens_to_ids(GEMMA_TURN_END)
        if isinstance(turn_end, int) and turn_end != tokenizer.unk_token_id:
            eos.append(turn_end)
    _set_special_tokens(tokenizer, reader)
    return GGUFCheckpoint(file, config, tokenizer, eos_ids=tuple(eos), architecture=architecture)


SPM_BPE = ("gemma3",)  # architectures whose SentencePiece vocabulary is BPE (sentencepiece_bpe)
_NORMAL, _CONTROL, _USER = 1, 3, 4  # tokenizer.ggml.token_type (SentencePiece's piece types)


def sentencepiece_bpe(reader, file: Path, role: str):
    """A Gemma file's tokenizer: its SentencePiece BPE vocabulary (tokenizer.ggml.model
    "llama": pieces and scores) as a Hugging Face BPE tokenizer that splits text as llama.cpp's
    SPM tokenizer does (src/llama-vocab.cpp): characters merged, the adjacent pair whose
    concatenation is the highest-scoring piece first, unknown characters as bytes.

    transformers 4.57 reads these files as a Unigram model over the same scores, which splits
    "the capital" into "▁t he ▁c ap it al" (a BPE piece's score is minus its rank, so Unigram
    prefers the shortest pieces) and the model answers garbled. Here the merges are every
    split of a normal piece into two normal pieces, ranked by the piece's score (transformers'
    own merges for a Llama GGUF without any, made with a dictionary rather than list lookups:
    262,144 pieces). Control pieces are special tokens, user-defined ones ("\n", "<b>")
    matched whole, as SentencePiece and llama.cpp match them."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import GemmaTokenizerFast

    tokens = [str(t) for t in _array(reader, "tokenizer.ggml.tokens")]
    scores = [float(s) for s in _array(reader, "tokenizer.ggml.scores")]
    kinds = [int(k) for k in _array(reader, "tokenizer.ggml.token_type")]
    if not len(tokens) == len(scores) == len(kinds) or len(set(tokens)) < len(tokens):
        raise ExportError(f"--{role} {file}: its vocabulary's {len(tokens):,} pieces come with "
                          f"{len(scores):,} scores and {len(kinds):,} types, or repeat a piece; "
                          "a SentencePiece vocabulary has one of each per distinct piece; "
                          "convert the file again")
    normal = {t: s for t, s, k in zip(tokens, scores, kinds) if k == _NORMAL}
    merges = []  # (score of the piece, left, right)
    for piece, score in normal.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                  if piece[:i] in normal and piece[i:] in normal]
        splits.sort(key=lambda pair: (normal[pair[0]], normal[pair[1]]), reverse=True)
        merges.extend((score, left, right) for left, right in splits)
    merges.sort(key=lambda merge: merge[0], reverse=True)  # stable: ties keep their order
    ids = {name: int(_field(reader, f"tokenizer.ggml.{name}_token_id"))
           for name in ("bos", "eos", "unknown", "padding")
           if f"tokenizer.ggml.{name}_token_id" in reader.fields}
    unk = tokens[ids["unknown"]] if "unknown" in ids else None
    backend = Tokenizer(BPE({t: i for i, t in enumerate(tokens)},
                            [(left, right) for _, left, right in merges], unk_token=unk,
                            fuse_unk=True, byte_fallback=True))
    prefix = ([normalizers.Prepend("▁")] if _flag(reader, "tokenizer.ggml.add_space_prefix")
              else [])
    backend.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, kinds) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, normalized="▁" in t, special=False)
                        for t, k in zip(tokens, kinds) if k == _USER])
    named = {f"{name}_token": tokens[ids[key]] for name, key in (
        ("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")) if key in ids}
    template = ({"chat_template": _field(reader, "tokenizer.chat_template")}
                if "tokenizer.chat_template" in reader.fields else {})
    return GemmaTokenizerFast(
        tokenizer_object=backend, add_bos_token=_flag(reader, "tokenizer.ggml.add_bos_token",
                                                      True),
        add_eos_token=_flag(reader, "tokenizer.ggml.add_eos_token"), **named, **template)


def _array(reader, key: str) -> list:
    from transformers.modeling_gguf_pytorch_utils import read_field

    return read_field(reader, key)


def _flag(reader, key: str, default: bool = False) -> bool:
    return bool(_field(reader, key)) if key in reader.fields else default


GEMMA_TURN_END = "<end_of_turn>"
GEMMA_27B_LAYERS = 62  # llama.cpp's LLM_TYPE_27B for gemma3: attention scaled by hidden / heads


def gemma3_config(reader, config, file: Path, role: str) -> None:
    """Gemma 3's config as llama.cpp reads the file (LLM_ARCH_GEMMA3 in src/llama-model.cpp):
    with ``attention.sliding_window``, every sixth layer global and the others local, rotating
    with base 10,000 unscaled; without it, every layer global. q.k scaled by head_dim ** -0.5
    (hidden / heads for the 27B, 62 layers); ``final_logit_softcapping`` if the file has one;
    linear ``rope.scaling`` (Gemma 3 4B and larger) on the global layers."""
    arch = "gemma3"
    window = reader.fields.get(f"{arch}.attention.sliding_window") and int(
        _field(reader, f"{arch}.attention.sliding_window"))
    layers = config.num_hidden_layers
    config.layer_types = ["sliding_attention" if window and (i + 1) % 6 else "full_attention"
                          for i in range(layers)]
    config.sliding_window = window or None
    config.rope_local_base_freq = 10000.0
    config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads
                                    if layers == GEMMA_27B_LAYERS else config.head_dim)
    config.final_logit_softcapping = None
    if f"{arch}.final_logit_softcapping" in reader.fields:
        cap = _number(reader, f"{arch}.final_logit_softcapping", file, role)
        config.final_logit_softcapping = cap if cap > 0 else None
    kind = f"{arch}.rope.scaling.type"
    if kind in reader.fields and _field(reader, kind) != "none":
        factor = f"{arch}.rope.scaling.factor"
        if _field(reader, kind) != "linear" or factor not in reader.fields:
            raise ExportError(f"--{role} {file}: its rope scaling is {_field(reader, kind)}; "
                              "edgespec reads Gemma 3's linear scaling only from GGUF files; "
                              "export the model's Hugging Face folder instead")
        config.rope_scaling = {"rope_type": "linear",
                               "factor": _number(reader, factor, file, role)}


def _number(reader, key: str, file: Path, role: str) -> float:
    """A finite positive (or zero) number the file holds under ``key``; one line otherwise."""
    value = _field(reader, key)
    if isinstance(value, (bool, str)) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise ExportError(f"--{role} {file}: {key} is {str(value)[:40]!r}, not a number a "
                          "model has; convert the file again")
    return float(value)


# Llama 3.1, 3.2 and 3.3 scale their rotary frequencies by these (config.json's rope_scaling);
# only the factor differs between them (8 for 3.1 and 3.3, 32 for 3.2)
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def llama3_factors(scaling: dict, base: float, head_dim: int) -> np.ndarray:
    """The per-dimension divisors of the rotary frequencies that Llama 3's rope_scaling makes
    (llama.cpp's converter writes them as the rope_freqs tensor; transformers computes the
    same in _compute_llama3_parameters): 1 for short wavelengths, the factor for long ones,
    a smooth mix between."""
    factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = scaling["original_max_position_embeddings"]
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    mixed = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mixed))


def llama3_scaling(factors: np.ndarray, config, file: Path, role: str) -> dict:
    """config.json's rope_scaling that makes the file's rope_freqs (Llama 3.x's: its factor
    is the largest divisor), checked divisor by divisor; anything else is refused."""
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), **LLAMA3_ROPE}
    expected = llama3_factors(scaling, float(config.rope_theta), int(config.head_dim))
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-5):
        raise ExportError(f"--{role} {file}: its rope_freqs are not Llama 3's rotary scaling "
                          "(factor, low 1, high 4, 8192 positions), the only one edgespec reads "
                          "from GGUF files; export the model's Hugging Face folder instead")
    return scaling


def _rope_factors(tensor, file: Path, role: str) -> np.ndarray:
    if tensor.tensor_type.name != "F32" or len(tensor.shape) != 1 or int(tensor.shape[0]) > 4096:
        raise ExportError(f"--{role} {file}: its rope_freqs tensor is not a float32 vector; "
                          "download or convert the file again")
    return np.asarray(tensor.data, dtype=np.float64).reshape(-1)


def _head_dim(reader, architecture: str, config, file: Path, role: str) -> int:
    """The file's head size: ``attention.key_length``, which llama.cpp's converter writes from
    config.json's head_dim, else hidden / heads (llama.cpp's default; src/llama-model.cpp).
    transformers' GGUF config leaves it out, and Qwen3Config's own default, 128, is Qwen3's
    real size but not every file's."""
    keys = [f"{architecture}.attention.{kind}_length" for kind in ("key", "value")]
    sizes = {int(_field(reader, key)) for key in keys if key in reader.fields}
    if len(sizes) > 1:
        raise ExportError(f"--{role} {file}: its keys and values differ in size "
                          f"({' and '.join(map(str, sorted(sizes)))}); edgespec's graph needs "
                          "one head size")
    return sizes.pop() if sizes else config.hidden_size // config.num_attention_heads


def open_reader(file: Path):
    """gguf's GGUFReader of ``file``, parsed once for as long as the file is unchanged.

    Parsing the metadata is the slow part of reading a GGUF file (gguf-py reads each of a
    151,936-token vocabulary's strings and merges as its own array: 10-15 s a time on 2 cores),
    and an export reads one file's metadata four times (the checks here, transformers' config
    and tokenizer, the tensor table)."""
    from gguf import GGUFReader

    key = _key(file)
    if key not in _READERS:
        _READERS[key] = GGUFReader(key[0])
    return _READERS[key]


def forget_reader(file: Path) -> None:
    """Drop ``file``'s parsed reader (hundreds of MB for a large vocabulary) once the export
    has read what it needs of the file."""
    _READERS.pop(_key(file), None)


_READERS: dict[tuple, object] = {}


def _key(file: Path) -> tuple:
    file = Path(file).resolve()
    stat = file.stat()
    return str(file), stat.st_size, stat.st_mtime_ns


@contextmanager
def _one_parse():
    """transformers' GGUF loader (``AutoConfig`` / ``AutoTokenizer`` with ``gguf_file``)
    given the parsed reader instead of a parse of its own: its load_gguf_checkpoint imports
    GGUFReader from gguf on each call (transformers is pinned below 4.58 in pyproject.toml)."""
    import gguf

    own = gguf.GGUFReader
    gguf.GGUFReader = lambda path, *args, **kwargs: open_reader(Path(path))
    try:
        yield
    finally:
        gguf.GGUFReader = own


def _reader(file: Path, role: str):
    """gguf-py's reader of ``file``, its header checked before (gguf_header.py says why)."""
    try:
        return open_reader(file)
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


class GGUFTensors(TensorIndex):
    """The tensors of a GGUF file under the Hugging Face names, read one at a time
    (tensors.py's interface), and repacked MatMulNBits blocks for the fused builder (``packed``).

    ``record``: per tensor read, how ("repacked", "kept" as stored, "dequantized"), and its
    type; ``requantizable``: whether a matrix was handed over as floats (which --quantize
    then quantizes again).
    """

    @property
    def _missing_hint(self) -> str:
        return f"is it a complete GGUF file of a {self.config.model_type} model?"

    def __init__(self, file: Path, model):
        from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

        self.path = Path(file)
        reader = open_reader(self.path)
        self.config = model.config
        architecture = _field(reader, "general.architecture")
        self._permuted = architecture in PERMUTED
        self._norm_plus_one = architecture in NORM_PLUS_ONE
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
        if self._norm_plus_one and name.endswith("norm.weight"):
            tensor = tensor.float() - 1  # the file's 1 + w: the checkpoint's w
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
