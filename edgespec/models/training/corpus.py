"""The stdlib's ``.py`` files, split by file into train / held-out, and held-out prompts."""

import ast
import hashlib
import sysconfig
import textwrap
import tokenize
from collections.abc import Sequence
from pathlib import Path

from edgespec.errors import EdgespecError

# Tests, third-party packages, and generated data: codec tables (encodings/) and pydoc's topic
# texts (pydoc_data/), which are 18% of the stdlib's bytes but neither hand-written nor code.
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"}
)


def stdlib_dir() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def find_corpus(root: Path | None = None) -> list[Path]:
    """The ``.py`` files under root (default: the stdlib), sorted.

    Leaves out tests (test/, tests/, idle_test/, test_*.py), site-packages and generated data.
    """
    root = stdlib_dir() if root is None else root
    files = sorted(path for path in root.rglob("*.py") if _is_source(path.relative_to(root)))
    if not files:
        raise EdgespecError(f"no Python sources under {root}; is the standard library installed?")
    return files


def _is_source(relative: Path) -> bool:
    if relative.name.startswith("test_"):
        return False
    return _EXCLUDED_DIRS.isdisjoint(relative.parts[:-1])


def split_corpus(
    files: Sequence[Path], heldout_fraction: float, root: Path | None = None
) -> tuple[list[Path], list[Path]]:
    """Split files into (train, held-out) by a hash of each path relative to root.

    The split depends only on the relative path: it is the same on every machine, and adding or
    removing a file moves no other file across the split.
    """
    root = stdlib_dir() if root is None else root
    train: list[Path] = []
    heldout: list[Path] = []
    for path in files:
        (heldout if _unit_hash(path.relative_to(root)) < heldout_fraction else train).append(path)
    if not train or not heldout:
        raise EdgespecError(
            f"{len(files)} files split into {len(train)} train and {len(heldout)} held-out; "
            "both must be non-empty: use more files or change heldout_fraction"
        )
    return train, heldout


def _unit_hash(relative: Path) -> float:
    """A number in [0, 1) fixed by the path."""
    digest = hashlib.sha256(relative.as_posix().encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _read_source(path: Path) -> str:
    """Read a Python source file in the encoding its PEP 263 cookie declares (default UTF-8)."""
    with tokenize.open(path) as source:
        return source.read()


def heldout_prompts(files: Sequence[Path], count: int, max_chars: int = 400) -> list[str]:
    """Code-completion prompts from held-out files: a function's signature and docstring.

    The models never trained on these files, so a benchmark on them measures generalisation,
    not recall. Functions are taken in file order, round-robin over files, for variety.
    """
    per_file = [_documented_functions(_read_source(path), max_chars) for path in files]
    prompts: list[str] = []
    for round_ in range(max(map(len, per_file), default=0)):
        prompts += [functions[round_] for functions in per_file if round_ < len(functions)]
    return prompts[:count]


def _documented_functions(source: str, max_chars: int) -> list[str]:
    """The text of each documented function from ``def`` to the end of its docstring."""
    lines = source.splitlines(keepends=True)
    prompts = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or ast.get_docstring(node) is None:
            continue
        start = node.lineno - 1 if not node.decorator_list else node.decorator_list[0].lineno - 1
        text = "".join(lines[start : node.body[0].end_lineno])
        if len(text) <= max_chars:
            prompts.append(textwrap.dedent(text))
    return prompts
