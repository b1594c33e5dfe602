"""Which checkpoints the fused builder (fused.py) writes, and what sets the families apart.

Llama, Mistral, Qwen2, Qwen3 and Gemma 3 decoders share the layer fused.py writes: RMSNorm,
q|k|v projections, rotary attention with grouped KV heads, a gated MLP. They differ in facts
the builder reads from the config and the checkpoint:

- q/k/v (and o) biases: read where the checkpoint has them (Qwen2; Llama's ``attention_bias``).
- ``head_dim``: Qwen3 (and some Llama/Mistral configs) declare it, and it need not be
  hidden_size / num_attention_heads (Qwen3-0.6B: 1024 / 16 = 64, head_dim 128).
- Qwen3 RMS-normalizes every head of q and k (``q_norm`` / ``k_norm`` over head_dim) before
  the rotation (transformers' Qwen3Attention): ``QK_NORM``.
- Tied embeddings (SmolLM2, Qwen2.5 and Qwen3 up to 4B): read from the model's modules.
- Static rope scaling (linear, llama3, yarn) is in the rotary tables the model's own rotary
  module computes; what depends on the sequence length is refused.
- Gemma 3 (transformers' Gemma3DecoderLayer, ``GEMMA``) adds to Qwen3's layer: RMSNorm weights
  applied as ``1 + w``; a norm after attention and one after the MLP (``post_attention_layernorm``
  / ``post_feedforward_layernorm``), and a separate one before the MLP
  (``pre_feedforward_layernorm``); a GeGLU MLP (``gelu_pytorch_tanh``); the embedding scaled by
  sqrt(hidden_size) (``embed_scale``); attention scaled by ``query_pre_attn_scalar ** -0.5``;
  sliding-window layers (``layer_types``) interleaved with global ones, each kind with its own
  rope base (``rope_local_base_freq`` for the local ones, unscaled; ``rope_theta`` and
  ``rope_scaling`` for the global ones).
"""

from __future__ import annotations

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
QK_NORM = ("qwen3", "gemma3_text")  # families that RMS-normalize each head of q and k before
# the rotation
GEMMA = ("gemma3_text",)  # Gemma 3's layer (the module docstring lists what it adds)
SLIDING = "sliding_attention"  # a layer_types entry: attends within the sliding window


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
    if sliding and config.model_type not in GEMMA:
        return (f"sliding-window attention (sliding_window {config.sliding_window} on "
                f"{sliding} of {config.num_hidden_layers} layers) is not supported")
    if config.model_type in GEMMA:
        return _why_not_gemma(config)
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act} is not supported"
    return None


def _why_not_gemma(config) -> str | None:
    if config.hidden_activation != "gelu_pytorch_tanh":
        return f"hidden_activation {config.hidden_activation} is not supported"
    if config.attn_logit_softcapping is not None:
        return "attn_logit_softcapping is not supported (Gemma 3 sets none)"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention is not supported (a decoder attends causally)"
    return None


def layer_window(config, layer: int) -> int | None:
    """The sliding window of ``layer`` (it attends to the ``window`` last positions, its own
    included: transformers' sliding_window_overlay keeps kv_idx > q_idx - window), or None for
    a layer that attends to every position."""
    kinds = getattr(config, "layer_types", None)
    if config.model_type in GEMMA and kinds[layer] == SLIDING:
        return config.sliding_window
    return None


def widest_window(config) -> int:
    """The widest sliding window of the model's layers (0 without one): validation runs past
    it, so that a window off by one position is seen."""
    return max((layer_window(config, i) or 0 for i in range(config.num_hidden_layers)),
               default=0)


def local_rope_config(config):
    """The config Gemma 3's local (sliding) layers rotate with: ``rope_local_base_freq``,
    unscaled (as Gemma3TextModel builds its ``rotary_emb_local``)."""
    import copy

    local = copy.deepcopy(config)
    local.rope_theta = config.rope_local_base_freq
    local.rope_scaling = {"rope_type": "default"}
    return local


def embed_scale(config, dtype):
    """What Gemma 3 multiplies the embedding's rows by, sqrt(hidden_size), in the embedding
    table's stored ``dtype`` (Gemma3TextScaledWordEmbedding: ``embed_scale.to(weight.dtype)``;
    a bf16 table's is 25.25 for hidden 640, not 25.298); 1.0 for other families."""
    import torch

    if config.model_type not in GEMMA:
        return 1.0
    return float(torch.tensor(config.hidden_size**0.5).to(dtype))


def norm_offset(config) -> float:
    """What an RMSNorm adds to its stored weight: Gemma's scale by ``1 + w``, the others by w."""
    return 1.0 if config.model_type in GEMMA else 0.0


def attention_scale(config) -> float:
    """The factor on q.k: Gemma 3's ``query_pre_attn_scalar ** -0.5``, else head_dim ** -0.5."""
    if config.model_type in GEMMA:
        return float(config.query_pre_attn_scalar**-0.5)
    return float(head_dim_of(config)**-0.5)


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
