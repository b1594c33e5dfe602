"""A checkpoint as the exporter reads it: ``Checkpoint`` (a Hugging Face causal LM folder, read
but not loaded: config, tokenizer, what its generation_config.json asks of sampling) and
``read_folder``, the reading of a Hugging Face folder with its weights checked.

The bottom of export/'s checkpoint reading: gguf.py's ``GGUFCheckpoint`` is a Checkpoint read
from a GGUF file, pair.py checks two of them, source.py says which kind a path is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from edgespec.errors import ExportError, one_line, shown


# generation_config.json settings edgespec's sampler does not apply (yet): named at export.
# min_p among them: transformers cuts after temperature, edgespec's min_p is llama.cpp's.
SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p"}
UNSUPPORTED_GENERATION = ("min_p", "typical_p", "no_repeat_ngram_size")


@dataclass(frozen=True)
class Checkpoint:
    """A Hugging Face causal LM folder, read but not loaded."""

    path: Path
    config: PretrainedConfig
    tokenizer: object  # a transformers PreTrainedTokenizerFast

    @property
    def vocab_size(self) -> int:
        """Rows of the model's logits (may exceed the tokenizer: padded vocabularies)."""
        return self.config.get_text_config().vocab_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weight files: which of two checkpoints is the larger model."""
        return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin")
                   for f in self.path.glob(pattern))

    @property
    def max_positions(self) -> int:
        text = self.config.get_text_config()
        return getattr(text, "max_position_embeddings", None) or text.n_positions

    @property
    def sampling_defaults(self) -> tuple[dict, list[str]]:
        """What generation_config.json asks of sampling, as edgespec's settings, and the
        settings it names that edgespec does not apply.

        transformers samples only with ``do_sample``; then temperature, top_k (50 unless set)
        and top_p apply. Without do_sample it decodes greedily: temperature 0 here. A
        repetition_penalty other than 1 applies either way, as transformers applies it.
        """
        try:
            config = GenerationConfig.from_pretrained(self.path)
            written = set(json.loads((self.path / "generation_config.json").read_text()))
        except (OSError, ValueError):  # none (or unreadable): no defaults of its own
            return {}, []
        ignored = [f"{name} {getattr(config, name)}" for name in UNSUPPORTED_GENERATION
                   if getattr(config, name, None) not in (None, 1.0, 0, 0.0, False)]
        penalty = getattr(config, "repetition_penalty", None)
        penalized = {} if penalty in (None, 1.0) else {"repetition_penalty": float(penalty)}
        if not SAMPLING_KEYS & written:  # transformers' defaults, not the author's choice
            return penalized, ignored
        if not config.do_sample:
            return {"temperature": 0.0, **penalized}, ignored
        temperature = config.temperature if config.temperature is not None else 1.0
        defaults = {"temperature": float(temperature), "top_k": int(config.top_k or 0),
                    "top_p": float(config.top_p or 1.0)}
        return {**defaults, **penalized}, ignored

    @property
    def eos_token_ids(self) -> list[int]:
        try:
            eos = GenerationConfig.from_pretrained(self.path).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        eos = eos if eos is not None else self.config.eos_token_id
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        return sorted({eos} if isinstance(eos, int) else set(eos or []))


def read_folder(path: Path, role: str) -> Checkpoint:
    """Read config and tokenizer of a causal LM's Hugging Face folder, or say plainly why
    ``path`` is not one (source.py's ``read_checkpoint`` has taken a GGUF file first)."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"--{role} {path} is not a folder; pass a Hugging Face model folder "
                          "or a .gguf file")
    if not (path / "config.json").is_file():
        raise ExportError(
            f"--{role} {path} has no config.json; pass a Hugging Face model folder "
            "(one saved with save_pretrained)"
        )
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError, TypeError, KeyError, AttributeError) as e:
        raise ExportError(f"--{role} {path}: cannot read config.json ({one_line(e)})") from None
    if not isinstance(config.architectures, (list, type(None))) or not all(
            isinstance(name, str) for name in config.architectures or []):
        raise ExportError(f"--{role} {path}: config.json's architectures "
                          f"{shown(config.architectures)} is not a list of class names; "
                          "re-save the model with save_pretrained")
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    declared = set(config.architectures or [])
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or declared - causal_classes:
        kind = ", ".join(config.architectures or []) or config.model_type
        raise ExportError(
            f"--{role} {path} is a {kind} model, not a causal language model; "
            "edgespec needs decoder-only models such as Llama, Qwen2, Mistral or GPT-2"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True)
    except (ValueError, OSError, TypeError) as e:
        raise ExportError(f"--{role} {path}: cannot load its tokenizer ({e})") from None
    if not tokenizer.is_fast:
        raise ExportError(f"--{role} {path}: needs a fast tokenizer (tokenizer.json)")
    check_weights(path, role)
    return Checkpoint(path, config, tokenizer)


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_weights(path: Path, role: str) -> None:
    """Refuse a checkpoint whose weights are missing or cut short, before any work.

    For safetensors files the header says how many bytes of tensors follow it: a file shorter
    than that was truncated (an interrupted download or copy).
    """
    found = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not found:
        raise ExportError(
            f"--{role} {path} has no weights ({' or '.join(WEIGHT_FILES[::2])}); "
            "pass the folder save_pretrained wrote"
        )
    shards = [path / found[0]]
    if found[0].endswith(".index.json"):
        try:
            index = json.loads(shards[0].read_text())
            shards = sorted({path / shard for shard in index["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ExportError(f"--{role} {shards[0]} is not a weight index ({e})") from None
    for shard in shards:
        if not shard.is_file():
            raise ExportError(f"--{role} {shard} is missing (listed in {found[0]})")
        if shard.suffix == ".safetensors":
            _check_safetensors(shard, role)


def _check_safetensors(file: Path, role: str) -> None:
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if not 0 < header_len <= size - 8:
                raise ValueError("bad header length")
            header = json.loads(f.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                  default=0)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ExportError(f"--{role} {file} is not a valid safetensors file ({e})") from None
    if size < 8 + header_len + end:
        raise ExportError(
            f"--{role} {file} is truncated ({size} of {8 + header_len + end} bytes); "
            "download or copy it again"
        )
