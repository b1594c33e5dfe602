"""edgespec: speculative decoding for on-device LLMs on ONNX Runtime.

    import edgespec
    pipe = edgespec.load("pkg")            # a folder made by `edgespec export`
    print(pipe.generate("def fibonacci(n):", max_new_tokens=64).text)
"""

from edgespec.config import GenerationConfig, SamplingConfig
from edgespec.errors import EdgespecError
from edgespec.runtime import GenerationResult, GenerationStats, Pipeline, SessionConfig, load

__version__ = "0.1.0"

__all__ = [
    "EdgespecError",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "Pipeline",
    "SamplingConfig",
    "SessionConfig",
    "load",
]
