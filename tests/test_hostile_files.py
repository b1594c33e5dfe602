"""Files from strangers: GGUF files, EAGLE-3 head folders and folders being resumed, made
hostile by hand. Each is answered by one line naming the problem (an EdgespecError, exit 1 from
the CLI, no traceback), within bounded time and memory, and nothing is written outside the
output folder. Each case says what happened to it before these checks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgespec.cli import main
from edgespec.errors import EdgespecError, ExportError
from edgespec.export.gguf_header import check_gguf

# -- GGUF headers written by hand (llama.cpp's docs/gguf.md) ------------------------------------

U32, F32, BOOL, STRING, ARRAY = 4, 6, 7, 8, 9


def _str(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str | bytes, kind: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", kind) + payload


def _u32(key: str, value: int) -> bytes:
    return _kv(key, U32, struct.pack("<I", value))


def _strings(key: str, items: list[str]) -> bytes:
    return _kv(key, ARRAY, struct.pack("<IQ", STRING, len(items)) + b"".join(map(_str, items)))


def _u32s(key: str, items: list[int]) -> bytes:
    return _kv(key, ARRAY, struct.pack("<IQ", U32, len(items)) + struct.pack(f"<{len(items)}I",
                                                                           *items))


LLAMA = {
    "general.architecture": _kv("general.architecture", STRING, _str("llama")),
    "llama.block_count": _u32("llama.block_count", 1),
    "llama.context_length": _u32("llama.context_length", 128),
    "llama.embedding_length": _u32("llama.embedding_length", 32),
    "llama.feed_forward_length": _u32("llama.feed_forward_length", 64),
    "llama.attention.head_count": _u32("llama.attention.head_count", 2),
    "llama.attention.head_count_kv": _u32("llama.attention.head_count_kv", 1),
    "tokenizer.ggml.model": _kv("tokenizer.ggml.model", STRING, _str("gpt2")),
    "tokenizer.ggml.tokens": _strings("tokenizer.ggml.tokens", ["a", "b", "ab", "aba"]),
    "tokenizer.ggml.token_type": _u32s("tokenizer.ggml.token_type", [1, 1, 1, 1]),
    "tokenizer.ggml.merges": _strings("tokenizer.ggml.merges", ["a b", "ab a"]),
    "tokenizer.ggml.add_bos_token": _kv("tokenizer.ggml.add_bos_token", BOOL, b"\x00"),
    "tokenizer.ggml.bos_token_id": _u32("tokenizer.ggml.bos_token_id", 0),
    "tokenizer.ggml.eos_token_id": _u32("tokenizer.ggml.eos_token_id", 0),
}


def gguf_file(path: Path, version: int = 3, tensors: int = 1, **changes: bytes | None) -> Path:
    """A GGUF file of LLAMA's metadata (``changes``: key with dots as "__" -> its encoded
    pair, or None to leave the key out) and ``tensors`` F32 tensors of 4 zeros, laid out as
    gguf-py reads them (data aligned to 32 bytes): the header is what is hostile."""
    fields = {**LLAMA, **{k.replace("__", "."): v for k, v in changes.items()}}
    pairs = [v for v in fields.values() if v is not None]
    infos = b"".join(_str(f"t{i}.weight") + struct.pack("<IQIQ", 1, 4, 0, 32 * i)
                     for i in range(tensors))
    header = b"GGUF" + struct.pack("<IQQ", version, tensors, len(pairs)) + b"".join(pairs) + infos
    path.write_bytes(header + bytes(-len(header) % 32) + bytes(32 * tensors))
    return path


def assert_one_line(args: list[str], match: str, out: Path | None = None) -> None:
    """The CLI answers ``args`` with exit 1 and one line holding ``match``, no traceback."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and match in errors[0], result.output
    assert "Traceback" not in result.output and "\x1b" not in result.output
    assert out is None or not out.exists()


def test_the_hand_made_header_passes(tmp_path):
    """The writer's own file passes the checks and is read on to its missing weights: the
    cases below fail for their one change."""
    good = gguf_file(tmp_path / "ok.gguf")
    header = check_gguf(good, "target")
    assert header.architecture == "llama" and header.fields["llama.block_count"] == 1
    assert_one_line(["export", "--target", str(good), "--out", str(tmp_path / "out")],
                    "has no tensor model.embed_tokens.weight", tmp_path / "out")


GGUF_CASES = {
    # Before: gguf-py's "index 0 is out of bounds", which names no problem.
    "huge_array": (dict(general__name=_kv("general.name", ARRAY,
                                          struct.pack("<IQ", STRING, 1 << 40))),
                   "declares 1,099,511,627,776 items"),
    # Before: GGUFReader read empty items past the end, 2^40 of them (killed after 20 s here;
    # the 6 GB in 61 s).
    "huge_numeric_array": (dict(general__name=_kv("general.name", ARRAY,
                                                  struct.pack("<IQ", 0, 1 << 40))),
                           "declares 1,099,511,627,776 items"),
    # Before: a meta model of ten million layers (killed after 25 s here; the 3.4 GB).
    "block_count": (dict(llama__block_count=_u32("llama.block_count", 10_000_000)),
                    "llama.block_count is 10,000,000"),
    # Before: unnoticed until a tensor was missing (kv_heads, vocab_size, eos_id the same).
    "blocks_over_tensors": (dict(llama__block_count=_u32("llama.block_count", 2)),
                            "the file holds 1 tensors"),
    # Before: RuntimeError's traceback, 34,359,738,360 bytes asked for (the rotary positions).
    "context_length": (dict(llama__context_length=_u32("llama.context_length", 2**32 - 1)),
                       "llama.context_length is 4,294,967,295"),
    # Before: ZeroDivisionError (hidden // heads).
    "head_count": (dict(llama__attention__head_count=_u32("llama.attention.head_count", 0)),
                   "llama.attention.head_count is 0"),
    "kv_heads": (dict(llama__attention__head_count_kv=_u32("llama.attention.head_count_kv", 3)),
                 "3 key/value heads do not divide 2"),
    # Before: read as 4.0 (a "head size 2.0" in the message).
    "embedding_float": (dict(llama__embedding_length=_kv("llama.embedding_length", F32,
                                                         struct.pack("<f", 4.0))),
                        "is a float, not an integer"),
    "vocab_size": (dict(llama__vocab_size=_u32("llama.vocab_size", 2**31)),
                   "llama.vocab_size is 2,147,483,648"),
    "eos_id": (dict(tokenizer__ggml__eos_token_id=_u32("tokenizer.ggml.eos_token_id", 7)),
               "eos_token_id 7 is not one of its 4 tokens"),
    # Before: IndexError's traceback (transformers' read_field).
    "no_architecture": (dict(general__architecture=None), "no general.architecture"),
    # Before: transformers' default layer count, then a missing tensor.
    "no_blocks": (dict(llama__block_count=None), "no llama.block_count"),
    # Before: "not a valid JSON file" (transformers' message).
    "not_utf8": (dict(general__name=_kv("general.name", STRING, _str(b"\xff\xfe"))),
                 "is not UTF-8 text"),
    # Before: RecursionError's traceback.
    "nested": (dict(general__name=_kv("general.name", ARRAY,
                                      struct.pack("<IQ", ARRAY, 1) * 5000)),
               "nests arrays deeper than"),
    # Before: the escape sequences reached a terminal raw (click strips them only elsewhere).
    "escape": (dict(general__architecture=_kv("general.architecture", STRING,
                                              _str("\x1b[2J\x1b[31mllama"))),
               "'\\x1b[2J\\x1b[31mllama' is not a name"),
    # Before: one line already (gguf-py's own checks); the header reader says it first now.
    "bad_type": (dict(general__name=_kv("general.name", 77, b"")), "value type 77"),
    "alignment_zero": (dict(general__alignment=_u32("general.alignment", 0)),
                       "general.alignment is 0"),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_hostile_gguf_headers_are_one_line_errors(tmp_path, case):
    """Each header fault above, through `edgespec export` (before: see each case)."""
    changes, match = GGUF_CASES[case]
    bad = gguf_file(tmp_path / f"{case}.gguf", **changes)
    with pytest.raises(ExportError) as error:
        check_gguf(bad, "target")
    assert match in str(error.value) and "\x1b" not in str(error.value)
    out = tmp_path / "out"
    assert_one_line(["export", "--target", str(bad), "--out", str(out)], match, out)


def test_distill_refuses_a_hostile_gguf_target_before_writing(tmp_path):
    """`edgespec distill --target FILE.gguf`: transformers' GGUF loader is not reached, and
    --out is not made (before: OUT/work/ made, then transformers built the ten-million-layer
    model: killed after 40 s here)."""
    bad = gguf_file(tmp_path / "bad.gguf", **GGUF_CASES["block_count"][0])
    out = tmp_path / "head"
    assert_one_line(["distill", "--target", str(bad), "--out", str(out)],
                    GGUF_CASES["block_count"][1], out)


def test_models_build_refuses_a_hostile_gguf(tmp_path, monkeypatch):
    """`edgespec models build smollm2 --from FILE.gguf` (before: hung assembling the draft, in
    the meta model of ten million layers: killed after 40 s here)."""
    import hashlib
    from dataclasses import replace

    from edgespec.models import registry

    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "models"))
    bad = gguf_file(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf",
                    **GGUF_CASES["block_count"][0])
    assert_one_line(["models", "build", "smollm2", "--from", str(bad)],
                    "is not the file this model pins")  # the pin refuses it first
    model = registry.MODELS["smollm2"]  # pinned to the hostile file: its header is what refuses
    pin = replace(model.target, size=bad.stat().st_size,
                  sha256=hashlib.sha256(bad.read_bytes()).hexdigest())
    monkeypatch.setitem(registry.MODELS, "smollm2", replace(model, target=pin))
    assert_one_line(["models", "build", "smollm2", "--from", str(bad)],
                    GGUF_CASES["block_count"][1])
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("data,match", [
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 50), "1,125,899,906,842,624 metadata entries"),
    (b"GGUF" + struct.pack("<IQQ", 3, 1 << 50, 0), "1,125,899,906,842,624 tensors declared"),
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "GGUF version 1"),
    (b"GGML" + bytes(20), "does not start with GGUF"),
    (b"GGUF", "shorter than a GGUF header"),
])
def test_hostile_gguf_counts_are_one_line_errors(tmp_path, data, match):
    """Counts past what the file can hold, wrong magic or version, too short (before: one line
    of gguf-py's "index 0 is out of bounds" for the counts and the short file)."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(ExportError) as error:
        check_gguf(bad, "target")
    assert match in str(error.value)


def test_a_tensor_larger_than_its_file_is_refused(tmp_path):
    """A tensor info declaring 2^60 elements in a file of a few hundred bytes."""
    bad = gguf_file(tmp_path / "big.gguf")
    data = bad.read_bytes()
    shape_at = data.index(b"t0.weight") + len(b"t0.weight") + 4
    bad.write_bytes(data[:shape_at] + struct.pack("<Q", 1 << 60) + data[shape_at + 8:])
    with pytest.raises(ExportError, match="larger than the file"):
        check_gguf(bad, "target")


# -- EAGLE-3 head folders -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tiny Llama target folder with its tokenizer (safetensors weights)."""
    from conftest import _hf_tokenizer, _save, _train_words, llama

    words = _hf_tokenizer(_train_words(["a", "b", "c", "d", "e"]))
    return _save(llama(len(words), 64, 3, seed=1), words,
                 tmp_path_factory.mktemp("hostile") / "target")


def _head(tmp_path: Path, target: Path, edit_config=None) -> Path:
    from transformers import AutoConfig

    from edgespec.export.eagle3 import write_random_head

    folder = write_random_head(tmp_path / "head", AutoConfig.from_pretrained(target),
                               aux_layers=(0, 1, 2))
    if edit_config is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(edit_config(config)))
    return folder


def _read_head(folder: Path, target: Path):
    from transformers import AutoConfig

    from edgespec.export.eagle3 import HeadTensors, is_eagle3_head, read_head_config

    assert is_eagle3_head(folder)
    return HeadTensors(read_head_config(folder, AutoConfig.from_pretrained(target)))


def test_the_written_head_reads(tmp_path, target):
    """The cases below fail for their one change: the unchanged head reads."""
    assert "fc.weight" in _read_head(_head(tmp_path, target), target)


def _set(**values):
    return lambda config: {**config, **values}


HEAD_CONFIGS = {
    # Before: AttributeError ('list' object has no attribute 'get').
    "not_an_object": (lambda config: [config], "is not a JSON object"),
    # Before: AttributeError ('int' object has no attribute 'get').
    "eagle_config": (_set(eagle_config=5), "eagle_config 5 is not an object"),
    # Before: TypeError (object of type 'int' has no len()).
    "aux_layers": (_set(eagle_config={"eagle_aux_hidden_state_layer_ids": 7}),
                   "aux hidden-state layers 7"),
    # Before: ValueError (could not convert string to float).
    "eps": (_set(rms_norm_eps="small"), "rms_norm_eps 'small' is not a positive number"),
    # Before: a head of 0 key/value heads was read as one of 4 (``or heads``), then refused
    # as malformed weights.
    "kv_heads": (_set(num_key_value_heads=0), "num_key_value_heads 0 is not an integer"),
    # Before: blamed on the weights ("gate_proj.weight is [128, 64], not [-5, 64]"), as
    # draft_vocab.
    "intermediate": (_set(intermediate_size=-5), "intermediate_size -5 is not an integer"),
    # Before: accepted.
    "rope_theta": (_set(rope_theta="x"), "rope_theta 'x' is not a positive number"),
    "draft_vocab": (_set(draft_vocab_size=10**9), "draft_vocab_size 1000000000 is not"),
    # Before: "config.json needs hidden_size", the value not named.
    "escape": (_set(hidden_size="\x1b[2J"), "hidden_size '\\x1b[2J' is not an integer"),
    # Before: read as no head (architectures must be a list), then as a draft model: "is a L,
    # l, a, m, a, F, o, r, ... model" (the name's letters joined).
    "architectures_one_name": (_set(architectures="LlamaForCausalLMEagle3"),
                               "architectures 'LlamaForCausalLMEagle3' is not a list of"),
    # Before: TypeError (unhashable type: 'list'), in transformers' rope validation.
    "rope_type_list": (_set(rope_scaling={"rope_type": ["linear"], "factor": 2.0}),
                       "is not an object whose rope_type is one of"),
    "rope_scaling_list": (_set(rope_scaling=[1, 2]), "rope_scaling [1, 2] is not an object"),
    # Before: accepted (transformers only logs), then TypeError (Tensor /= str) in the rotary.
    "rope_factor_text": (_set(rope_scaling={"rope_type": "linear", "factor": "x"}),
                         "'factor' not numbers"),
    # Before: KeyError's traceback (Missing required keys in `rope_scaling`).
    "rope_field_missing": (_set(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                           "Missing required keys"),
    # Before: accepted: a rotary that depends on the sequence length, which the graph has not.
    "rope_dynamic": (_set(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                     "is not an object whose rope_type is one of"),
}


@pytest.mark.parametrize("case", sorted(HEAD_CONFIGS))
def test_malformed_head_configs_are_one_line_errors(tmp_path, target, case):
    """A head config.json field of the wrong type or range, named in the message."""
    edit, match = HEAD_CONFIGS[case]
    folder = _head(tmp_path, target, edit)
    if case == "not_an_object":  # not a head by its config: read as one directly
        from transformers import AutoConfig

        from edgespec.export.eagle3 import read_head_config

        with pytest.raises(ExportError) as error:
            read_head_config(folder, AutoConfig.from_pretrained(target))
        assert match in str(error.value)
        return
    with pytest.raises(ExportError) as error:
        _read_head(folder, target)
    assert match in str(error.value)
    out = tmp_path / "out"
    assert_one_line(["export", "--target", str(target), "--draft", str(folder), "--out",
                     str(out)], match, out)


def _header(folder: Path) -> tuple[dict, bytes]:
    """model.safetensors' header and the bytes after it."""
    data = (folder / "model.safetensors").read_bytes()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8: 8 + length]), data[8 + length:]


def _rewrite(folder: Path, header: dict, body: bytes, length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(
        (length if length is not None else len(raw)).to_bytes(8, "little") + raw + body)


def _claim_6_gb(folder: Path) -> None:
    """d2t's shape as the config says, its byte range 6.4 GB long."""
    header, body = _header(folder)
    begin = header["d2t"]["data_offsets"][0]
    header["d2t"]["data_offsets"] = [begin, begin + 6_400_000_000]
    _rewrite(folder, header, body)


def _index_naming(shard: str):
    def write(folder: Path) -> None:
        header, _ = _header(folder)
        (folder / "model.safetensors").rename(folder / "shard.safetensors")
        weight_map = {name: "shard.safetensors" for name in header}
        weight_map["fc.weight"] = shard
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": weight_map}))
    return write


def _outside_copy(folder: Path) -> None:
    (folder.parent / "outside_head.safetensors").write_bytes(
        (folder / "model.safetensors").read_bytes())


def _linked_shard(folder: Path) -> None:
    _outside_copy(folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(folder.parent / "outside_head.safetensors")


@pytest.mark.parametrize("names", [5, [{"name": "LlamaForCausalLM"}]])
def test_a_draft_config_whose_architectures_is_no_list_of_names_is_one_line(
        tmp_path, target, names):
    """config.json's architectures not a list of class names (an integer, objects), in a draft
    model's folder: one line (before: TypeError, 'int' object is not iterable / unhashable
    type: 'dict')."""
    folder = _head(tmp_path, target, _set(architectures=names))
    out = tmp_path / "out"
    assert_one_line(["export", "--target", str(target), "--draft", str(folder), "--out",
                     str(out)], "is not a list of class names", out)


HEAD_WEIGHTS = {
    # Before: a bytearray of 6.4 GB allocated before the read (MemoryError under a 4 GB limit).
    "claims_6_gb": (_claim_6_gb, "outside the file's"),
    # Before: a read of 2^40 bytes asked for (MemoryError).
    "header_length": (lambda f: _rewrite(f, *_header(f), length=1 << 40),
                      "a header of 1,099,511,627,776 bytes"),
    # Before: TypeError (string indices must be integers).
    "entry_not_object": (lambda f: _rewrite(f, {**_header(f)[0], "fc.weight": "x"},
                                            _header(f)[1]), "has no dtype, shape and data_offsets"),
    # Before: "norm.weight is ['6', '4'], not [64]" (the string read as a shape).
    "shape_wrong": (lambda f: _rewrite(f, {**_header(f)[0], "norm.weight": {
        "dtype": "F32", "shape": "64", "data_offsets": [0, 256]}}, _header(f)[1]),
        "has shape '64'"),
    # Before: exported with exit 0, the weights read from the file beside the folder.
    "index_outside": (lambda f: (_outside_copy(f), _index_naming("../outside_head.safetensors")(f)),
                      "'../outside_head.safetensors', which is not a file name"),
    # Before: /etc/passwd opened, its first 8 bytes read as a header length (MemoryError).
    "index_system": (_index_naming("/etc/passwd"), "'/etc/passwd', which is not a file name"),
    # Before: TypeError's traceback (list indices must be integers).
    "index_malformed": (lambda f: (f / "model.safetensors.index.json").write_text("[1]"),
                        "has no weight_map"),
    # Before: read through the link.
    "linked_out": (_linked_shard, "outside the folder"),
    # Before: pickle.UnpicklingError's traceback.
    "pickle": (lambda f: ((f / "model.safetensors").unlink(),
                          (f / "pytorch_model.bin").write_bytes(
                              b"\x80\x02cos\nsystem\n(S'echo hi'\ntR.")),
               "is not a file of plain weights"),
}


@pytest.mark.parametrize("case", sorted(HEAD_WEIGHTS))
def test_malformed_head_weights_are_one_line_errors(tmp_path, target, case):
    """Head weights whose header, index or location is hostile; nothing outside is read."""
    spoil, match = HEAD_WEIGHTS[case]
    folder = _head(tmp_path, target)
    spoil(folder)
    with pytest.raises(ExportError) as error:
        _read_head(folder, target)
    assert match in str(error.value)
    out = tmp_path / "out"
    assert_one_line(["export", "--target", str(target), "--draft", str(folder), "--out",
                     str(out)], match, out)


def test_a_hugging_face_cache_snapshot_reads_through_its_links(tmp_path, target):
    """A snapshot folder of the Hugging Face cache holds links to ../../blobs/: still read."""
    folder = _head(tmp_path, target)
    snapshot = tmp_path / "models--x" / "snapshots" / "abc"
    blobs = tmp_path / "models--x" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in folder.iterdir():
        file.rename(blobs / file.name)
        (snapshot / file.name).symlink_to(Path("../../blobs") / file.name)
    assert "fc.weight" in _read_head(snapshot, target)


# -- folders being resumed: temporary files created exclusively ---------------------------------

def test_a_planted_link_is_never_written_through(tmp_path):
    """write_file refuses a link at its temporary name and leaves its target as it was (before:
    torch.save(..., features.tmp) followed the link, and the rename put it in place)."""
    from edgespec.export.destination import write_file

    outside = tmp_path / "outside.txt"
    outside.write_text("theirs")
    work = tmp_path / "work"
    work.mkdir()
    (work / "features.tmp").symlink_to(outside)
    with pytest.raises(EdgespecError, match="is a link"):
        write_file(work / "features.pt", lambda f: f.write(b"ours"))
    assert outside.read_text() == "theirs" and not (work / "features.pt").exists()


def test_a_link_at_the_final_name_is_replaced_not_followed(tmp_path):
    from edgespec.export.destination import write_file

    outside = tmp_path / "outside.json"
    outside.write_text("theirs")
    (tmp_path / "config.json").symlink_to(outside)
    write_file(tmp_path / "config.json", lambda f: f.write(b"ours"))
    assert outside.read_text() == "theirs"
    assert not (tmp_path / "config.json").is_symlink()
    assert (tmp_path / "config.json").read_text() == "ours"


def test_a_leftover_is_replaced_and_a_failed_write_leaves_nothing(tmp_path):
    """An interrupted run's plain .tmp is removed first; a write that fails removes its own
    temporary file and keeps the old content."""
    from edgespec.export.destination import write_file

    (tmp_path / "state.tmp").write_bytes(b"half")
    (tmp_path / "state.pt").write_bytes(b"old")

    def fail(f):
        f.write(b"par")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_file(tmp_path / "state.pt", fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]
    assert (tmp_path / "state.pt").read_bytes() == b"old"
    write_file(tmp_path / "state.pt", lambda f: f.write(b"new"))
    assert (tmp_path / "state.pt").read_bytes() == b"new"


def test_feature_stage_refuses_a_planted_link(tmp_path):
    """The distill stage of the issue: OUT/work/features.tmp a link to a file outside."""
    import torch

    from conftest import llama
    from edgespec.models.training.eagle3_head import Example, feature_stage

    target = llama(20, 32, 3, seed=0)
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"theirs")
    work = tmp_path / "head" / "work"
    work.mkdir(parents=True)
    (work / "features.tmp").symlink_to(outside)
    examples = [Example(torch.arange(6), 1, None, None)]
    with pytest.raises(EdgespecError, match="is a link"):
        feature_stage(target, examples, (0, 1, 2), work / "features.pt", lambda line: None)
    assert outside.read_bytes() == b"theirs" and not (work / "features.pt").exists()


def test_distill_refuses_a_work_folder_that_is_a_link(tmp_path):
    """`edgespec distill --out HEAD` with HEAD/work a link elsewhere: one line, nothing read
    or written (before: the stages wrote wherever it pointed)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    head = tmp_path / "head"
    head.mkdir()
    (head / "work").symlink_to(elsewhere)
    target = tmp_path / "target.gguf"
    target.write_bytes(b"")
    assert_one_line(["distill", "--target", str(target), "--out", str(head)], "is a link")
    assert list(elsewhere.iterdir()) == []
