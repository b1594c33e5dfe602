"""The edge runtime: onnxruntime, NumPy and tokenizers only. Never import torch here."""

from edgespec.runtime.pipeline import GenerationResult, Pipeline, TextStream
from edgespec.runtime.providers import SessionConfig
from edgespec.runtime.stats import GenerationStats

__all__ = ["GenerationResult", "GenerationStats", "Pipeline", "SessionConfig", "TextStream"]
