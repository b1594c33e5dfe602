"""Exported graph vs PyTorch: the same logits, with and without the KV cache.

The graph is run through the runtime's own ``ModelSession``, so validation also covers the
feeds the runtime builds (position ids, attention mask, cache layout).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from edgespec.manifest import ModelSpec
from edgespec.runtime.providers import SessionConfig
from edgespec.runtime.session import ModelSession

# Tolerance on max |ORT logits - PyTorch logits|, as a fraction of the largest |logit| (at
# least 1). Measured on the demo target (largest logit 11.3): fp32 1e-6 of it, fp16 6e-4,
# int8 2.7e-3, int4 5.1e-2; each tolerance leaves room for models that round worse.
TOLERANCES = {"fp32": 1e-3, "fp16": 1e-2, "int8": 2e-2, "int4": 2e-1}
# Cached vs uncached runs of the same graph: the runtime's exactness rests on a token's logits
# not depending on how many tokens share its run.
CONSISTENCY = 1e-3


def validate_graph(
    model: PreTrainedModel,
    root: Path,
    spec: ModelSpec,
    max_positions: int,
    variant: str = "fp32",
    length: int = 24,
    seed: int = 0,
) -> tuple[dict, list[str]]:
    """Compare logits on a random sequence; returns (measured deviations, failures).

    Three ways through the graph must agree with one uncached PyTorch forward pass, within the
    variant's tolerance: the whole sequence with an empty cache; a prefix, then the rest with
    the prefix cached; and the last tokens fed one at a time. The three must also agree with
    each other within CONSISTENCY, whatever the variant.
    """
    ids = np.random.default_rng(seed).integers(0, spec.vocab_size, size=length)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)[None]).logits[0].float().numpy()  # [n, V]
    scale = max(1.0, float(np.abs(expected).max()))

    session = ModelSession(root / spec.path, spec, spec.vocab_size, max_positions,
                           SessionConfig("cpu"))
    split = length // 2
    measured = {
        "no_cache": _run(session, [ids]),
        "prefix_then_rest": _run(session, [ids[:split], ids[split:]]),
        "one_token_steps": _run(session, [ids[:split], *ids[split:, None]]),
    }
    tolerance = TOLERANCES[variant] * scale
    deviations = {"variant": variant, "tolerance": tolerance, "logit_scale": scale}
    failures = []
    for name, logits in measured.items():
        diff = float(np.abs(logits - expected).max())
        deviations[f"max_abs_diff_{name}"] = diff
        if not diff <= tolerance:
            failures.append(
                f"{spec.path}: {name} logits differ from PyTorch by {diff:.2e} "
                f"(tolerance {tolerance:.1e} for {variant})"
            )
    deviations["top1_agreement"] = float(
        (measured["no_cache"].argmax(-1) == expected.argmax(-1)).mean()
    )
    consistency = max(
        float(np.abs(measured[name] - measured["no_cache"]).max())
        for name in ("prefix_then_rest", "one_token_steps")
    )
    deviations["max_abs_diff_cached_vs_uncached"] = consistency
    if not consistency <= CONSISTENCY * scale:
        failures.append(
            f"{spec.path}: cached and uncached runs of the graph differ by {consistency:.2e} "
            f"(tolerance {CONSISTENCY * scale:.1e}); speculative output would not match "
            "target-only output"
        )
    return deviations, failures


def _run(session: ModelSession, chunks: list[np.ndarray]) -> np.ndarray:
    cache = session.new_cache()
    return np.concatenate([session.forward(chunk, cache) for chunk in chunks])  # [n, V]
