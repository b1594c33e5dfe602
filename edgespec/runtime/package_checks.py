"""What a package's files must be, checked when they load, so that a broken or hostile package
is refused with one line naming the file instead of failing at the first request.

The manifest's own fields are checked by ``Manifest.read``; here are the checks that need the
loaded files: each graph's KV inputs and outputs (tensor type, rank 4, fixed head count and
size as the manifest says), its logits (no fewer rows than the shared vocabulary), a probe
run whose cache must grow by what it was fed, and the tokenizer: the one the package was
exported with (``tokenizer_fingerprint``: its size and a hash of its vocabulary), one whose
normalizer does not multiply text, and one that encodes and decodes without a panic.
"""

from __future__ import annotations

import hashlib
import json
import mmap
from pathlib import Path

import numpy as np

from edgespec.errors import ManifestError, one_line, shown

KV_TYPES = ("tensor(float)", "tensor(float16)")
# Text a tokenizer must take without a fault or a blow-up: printable ASCII, and a little of
# each script family the tests' corpora use
PROBE = "".join(map(chr, range(32, 127))) + " \t\n é ß Ω Ж 東京 🙂 \u200b"
GROWTH = 8  # the most characters a normalizer may make of one


def check_graph_io(path: Path, spec, vocab_size: int, max_positions: int, inputs: list,
                   outputs: list) -> None:
    """The graph's KV inputs and outputs and its logits, as onnxruntime declares them
    (NodeArgs: ``name``, ``type``, ``shape``), against the manifest's ``spec``; a fused graph's
    rotary tables must cover ``max_positions``."""
    declared = {arg.name: arg for arg in [*inputs, *outputs]}
    for name in [*spec.kv_inputs, *spec.kv_outputs]:
        arg = declared.get(name)
        if arg is None:
            _refuse(path, f"has no {name}, which the manifest names")
        if arg.type not in KV_TYPES:
            _refuse(path, f"{name} is a {arg.type}; KV tensors must be float or float16")
        if len(arg.shape) != 4:
            _refuse(path, f"{name} has rank {len(arg.shape)}; KV tensors are "
                          "[batch, heads, positions, head size]")
        heads, size = arg.shape[1], arg.shape[3]
        if (heads, size) != (spec.kv_heads, spec.head_dim):
            _refuse(path, f"{name} has {heads} heads of size {size}; the manifest says "
                          f"{spec.kv_heads} of {spec.head_dim} (fixed numbers)")
    types = {declared[name].type for name in spec.kv_inputs}
    if len(types) > 1:
        _refuse(path, f"its KV inputs mix tensor types ({', '.join(sorted(types))})")
    logits = declared.get("logits")
    if logits is None or logits.type not in KV_TYPES or len(logits.shape) != 3:
        _refuse(path, "has no logits output [batch, positions, vocabulary] of floats")
    rows = logits.shape[2]
    # a draft scoring a subset of the vocabulary (spec.token_ids) has one row per token of it
    wanted = spec.vocab_size if spec.token_ids else max(vocab_size, spec.vocab_size)
    if isinstance(rows, int) and rows < wanted:
        _refuse(path, f"has {rows} rows of logits but the manifest's vocab_size is {wanted}")
    if spec.graph == "fused":
        positions = rotary_positions(path)
        if positions is None:
            _refuse(path, "is a fused graph without its rotary table cos_cache")
        if max_positions > positions:
            _refuse(path, f"has rotary tables for {positions} positions but the manifest's "
                          f"max_positions is {max_positions}")


def rotary_positions(path: Path) -> int | None:
    """The rows of a fused graph's ``cos_cache`` initializer (export/fused.py), read from the
    ONNX protobuf without loading the weights (onnx is not a runtime dependency): ModelProto
    field 7 is the graph, GraphProto field 5 its initializers, TensorProto field 1 the dims
    (packed or not) and 8 the name. None if there is no such table."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            for field, _, graph in _fields(data, 0, len(data)):
                if field != 7:
                    continue
                for field, _, tensor in _fields(data, *graph):
                    if field != 5:
                        continue
                    dims, name = [], ""
                    for field, wire, value in _fields(data, *tensor):
                        if field == 1:
                            dims += _packed(data, *value) if wire == 2 else [value]
                        elif field == 8:
                            name = bytes(data[value[0]:value[1]]).decode("utf-8", "replace")
                    if name == "cos_cache" or name.startswith("cos_cache."):
                        return dims[0] if dims else None
        except (IndexError, ValueError):  # not a protobuf: onnxruntime would have said so
            return None
    return None


def _fields(data, start: int, end: int):
    """(field number, wire type, value) of each field of the protobuf message in
    ``data[start:end]``: an int for a varint, (start, end) for a length-delimited field."""
    pos = start
    while pos < end:
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield field, wire, value
        elif wire == 2:
            length, pos = _varint(data, pos)
            yield field, wire, (pos, pos + length)
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {wire}")


def _packed(data, start: int, end: int) -> list[int]:
    values, pos = [], start
    while pos < end:
        value, pos = _varint(data, pos)
        values.append(value)
    return values


def _varint(data, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("protobuf varint too long")


def check_probe_run(path: Path, session) -> None:
    """Two one-token runs of a loaded ModelSession: each must give a row of logits as wide as
    the vocabulary, and a cache that grows by one position (optimum's graphs return it)."""
    from edgespec.runtime.kv_cache import CacheError

    cache = session.new_cache(2)
    try:
        for length in (1, 2):
            token = np.array([0], np.int64)
            if getattr(session, "reads_features", False):  # an EAGLE-3 head: zero features
                features = np.zeros((1, session.feature_size), np.float32)
                logits, _ = session.forward_rows(token, cache, features)  # [1, V]
            else:
                logits = session.forward(token, cache)
            width = session.vocab_size if session.token_ids is None else len(session.token_ids)
            if logits.shape != (1, width):
                _refuse(path, f"gave logits of shape {list(logits.shape)} for one token, not "
                              f"[1, {width}]")
            if cache.length != length:
                _refuse(path, f"has a KV cache of {cache.length} positions after {length} "
                              "tokens")
    except CacheError as e:
        _refuse(path, f"does not grow its KV cache by the tokens fed ({e})")
    except ManifestError:
        raise
    except Exception as e:  # onnxruntime's own errors: a graph that cannot run
        _refuse(path, f"cannot run one token ({one_line(e)})")


def tokenizer_fingerprint(tokenizer) -> dict:
    """What identifies a tokenizers.Tokenizer's vocabulary: its size, and the SHA-256 of its
    (token, id) pairs in id order, added tokens included."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    pairs = sorted(vocab.items(), key=lambda pair: pair[1])
    digest = hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()
    return {"size": len(vocab), "sha256": digest}


def check_tokenizer(path: Path, tokenizer, fingerprint: dict | None) -> None:
    """The tokenizer is the one the package was exported with (``fingerprint`` None: not
    checked, for a Manifest built in code; one read from a file always has it), its normalizer does not multiply text, and
    it encodes and decodes PROBE without a fault (a Rust panic is a BaseException)."""
    if fingerprint is not None:
        found = tokenizer_fingerprint(tokenizer)
        if found["size"] != fingerprint.get("size"):
            _refuse(path, f"has {found['size']} tokens but the package was exported with "
                          f"{fingerprint.get('size')}")
        if found["sha256"] != fingerprint.get("sha256"):
            _refuse(path, "is not the tokenizer the package was exported with (its "
                          "vocabulary differs)")
    try:
        normalizer = tokenizer.normalizer
        if normalizer is not None:
            for text in [*PROBE, PROBE]:  # one character at a time first: a bounded blow-up
                grown = len(normalizer.normalize_str(text))
                if grown > GROWTH * len(text) + 16:
                    _refuse(path, f"has a normalizer that makes {grown} characters of "
                                  f"{len(text)}")
        ids = tokenizer.encode(PROBE, add_special_tokens=False).ids
        tokenizer.decode(ids, skip_special_tokens=False)
    except ManifestError:
        raise
    except BaseException as e:  # a panic in the tokenizers library, or its own errors
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        _refuse(path, f"fails on plain text ({type(e).__name__}: {shown(str(e), 200)})")


def _refuse(path: Path, what: str) -> None:
    raise ManifestError(f"{path} {what}; re-export the pair")
