"""edgespec: speculative decoding for on-device LLMs on ONNX Runtime.

    import edgespec
    pipe = edgespec.load()                 # the bundled demo pair; or a folder from `edgespec export`
    print(pipe.generate("def fibonacci(n):", max_new_tokens=64).text)

The runtime (onnxruntime, NumPy, tokenizers) is imported on first use of its names, so the
command line starts, and answers Ctrl-C, before the heavy imports.
"""

from edgespec import models  # light: paths only (edgespec.models.demo_package())
from edgespec.config import Constraint, GenerationConfig, SamplingConfig
from edgespec.errors import EdgespecError
from edgespec.loading import load  # light: the runtime is imported when it is called

__version__ = "0.1.0"

_RUNTIME = ("GenerationResult", "GenerationStats", "Pipeline", "SessionConfig")

__all__ = ["Constraint", "EdgespecError", "GenerationConfig", "SamplingConfig", "load", "models",
           *_RUNTIME]


def __getattr__(name: str):
    if name in _RUNTIME:
        import edgespec.runtime

        return getattr(edgespec.runtime, name)
    raise AttributeError(f"module 'edgespec' has no attribute {name!r}")
