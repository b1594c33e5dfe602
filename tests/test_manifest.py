"""The manifest: every field's type and range checked at load, paths kept inside the package."""

from __future__ import annotations

import json
import shutil
from dataclasses import fields, replace
from pathlib import Path

import pytest

from edgespec.errors import ManifestError
from edgespec.manifest import MANIFEST_NAME, Manifest, ModelSpec
from edgespec.models import demo_package


def copy_package(packages, tmp_path, name="gpt2"):
    pkg = tmp_path / "pkg"
    shutil.copytree(packages[name], pkg)
    return pkg


def edit_manifest(pkg, change) -> None:
    path = pkg / MANIFEST_NAME
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def setter(dotted: str, value):
    *parents, name = dotted.split(".")

    def change(raw):
        for parent in parents:
            raw = raw[parent]
        raw[name] = value

    return change


def deleter(dotted: str):
    *parents, name = dotted.split(".")

    def change(raw):
        for parent in parents:
            raw = raw[parent]
        del raw[name]

    return change


# (field named in the error, how the manifest is spoiled)
BAD_FIELDS = {
    "string max_positions": ("max_positions", setter("max_positions", "512")),
    "float max_positions": ("max_positions", setter("max_positions", 512.5)),
    "zero max_positions": ("max_positions", setter("max_positions", 0)),
    "int eos_token_ids": ("eos_token_ids", setter("eos_token_ids", 0)),
    "string in eos_token_ids": ("eos_token_ids", setter("eos_token_ids", ["0"])),
    "negative eos id": ("eos_token_ids", setter("eos_token_ids", [-1])),
    "eos id past the vocabulary": ("eos_token_ids", lambda raw: raw.update(
        eos_token_ids=[raw["vocab_size"]])),
    "bos id past the vocabulary": ("bos_token_id", lambda raw: raw.update(
        bos_token_id=raw["vocab_size"] + 5)),
    "negative pad id": ("pad_token_id", setter("pad_token_id", -3)),
    "boolean bos id": ("bos_token_id", setter("bos_token_id", True)),
    "non-string model path": ("target.path", setter("target.path", 5)),
    "empty model path": ("draft.path", setter("draft.path", "")),
    "non-string tokenizer": ("tokenizer", setter("tokenizer", ["tokenizer.json"])),
    "negative vocab_size": ("vocab_size", setter("vocab_size", -1)),
    "negative layers": ("target.layers", setter("target.layers", -2)),
    "zero kv_heads": ("draft.kv_heads", setter("draft.kv_heads", 0)),
    "negative parameters": ("target.parameters", setter("target.parameters", -10)),
    "model vocabulary below the shared one": ("target.vocab_size", lambda raw: raw["target"].update(
        vocab_size=raw["vocab_size"] - 1)),
    "unknown graph kind": ("draft.graph", setter("draft.graph", "magic")),
    "unknown dtype": ("target.dtype", setter("target.dtype", "float64")),
    "unknown quantization": ("target.quantization", setter("target.quantization", "int3")),
    "string kv_inputs": ("target.kv_inputs", setter("target.kv_inputs", "past_key_values.0.key")),
    "kv lists of different lengths": ("target.kv_outputs", lambda raw: raw["target"].update(
        kv_outputs=raw["target"]["kv_outputs"][:-1])),
    "stored counts as strings": ("target.stored", setter("target.stored", {"float": "7"})),
    "validation as a list": ("draft.validation", setter("draft.validation", [])),
    "string add_bos_token": ("add_bos_token", setter("add_bos_token", "yes")),
    "source as a string": ("source", setter("source", "here")),
    "target as a list": ("target", setter("target", [])),
    "missing vocab_size": ("vocab_size", deleter("vocab_size")),
    "missing target path": ("target.path", deleter("target.path")),
    "unknown field": ("colour", setter("colour", "blue")),
    "empty chat_template": ("chat_template", setter("chat_template", "")),
    "special_tokens as a list": ("special_tokens", setter("special_tokens", ["<s>"])),
    "special token id for a string": ("special_tokens", setter("special_tokens",
                                                               {"bos_token": 0})),
    "negative default temperature": ("generation", setter("generation", {"temperature": -1})),
    "unknown sampling default": ("generation", setter("generation", {"typical_p": 0.9})),
    "top_p default of 0": ("generation", setter("generation", {"top_p": 0})),
}


@pytest.mark.parametrize("case", BAD_FIELDS)
def test_a_bad_field_is_named_at_load(packages, tmp_path, case):
    field_name, change = BAD_FIELDS[case]
    pkg = copy_package(packages, tmp_path)
    edit_manifest(pkg, change)
    with pytest.raises(ManifestError) as error:
        Manifest.read(pkg)
    message = str(error.value)
    assert field_name in message and "re-export the pair" in message
    assert "\n" not in message


@pytest.mark.parametrize("field_name", ["target.path", "draft.path", "tokenizer"])
@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_paths_outside_the_package_are_refused(packages, tmp_path, field_name, where):
    pkg = copy_package(packages, tmp_path)
    original = json.loads((pkg / MANIFEST_NAME).read_text())
    relative = original[field_name] if field_name == "tokenizer" else original[
        field_name.split(".")[0]]["path"]
    outside = tmp_path / "outside" / relative  # a real file, so only the place is wrong
    outside.parent.mkdir(parents=True)
    shutil.copy(pkg / relative, outside)
    escaped = str(outside) if where == "absolute" else f"../outside/{relative}"
    edit_manifest(pkg, setter(field_name, escaped))
    with pytest.raises(ManifestError, match=f"{field_name} must be a path inside the package"):
        Manifest.read(pkg)


def test_a_path_through_a_subfolder_that_stays_inside_is_fine(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)
    edit_manifest(pkg, setter("target.path", "draft/../target/model.onnx"))
    assert Manifest.read(pkg).target.path == "draft/../target/model.onnx"


def test_a_loop_of_links_or_an_unreadable_manifest_is_one_line(packages, tmp_path, monkeypatch):
    """A package's tokenizer that is a loop of links (resolve() raises RuntimeError before
    Python 3.13, OSError after) and a manifest that cannot be read are ManifestErrors, not
    tracebacks (``edgespec models list`` and every command read manifests)."""
    pkg = copy_package(packages, tmp_path)
    relative = json.loads((pkg / MANIFEST_NAME).read_text())["tokenizer"]
    (pkg / relative).unlink()
    (pkg / relative).symlink_to(pkg / "loop")
    (pkg / "loop").symlink_to(pkg / relative)
    with pytest.raises(ManifestError, match=f"{relative} cannot be resolved"):
        Manifest.read(pkg)
    (pkg / relative).unlink()
    shutil.copy(packages["gpt2"] / relative, pkg / relative)
    Manifest.read(pkg)  # the package reads again: what failed was the loop

    def forbidden(self, *args, **kwargs):  # tests run as root here: permissions cannot forbid
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", forbidden)
    with pytest.raises(ManifestError, match="cannot read .*Permission denied"):
        Manifest.read(pkg)


def test_a_manifest_that_is_not_an_object_is_refused(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)
    (pkg / MANIFEST_NAME).write_text("[1, 2]")
    with pytest.raises(ManifestError, match="JSON object.*re-export the pair"):
        Manifest.read(pkg)


@pytest.mark.parametrize("version,match", [
    (3, "format version 3, this edgespec reads 1 and 2; upgrade edgespec"),
    (0, "format version 0, .*re-export the pair"),
    (True, "format version True, .*re-export the pair"),
    ("2", "format version 2, .*re-export the pair"),
])
def test_a_format_version_it_cannot_read_is_one_line(packages, tmp_path, version, match):
    """Version 1 (graphs that score every row) and 2 are read; a newer package asks for a newer
    edgespec, anything else for a new export."""
    pkg = copy_package(packages, tmp_path)
    edit_manifest(pkg, setter("format_version", version))
    with pytest.raises(ManifestError, match=match):
        Manifest.read(pkg)
    edit_manifest(pkg, setter("format_version", 1))
    assert Manifest.read(pkg).format_version == 1


def test_real_packages_still_read(packages):
    for pkg in [demo_package(), *packages.values()]:
        manifest = Manifest.read(pkg)
        assert manifest.target.graph in ("optimum", "fused")


@pytest.mark.parametrize("field", ["target.stored", "draft.validation", "chat_template"])
def test_a_field_with_a_default_is_still_required_in_a_file(packages, tmp_path, field):
    """No released package predates a field: export writes them all, and load asks for all."""
    pkg = copy_package(packages, tmp_path, "llama")
    edit_manifest(pkg, deleter(field))
    with pytest.raises(ManifestError, match=f"field {field} is missing"):
        Manifest.read(pkg)


def test_every_field_has_a_check():
    from edgespec.manifest import MANIFEST_FIELDS, SPEC_FIELDS

    assert set(SPEC_FIELDS) == {f.name for f in fields(ModelSpec)}
    assert set(MANIFEST_FIELDS) == {f.name for f in fields(Manifest)}


def test_with_bos_is_the_one_bos_rule():
    adds = replace(Manifest.read(demo_package()), add_bos_token=True, bos_token_id=1)
    assert adds.with_bos([5, 6]) == [1, 5, 6]
    assert replace(adds, add_bos_token=False).with_bos([5, 6]) == [5, 6]
    assert replace(adds, bos_token_id=None).with_bos([5, 6]) == [5, 6]
