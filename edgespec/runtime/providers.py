"""Where a graph runs: execution providers with fallback, threads, and per-model settings."""

from __future__ import annotations

import os
from dataclasses import dataclass

import onnxruntime as ort

PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
PROVIDERS = ("auto", *PROVIDER_NAMES)
_FALLBACKS = {"tensorrt": ["tensorrt", "cuda", "cpu"], "cuda": ["cuda", "cpu"], "cpu": ["cpu"]}


@dataclass(frozen=True)
class SessionConfig:
    """Where and how one graph runs.

    provider: "auto" (the best onnxruntime offers: TensorRT, CUDA, then CPU), "cpu", "cuda" or
        "tensorrt". Each falls back to the next (TensorRT -> CUDA -> CPU) with a warning.
    threads: intra-op threads on the CPU; 0 lets onnxruntime use every core.
    spin: let idle worker threads spin. Faster for a lone session, but two sessions that run
        in turn on a small machine steal each other's cores while spinning.
    trt_cache_dir: folder where TensorRT keeps built engines (building one takes minutes; the
        cache makes every later load fast). None: no cache.
    trt_fp16: let TensorRT run layers in fp16.
    """

    provider: str = "auto"
    threads: int = 0
    spin: bool = False
    trt_cache_dir: str | None = None
    trt_fp16: bool = False

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = all cores), got {self.threads}")


def default_session_configs(
    provider: str = "auto", draft_provider: str | None = None
) -> tuple[SessionConfig, SessionConfig]:
    """(target, draft) settings that do not fight over a small CPU.

    The draft's steps are tiny: one thread does them as fast as several, and with a single
    thread it has no worker threads to spin. The target gets every core and spinning workers,
    which answer its next run sooner. Measured on 2 cores with the demo pair: with two spinning
    threads on both sessions, speculation ran at 0.6-0.8x of target-only; with the draft on one
    thread, target spinning raised target-only decoding from 363 to 435 tokens/s and speculative
    (k=8) from 948 to 1059.
    """
    target = SessionConfig(provider, threads=os.cpu_count() or 1, spin=True)
    return target, SessionConfig(draft_provider or provider, threads=1)


def provider_chain(config: SessionConfig) -> tuple[list, str | None]:
    """The providers to ask onnxruntime for, in order, and a warning if the request can't be met."""
    available = ort.get_available_providers()
    warning = None
    if config.provider == "auto":
        wanted = next(p for p in ("tensorrt", "cuda", "cpu") if PROVIDER_NAMES[p] in available)
    elif PROVIDER_NAMES[config.provider] in available:
        wanted = config.provider
    else:
        wanted = "cpu"
        warning = (
            f"provider {config.provider!r} is not in this onnxruntime (it has "
            f"{', '.join(available)}); running on CPU. For GPUs: pip uninstall onnxruntime "
            "&& pip install 'edgespec[gpu]'"
        )
    chain = [_with_options(p, config) for p in _FALLBACKS[wanted] if PROVIDER_NAMES[p] in available]
    return chain, warning


def fallback_warning(chain: list, loaded: list[str]) -> str | None:
    """Say so when onnxruntime could not start the provider asked for and fell back."""
    first = chain[0][0] if isinstance(chain[0], tuple) else chain[0]
    if first in loaded:
        return None
    return (
        f"{first} could not start (for CUDA: are the CUDA and cuDNN libraries installed and "
        f"on the library path?); running on {loaded[0]}"
    )


def _with_options(provider: str, config: SessionConfig):
    name = PROVIDER_NAMES[provider]
    if provider != "tensorrt":
        return name
    options = {"trt_fp16_enable": config.trt_fp16}
    if config.trt_cache_dir:
        options |= {"trt_engine_cache_enable": True, "trt_engine_cache_path": config.trt_cache_dir}
    return name, options
