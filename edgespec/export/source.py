"""What ``--target`` and ``--draft`` name, read as a checkpoint: a Hugging Face folder
(checkpoint.py) or a GGUF file (gguf.py), whichever the path is. The one place that knows
both kinds, so that neither reader imports the other.
"""

from __future__ import annotations

from pathlib import Path

from edgespec.export.checkpoint import Checkpoint, read_folder
from edgespec.export.gguf import find_gguf, read_gguf_checkpoint


def read_checkpoint(path: Path, role: str) -> Checkpoint:
    """Read config and tokenizer of a causal LM, or say plainly why the folder is not one.

    A .gguf file, or a folder holding one and no config.json, is read as a GGUF checkpoint
    (export/gguf.py)."""
    path = Path(path)
    gguf_file = find_gguf(path, role)
    if gguf_file is not None:
        return read_gguf_checkpoint(gguf_file, role)
    return read_folder(path, role)
