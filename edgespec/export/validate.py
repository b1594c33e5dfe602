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

FP32_ATOL = 1e-3  # absolute, on logits; fp32 graphs measured here differ by ~1e-5


def validate_graph(
    model: PreTrainedModel, root: Path, spec: ModelSpec, length: int = 24, seed: int = 0
) -> tuple[dict, list[str]]:
    """Compare logits on a random sequence; returns (measured deviations, failures).

    Three ways through the graph must agree with one uncached PyTorch forward pass:
    the whole sequence with an empty cache; a prefix, then the rest with the prefix cached;
    and the last tokens fed one at a time.
    """
    ids = np.random.default_rng(seed).integers(0, spec.vocab_size, size=length)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)[None]).logits[0].float().numpy()  # [n, V]

    session = ModelSession(root / spec.path, spec, spec.vocab_size, SessionConfig("cpu"))
    split = length // 2
    measured = {
        "no_cache": _run(session, [ids]),
        "prefix_then_rest": _run(session, [ids[:split], ids[split:]]),
        "one_token_steps": _run(session, [ids[:split], *ids[split:, None]]),
    }
    deviations, failures = {}, []
    for name, logits in measured.items():
        diff = float(np.abs(logits - expected).max())
        deviations[f"max_abs_diff_{name}"] = diff
        if not diff <= FP32_ATOL:
            failures.append(
                f"{spec.path}: {name} logits differ from PyTorch by {diff:.2e} "
                f"(tolerance {FP32_ATOL:.0e})"
            )
    deviations["atol"] = FP32_ATOL
    return deviations, failures


def _run(session: ModelSession, chunks: list[np.ndarray]) -> np.ndarray:
    cache = session.new_cache()
    return np.concatenate([session.forward(chunk, cache) for chunk in chunks])  # [n, V]
