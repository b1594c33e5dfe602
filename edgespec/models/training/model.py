"""The Llama decoders the recipe trains: built from a ModelShape, saved as float16 checkpoints."""

import copy
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from edgespec.models.training.config import ModelShape, RecipeConfig


def new_model(
    shape: ModelShape, tokenizer: PreTrainedTokenizerFast, config: RecipeConfig
) -> LlamaForCausalLM:
    """A randomly initialised Llama of the given shape, seeded, with tied embeddings."""
    torch.manual_seed(config.seed)
    llama_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=config.context_length,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(llama_config)


def save_checkpoint(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, directory: Path
) -> None:
    """Write a Hugging Face checkpoint: float16 safetensors weights, config and tokenizer."""
    copy.deepcopy(model).to(torch.float16).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
