"""GGUF files in (export/gguf.py): llama.cpp's blocks repacked for MatMulNBits hold the numbers
llama.cpp's own dequantization gives, the tensors read are transformers' GGUF load's, exported
graphs equal the dequantized model at fp32's gate, greedy output is the same with and without
drafting, and bad files are refused in one line.

The GGUF files are written from tiny random checkpoints by tests/gguf_files.py, with llama.cpp's
own writer and quantizer (gguf-py), as its convert_hf_to_gguf.py writes them.
The real SmolLM2-135M-Instruct file is tested only where EDGESPEC_SMOLLM2_GGUF names it.
"""

from __future__ import annotations

import json

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import edgespec
from edgespec.cli import main
from edgespec.errors import ExportError
from edgespec.export import export_pair
from edgespec.export.gguf_blocks import REPACKED, Packed, repack
from edgespec.models import gguf_blocks

gguf = pytest.importorskip("gguf")
from conftest import greedy_is_target_only  # noqa: E402
from gguf_files import (NGRAM_PROMPTS, LLAMA, LLAMA_K, LLAMA_Q4_0, Q, QWEN2, QWEN3, _model,  # noqa: E402
                        _raw, assert_compact, write_gguf)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {
        "llama": write_gguf(root / "llama.gguf", "llama", LLAMA, seed=1),
        "qwen2": write_gguf(root / "qwen2.gguf", "qwen2", QWEN2, seed=2, tied=False),
        "llama_q4_0": write_gguf(root / "q4_0.gguf", "llama", LLAMA_Q4_0, seed=3),
        "llama_k": write_gguf(root / "k.gguf", "llama", LLAMA_K, seed=5, hidden=256),
        "qwen3": write_gguf(root / "qwen3.gguf", "qwen3", QWEN3, seed=6),
    }


@pytest.fixture(scope="module")
def packages(files, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_packages")
    for name, file in files.items():
        export_pair(file, None, root / name)
    return {name: root / name for name in files}


# -- the blocks ---------------------------------------------------------------------------------

def _matmul_nbits(packed: Packed) -> np.ndarray:
    """The weight onnxruntime's MatMulNBits computes with (identity rows in, float compute):
    with minimums, zero point 0 and the minimums added as the fused graph adds them."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    n, k = packed.shape
    inits = [numpy_helper.from_array(packed.data, "B"), numpy_helper.from_array(packed.scales, "S")]
    inputs = ["x", "B", "S"]
    if packed.minimums is not None:
        columns = -(-packed.scales.shape[1] * packed.bits // 8)
        inits.append(numpy_helper.from_array(np.zeros((n, columns), np.uint8), "Z"))
        inputs.append("Z")
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n,
                            bits=packed.bits, block_size=packed.block_size)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    w = session.run(None, {"x": np.eye(k, dtype=np.float32)})[0].T  # [N, K]
    if packed.minimums is not None:
        w = w + np.repeat(packed.minimums, packed.block_size, axis=1)
    return w


@pytest.mark.parametrize("qtype", REPACKED)
def test_repacked_blocks_hold_llama_cpps_numbers(qtype):
    """Each repacked type, through onnxruntime's MatMulNBits, gives llama.cpp's dequantization
    (gguf-py's): exactly for the types without a minimum, to float rounding with one."""
    raw = _raw(qtype, 48, 512, seed=len(qtype))
    expected = gguf.quants.dequantize(raw, Q[qtype])  # [48, 512]
    packed = repack(raw, qtype)
    assert packed.shape == expected.shape
    for got in (packed.dequantize(), _matmul_nbits(packed)):
        if packed.minimums is None:
            np.testing.assert_array_equal(got, expected)
        else:
            scale = np.abs(expected).max()
            assert np.abs(got - expected).max() <= 1e-6 * scale


def test_tensors_are_transformers_gguf_weights(files):
    """Read a tensor at a time (names mapped, q/k rows un-permuted, blocks dequantized), the
    file gives the state transformers' own GGUF loader makes of it; and each repacked weight,
    q and k included, is the same numbers as the float read."""
    pytest.importorskip("accelerate")  # transformers loads a GGUF model only with it
    from transformers import AutoModelForCausalLM

    from edgespec.export.gguf import GGUFTensors, read_gguf_checkpoint
    from edgespec.export.graph import meta_model

    for name in ("llama", "qwen2", "qwen3"):
        file = files[name]
        ckpt = read_gguf_checkpoint(file, "target")
        # with edgespec's config: transformers' own reads no head size from the file, and
        # gives a Qwen3 Qwen3Config's default (128)
        loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                      config=ckpt.config)
        tensors = GGUFTensors(file, meta_model(ckpt.config))
        for key, value in loaded.state_dict().items():
            if key == "lm_head.weight" and loaded.config.tie_word_embeddings:
                continue
            np.testing.assert_array_equal(tensors.read(key).float().numpy(), value.numpy(),
                                          err_msg=key)
            packed = tensors.packed([key]) if value.ndim == 2 else None
            if packed is not None:
                np.testing.assert_allclose(packed.dequantize(), value.numpy(), rtol=0,
                                           atol=1e-6 * float(value.abs().max()), err_msg=key)


# -- exported packages --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_q4_0", "llama_k", "qwen3"])
def test_exports_equal_the_dequantized_model_at_fp32s_gate(packages, name):
    manifest = edgespec.manifest.Manifest.read(packages[name])
    validation = manifest.target.validation
    weights = validation["gguf"]
    assert weights["requantized"] is False and validation["failures"] == []
    assert validation["variant"] == "fp32" and manifest.target.compute == "float"
    assert validation["max_abs_diff_no_cache"] <= validation["tolerance"]
    assert validation["mean_tv"] < 1e-4 and validation["top1_agreement"] == 1.0
    assert manifest.target.quantization == "int4" and manifest.target.graph == "fused"
    repacked = weights["tensors"]["repacked"]
    expected = {"llama": {"Q4_0": 4, "Q4_1": 7, "Q8_0": 3},
                "qwen2": {"Q4_0": 5, "Q4_1": 1, "Q5_0": 2, "Q8_0": 8},
                "llama_q4_0": {"Q4_0": 15},
                "llama_k": {"Q4_K": 10, "Q6_K": 5},
                "qwen3": {"Q4_0": 7, "Q4_1": 8}}[name]
    assert repacked == expected
    # 8-bit blocks stay blocks in float compute too (dequantized when the session loads)
    assert "dequantized" not in weights["tensors"]
    assert_compact(manifest, packages[name])
    if name == "llama":
        assert weights["tensors"]["kept"]["F16"] == 1
        _assert_one_transposed_table(packages[name] / "target" / "model.onnx")
    if name == "qwen3":  # the head size from attention.key_length; the norms read as stored
        assert manifest.target.head_dim == 32 and weights["tensors"]["kept"]["F32"] == 9
    assert manifest.source["target"].endswith(".gguf")


def _assert_one_transposed_table(path: Path) -> None:
    """A tied float table is stored once, [H, V]: the output layer's MatMul weight, whose
    columns the embedding's Gather reads (the numbers: the fp32 gate above)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    (head,) = [n for n in graph.node if "logits" in n.output]
    assert head.op_type == "MatMul"
    (gather,) = [n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    assert gather.input[0] == head.input[1]
    assert [a.i for a in gather.attribute if a.name == "axis"] == [1]


def _assert_ngram_greedy_is_target_only(pipe) -> None:
    """Greedy output with n-gram drafting (k = 4, fixed) is target-only output, tokens drafted."""
    drafted, _ = greedy_is_target_only(pipe, NGRAM_PROMPTS, 4, "ngram")
    assert drafted > 0


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_q4_0", "llama_k", "qwen3"])
def test_greedy_output_with_ngram_drafting_is_target_only(packages, name):
    pipe = edgespec.load(packages[name])
    _assert_ngram_greedy_is_target_only(pipe)


def assert_constrained_words(pipe) -> None:
    """A constraint whose text has spaces, on a package made from a GGUF file: its tokenizer's
    spaces are inside its tokens ("Ġthe" or "▁the"), which the grammar engine must read as
    the text they write (runtime/grammar.py's ``readable``), or no token could write the
    second word. Greedy and sampled, the answer is the regular expression's."""
    import re

    from edgespec import Constraint

    regex = "[a-z]{1,6}( [a-z]{1,6}){3}"
    for temperature in (0.0, 1.0):
        result = pipe.generate("the cat", max_new_tokens=40, temperature=temperature, seed=1,
                               constraint=Constraint("regex", regex), drafter="none")
        assert result.stats.finish_reason == "eos", result.text
        assert re.fullmatch(regex, result.text), result.text


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_constraint_writes_spaces_with_a_gguf_files_tokenizer(packages, name):
    assert_constrained_words(edgespec.load(packages[name]))


def test_a_required_tool_call_is_written_with_a_gguf_files_tokenizer(packages):
    """A call in Llama 3's format ({"name": ..., "parameters": ...} with ", " and ": " between
    items, runtime/tools.py) from a package made of a "gpt2"-vocabulary GGUF file, as a Llama
    3.2 file is: every separator's space is inside a token, and the call parses."""
    from edgespec.runtime.tools import Llama3, read_tools

    tools = read_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"]}}}])
    pipe = edgespec.load(packages["llama"])
    result = pipe.generate("the cat", max_new_tokens=64, drafter="none",
                           constraint=Llama3().constraint("required", tools, parallel=False))
    assert result.stats.finish_reason == "eos", result.text
    assert result.text.startswith('{"name": "get_weather", "parameters": {"city": "')
    content, calls = Llama3().parse(result.text)
    assert content is None and [call.name for call in calls] == ["get_weather"]


def _logits(pipe, tokens=(5, 9, 2, 7, 11)) -> np.ndarray:
    session = pipe.target
    return session.forward(np.array(tokens, np.int64), session.new_cache(8))


def test_load_lets_go_of_the_tensors_it_made(packages, monkeypatch):
    """The K-quant package's tensors made at load are handed to onnxruntime in place; those it
    packed (the marked weights and, for float compute, not the scales it reads) are dropped,
    and the logits are bit for bit those of a session that keeps every tensor and of one that
    gets them as copies (the path of packages without the location file)."""
    import shutil

    from edgespec.runtime import loader, unpack

    package = packages["llama_k"]
    marks = {name: recipe.get("packed") for name, recipe in
             json.loads((package / "target" / unpack.UNPACK_NAME).read_text()).items()}
    assert (package / "target" / unpack.LOCATION).is_file()
    assert "weights" in marks.values() and "scales" in marks.values()
    pipe = edgespec.load(package)
    left = pipe.target.session.edgespec_unpacked
    assert not any(marks[name] == "weights" for name in left)  # packed as the session loaded
    assert set(left) <= {name for name, mark in marks.items() if mark != "weights"}
    copies = package.parent / "copies"
    shutil.copytree(package, copies)
    (copies / "target" / unpack.LOCATION).unlink()
    copied = edgespec.load(copies)
    assert copied.target.session.edgespec_unpacked == {}  # onnxruntime holds its own copies
    monkeypatch.setattr(loader, "release_unpacked", lambda session, probe: 0)
    kept = edgespec.load(package)
    assert set(kept.target.session.edgespec_unpacked) == set(marks)
    np.testing.assert_array_equal(_logits(pipe), _logits(kept))
    np.testing.assert_array_equal(_logits(pipe), _logits(copied))


def test_a_tensor_a_run_reads_marked_as_packed_is_kept(packages, tmp_path):
    """The wrong variant of the export's marks: the tensors runs read (the tied table a gather
    reads, the rotary tables) marked as packed weights. The probe sees the run read them: the
    group is kept as it was, and the logits equal the true marks' bit for bit."""
    import shutil

    from edgespec.runtime import unpack

    wrong = tmp_path / "wrong"
    shutil.copytree(packages["llama_k"], wrong)
    path = wrong / "target" / unpack.UNPACK_NAME
    recipes = json.loads(path.read_text())
    gathered = [name for name, recipe in recipes.items() if not recipe.get("packed")]
    assert "lm_head.folded" in gathered
    for name in gathered:
        recipes[name]["packed"] = "weights"
    path.write_text(json.dumps(recipes))
    pipe = edgespec.load(wrong)
    left = pipe.target.session.edgespec_unpacked
    assert set(gathered) <= set(left)  # their group kept, remade in place
    assert {recipes[name].get("packed") for name in left} >= {"weights"}
    np.testing.assert_array_equal(_logits(pipe), _logits(edgespec.load(packages["llama_k"])))


def test_a_gguf_pair_quantized_draft_is_exact(files, tmp_path):
    """A GGUF target with a GGUF draft (a folder holding one .gguf): the pair checks pass and
    greedy output with the draft is target-only output; a draft asked to be int4 computes in
    int8, its 4-bit blocks kept and its 8-bit ones (a Q8_0 table) quantized to int4."""
    folder = tmp_path / "draft"
    folder.mkdir()
    # the target's weights, every matrix in a repacked type (its layer 1 ffn_down is F16)
    write_gguf(folder / "model.gguf", "llama", {**LLAMA, "ffn_down.1": "Q4_1"}, seed=1)
    manifest = export_pair(files["llama"], folder, tmp_path / "pair", draft_quantize="int4")
    assert manifest.draft.compute == "int8" and manifest.source["draft"].endswith("model.gguf")
    weights = manifest.draft.validation["gguf"]
    assert weights["tensors"]["repacked"] == {"Q4_0": 4, "Q4_1": 8}
    assert weights["tensors"]["dequantized"] == {"Q8_0": 3} and weights["requantized"]
    assert manifest.draft.quantization == "int4"
    import onnx  # the file's blocks stay blocks of 32; those quantized here are the widest
    # that divide every matrix's input (hidden 64: precision.draft_block_size)
    graph = onnx.load(str(tmp_path / "pair" / "draft" / "model.onnx"), load_external_data=False)
    sizes = {a.i for n in graph.graph.node if n.op_type == "MatMulNBits"
             for a in n.attribute if a.name == "block_size"}
    assert sizes == {32, 64}
    pipe = edgespec.load(tmp_path / "pair")
    prompt = "for i in range(10):\n    print(i * i)\n"
    baseline = pipe.generate(prompt, max_new_tokens=24, drafter="none").token_ids
    result = pipe.generate(prompt, max_new_tokens=24, draft_length=3, schedule="fixed")
    assert result.token_ids == baseline and result.stats.drafted > 0


def test_a_gguf_target_takes_an_eagle3_head(files, tmp_path):
    """A head beside a GGUF target: its graph reads the file's embedding (dequantized, the
    reference's), validates against PyTorch, and greedy output with it is target-only's."""
    from edgespec.export.eagle3 import write_random_head
    from edgespec.export.gguf import read_gguf_checkpoint

    config = read_gguf_checkpoint(files["llama"], "target").config
    head = write_random_head(tmp_path / "head", config, draft_vocab=200, seed=2,
                             aux_layers=(0, 1, 1), init=0.05)
    manifest = export_pair(files["llama"], head, tmp_path / "pair")
    assert manifest.draft.architecture == "eagle3"
    pipe = edgespec.load(tmp_path / "pair")
    prompt = "for i in range(10):\n    print(i * i)\n"
    baseline = pipe.generate(prompt, max_new_tokens=24, drafter="none").token_ids
    result = pipe.generate(prompt, max_new_tokens=24, draft_length=3, schedule="fixed")
    assert result.token_ids == baseline and result.stats.drafted > 0


def test_a_gguf_target_fixed_to_int8_compute_repacks_its_8_bit_blocks(files, tmp_path):
    """target_compute int8 (the user's choice, which the manifest states): the Q8_0 tied table
    and o_proj become 8-bit MatMulNBits (the table also gathered from those blocks), not fp32;
    validated at int8's gate (the float-compute export of the same blocks, at fp32's, is
    the next test's), and greedy output with n-gram drafting is target-only output (runs of
    >= 2 tokens, rows bit-identical)."""
    import onnx

    manifest = export_pair(files["llama"], None, tmp_path / "p", target_compute="int8")
    target = manifest.target
    assert target.compute == "int8" and target.min_run_tokens == 2
    weights = target.validation["gguf"]
    assert weights["tensors"]["repacked"] == {"Q4_0": 4, "Q4_1": 7, "Q8_0": 3}
    assert "dequantized" not in weights["tensors"] and "skipped" in weights["repack_check"]
    assert target.validation["failures"] == [] and target.validation["variant"] == "int4"
    graph = onnx.load(str(tmp_path / "p" / "target" / "model.onnx"),
                      load_external_data=False).graph
    (head,) = [n for n in graph.node if "logits" in n.output]
    attrs = {a.name: a.i for a in head.attribute}
    assert head.op_type == "MatMulNBits" and attrs["bits"] == 8 and attrs["accuracy_level"] == 4
    pipe = edgespec.load(tmp_path / "p")
    _assert_ngram_greedy_is_target_only(pipe)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q6_K"])
def test_a_repack_out_of_order_fails_the_fp32_gate(files, tmp_path, monkeypatch, qtype):
    """The gate that proves 8-bit blocks exact can fail: the same export with ``qtype``'s
    values in the wrong order inside each block (as a repack that mixed up low and high
    nibbles or bit planes would hold them) is refused, and nothing is written."""
    import edgespec.export.gguf as gguf_module
    from edgespec.errors import ExportError

    def off_by_one(raw, kind):
        packed = repack(raw, kind)
        wrong = np.ascontiguousarray(packed.data[..., ::-1])
        return replace(packed, data=wrong) if kind == qtype else packed

    file = {"Q8_0": "llama", "Q5_0": "qwen2", "Q6_K": "llama_k"}[qtype]
    export_pair(files[file], None, tmp_path / "good")  # the same export passes as it is
    monkeypatch.setattr(gguf_module, "repack", off_by_one)
    with pytest.raises(ExportError, match="failed validation"):
        export_pair(files[file], None, tmp_path / "off")
    assert not (tmp_path / "off").exists()


def test_block_sums_by_reduce_sum_keep_the_fp32_gate(files, tmp_path, monkeypatch):
    """Blocks with minimums (Q4_K) whose input is too wide for a matrix of ones (a real MLP's
    down projection) sum x's blocks with ReduceSum: the same numbers to float rounding."""
    import onnx

    import edgespec.export.fused as fused

    monkeypatch.setattr(fused, "ONES_BYTES", 0)
    manifest = export_pair(files["llama_k"], None, tmp_path / "p")
    assert manifest.target.validation["failures"] == []
    graph = onnx.load(str(tmp_path / "p" / "target" / "model.onnx"),
                      load_external_data=False).graph
    assert any(n.op_type == "ReduceSum" and n.input[0] != "attention_mask" for n in graph.node)
    assert not any(i.name.startswith("block_sums") for i in graph.initializer)


# Llama 3.2's rope_scaling (config.json of Llama-3.2-1B/3B); at head size 16 and base 10,000
# the wavelengths reach each of its three regions (kept, smoothed, divided by the factor)
LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_llama3_rope_scaling_from_gguf_is_transformers_model(tmp_path):
    """A GGUF file with rope_freqs (Llama 3.1+) exports to the graph of transformers' model
    with config.json's llama3 rope_scaling: logits equal over 120 positions at fp32's gate. The
    same comparison against the model without the scaling fails (the check can fail), and
    rope_freqs of another kind are refused in one line."""
    from edgespec.errors import ExportError

    file = write_gguf(tmp_path / "l3.gguf", "llama", {}, seed=7, rope_scaling=LLAMA32_ROPE)
    manifest = export_pair(file, None, tmp_path / "p")
    assert manifest.target.validation["failures"] == []
    ids = np.random.default_rng(0).integers(1, 300, 120)
    pipe = edgespec.load(tmp_path / "p")
    graph = pipe.target.forward(ids, pipe.target.new_cache())
    for scaling, same in ((LLAMA32_ROPE, True), (None, False)):
        model, _ = _model("llama", 7, True, rope_scaling=scaling)
        with torch.no_grad():
            expected = model(torch.from_numpy(ids)[None]).logits[0].numpy()
        diff = np.abs(graph - expected).max()
        assert (diff < 1e-3) == same, (scaling, diff)
    other = write_gguf(tmp_path / "o.gguf", "llama", {}, seed=7,
                       rope_scaling={**LLAMA32_ROPE, "high_freq_factor": 2.0})
    with pytest.raises(ExportError, match="not Llama 3's rotary scaling"):
        export_pair(other, None, tmp_path / "o")


def test_quantize_applies_to_the_weights_that_were_not_repacked(files, tmp_path):
    manifest = export_pair(files["llama"], None, tmp_path / "q", quantize="int8",
                           target_compute="float")  # its layer 1 down_proj is F16
    weights = manifest.target.validation["gguf"]
    assert weights["requantized"] is True and "repack_check" not in weights
    assert manifest.target.quantization == "int8"
    assert manifest.target.validation["variant"] == "int8"  # the lossy gate: o quantized
    assert manifest.target.validation["failures"] == []
    # edgespec models list says which matrices kept the file's blocks and which were made int8
    taken = gguf_blocks(manifest.target.validation)
    assert taken.endswith("kept as the file's blocks; its float matrices quantized (int8)"), taken


def test_models_list_says_how_the_files_blocks_were_taken(packages):
    """A package exported as the file is says so (nothing made again), and a manifest's record
    from anyone is read for its counts only."""
    from edgespec.models import describe_package

    lines = describe_package("k", packages["llama_k"])
    taken = next(line for line in lines if "from GGUF" in line)
    assert "kept as the file's blocks" in taken and "made" not in taken, lines
    hostile = {"gguf": {"tensors": {"repacked": {"Q4_K": "9" * 99, "X" * 500: 3, "Y": True,
                                                 "Q4\n      draft": 2, "\x1b[2J": 1,
                                                 "Q8_0": -4, "Q6_K": 10**40, "Q5_0": 5},
                                    "dequantized": [1, 2]},
                        "requantized": True, "quantization": "int4; rm -rf /"}}
    assert gguf_blocks(hostile) == "5 Q5_0 kept as the file's blocks"
    assert gguf_blocks({"gguf": "junk"}) == gguf_blocks([]) == gguf_blocks({}) == ""
    many = {"gguf": {"tensors": {"repacked": {f"Q{i}": 1 for i in range(1000)}}}}
    assert gguf_blocks(many).count(",") < 20


# -- bad input ----------------------------------------------------------------------------------

def _truncated(path: Path, good: Path) -> Path:
    data = good.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    return path


@pytest.mark.parametrize("case,match", [
    ("phi3", "architecture phi3"),
    ("no_tokenizer", "has no tokenizer"),
    ("truncated", "truncated"),
    ("Q8_K", "type Q8_K"),
    ("two_files", "holds 2 .gguf files"),
    ("value_length", "keys and values differ in size"),
])
def test_bad_gguf_files_are_one_line_errors_and_write_nothing(files, tmp_path, case, match):
    if case == "phi3":
        bad = write_gguf(tmp_path / "phi.gguf", "llama", LLAMA_Q4_0, architecture="phi3")
    elif case == "no_tokenizer":
        bad = write_gguf(tmp_path / "bare.gguf", "llama", LLAMA_Q4_0, tokenizer=False)
    elif case == "truncated":
        bad = _truncated(tmp_path / "cut.gguf", files["llama"])
    elif case == "value_length":  # heads of 32 for keys, 16 for values (a head size apart)
        bad = write_gguf(tmp_path / "kv.gguf", "qwen3", QWEN3, value_length=16)
    elif case == "Q8_K":
        # llama.cpp's intermediate Q8_K, which gguf-py cannot dequantize
        bad = write_gguf(tmp_path / "q8k.gguf", "llama", {**LLAMA_Q4_0, "ffn_up.1": "Q8_K"})
    else:
        bad = tmp_path / "two"
        bad.mkdir()
        for n in ("a", "b"):
            (bad / f"{n}.gguf").write_bytes(files["llama"].read_bytes())
    with pytest.raises(ExportError, match=match) as error:
        export_pair(bad, None, tmp_path / "out")
    assert str(bad) in str(error.value)
    result = CliRunner().invoke(main, ["export", "--target", str(bad), "--out",
                                       str(tmp_path / "cli")])
    assert result.exit_code == 1 and match in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and match in errors[0] and "Traceback" not in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "cli").exists()


# -- the real file --------------------------------------------------------------------------------

SMOLLM2 = os.environ.get("EDGESPEC_SMOLLM2_GGUF")


@pytest.mark.skipif(not SMOLLM2, reason="EDGESPEC_SMOLLM2_GGUF names no SmolLM2 GGUF file")
def test_smollm2_exports_and_answers(tmp_path):
    """SmolLM2-135M-Instruct (Q4_1, Q8_0 table): every matrix repacked, fp32's gate on the
    repacked blocks, a chat answer in words, greedy identity with n-gram drafting."""
    manifest = export_pair(SMOLLM2, None, tmp_path / "smol")
    weights = manifest.target.validation["gguf"]
    assert weights["tensors"]["repacked"] == {"Q4_1": 210}
    assert weights["tensors"]["dequantized"] == {"Q8_0": 1}  # float compute: read as floats
    validation = manifest.target.validation
    assert validation["variant"] == "fp32" and validation["failures"] == []
    # the file's special tokens (transformers' converter names BOS <|im_start|> as EOS too)
    assert manifest.eos_token_ids == [2] and manifest.bos_token_id == 1
    assert manifest.special_tokens["eos_token"] == "<|im_end|>"
    pipe = edgespec.load(tmp_path / "smol")
    template = (tmp_path / "smol" / "chat_template.jinja").read_text()
    from jinja2 import Template

    text = Template(template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True)
    prompt = pipe.tokenizer.encode(text, add_special_tokens=False).ids  # its BOS only once
    baseline = pipe.generate(prompt, max_new_tokens=32, drafter="none")
    assert baseline.text.strip() and "Paris" in baseline.text
    result = pipe.generate(prompt, max_new_tokens=32, draft_length=4, schedule="fixed",
                           drafter="ngram")
    assert result.token_ids == baseline.token_ids and result.stats.drafted > 0
