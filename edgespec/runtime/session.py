"""One exported decoder graph on onnxruntime: feeds built from the cache, logits out."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgespec.errors import ManifestError
from edgespec.manifest import ModelSpec
from edgespec.runtime.kv_cache import KVCache

PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


@dataclass(frozen=True)
class SessionConfig:
    """Where and how one graph runs.

    provider: "auto" (the best one onnxruntime offers: TensorRT, CUDA, then CPU), "cpu",
        "cuda" or "tensorrt". A provider that cannot load falls back to CPU with a warning.
    threads: intra-op threads; 0 lets onnxruntime use every core.
    spin: let idle worker threads spin. Faster for a lone session, but two sessions that run
        in turn on a small machine steal each other's cores while spinning.
    """

    provider: str = "auto"
    threads: int = 0
    spin: bool = False

    def __post_init__(self) -> None:
        if self.provider != "auto" and self.provider not in PROVIDER_NAMES:
            choices = ", ".join(["auto", *PROVIDER_NAMES])
            raise ValueError(f"provider must be one of {choices}, got {self.provider!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = all cores), got {self.threads}")


def default_session_configs(provider: str = "auto") -> tuple[SessionConfig, SessionConfig]:
    """(target, draft) settings that do not fight over a small CPU.

    The draft's steps are tiny: one thread does them as fast as several, and leaves the other
    cores quiet for the target. Measured on 2 cores with spinning threads on both sessions,
    speculation ran at 0.6-0.8x of target-only; with the draft on one thread and no spinning
    it ran faster than target-only.
    """
    return SessionConfig(provider, threads=os.cpu_count() or 1), SessionConfig(provider, threads=1)


def resolve_providers(requested: str) -> tuple[list[str], str | None]:
    """Providers to ask onnxruntime for, and a warning when the request cannot be met."""
    available = ort.get_available_providers()
    if requested == "auto":
        order = ["tensorrt", "cuda", "cpu"]
        chosen = next(p for p in order if PROVIDER_NAMES[p] in available or p == "cpu")
        return _with_fallback(chosen), None
    if PROVIDER_NAMES[requested] not in available:
        return ["CPUExecutionProvider"], (
            f"provider {requested!r} is not available in this onnxruntime "
            f"(has {', '.join(available)}); running on CPU. For GPUs install edgespec[gpu]"
        )
    return _with_fallback(requested), None


def _with_fallback(provider: str) -> list[str]:
    chain = {"tensorrt": ["tensorrt", "cuda", "cpu"], "cuda": ["cuda", "cpu"], "cpu": ["cpu"]}
    return [PROVIDER_NAMES[p] for p in chain[provider]]


class ModelSession:
    """An onnxruntime session for one decoder with KV cache inputs and outputs.

    The KV input and output names, head count and head size are read from the graph and checked
    against the manifest, so any layer count or architecture optimum exports works.
    """

    def __init__(self, path: Path, spec: ModelSpec, vocab_size: int, config: SessionConfig):
        providers, self.warning = resolve_providers(config.provider)
        options = ort.SessionOptions()
        options.intra_op_num_threads = config.threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.spin else "0")
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as e:  # onnxruntime raises its own untyped errors for bad files
            raise ManifestError(f"cannot load {path}: {e}; re-export the pair") from None
        self.providers = self.session.get_providers()
        self.vocab_size = vocab_size
        self._read_graph(spec)

    def _read_graph(self, spec: ModelSpec) -> None:
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        self.kv_inputs = [n for n in inputs if n.startswith("past_key_values.")]
        self.kv_outputs = [n for n in outputs if n.startswith("present.")]
        if self.kv_inputs != spec.kv_inputs or self.kv_outputs != spec.kv_outputs:
            raise ManifestError(f"{spec.path}: KV names differ from the manifest; re-export the pair")
        first = inputs[self.kv_inputs[0]]
        self.kv_heads, self.head_dim = first.shape[1], first.shape[3]
        self.kv_dtype = _ORT_DTYPES[first.type]
        self.has_position_ids = "position_ids" in inputs
        self.has_attention_mask = "attention_mask" in inputs
        self.output_names = ["logits", *self.kv_outputs]

    def new_cache(self) -> KVCache:
        return KVCache(self.kv_inputs, self.kv_heads, self.head_dim, self.kv_dtype)

    def forward(self, tokens: np.ndarray, cache: KVCache) -> np.ndarray:
        """Run ``tokens [n]`` after what the cache covers; returns logits ``[n, vocab]``.

        position_ids and attention_mask are derived from the cache length; the cache then
        covers the fed tokens too.
        """
        start, n = cache.length, len(tokens)
        feeds = cache.feeds()
        feeds["input_ids"] = np.asarray(tokens, dtype=np.int64)[None, :]
        if self.has_attention_mask:
            feeds["attention_mask"] = np.ones((1, start + n), dtype=np.int64)
        if self.has_position_ids:
            feeds["position_ids"] = np.arange(start, start + n, dtype=np.int64)[None, :]
        logits, *presents = self.session.run(self.output_names, feeds)
        cache.replace(presents, added=n)
        return logits[0, :, : self.vocab_size]  # [n, V]; padded rows dropped
