"""Random checkpoints with the public shapes of the pairs users bring.

No hub is reachable here, so the weights are random; the configs (sizes, vocabulary, tied
embeddings, rope, context) are those the public checkpoints declare, and the weights are saved
in bf16 as they ship. The tokenizer is a small byte-level BPE: the exporter only needs it to
fit in the vocabulary, and random weights make its merges irrelevant.

    python benchmarks/real_shapes.py make qwen2.5-1.5b build/shapes/qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Public config.json values (hidden, intermediate, layers, heads, KV heads, vocabulary, tied
# embeddings, context, rope theta).
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
    "smollm2-360m": dict(model_type="llama", hidden_size=960, intermediate_size=2560,
                         num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                         vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={"factor": 32.0, "high_freq_factor": 4.0,
                                       "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192,
                                       "rope_type": "llama3"}),
}


def make_checkpoint(name: str, out: Path, seed: int = 0) -> Path:
    """Save a random ``name``-shaped model (bf16) with a small tokenizer into ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    shape = dict(SHAPES[name])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape, bos_token_id=0,
                                  eos_token_id=0, pad_token_id=0, initializer_range=0.02)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = 0
    model.save_pretrained(out)

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([Path(__file__).read_text()] * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>", pad_token="<|endoftext|>").save_pretrained(out)
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="save one random checkpoint")
    make.add_argument("shape", choices=sorted(SHAPES))
    make.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "make":
        print(make_checkpoint(args.shape, args.out))


if __name__ == "__main__":
    main(sys.argv[1:])
