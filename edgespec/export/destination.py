"""Where an export writes: checked before any work, written atomically, nothing of yours lost.

Rules, in order:
- ``--out`` must not be the current folder or one of its parents, nor sit inside a file.
- An existing ``--out`` is replaced only with ``--overwrite``, only if it is an edgespec package
  (it holds ``edgespec.json``) and only if it holds nothing edgespec did not write.
- The package is built in a hidden temporary folder in the nearest existing folder on the way to
  ``--out`` and renamed into place at the end; missing parent folders are created only then.
  Any way out of the block (an error, Ctrl-C, SIGTERM turned into an exception by the CLI)
  removes the temporary folder and leaves ``--out`` as it was.
- A file rewritten in a folder that may come from elsewhere (a stage's data when a run resumes,
  a head's files) is written by ``write_file``: into a temporary file created exclusively, never
  through a link, then renamed over the file.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from edgespec.errors import EdgespecError, ExportError
from edgespec.manifest import MANIFEST_NAME, PACKAGE_ENTRIES


def check_destination(out: Path, overwrite: bool, entries: frozenset[str] = PACKAGE_ENTRIES,
                      flag: str = "--out") -> Path:
    """Refuse every ``out`` that would lose data or fail after the work; returns it absolute.

    ``entries``: the names an existing folder may hold to be replaced with ``overwrite``.
    """
    out = Path(os.path.abspath(out))
    cwd = Path.cwd().resolve()
    real = out.resolve()
    if real == cwd or real in cwd.parents:
        raise ExportError(
            f"{flag} {out} is the current folder or one of its parents; "
            f"name a new folder, e.g. {flag} pkg"
        )
    base = _nearest_existing(out)
    if base != out and not base.is_dir():
        raise ExportError(f"{flag} {out}: {base} is a file, not a folder; choose another {flag}")
    if base == out:
        _check_existing(out, overwrite, entries, flag)
    parent = base if base != out else out.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"{flag} {out}: cannot write in {parent} (permission denied)")
    return out


def _check_existing(out: Path, overwrite: bool, entries: frozenset[str], flag: str) -> None:
    if not out.is_dir():
        raise ExportError(f"{flag} {out} is a file; choose a folder path for {flag}")
    present = {p.name for p in out.iterdir()}
    if not present:
        return  # an empty folder: nothing to lose
    if not overwrite:
        raise ExportError(f"{out} already exists; choose another {flag} or pass --overwrite")
    if MANIFEST_NAME not in present and entries is PACKAGE_ENTRIES:
        raise ExportError(
            f"{out} is not an edgespec package (no {MANIFEST_NAME}) and --overwrite replaces "
            f"only packages; choose another {flag}"
        )
    foreign = sorted(present - entries)
    if foreign:
        raise ExportError(
            f"{out} holds files edgespec did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); move them or choose another {flag}"
        )


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """A temporary folder, renamed to ``out`` only if the block succeeds.

    Call ``check_destination`` first. The folder gets the permissions of any new folder (not
    mkdtemp's 0700). An existing ``out`` is moved aside, replaced, then removed; if the rename
    fails it is put back.
    """
    out = Path(os.path.abspath(out))
    base = _nearest_existing(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=base))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    try:
        yield tmp
        out.parent.mkdir(parents=True, exist_ok=True)
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace(tmp: Path, out: Path) -> None:
    if not out.exists():
        tmp.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    old.rmdir()
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_file(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """``path``'s new content, written by ``write`` into ``path`` with suffix .tmp and renamed
    over ``path``: a reader (a run that resumes) finds the old file or the new, never half of one.

    The temporary file is created exclusively and not through a link (O_EXCL | O_NOFOLLOW): a
    link or anything but a plain file at its name (planted in a folder from elsewhere) is refused,
    never written through; a plain file there (an interrupted run's) is removed first. The rename
    replaces a link at ``path`` itself, not what it points to. On any failure the temporary file
    is removed and ``path`` is left as it was.
    """
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    try:
        info = os.lstat(tmp)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(info.st_mode):
            raise EdgespecError(f"{tmp} is a link or not a plain file; edgespec writes only its "
                                "own files there: remove it, or choose another folder")
        tmp.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(tmp, flags | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as e:
        raise EdgespecError(f"cannot create {tmp} ({e.strerror or e}); is something else "
                            "writing in the folder?") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise EdgespecError(f"cannot write {path} ({e.strerror or e})") from None
        raise
