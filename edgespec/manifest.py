"""The package manifest, ``edgespec.json``: what an exported folder holds and how to run it.

Written by the exporter, read by the runtime; plain JSON so both sides stay light.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgespec.errors import ManifestError

MANIFEST_NAME = "edgespec.json"
PROMPTS_NAME = "prompts.jsonl"  # optional: prompts for `edgespec bench`, JSON Lines of strings
REPORT_NAME = "training_report.json"  # optional: how the pair was trained (the demo pair)
FORMAT_VERSION = 1
TOKENIZER_NAME = "tokenizer.json"
# Everything an export (or the demo recipe) writes into a package folder: --overwrite replaces
# a folder only if it holds nothing else.
PACKAGE_ENTRIES = frozenset(
    {MANIFEST_NAME, TOKENIZER_NAME, PROMPTS_NAME, REPORT_NAME, "target", "draft"}
)


@dataclass(frozen=True)
class ModelSpec:
    """One exported graph. ``kv_inputs[i]`` feeds from ``kv_outputs[i]`` on the next run."""

    path: str  # relative to the package folder
    architecture: str
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the graph's logits, before restriction to the shared vocabulary
    kv_inputs: list[str]
    kv_outputs: list[str]
    graph: str = "optimum"  # "optimum" (optimum's exporter) or "fused" (export/fused.py)
    dtype: str = "float32"  # what the graph computes in
    stored: dict = field(default_factory=dict)  # float weights per stored type (bfloat16: cast
    # to float32 at load, losslessly)
    quantization: str | None = None  # "int8" / "int4": block-wise weight-only MatMulNBits
    parameters: int = 0
    validation: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    """What ``edgespec export`` wrote. ``vocab_size`` is the range shared by both models."""

    target: ModelSpec
    draft: ModelSpec
    vocab_size: int
    max_positions: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    tokenizer: str = "tokenizer.json"
    source: dict = field(default_factory=dict)
    edgespec_version: str = ""
    format_version: int = FORMAT_VERSION

    def write(self, folder: Path) -> None:
        (Path(folder) / MANIFEST_NAME).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        folder = Path(folder)
        path = folder / MANIFEST_NAME
        if not folder.is_dir():
            raise ManifestError(f"{folder} is not a folder; pass a package made by 'edgespec export'")
        if not path.is_file():
            raise ManifestError(
                f"{folder} has no {MANIFEST_NAME}; pass a package made by 'edgespec export'"
            )
        try:
            raw = json.loads(path.read_text())
            version = raw.get("format_version")
            if version != FORMAT_VERSION:
                raise ManifestError(
                    f"{path} has format version {version}, this edgespec reads {FORMAT_VERSION}; "
                    "re-export the pair with this version"
                )
            raw["target"] = ModelSpec(**raw["target"])
            raw["draft"] = ModelSpec(**raw["draft"])
            manifest = cls(**raw)
        except ManifestError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ManifestError(
                f"{path} is corrupt ({type(e).__name__}: {e}); re-export the pair"
            ) from None
        manifest._check_files(folder)
        return manifest

    def _check_files(self, folder: Path) -> None:
        for relative in (self.target.path, self.draft.path, self.tokenizer):
            if not (folder / relative).is_file():
                raise ManifestError(f"{folder / relative} is missing; re-export the pair")
