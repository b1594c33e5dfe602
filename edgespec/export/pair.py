"""Checks that a target and a draft checkpoint can be paired, before anything is exported.

Speculative decoding compares the two models' distributions token by token, so both must
mean the same thing by every token id they can emit and agree on the special tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from edgespec.errors import ExportError, IncompatiblePairError, one_line, shown


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


def read_checkpoint(path: Path, role: str) -> Checkpoint:
    """Read config and tokenizer of a causal LM, or say plainly why the folder is not one.

    A .gguf file, or a folder holding one and no config.json, is read as a GGUF checkpoint
    (export/gguf.py)."""
    from edgespec.export.gguf import find_gguf, read_gguf_checkpoint

    path = Path(path)
    gguf_file = find_gguf(path, role)
    if gguf_file is not None:
        return read_gguf_checkpoint(gguf_file, role)
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


def check_pair(target: Checkpoint, draft: Checkpoint) -> int:
    """Refuse a pair whose tokens or special ids differ; returns the shared vocabulary size.

    Vocabularies padded to different sizes (Qwen2 checkpoints: 151936 vs 152064 rows) are
    fine: logits are restricted to the shared range, which must mean the same in both.
    """
    shared = min(target.vocab_size, draft.vocab_size)
    sizes = len(target.tokenizer), len(draft.tokenizer)
    if sizes[0] != sizes[1]:
        raise IncompatiblePairError(
            f"the target's tokenizer has {sizes[0]} tokens and the draft's {sizes[1]}: the pair "
            "must share one tokenizer (a draft from the target's model family)"
            + ("; were --target and --draft swapped? The target is the larger model"
               if draft.weight_bytes > target.weight_bytes else "")
        )
    for ckpt, role in ((target, "target"), (draft, "draft")):
        if len(ckpt.tokenizer) > shared:
            raise IncompatiblePairError(
                f"the {role}'s tokenizer has {len(ckpt.tokenizer)} tokens but the pair shares "
                f"only {shared} rows of logits (target {target.vocab_size}, draft "
                f"{draft.vocab_size}); the draft must cover the target's whole vocabulary"
            )

    target_tokens = _id_to_token(target.tokenizer, shared)
    draft_tokens = _id_to_token(draft.tokenizer, shared)
    for i in range(shared):
        if target_tokens.get(i) != draft_tokens.get(i):
            raise IncompatiblePairError(
                f"the tokenizers differ at id {i}: target has {target_tokens.get(i)!r}, draft has "
                f"{draft_tokens.get(i)!r}; the draft must use the target's tokenizer"
            )

    specials = {
        "EOS": (target.eos_token_ids, draft.eos_token_ids),
        "BOS": (target.tokenizer.bos_token_id, draft.tokenizer.bos_token_id),
        "pad": (target.tokenizer.pad_token_id, draft.tokenizer.pad_token_id),
    }
    for name, (t, d) in specials.items():
        if t != d:
            raise IncompatiblePairError(
                f"the {name} token ids differ: target {t}, draft {d}; "
                "give both checkpoints the same special tokens"
            )
    return shared


def _id_to_token(tokenizer, limit: int) -> dict[int, str]:
    return {i: t for t, i in tokenizer.get_vocab().items() if i < limit}
