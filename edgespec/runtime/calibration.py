"""Measured step costs kept on disk, once per package, machine and session settings.

The adaptive schedule needs the time of a draft step and of target runs on 1..k+1 tokens
(schedule.calibrate). Measuring them costs about a second before the first token of every new
process; the costs depend only on the graphs, the CPU, the onnxruntime build and the thread
settings, so the first process stores them and later ones read them back.

The store is one JSON file in the user's cache folder: ``$EDGESPEC_CACHE_DIR``, else
``$XDG_CACHE_HOME/edgespec``, else ``~/.cache/edgespec``. Delete it to measure again.
An unreadable or foreign file is ignored (and replaced on the next store); a folder that cannot
be written leaves the costs unstored, never a failed generation.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from edgespec.runtime.machine import cpu_model, onnxruntime_build, usable_cores
from edgespec.runtime.schedule import StepCosts

FILE_NAME = "calibration.json"
FORMAT = 1
MAX_ENTRIES = 64  # oldest dropped first: one entry per package x settings, a few KB in all


def cache_folder() -> Path:
    if folder := os.environ.get("EDGESPEC_CACHE_DIR"):
        return Path(folder)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "edgespec"


def package_stamp(package: Path, model_paths: list[str]) -> str:
    """What identifies a package's graphs: its manifest's bytes and each model folder's file
    names, sizes and modification times (a re-export changes them)."""
    digest = hashlib.sha256((package / "edgespec.json").read_bytes())
    for model in model_paths:
        for file in sorted((package / model).parent.iterdir()):
            if file.is_file():
                stat = file.stat()
                digest.update(f"{model}:{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def cache_key(package: Path, model_paths: list[str], settings: dict, kmax: int,
              context: int) -> str:
    """One entry per package, machine, onnxruntime build, session settings and kmax."""
    parts = {
        "package": package_stamp(package, model_paths),
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "onnxruntime": onnxruntime_build(),
        "settings": settings,
        "kmax": kmax,
        "context": context,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def load_costs(key: str, folder: Path | None = None) -> StepCosts | None:
    """The costs stored under ``key``, or None (none stored, or a file that cannot be read)."""
    entry = _read(folder or cache_folder()).get(key)
    try:
        return StepCosts(float(entry["draft_step_ms"]), tuple(float(t) for t in entry["target_ms"]))
    except (TypeError, KeyError, ValueError):
        return None


def store_costs(key: str, costs: StepCosts, folder: Path | None = None) -> bool:
    """Add ``costs`` under ``key``; False if the folder cannot be written (nothing changes)."""
    folder = folder or cache_folder()
    entries = _read(folder)
    entries[key] = {"draft_step_ms": costs.draft_step_ms, "target_ms": list(costs.target_ms),
                    "measured_at": time.time()}
    newest = sorted(entries.items(), key=lambda kv: kv[1].get("measured_at", 0))[-MAX_ENTRIES:]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".calibration-", suffix=".tmp")
    except OSError:
        return False
    try:  # written whole, then renamed over the old file: a reader never sees half of it
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "entries": dict(newest)}, f)
        os.replace(tmp, folder / FILE_NAME)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        return False
    return True


def _read(folder: Path) -> dict:
    try:
        data = json.loads((folder / FILE_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return {}
    entries = data.get("entries")
    return {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}
