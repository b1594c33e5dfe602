"""The byte-level BPE tokenizer trained on the train split, and encoding files with it."""

from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from edgespec.models.training.config import EOS_TOKEN
from edgespec.models.training.corpus import _read_source


def train_tokenizer(files: Sequence[Path], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (GPT-2 style) on files; ``<|endoftext|>`` is BOS, EOS and pad."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator((_read_source(path) for path in files), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def encode_files(tokenizer: PreTrainedTokenizerFast, files: Sequence[Path]) -> torch.Tensor:
    """One token stream [N]: every file preceded by EOS, so EOS separates files (and is BOS)."""
    texts = [_read_source(path) for path in files]
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    return torch.cat([torch.tensor([eos, *encoding.ids]) for encoding in encodings])
