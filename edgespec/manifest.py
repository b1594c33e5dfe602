"""The package format: the manifest, ``edgespec.json`` (what an exported folder holds and how
to run it), and the names of the files and graph inputs and outputs beside it.

Written by the exporter, read by the runtime: the one module of the format both import (the
bottom floor; it imports only config and errors); plain JSON so both sides stay light.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from edgespec.config import is_int
from edgespec.errors import ManifestError

MANIFEST_NAME = "edgespec.json"
PROMPTS_NAME = "prompts.jsonl"  # optional: prompts for `edgespec bench`, JSON Lines of strings
REPORT_NAME = "training_report.json"  # optional: how the pair was trained (the demo pair)
FORMAT_VERSION = 2  # 2: a fused graph takes logits_to_keep, which edgespec before it never fed
READ_VERSIONS = (1, 2)  # a package of version 1 still loads (its graphs score every row)
TOKENIZER_NAME = "tokenizer.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"  # optional: the target tokenizer's chat template
# A graph's folder: its data file, and for tensors made at load (runtime/unpack.py, written by
# export/onnx_io.py) the recipes and the external-data location they are declared at
DATA_NAME = "model.onnx_data"
UNPACK_NAME = "unpack.json"
LOCATION = "edgespec.unpacked"
# a made tensor's recipe mark ("packed"), in the order the load lets them go
# (runtime/loader.py): MatMulNBits' weights and MatMul's right-hand side, which the kernels
# pack as the session loads; MatMulNBits' scales and zero points, which int8 compute packs
# with the weights and float compute reads at every run
PACKED_GROUPS = ("weights", "scales", "zero_points")
# Graph inputs and outputs beyond input_ids, the mask, positions, logits and the KV cache.
# An EAGLE-3 pair's rows (export/eagle3.py): the target outputs FEATURES (fc of its aux hidden
# states) for every row it runs; the head reads them as its input of that name and outputs
# HIDDEN_OUT, which it reads back as FEATURES for the rows it drafts on its own
FEATURES, HIDDEN_OUT = "eagle_features", "hidden_out"
# a fused graph's input: score only the run's last rows (int64 [1]; 0: all of them): a
# prefill's logits are thrown away, and a 2,048-token prompt's are 1.2 GB at 152k tokens
LOGITS_TO_KEEP = "logits_to_keep"
# Everything an export (or the demo recipe) writes into a package folder: --overwrite replaces
# a folder only if it holds nothing else.
PACKAGE_ENTRIES = frozenset(
    {MANIFEST_NAME, TOKENIZER_NAME, CHAT_TEMPLATE_NAME, PROMPTS_NAME, REPORT_NAME, "target",
     "draft"}
)
# What a manifest may say of a graph (export offers its own choices: config.EXPORT_*)
GRAPH_KINDS = ("optimum", "fused")  # optimum's exporter; edgespec's own (export/fused.py)
GRAPH_DTYPES = ("float32", "float16")  # what a graph computes in
WEIGHT_QUANTIZATIONS = (None, "int8", "int4")
COMPUTES = ("float", "int8")  # what quantized MatMuls compute in


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
    compute: str = "float"  # what quantized MatMuls compute in: "float", or "int8" (int8
    # activations, integer dot products: MatMulNBits accuracy_level 4)
    min_run_tokens: int = 1  # every run feeds at least this many tokens: a lone token gets
    # throw-away ones after it (dropped from the cache), so that every row comes from one kernel
    parameters: int = 0
    validation: dict = field(default_factory=dict)
    token_ids: str | None = None  # a draft scoring a subset of the vocabulary (FR-Spec): the
    # .npy file of the ids its logits' columns stand for, ascending; None: every id, in order


@dataclass(frozen=True)
class Manifest:
    """What ``edgespec export`` wrote. ``vocab_size`` is the range shared by both models.

    ``draft`` None (null in the file): a target-only package, decoded with n-gram drafting
    (runtime/drafters.py) or the target alone. ``chat_template``: the file holding the target
    tokenizer's Jinja chat template, None when it had none; ``special_tokens``: the tokenizer's special token strings by name
    (bos_token, eos_token, ...), which templates use.
    """

    target: ModelSpec
    draft: ModelSpec | None
    vocab_size: int
    max_positions: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    tokenizer: str = TOKENIZER_NAME
    # the tokenizer's size and vocabulary hash (runtime/package_checks.py), checked at load
    tokenizer_fingerprint: dict | None = None
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=dict)
    generation: dict = field(default_factory=dict)  # sampling defaults: temperature, top_k,
    # top_p from the target's generation_config.json, used where a request sets none
    source: dict = field(default_factory=dict)
    edgespec_version: str = ""
    format_version: int = FORMAT_VERSION

    def with_bos(self, ids: list[int]) -> list[int]:
        """Text's token ids as the model reads them: BOS first where the tokenizer adds one
        (``add_bos_token``, and a ``bos_token_id`` to add); ``ids`` as they are otherwise."""
        if self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    @property
    def models(self) -> dict[str, ModelSpec]:
        """The graphs the package holds by role: the target, and the draft if there is one."""
        return {"target": self.target, **({"draft": self.draft} if self.draft else {})}

    def write(self, folder: Path) -> None:
        (Path(folder) / MANIFEST_NAME).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        """The manifest of a package folder, every field checked for type and range, and the
        files it names checked to be inside the folder; any fault is a ManifestError."""
        folder = Path(folder)
        path = folder / MANIFEST_NAME
        if not folder.is_dir():
            raise ManifestError(f"{folder} is not a folder; pass a package made by 'edgespec export'")
        if not path.is_file():
            raise ManifestError(
                f"{folder} has no {MANIFEST_NAME}; pass a package made by 'edgespec export'"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep
            raise ManifestError(
                f"{path} is corrupt ({type(e).__name__}: {e}); re-export the pair"
            ) from None
        except OSError as e:  # unreadable: permissions, a link to nowhere
            raise ManifestError(f"cannot read {path} ({e.strerror or e})") from None
        if not isinstance(raw, dict):
            raise ManifestError(f"{path} is corrupt (not a JSON object); re-export the pair")
        version = raw.get("format_version")
        if version not in READ_VERSIONS or isinstance(version, bool):
            newer = isinstance(version, int) and not isinstance(version, bool) and \
                version > FORMAT_VERSION
            raise ManifestError(
                f"{path} has format version {str(version)[:20]}, this edgespec reads "
                f"{' and '.join(map(str, READ_VERSIONS))}; "
                + ("upgrade edgespec (pip install -U edgespec)" if newer else
                   "re-export the pair with this version")
            )
        _check_fields(path, raw, MANIFEST_FIELDS, cls)
        roles = ("target", "draft") if raw["draft"] is not None else ("target",)
        for role in roles:
            _check_fields(path, raw[role], SPEC_FIELDS, ModelSpec, f"{role}.")
        specs = {role: ModelSpec(**raw[role]) for role in roles}
        manifest = cls(**{**raw, "draft": None, **specs})
        manifest._check_consistency(path)
        manifest._check_files(folder)
        return manifest

    def _check_consistency(self, path: Path) -> None:
        """What no single field shows: ids inside the shared vocabulary, which both graphs'
        logits cover, and one KV output for every KV input."""
        for role, spec in self.models.items():
            if role == "draft" and spec.token_ids is not None:
                continue  # its columns are a subset; their ids are checked when loaded
            if spec.vocab_size < self.vocab_size:
                _refuse(path, f"{role}.vocab_size", spec.vocab_size,
                        f"at least the shared vocab_size {self.vocab_size}")
            if len(spec.kv_outputs) != len(spec.kv_inputs):
                _refuse(path, f"{role}.kv_outputs", spec.kv_outputs,
                        f"a list as long as {role}.kv_inputs ({len(spec.kv_inputs)})")
        specials = {"eos_token_ids": self.eos_token_ids, "bos_token_id": [self.bos_token_id],
                    "pad_token_id": [self.pad_token_id]}
        for name, ids in specials.items():
            if any(i is not None and i >= self.vocab_size for i in ids):
                _refuse(path, name, ids if name == "eos_token_ids" else ids[0],
                        f"below vocab_size {self.vocab_size}")

    def _check_files(self, folder: Path) -> None:
        """Each file the manifest names exists, inside the folder once links are resolved: a
        package cannot make edgespec load a model or tokenizer from elsewhere."""
        root = folder.resolve()
        named = {**{f"{role}.path": spec.path for role, spec in self.models.items()},
                 **{f"{role}.token_ids": spec.token_ids for role, spec in self.models.items()},
                 "tokenizer": self.tokenizer, "chat_template": self.chat_template}
        for name, relative in named.items():
            if relative is None:  # an optional file the package does not have
                continue
            try:
                resolved = (folder / relative).resolve()
            except (OSError, RuntimeError) as e:  # a loop of links (RuntimeError before 3.13)
                raise ManifestError(f"{folder / relative} cannot be resolved ({e}); re-export "
                                    "the pair") from None
            if Path(relative).is_absolute() or not resolved.is_relative_to(root):
                _refuse(folder / MANIFEST_NAME, name, relative,
                        "a path inside the package folder")
            if not resolved.is_file():
                raise ManifestError(f"{folder / relative} is missing; re-export the pair")


# The checks Manifest.read makes, one per field: (what the field must be, test of a value).
# Export writes every field, so none may be absent from a file (there is one format, and no
# released package predates a field); the dataclasses' defaults serve code that builds one.
Check = tuple[str, Callable[[object], bool]]


def _one_of(choices: tuple) -> Check:
    return f"one of {', '.join(json.dumps(c) for c in choices)}", lambda v: v in choices


_COUNT: Check = ("an integer >= 1", lambda v: is_int(v) and v >= 1)
_SIZE: Check = ("an integer >= 0", lambda v: is_int(v) and v >= 0)
_TOKEN_ID: Check = ("null or a token id (an integer >= 0)", lambda v: v is None or _SIZE[1](v))
_TEXT: Check = ("a string", lambda v: isinstance(v, str))
_PATH: Check = ("a path inside the package folder",
                 lambda v: isinstance(v, str) and v != "" and "\x00" not in v)
_OBJECT: Check = ("a JSON object", lambda v: isinstance(v, dict))
_NAMES: Check = ("a non-empty list of strings",
                 lambda v: isinstance(v, list) and bool(v) and all(isinstance(n, str) for n in v))

SPEC_FIELDS: dict[str, Check] = {
    "path": _PATH,
    "architecture": _TEXT,
    "layers": _COUNT,
    "kv_heads": _COUNT,
    "head_dim": _COUNT,
    "vocab_size": _COUNT,
    "kv_inputs": _NAMES,
    "kv_outputs": _NAMES,
    "graph": _one_of(GRAPH_KINDS),
    "dtype": _one_of(GRAPH_DTYPES),
    "stored": ("a JSON object of counts (string: integer >= 0)",
               lambda v: isinstance(v, dict) and all(_SIZE[1](n) for n in v.values())),
    "quantization": _one_of(WEIGHT_QUANTIZATIONS),
    "compute": _one_of(COMPUTES),
    "min_run_tokens": ("an integer from 1 to 16", lambda v: is_int(v) and 1 <= v <= 16),
    "parameters": _SIZE,
    "validation": _OBJECT,
    "token_ids": ("null or a path inside the package folder", lambda v: v is None or _PATH[1](v)),
}
MANIFEST_FIELDS: dict[str, Check] = {
    "target": _OBJECT,
    "draft": ("a JSON object, or null for a target-only package",
              lambda v: v is None or isinstance(v, dict)),
    "vocab_size": _COUNT,
    "max_positions": ("an integer >= 2 (a prompt token and one to generate)",
                      lambda v: is_int(v) and v >= 2),
    "eos_token_ids": ("a list of token ids (integers >= 0)",
                      lambda v: isinstance(v, list) and all(_SIZE[1](i) for i in v)),
    "bos_token_id": _TOKEN_ID,
    "pad_token_id": _TOKEN_ID,
    "add_bos_token": ("true or false", lambda v: isinstance(v, bool)),
    "tokenizer": _PATH,
    "tokenizer_fingerprint": ("a JSON object: size (an integer), sha256 (a string)",
                              lambda v: isinstance(v, dict) and is_int(v.get("size"))
                              and isinstance(v.get("sha256"), str)),
    "chat_template": ("null or a path inside the package folder",
                      lambda v: v is None or _PATH[1](v)),
    "generation": ("a JSON object of sampling settings (temperature, top_k, top_p)",
                   lambda v: isinstance(v, dict) and _valid_sampling(v)),
    "special_tokens": ("a JSON object of strings or lists of strings",
                       lambda v: isinstance(v, dict) and all(
                           isinstance(t, str) or (isinstance(t, list)
                                                  and all(isinstance(x, str) for x in t))
                           for t in v.values())),
    "source": _OBJECT,
    "edgespec_version": _TEXT,
    "format_version": ("an integer", is_int),
}


def _valid_sampling(settings: dict) -> bool:
    from edgespec.config import SamplingConfig
    from edgespec.errors import ConfigError

    try:
        SamplingConfig(**settings)
    except (ConfigError, TypeError):  # a bad value, or a setting SamplingConfig lacks
        return False
    return True


def _check_fields(path: Path, raw: dict, checks: dict[str, Check], kind: type,
                  prefix: str = "") -> None:
    """Refuse the first field of ``raw`` that is unknown, missing or fails its check
    (``kind``'s dataclass fields are the ones it must have)."""
    for name in raw:
        if name not in checks:
            raise ManifestError(
                f"{path}: unknown field {prefix}{name} (written by a newer edgespec?); "
                "re-export the pair with this version"
            )
    for f in fields(kind):
        if f.name not in raw:
            raise ManifestError(f"{path}: field {prefix}{f.name} is missing; re-export the pair")
        what, ok = checks[f.name]
        if not ok(raw[f.name]):
            _refuse(path, prefix + f.name, raw[f.name], what)


def _refuse(path: Path, name: str, value: object, what: str) -> None:
    shown = json.dumps(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise ManifestError(f"{path}: {name} must be {what}, got {shown}; re-export the pair")
