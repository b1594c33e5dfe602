"""Which checkpoints the fused builder (fused.py) writes, and what sets the families apart.

Llama, Mistral, Qwen2 and Qwen3 decoders share the layer fused.py writes: RMSNorm, q|k|v
projections, rotary attention with grouped KV heads, a SiLU-gated MLP. They differ in facts
the builder reads from the config and the checkpoint:

- q/k/v (and o) biases: read where the checkpoint has them (Qwen2; Llama's ``attention_bias``).
- ``head_dim``: Qwen3 (and some Llama/Mistral configs) declare it, and it need not be
  hidden_size / num_attention_heads (Qwen3-0.6B: 1024 / 16 = 64, head_dim 128).
- Qwen3 RMS-normalizes every head of q and k (``q_norm`` / ``k_norm`` over head_dim) before
  the rotation (transformers' Qwen3Attention): ``QK_NORM``.
- Tied embeddings (SmolLM2, Qwen2.5 and Qwen3 up to 4B): read from the model's modules.
- Static rope scaling (linear, llama3, yarn) is in the rotary tables the model's own rotary
  module computes; what depends on the sequence length is refused.
"""

from __future__ import annotations

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
QK_NORM = ("qwen3",)  # families that RMS-normalize each head of q and k before the rotation


def why_not_fused(config) -> str | None:
    """None if the builder handles a model of this config, else the reason it does not, naming
    the config option."""
    if config.model_type not in SUPPORTED:
        return f"{config.model_type} is not a Llama-family model"
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("dynamic", "longrope"):
        return (f"rope_scaling of rope_type {kind!r} depends on the sequence length; "
                "not supported")
    head_dim = head_dim_of(config)
    if head_dim % 16:
        return f"head size {head_dim} is not a multiple of 16 (GroupQueryAttention needs it)"
    sliding = sliding_layers(config)
    if sliding:
        return (f"sliding-window attention (sliding_window {config.sliding_window} on "
                f"{sliding} of {config.num_hidden_layers} layers) is not supported")
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act} is not supported"
    return None


def head_dim_of(config) -> int:
    """The size of one attention head: the config's ``head_dim`` where it declares one."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_layers(config) -> int:
    """How many layers attend within a sliding window. Qwen2/Qwen3 configs list each layer's
    kind (``layer_types``: ``use_sliding_window`` turns it on from ``max_window_layers`` on,
    as transformers computes it); a Mistral config's ``sliding_window`` applies to every layer."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return sum(kind == "sliding_attention" for kind in kinds)
    window = getattr(config, "sliding_window", None)
    return config.num_hidden_layers if window and getattr(config, "use_sliding_window", True) else 0
