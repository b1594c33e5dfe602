"""Exported graph vs PyTorch: the same logits (or, for lossy variants, the same distributions),
with and without the KV cache.

The graph is run through the runtime's own ``ModelSession``, so validation also covers the
feeds the runtime builds (position ids, attention mask, cache layout). PyTorch's logits are
computed first so that the model is freed before onnxruntime loads the graph: from the loaded
model (``reference_logits``, optimum's graphs), or for a fused graph one decoder layer at a time
from the checkpoint (``reference_logits_by_layer``, the same figures in the memory of a layer),
so that a 7B model is checked on a machine that could not hold it in float32. The manifest's
``validation.reference`` says which.

Two gates:
- **fp32** graphs must reproduce PyTorch's logits: max |difference| / max(1, max |logit|) within
  ``FP32_TOLERANCE``.
- **Lossy variants** (fp16, int8, int4) change the logits on purpose, and a maximum over
  positions x vocabulary rows says little (it grows with the vocabulary). They are judged by what
  speculative decoding and users see: the total variation distance between PyTorch's and the
  graph's next-token distributions (1 - TV is the acceptance rate the variant would get as a
  draft of the exact model), averaged over the validation positions, and the top-1 agreement on
  positions where PyTorch's choice is clear (a margin of ``CLEAR_MARGIN`` in probability; on
  near-flat distributions, as random weights give, the top-1 token is a coin toss).
Whatever the precision, a target's cached and uncached runs must agree within ``CONSISTENCY``:
speculative decoding's exactness rests on a target token's logits not depending on how many
tokens share its run. A draft's need not agree as closely (``DRAFT_CONSISTENCY``): its logits
only move acceptance, and a quantized draft computes with int8 activations (precision.py),
whose kernels differ slightly with the number of rows; a broken cache still fails.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from edgespec.config import EXPORT_VALIDATIONS
from edgespec.export.families import GEMMA, SLIDING, embed_scale, local_rope_config
from edgespec.export.memory import trim
from edgespec.manifest import ModelSpec
from edgespec.runtime.providers import SessionConfig
from edgespec.runtime.run_checks import DRAFT_CONSISTENCY
from edgespec.runtime.session import ModelSession

VALIDATIONS = EXPORT_VALIDATIONS
FP32_TOLERANCE = 1e-3  # float32's reorderings stay orders of magnitude below it
# Lossy variants: (largest mean total variation, smallest top-1 agreement on clear positions).
# Trained weights stay far inside these (the figures: benchmarks/RESULTS.md); random weights at
# real shapes are far less kind to int4 (near-flat distributions over a large vocabulary), so
# int4's bound leaves room for them; a broken graph (wrong layout, scale or rotation) lands well
# above it.
LOSSY_GATES = {"fp16": (0.01, 0.98), "int8": (0.05, 0.95), "int4": (0.35, 0.85)}
CLEAR_MARGIN = 0.1
CONSISTENCY = 1e-3  # cached vs uncached, as a fraction of the largest |logit|


# Code and prose, so that a trained model has positions where its next token is clear.
VALIDATION_TEXT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nThe quick brown fox jumps over the lazy dog. One, two, three, four, five."
)


def validation_ids(tokenizer, vocab_size: int, length: int, seed: int = 0) -> np.ndarray:
    """The token sequence a graph is checked on: VALIDATION_TEXT, then random ids to ``length``."""
    ids = [i for i in tokenizer(VALIDATION_TEXT, add_special_tokens=False).input_ids
           if i < vocab_size][:length]
    rest = np.random.default_rng(seed).integers(0, vocab_size, size=length - len(ids))
    return np.concatenate([np.array(ids, dtype=np.int64), rest])


def reference_logits(model, ids: np.ndarray) -> np.ndarray:
    """PyTorch's float32 logits ``[n, V]`` for ``ids`` (upcasts the model in place)."""
    import torch

    model.float()
    with torch.no_grad():
        return model(torch.from_numpy(ids)[None]).logits[0].float().numpy()


def reference_logits_by_layer(model, tensors, ids: np.ndarray,
                              progress=lambda line: None) -> np.ndarray:
    """``reference_logits`` with one decoder layer in memory at a time, for Llama-family models.

    model: the model's modules on the meta device (graph.meta_model); tensors: its weights
    (export/tensors.py). The steps of the model's own forward (LlamaModel.forward: embedding,
    causal mask, rotary embedding, the layers, the final norm, the output layer) with the same
    modules in float32, each layer's weights read, run and dropped: the same figures as the
    whole model (the tests compare them) in the memory of one layer in float32 plus a slice
    of the output layer. Only the ``ids``' rows of the embedding table are read.
    Gemma 3 (Gemma3TextModel.forward, Gemma3ForCausalLM.forward): the rows scaled, a mask and
    a rotary embedding for each kind of layer, the logits softcapped where the config says so.
    """
    import torch

    inner, config = model.model, model.config
    layers = config.num_hidden_layers
    gemma = config.model_type in GEMMA
    start = time.perf_counter()
    with torch.no_grad():
        rows = tensors.rows("model.embed_tokens.weight", ids)
        hidden = (rows.float() * embed_scale(config, rows.dtype))[None]  # [1, n, H]
        positions = torch.arange(len(ids))
        rotary = type(inner.rotary_emb)(config=config)
        position_embeddings = rotary(hidden, positions[None])
        masks = _masks(config, hidden, positions)
        if gemma:
            local = type(inner.rotary_emb)(config=local_rope_config(config))
            position_embeddings = {"position_embeddings_global": position_embeddings,
                                   "position_embeddings_local": local(hidden, positions[None])}
        else:
            position_embeddings = {"position_embeddings": position_embeddings}
        for i, layer in enumerate(inner.layers[:layers]):
            _materialize(layer, tensors, f"model.layers.{i}.")
            hidden = layer(hidden, attention_mask=masks[getattr(layer, "attention_type",
                                                                "full_attention")],
                           position_ids=positions[None], **position_embeddings)
            if isinstance(hidden, tuple):  # Gemma3DecoderLayer returns (hidden_states,)
                hidden = hidden[0]
            layer.to_empty(device="meta")  # drop the layer's weights
            trim()
            progress(f"PyTorch reference: layer {i + 1}/{layers}, "
                     f"{time.perf_counter() - start:.0f} s")
        _materialize(inner.norm, tensors, "model.norm.")
        hidden = inner.norm(hidden)[0]  # [n, H]
        inner.norm.to_empty(device="meta")
        head = ("model.embed_tokens.weight" if model.get_output_embeddings().weight
                is model.get_input_embeddings().weight else "lm_head.weight")
        table = tensors.read(head)  # [V, H] in its stored type
        logits = torch.cat([torch.nn.functional.linear(hidden, table[rows : rows + _HEAD_ROWS].float())
                            for rows in range(0, len(table), _HEAD_ROWS)], dim=-1)
        cap = getattr(config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
    return logits.numpy()


def _masks(config, hidden, positions) -> dict:
    """The attention masks by layer kind (``layer_types``' names), as the model's forward makes
    them: causal, and for sliding layers causal within the window."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kwargs = dict(config=config, input_embeds=hidden, attention_mask=None,
                  cache_position=positions, past_key_values=None, position_ids=positions[None])
    masks = {"full_attention": create_causal_mask(**kwargs)}
    if SLIDING in (getattr(config, "layer_types", None) or ()):
        masks[SLIDING] = create_sliding_window_causal_mask(**kwargs)
    return masks


_HEAD_ROWS = 16384  # output rows upcast at a time


def _materialize(module, tensors, prefix: str) -> None:
    """Give a meta ``module`` its float32 weights from the checkpoint."""
    state = {name: tensors.read(prefix + name).float() for name in module.state_dict()}
    module.load_state_dict(state, assign=True)


def validate_graph(
    expected: np.ndarray,
    ids: np.ndarray,
    root: Path,
    spec: ModelSpec,
    max_positions: int,
    variant: str = "fp32",
    role: str = "target",
) -> tuple[dict, list[str]]:
    """Compare the graph with PyTorch's ``expected`` logits; returns (figures, failures).

    Three ways through the graph: the whole sequence with an empty cache; a prefix, then the
    rest with the prefix cached; the last tokens fed one at a time.
    """
    scale = max(1.0, float(np.abs(expected).max()))
    session = ModelSession(root / spec.path, spec, spec.vocab_size, max_positions,
                           SessionConfig("cpu"))
    split = len(ids) // 2
    runs = {  # each run's logits are compared as they come, only no_cache's kept: a
        # vocabulary of 262,144 past a window of 512 makes 0.6 GB of logits a run
        "no_cache": lambda: _run(session, [ids]),
        "prefix_then_rest": lambda: _run(session, [ids[:split], ids[split:]]),
        "one_token_steps": lambda: _run(session, [ids[:split], *ids[split:, None]]),
    }
    figures: dict = {"variant": variant, "logit_scale": scale, "positions": len(ids)}
    failures = []
    consistency = 0.0
    for name, run in runs.items():
        logits = run()
        figures[f"max_abs_diff_{name}"] = _max_abs_diff(logits, expected)
        if name == "no_cache":
            uncached = logits
        else:
            consistency = max(consistency, _max_abs_diff(logits, uncached))
        del logits
    figures |= distribution_figures(expected, uncached)
    if variant == "fp32":
        tolerance = FP32_TOLERANCE * scale
        figures["tolerance"] = tolerance
        for name in runs:
            diff = figures[f"max_abs_diff_{name}"]
            if not diff <= tolerance:
                failures.append(f"{spec.path}: {name} logits differ from PyTorch by {diff:.2e} "
                                f"(tolerance {tolerance:.1e} for fp32)")
    else:
        max_tv, min_top1 = LOSSY_GATES[variant]
        figures |= {"max_mean_tv": max_tv, "min_clear_top1": min_top1}
        if not figures["mean_tv"] <= max_tv:
            failures.append(
                f"{spec.path}: {variant} next-token distributions differ from PyTorch's by a "
                f"mean total variation of {figures['mean_tv']:.3f} (at most {max_tv} allowed)")
        clear = figures["clear_top1_agreement"]
        if clear is not None and not clear >= min_top1:
            failures.append(
                f"{spec.path}: {variant} agrees with PyTorch's clear top-1 token on "
                f"{clear:.0%} of {figures['clear_positions']} positions (at least "
                f"{min_top1:.0%} required)")
    figures["max_abs_diff_cached_vs_uncached"] = consistency
    limit = (CONSISTENCY if role == "target" else DRAFT_CONSISTENCY) * scale
    figures["consistent"] = bool(consistency <= limit)
    if not figures["consistent"]:
        failures.append(
            f"{spec.path}: cached and uncached runs of the graph differ by {consistency:.2e} "
            f"(tolerance {limit:.1e}); " + ("speculative output would not match target-only "
                                             "output" if role == "target" else "its KV cache is broken")
        )
    return figures, failures


def distribution_figures(expected: np.ndarray, logits: np.ndarray) -> dict:
    """Mean and max total variation, top-1 agreement overall and on clear positions."""
    tv, clear, agree = [], [], []
    for rows in range(0, len(expected), _ROWS):  # float64 rows a slice at a time
        p, q = _softmax(expected[rows:rows + _ROWS]), _softmax(logits[rows:rows + _ROWS])
        tv.append(0.5 * np.abs(p - q).sum(axis=-1))  # [rows]
        top2 = np.partition(p, -2, axis=-1)[:, -2:]
        clear.append(np.abs(top2[:, 1] - top2[:, 0]) >= CLEAR_MARGIN)
        agree.append(p.argmax(-1) == q.argmax(-1))
    tv, clear, agree = np.concatenate(tv), np.concatenate(clear), np.concatenate(agree)
    return {
        "mean_tv": float(tv.mean()),
        "max_tv": float(tv.max()),
        "top1_agreement": float(agree.mean()),
        "clear_positions": int(clear.sum()),
        "clear_top1_agreement": float(agree[clear].mean()) if clear.any() else None,
    }


_ROWS = 64  # rows of logits turned into float64 probabilities at a time


def _softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    return x / x.sum(axis=-1, keepdims=True)


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| over rows ``[n, V]``, a slice of rows at a time (no n x V temporaries)."""
    return max(float(np.abs(a[rows:rows + _ROWS] - b[rows:rows + _ROWS]).max())
               for rows in range(0, len(a), _ROWS))


def _run(session: ModelSession, chunks: list[np.ndarray]) -> np.ndarray:
    """The logits ``[n, V]`` of ``chunks`` run in turn through one cache, written into one
    array as they come."""
    cache = session.new_cache()
    out = None
    start = 0
    for chunk in chunks:
        logits = session.forward(chunk, cache)  # [len(chunk), V]
        if out is None:
            out = np.empty((sum(len(c) for c in chunks), logits.shape[-1]), logits.dtype)
        out[start:start + len(chunk)] = logits
        start += len(chunk)
    return out
