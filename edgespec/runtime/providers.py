"""Where a graph runs: execution providers with fallback, threads, and per-model settings."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import onnxruntime as ort

from edgespec.config import PROVIDERS
from edgespec.errors import ConfigError
from edgespec.runtime.machine import ONNXRUNTIME_BUILDS, usable_cores

PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
_FALLBACKS = {"tensorrt": ["tensorrt", "cuda", "cpu"], "cuda": ["cuda", "cpu"], "cpu": ["cpu"]}


def installed_builds() -> tuple[str, ...]:
    """The onnxruntime distributions installed, as ``name version``."""
    found = []
    for name in ONNXRUNTIME_BUILDS:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return tuple(found)


INSTALLED_BUILDS = installed_builds()  # read once, when edgespec.runtime is imported


@dataclass(frozen=True)
class SessionConfig:
    """Where and how one graph runs.

    provider: "auto" (the best onnxruntime offers: TensorRT, CUDA, then CPU), "cpu", "cuda" or
        "tensorrt". Each falls back to the next (TensorRT -> CUDA -> CPU) with a warning.
    threads: intra-op threads on the CPU; 0 lets onnxruntime use every core.
    spin: let idle worker threads spin. Faster for a lone session, but two sessions that run
        in turn on a small machine steal each other's cores while spinning.
    shared_pool: run on the process's one pool of worker threads (onnxruntime's global
        pools, their workers spinning), made by the first session that asks, with its
        ``threads``: a target and a draft that run in turn then never wait for each other's
        workers (``default_session_configs``). Once it exists every later session of the
        process runs on it, whatever its own settings (``on_shared_pool``), and so must any
        other onnxruntime session the process makes (``use_per_session_threads = False``).
    trt_cache_dir: folder where TensorRT keeps built engines (building one takes minutes; the
        cache makes every later load fast). None: no cache.
    trt_fp16: let TensorRT run layers in fp16.
    """

    provider: str = "auto"
    threads: int = 0
    spin: bool = False
    shared_pool: bool = False
    trt_cache_dir: str | None = None
    trt_fp16: bool = False

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise ConfigError(f"provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0 = all cores), got {self.threads}")


# The process's shared pool (onnxruntime's global pools: made once, never replaced; once
# they exist every session of the process must run on them): its intra-op threads once made
# here, 0 where other code made them, None before either.
_SHARED_POOL_THREADS: int | None = None


def on_shared_pool(config: SessionConfig) -> bool:
    """Whether a session of ``config`` runs on the process's shared pool: where it asks for
    it (made then, with its threads, 0 for every usable core), and always once the pool
    exists, whatever its threads: onnxruntime allows no pool of a session's own beside it."""
    global _SHARED_POOL_THREADS
    if config.shared_pool and _SHARED_POOL_THREADS is None:
        threads = config.threads or usable_cores()
        # onnxruntime 1.22 has no way to make them from Python: every session keeps its own
        make = getattr(ort.capi._pybind_state, "set_global_thread_pool_sizes", None)
        if make is None:
            return False
        try:
            make(threads, 1)
            _SHARED_POOL_THREADS = threads
        except Exception:  # onnxruntime's untyped error: made already, by code not ours
            _SHARED_POOL_THREADS = 0
    return _SHARED_POOL_THREADS is not None


def shared_pool_threads() -> int | None:
    """The shared pool's intra-op threads where this process made it; None where it has none
    or other code made it (its size unknown)."""
    return _SHARED_POOL_THREADS or None


# A draft this large (parameters) gets every core: its step streams tens of MB of weights or
# more, which one core reads far slower than all of them (see default_session_configs).
LARGE_DRAFT_PARAMETERS = 20_000_000


def default_session_configs(
    provider: str = "auto", draft_provider: str | None = None, draft_parameters: int = 0,
    shared_pool: bool = False,
) -> tuple[SessionConfig, SessionConfig]:
    """(target, draft) settings that do not fight over a small CPU, by the draft's size.

    ``shared_pool`` (the ``edgespec`` command's choice; a library's is its caller's,
    edgespec.load), for a real draft (``draft_parameters`` >= LARGE_DRAFT_PARAMETERS:
    SmolLM2-135M, Qwen2.5-0.5B): both sessions on the process's one pool of every core, its
    workers spinning. Two sessions that run in turn then never wait for each other's
    workers: on a 2-core AMD EPYC the real pair's draft step went from 12.8 ms to 9.1 and a
    k = 3 round from 121.5 ms to 109.9, SmolLM2's draft step from 2.4 to 1.5 ms
    (benchmarks/RESULTS.md, "Verification runs and draft steps against the target's step").
    A tiny draft keeps its one thread (the demo's round took 2.9 ms either way), and with it
    the outputs the library gives for a seed.

    Otherwise each session has a pool of its own. The target gets every core and spinning
    workers, which answer its next run sooner. A tiny draft (the demo's) runs on one thread,
    as fast as on several, with no worker threads to spin: spinning threads of two pools steal
    each other's cores on a small machine. A real draft is memory-bound like its target and
    one thread leaves most of its speed unused: it gets every core, not spinning
    (``python benchmarks/real_shapes.py run``).
    """
    cores = usable_cores()  # not os.cpu_count(): a container's share, not the host's CPUs
    large = draft_parameters >= LARGE_DRAFT_PARAMETERS
    if shared_pool and large:
        on_pool = SessionConfig(provider, threads=cores, spin=True, shared_pool=True)
        return on_pool, replace(on_pool, provider=draft_provider or provider)
    target = SessionConfig(provider, threads=cores, spin=True)
    return target, SessionConfig(draft_provider or provider, threads=cores if large else 1,
                                 spin=False)


def provider_chain(config: SessionConfig) -> tuple[list, str | None]:
    """The providers to ask onnxruntime for, in order, and a warning if the request can't be met."""
    available = ort.get_available_providers()
    missing = None
    if config.provider == "auto":
        wanted = next(p for p in ("tensorrt", "cuda", "cpu") if PROVIDER_NAMES[p] in available)
    elif PROVIDER_NAMES[config.provider] in available:
        wanted = config.provider
    else:
        wanted, missing = "cpu", config.provider
    warning = None
    if config.provider != "cpu":
        warning = install_warning(INSTALLED_BUILDS, available, missing)
    chain = [_with_options(p, config) for p in _FALLBACKS[wanted] if PROVIDER_NAMES[p] in available]
    return chain, warning


def install_warning(
    builds: tuple[str, ...], available: list[str], missing: str | None
) -> str | None:
    """One line when the install cannot give a GPU run: two onnxruntime builds installed (the
    module is whichever was written last), or a provider this build lacks; and how to fix it."""
    has = f"it has {', '.join(available)}"
    lacks = f"provider {missing!r} is not in this onnxruntime ({has}); running on CPU"
    if len(builds) > 1:
        names = [b.split()[0] for b in builds]
        keep = next(n for n in names if n != "onnxruntime")
        problem = f"{' and '.join(builds)} are both installed, sharing one onnxruntime module"
        return (f"{problem}; {lacks if missing else has}. Keep only {keep}: "
                f"pip uninstall -y {' '.join(names)} && pip install {keep}")
    if missing:
        return f"{lacks}. For GPUs: pip uninstall -y onnxruntime && pip install onnxruntime-gpu"
    return None


def fallback_warning(chain: list, loaded: list[str]) -> str | None:
    """One line naming each provider asked for that onnxruntime could not start, and why."""
    asked = [p[0] if isinstance(p, tuple) else p for p in chain]
    ran = asked.index(loaded[0]) if loaded[0] in asked else len(asked)
    failed = [p for p in asked[:ran] if p not in loaded]
    if not failed:
        return None
    reasons = ", ".join(f"{p} could not start ({start_failure(p)})" for p in failed)
    return f"{reasons}; running on {loaded[0]}"


def start_failure(provider: str) -> str:
    """Why a provider that onnxruntime lists could not start, as far as can be known.

    onnxruntime loads each GPU provider from a library of its own and logs why that failed
    (its log is silenced, session.py); loading the library again here names the first system
    library it lacks (CUDA, cuDNN, TensorRT). If it loads, the device or its driver failed.
    """
    short = {"CUDAExecutionProvider": "cuda", "TensorrtExecutionProvider": "tensorrt"}.get(provider)
    if short is None:
        return "onnxruntime gave no reason"
    name = f"onnxruntime_providers_{short}"
    name = f"{name}.dll" if os.name == "nt" else f"lib{name}.so"
    return (library_failure(Path(ort.__file__).parent / "capi" / name)
            or "its libraries load: no GPU, or a driver too old for this onnxruntime?")


def library_failure(path: Path) -> str | None:
    """Why the shared library at ``path`` does not load (the first library it lacks), or None."""
    if not path.is_file():
        return f"{path.name} is missing from this onnxruntime"
    try:
        ctypes.CDLL(str(path))
    except OSError as e:
        message = str(e)
        if "cannot open shared object file" in message:  # "libcudnn.so.9: cannot open ..."
            return f"{Path(message.split(':')[0]).name} not found"
        return message
    return None


def _with_options(provider: str, config: SessionConfig):
    name = PROVIDER_NAMES[provider]
    if provider != "tensorrt":
        return name
    options = {"trt_fp16_enable": config.trt_fp16}
    if config.trt_cache_dir:
        options |= {"trt_engine_cache_enable": True, "trt_engine_cache_path": config.trt_cache_dir}
    return name, options
