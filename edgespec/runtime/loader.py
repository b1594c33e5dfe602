"""An exported graph loaded into onnxruntime: the session, the tensors its recipes make handed
over, and those the session no longer reads let go.

MatMulNBits and MatMul pack their weights into layouts of their own as the session loads, so
once loaded most of the tensors runtime/unpack.py makes are only memory: kept, they would add
their size to the weights' (benchmarks/RESULTS.md, "Memory"). They are handed to
onnxruntime in place where it allows (``inference_session``), and ``release_unpacked`` lets go
of those a probe run shows nothing reads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec.manifest import LOCATION, PACKED_GROUPS
from edgespec.runtime.unpack import read_with_recipes


def inference_session(path: Path, options=None, providers=("CPUExecutionProvider",)):
    """An onnxruntime session of the graph at ``path``, given the tensors its folder's recipes
    make (``read``); they stay referenced by the session (``edgespec_unpacked``) for as long
    as it lives, or until ``release_unpacked`` finds that onnxruntime no longer reads them.

    onnxruntime copies external initializers as the session loads. On the CPU provider alone,
    a package whose export wrote the location file hands them over in place instead
    (``SessionOptions.add_initializer``): the load's peak holds one copy fewer. Other
    providers get copies (TensorRT builds its engines
    from the weights as given)."""
    import onnxruntime as ort

    folder = Path(path).parent
    made, recipes = read_with_recipes(folder)
    options = options or ort.SessionOptions()
    values = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in made.items()}
    in_place = bool(made) and list(providers) == ["CPUExecutionProvider"] and \
        _empty_file(folder / LOCATION)
    if in_place:
        for name, value in values.items():
            options.add_initializer(name, value)
    elif made:
        options.add_external_initializers(list(values), list(values.values()))
    session = ort.InferenceSession(str(path), options, providers=list(providers))
    session.edgespec_unpacked = made  # onnxruntime may read these buffers: kept while it might
    session.edgespec_values = values  # an in-place value must outlive the session's load
    session.edgespec_groups = _groups(recipes, made) if in_place else [list(made)]
    session.edgespec_folder = folder
    return session


def _empty_file(path: Path) -> bool:
    """Whether ``path`` is the export's empty location file (not a link: a package comes from
    anyone, and onnxruntime reads that location for any initializer declared there)."""
    return path.is_file() and not path.is_symlink() and path.stat().st_size == 0


def _groups(recipes: dict, made: dict) -> list[list[str]]:
    """The in-place tensors ``release_unpacked`` may let go of, group by group as the export
    marked them in their ``recipes``; the others are read at every run."""
    marks = {name: recipe.get("packed") for name, recipe in recipes.items()
             if isinstance(recipe, dict)}
    return [[name for name in made if marks.get(name) == kind] for kind in PACKED_GROUPS]


def release_unpacked(session, probe) -> int:
    """Drop the made tensors of ``session`` (an ``inference_session``) that onnxruntime no
    longer reads (it copied them, or packed them into a layout of its own); returns the bytes
    let go.

    Whether it reads them depends on its version, provider and kernels, so it is tested, not
    assumed: ``probe()`` runs the graph and returns its outputs; every bit of a group of
    tensors is flipped in place and it runs again (flipped, not zeroed: zero points are zeros,
    and a read of them would not show). Outputs equal bit for bit mean nothing reads the
    group, so it is dropped; otherwise its bits are flipped back and it is kept: one tensor the
    probe sees read keeps its whole group. Copied tensors are one group; tensors handed over
    in place are grouped as the export marked them (``PACKED_GROUPS``), tried all together first
    (one probe where nothing reads any), then group by group. Only for sessions on the CPU
    provider alone: other providers may read weights later (TensorRT builds its engines at the
    first run).
    """
    made = getattr(session, "edgespec_unpacked", None)
    if not made or session.get_providers() != ["CPUExecutionProvider"] or \
            not all(a.flags.writeable and a.flags.c_contiguous for a in made.values()):
        return 0
    values = getattr(session, "edgespec_values", {})
    groups = [g for g in getattr(session, "edgespec_groups", [list(made)]) if g]
    if len(groups) > 1:  # every group at once first: int8 compute reads none of them
        groups = [[name for group in groups for name in group], *groups]
    before = probe()
    freed = 0
    for group in groups:
        group = [name for name in group if name in made]
        if not group:
            continue
        _flip(made, group)
        after = probe()
        if len(before) != len(after) or \
                not all(np.array_equal(a, b) for a, b in zip(before, after)):
            _flip(made, group)  # back as they were
            continue
        for name in group:
            freed += made.pop(name).nbytes
            values.pop(name, None)  # each holds its array
    if freed:
        give_back_freed_memory()
    return freed


def _flip(made: dict[str, np.ndarray], names: list[str]) -> None:
    for name in names:
        made[name].reshape(-1).view(np.uint8)[...] ^= np.uint8(0xFF)


def give_back_freed_memory() -> None:
    """Ask glibc's allocator to return freed heap pages to the system (tensors of a few MB come
    from its heap, whose free pages it otherwise keeps); a no-op elsewhere."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


