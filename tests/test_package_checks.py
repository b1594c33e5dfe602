"""Broken or hostile packages are refused at load with one line naming the file: a manifest
nested too deep, a NUL in a path, KV inputs of the wrong type, rank or dims, fewer logits rows
than the vocabulary, a cache that does not grow, a context too small, and a tokenizer that is
not the one exported (permuted ids, fewer tokens), multiplies text or panics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import edgespec
from edgespec.errors import ManifestError
from edgespec.manifest import MANIFEST_NAME, TOKENIZER_NAME, Manifest, ModelSpec
from edgespec.runtime.package_checks import tokenizer_fingerprint


def copy_package(packages, tmp_path, name="llama") -> Path:
    pkg = tmp_path / "pkg"
    shutil.copytree(packages[name], pkg)
    return pkg


def edit_json(path: Path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def refused(pkg: Path) -> str:
    """The one-line ManifestError that loading ``pkg`` raises."""
    with pytest.raises(ManifestError) as error:
        edgespec.load(pkg)
    message = str(error.value)
    assert "\n" not in message and "re-export" in message
    return message


def test_export_writes_the_tokenizer_fingerprint_and_load_accepts_it(packages):
    manifest = Manifest.read(packages["llama"])
    pipe = edgespec.load(packages["llama"])
    assert manifest.tokenizer_fingerprint == tokenizer_fingerprint(pipe.tokenizer)
    assert manifest.tokenizer_fingerprint["size"] == pipe.tokenizer.get_vocab_size()


@pytest.mark.parametrize("change", [lambda raw: raw.pop("tokenizer_fingerprint"),
                                    lambda raw: raw.update(tokenizer_fingerprint=None)])
def test_a_package_without_a_fingerprint_is_refused(packages, tmp_path, change):
    pkg = copy_package(packages, tmp_path)
    edit_json(pkg / MANIFEST_NAME, change)
    with pytest.raises(ManifestError, match="tokenizer_fingerprint"):
        edgespec.load(pkg)


def test_a_tokenizer_with_permuted_ids_is_refused(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)

    def swap(raw):
        vocab = raw["model"]["vocab"]
        a, b = "a", "b"
        vocab[a], vocab[b] = vocab[b], vocab[a]

    edit_json(pkg / TOKENIZER_NAME, swap)
    message = refused(pkg)
    assert f"{pkg / TOKENIZER_NAME} is not the tokenizer the package was exported with" in message


def test_a_tokenizer_with_fewer_tokens_is_refused(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)
    shutil.copy(packages["words"] / TOKENIZER_NAME, pkg / TOKENIZER_NAME)  # 8 tokens, same specials
    assert "has 8 tokens but the package was exported with" in refused(pkg)


def test_a_normalizer_that_multiplies_text_is_refused(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)
    edit_json(pkg / TOKENIZER_NAME, lambda raw: raw.update(normalizer={
        "type": "Replace", "pattern": {"String": " "}, "content": "x" * 10_000}))
    assert "has a normalizer that makes 10000 characters of 1" in refused(pkg)


def test_a_tokenizer_that_panics_on_plain_text_is_refused(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)
    # onig's backtracking limit: a Rust panic (pyo3's PanicException, a BaseException)
    edit_json(pkg / TOKENIZER_NAME, lambda raw: raw.update(normalizer={
        "type": "Replace", "pattern": {"Regex": "([ -~]+)+b"}, "content": "y"}))
    assert "fails on plain text (PanicException" in refused(pkg)


def test_a_manifest_nested_too_deep_is_corrupt(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)
    raw = (pkg / MANIFEST_NAME).read_text()
    (pkg / MANIFEST_NAME).write_text(raw[:-2] + ', "source": ' + "[" * 100_000 + "]" * 100_000
                                     + "}")
    assert "is corrupt (RecursionError" in refused(pkg)


def test_a_nul_in_a_path_is_refused(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)
    edit_json(pkg / MANIFEST_NAME, lambda raw: raw.update(tokenizer="tokenizer.json\x00x"))
    assert "tokenizer must be a path inside the package folder" in refused(pkg)


def test_a_context_of_one_position_is_refused(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)
    edit_json(pkg / MANIFEST_NAME, lambda raw: raw.update(max_positions=1))
    assert "max_positions must be an integer >= 2" in refused(pkg)


def test_a_vocab_size_beyond_the_graphs_rows_is_refused(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)
    rows = Manifest.read(pkg).target.vocab_size

    def grow(raw):
        raw["vocab_size"] = raw["target"]["vocab_size"] = raw["draft"]["vocab_size"] = rows + 50

    edit_json(pkg / MANIFEST_NAME, grow)
    assert f"has {rows} rows of logits but the manifest's vocab_size is {rows + 50}" in \
        refused(pkg)


# Tiny ONNX decoders whose KV tensors and cache are wrong in one way each (onnx.helper)
def tiny_graph(folder: Path, kv_type="FLOAT", kv_shape=("batch", 2, "past", 4), rows=10,
               grows=True) -> Path:
    """logits [1, n, rows] of zeros; present.0.key is the past with the n fed positions
    appended (zeros), or the past unchanged when not ``grows``."""
    import onnx
    from onnx import TensorProto, helper

    kind = getattr(TensorProto, kv_type)
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "n"])
    past = helper.make_tensor_value_info("past_key_values.0.key", kind, list(kv_shape))
    present = helper.make_tensor_value_info("present.0.key", kind, None)
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "n", rows])
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["ids_f", "zero"], ["zeros"]),  # [1, n]
        helper.make_node("Unsqueeze", ["zeros", "axis2"], ["col"]),  # [1, n, 1]
        helper.make_node("Mul", ["col", "row"], ["logits"]),  # [1, n, rows]
    ]
    inits = [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
             helper.make_tensor("axis2", TensorProto.INT64, [1], [2]),
             helper.make_tensor("row", TensorProto.FLOAT, [rows], [0.0] * rows)]
    if grows and len(kv_shape) == 4:  # past ++ zeros [1, 2, n, 4]
        nodes += [
            helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
            helper.make_node("Slice", ["ids_shape", "one", "two"], ["n"]),
            helper.make_node("Concat", ["one", "heads", "n", "size"], ["new_shape"], axis=0),
            helper.make_node("ConstantOfShape", ["new_shape"], ["new"],
                             value=helper.make_tensor("v", kind, [1], [0])),
            helper.make_node("Concat", ["past_key_values.0.key", "new"], ["present.0.key"],
                             axis=2)]
        inits += [helper.make_tensor(name, TensorProto.INT64, [1], [value])
                  for name, value in (("one", 1), ("two", 2), ("heads", 2), ("size", 4))]
    else:
        nodes.append(helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"]))
    graph = helper.make_graph(nodes, "tiny", [ids, past], [logits, present], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def load_tiny(path: Path, vocab_size=10):
    from edgespec.runtime.providers import default_session_configs
    from edgespec.runtime.session import ModelSession

    spec = ModelSpec(path="model.onnx", architecture="tiny", layers=1, kv_heads=2, head_dim=4,
                     vocab_size=vocab_size, kv_inputs=["past_key_values.0.key"],
                     kv_outputs=["present.0.key"])
    return ModelSession(path, spec, vocab_size, 16, default_session_configs("cpu")[0])


def test_a_well_formed_tiny_graph_loads(tmp_path):
    session = load_tiny(tiny_graph(tmp_path))  # the builder itself is right
    assert session.kv_heads == 2 and session.head_dim == 4


@pytest.mark.parametrize("graph, message", [
    ({"kv_type": "DOUBLE"}, "is a tensor(double); KV tensors must be float or float16"),
    ({"kv_shape": ("batch", 8)}, "has rank 2; KV tensors are"),
    ({"kv_shape": ("batch", "heads", "past", "size")}, "has heads heads of size size"),
    ({"kv_shape": ("batch", 3, "past", 4)}, "has 3 heads of size 4; the manifest says 2 of 4"),
    ({"rows": 6}, "has 6 rows of logits but the manifest's vocab_size is 10"),
    ({"grows": False}, "does not grow its KV cache by the tokens fed"),
], ids=["double", "rank 2", "symbolic dims", "heads", "rows", "no growth"])
def test_a_graph_with_wrong_kv_tensors_or_logits_is_refused(tmp_path, graph, message):
    path = tiny_graph(tmp_path, **graph)
    with pytest.raises(ManifestError) as error:
        load_tiny(path)
    assert str(error.value).startswith(str(path)) and message in str(error.value)
    assert "\n" not in str(error.value)


def test_max_positions_beyond_the_rotary_tables_is_refused(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)  # fused graphs: GroupQueryAttention's cos_cache
    manifest = Manifest.read(pkg)
    assert manifest.target.graph == "fused"
    edit_json(pkg / MANIFEST_NAME, lambda raw: raw.update(max_positions=manifest.max_positions + 1))
    assert (f"has rotary tables for {manifest.max_positions} positions but the manifest's "
            f"max_positions is {manifest.max_positions + 1}") in refused(pkg)
