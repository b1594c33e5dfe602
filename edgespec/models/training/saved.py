"""A training stage's file from an earlier run, read back to resume (``edgespec distill``'s
OUT/work/teacher.pt, features.pt, state.pt).

The folder is the user's and may have come from anywhere: a file is read with torch's
weights-only unpickler (tensors, containers, numbers and strings; never code) and its layout
checked before any of it is used. A file that is not what the stage wrote is refused in one
line naming it and the fix, and left as it is: it is the user's to delete.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from edgespec.errors import EdgespecError, one_line, shown


def load_saved(path: Path, what: str, layout: Callable[[object], bool]):
    """The object saved at ``path`` (``what`` it holds, for the message), if ``layout`` accepts
    it; else an EdgespecError."""
    fix = (f"delete it to compute {what} again, or give another --out")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, ValueError,
            TypeError, AttributeError, ImportError, IndexError, KeyError, OSError) as e:
        reason = shown(one_line(e, None), 160)
        raise EdgespecError(f"{path} is not {what} as edgespec saves it (a file of plain "
                            f"tensors; this one: {reason}); {fix}") from None
    try:
        fits = bool(layout(saved))
    except (TypeError, AttributeError, KeyError, IndexError, ValueError):
        fits = False
    if not fits:
        raise EdgespecError(f"{path} holds plain tensors but not {what} as this version of "
                            f"edgespec saves it; {fix}")
    return saved


def is_list_of(value: object, check: Callable[[object], bool]) -> bool:
    return isinstance(value, list) and all(check(v) for v in value)


def is_tensor(value: object, dims: int | None = None) -> bool:
    return isinstance(value, torch.Tensor) and (dims is None or value.dim() == dims)
