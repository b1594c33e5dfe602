"""``edgespec.load``: a package named by its folder, by a named model's name, or the bundled
demo pair, loaded into a Pipeline.

Names are resolved here, above the runtime (edgespec/models/ knows the named models and where
they are built), so that runtime/ takes folders only; the runtime is imported on the first
call, so ``import edgespec`` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgespec.runtime.pipeline import Pipeline
    from edgespec.runtime.providers import SessionConfig


def load(
    path: str | Path | None = None,
    provider: str = "auto",
    draft_provider: str | None = None,
    target: "SessionConfig | None" = None,
    draft: "SessionConfig | None" = None,
    calibration_cache: bool = True,
    prefix_cache_slots: int = 1,
    prefix_cache_bytes: int | None = None,
    shared_pool: bool = False,
) -> "Pipeline":
    """Load an exported package (``path`` None: the bundled demo pair; a named model's name,
    ``edgespec models list``, its built package).

    provider: where both models run ("auto", "cpu", "cuda", "tensorrt"); draft_provider, if
    given, overrides it for the draft (a tiny draft can stay on the CPU next to a GPU target).
    target / draft: full SessionConfig per model, overriding the defaults.
    calibration_cache: read the adaptive schedule's step costs from, and store them in, the
        user's cache folder (runtime/calibration.py); False measures them in this process.
    prefix_cache_slots, prefix_cache_bytes: how many generations' KV caches are kept, and
        how much memory they may hold (None: no cap), for the next generation to start from
        the longest prefix it shares with one (runtime/prefix_cache.py); 0 slots keeps none.
    shared_pool: run both models on one pool of worker threads for the whole process
        (onnxruntime's global pools), faster where a draft and its target take turns on a
        few cores: the real coder pair's rounds 10% shorter on 2 cores. Once it exists,
        every onnxruntime session the process makes must set
        ``SessionOptions.use_per_session_threads = False``: the ``edgespec`` command turns it
        on, a library's caller chooses.
    """
    from edgespec.models import demo_package
    from edgespec.models.registry import package_path
    from edgespec.runtime.pipeline import Pipeline

    path = demo_package() if path is None else package_path(path)
    return Pipeline(path, target, draft, provider, draft_provider, calibration_cache,
                    prefix_cache_slots, prefix_cache_bytes, shared_pool)
