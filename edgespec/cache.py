"""Where edgespec keeps what it made for the user: named models' packages and calibrations.

Bottom floor: the runtime (runtime/calibration.py) and the named models (edgespec/models/)
both read the location here, so neither imports the other for it.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_folder() -> Path | None:
    """``$EDGESPEC_CACHE_DIR``, else the user's cache folder for edgespec
    (``$XDG_CACHE_HOME/edgespec`` or ``~/.cache/edgespec`` on Linux); None where no folder can
    be named (no HOME, and a user id without a passwd entry, as in some containers): costs are
    then measured, not stored, and named models cannot be built."""
    if folder := os.environ.get("EDGESPEC_CACHE_DIR"):
        return Path(folder)
    try:
        folder = Path(platformdirs.user_cache_dir("edgespec", appauthor=False))
    except RuntimeError:  # platformdirs could not name the home folder
        return None
    return folder if folder.is_absolute() else None  # "~" left as it is: no home to name
