"""Measured step costs and numerics checks kept on disk, once per package, machine and settings.

The adaptive schedule needs the time of a draft step and of target runs on 1..k+1 tokens
(schedule.calibrate). Measuring them costs about a second before the first token of every new
process; the costs depend only on the graphs, the CPU, the onnxruntime build and the thread
settings, so the first process stores them and later ones read them back. The load's checks of what a
package's exactness rests on (numerics.py) are kept the same way.

The store is one JSON file in the user's cache folder: ``$EDGESPEC_CACHE_DIR``, else the
platform's (platformdirs: ``$XDG_CACHE_HOME/edgespec`` or ``~/.cache/edgespec`` on Linux,
``~/Library/Caches/edgespec`` on macOS, ``%LOCALAPPDATA%\\edgespec\\Cache`` on Windows).
Delete it to measure again.
An unreadable or foreign file is ignored (and replaced on the next store); a folder that cannot
be written leaves the costs unstored, never a failed generation.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from edgespec.cache import cache_folder
from edgespec.manifest import MANIFEST_NAME
from edgespec.runtime.machine import cpu_model, instruction_sets, onnxruntime_build, usable_cores
from edgespec.runtime.schedule import LONG_RUNS, StepCosts

FILE_NAME = "calibration.json"
FORMAT = 1
MAX_ENTRIES = 64  # oldest dropped first: one entry per package x settings, a few KB in all


def package_stamp(package: Path, model_paths: list[str]) -> str:
    """What identifies a package's graphs: its manifest's bytes and each model folder's file
    names, sizes and modification times (a re-export changes them)."""
    digest = hashlib.sha256((package / MANIFEST_NAME).read_bytes())
    for model in model_paths:
        for file in sorted((package / model).parent.iterdir()):
            if file.is_file():
                stat = file.stat()
                digest.update(f"{model}:{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def cache_key(package_stamp: str, settings: dict, kmax: int, context: int) -> str:
    """One entry per package (``package_stamp``), machine, onnxruntime build, edgespec version
    (how costs are measured), session settings and kmax."""
    return _key(package=package_stamp, settings=settings, kmax=kmax, context=context)


def numerics_key(package_stamp: str, settings: dict) -> str:
    """The entry of a package's numerics checks (numerics.py) on this machine."""
    return _key(kind="numerics", package=package_stamp, settings=settings)


def _key(**parts) -> str:
    """A hash of ``parts`` and the machine: its CPU's name and instruction sets (one name, such
    as "AMD EPYC", covers CPUs with and without AVX-512), cores, onnxruntime and edgespec."""
    from edgespec import __version__

    parts |= {"edgespec": __version__, "cpu": cpu_model(), "isa": instruction_sets(),
              "cores": usable_cores(), "onnxruntime": onnxruntime_build()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def load_entry(key: str, folder: Path | None = None) -> dict | None:
    """The entry stored under ``key`` as it was stored (unchecked: the caller checks it)."""
    folder = folder or cache_folder()
    return _read(folder).get(key) if folder else None


def load_costs(key: str, kmax: int, folder: Path | None = None,
               long_runs: Sequence[int] = LONG_RUNS) -> StepCosts | None:
    """The costs stored under ``key``: a draft step, target runs on 1..kmax+1 tokens and on
    the ``long_runs`` past kmax + 1, each a positive number of ms; None if there are none, or
    the entry is not that."""
    entry = load_entry(key, folder)
    try:
        draft_ms = float(entry["draft_step_ms"])
        target_ms = tuple(float(t) for t in entry["target_ms"])
        long_ms = tuple((int(n), float(t)) for n, t in entry["long_ms"])
    except (TypeError, KeyError, ValueError):
        return None
    times = (draft_ms, *target_ms, *(t for _, t in long_ms))
    if (len(target_ms) != kmax + 1 or [n for n, _ in long_ms] != [
            n for n in long_runs if n > kmax + 1]
            or not all(0 <= t < math.inf for t in times) or not any(times)):
        return None
    return StepCosts(draft_ms, target_ms, long_ms)


def store_costs(key: str, costs: StepCosts, folder: Path | None = None) -> bool:
    """Add ``costs`` under ``key``; False if the folder cannot be written (nothing changes)."""
    return store_entry(key, {"draft_step_ms": costs.draft_step_ms,
                             "target_ms": list(costs.target_ms),
                             "long_ms": [list(point) for point in costs.long_ms]}, folder)


def store_entry(key: str, entry: dict, folder: Path | None = None) -> bool:
    """Add ``entry`` (JSON values) under ``key``, with the time; False if the folder cannot be
    written (nothing changes)."""
    folder = folder or cache_folder()
    if folder is None:
        return False
    entries = _read(folder)
    entries[key] = {**entry, "measured_at": time.time()}
    newest = sorted(entries.items(), key=_age)[-MAX_ENTRIES:]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".calibration-", suffix=".tmp")
    except OSError:
        return False
    try:  # written whole, then renamed over the old file: a reader never sees half of it
        os.fchmod(fd, 0o666 & ~_umask())  # as any file the user makes (mkstemp gives 0600)
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "entries": dict(newest)}, f)
        os.replace(tmp, folder / FILE_NAME)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        return False
    return True


def _age(item: tuple[str, dict]) -> float:
    when = item[1].get("measured_at")
    return when if isinstance(when, (int, float)) else 0.0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read(folder: Path) -> dict:
    try:
        data = json.loads((folder / FILE_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return {}
    entries = data.get("entries")
    return {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}
