"""Smaller or faster graphs after export: fp16 compute, int8/int4 weights, exact fp16 storage.

Every variant is validated against PyTorch afterwards (``validate.py``) with the tolerance of
its kind, and the measured deviation goes into the manifest.

Quantization is weight-only (onnxruntime's MatMulNBits, block-wise, symmetric): activations
stay in float32, so each row of logits is computed the same way whether a run holds one token
or k+1. Dynamic int8 quantization (``quantize_dynamic``) quantizes activations with one scale
per tensor, which makes a token's logits depend on the other tokens of the same run: the
target's verify run and a plain target step would then disagree, and speculative output would
no longer equal target-only output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec.export.onnx_io import save_model

DTYPES = ("fp32", "fp16")
QUANTIZATIONS = ("int8", "int4")
QUANT_BLOCK_SIZE = 32
_MIN_WEIGHT_SIZE = 1024  # smaller constants are not worth a Cast node


def store_exact_fp16(folder: Path) -> int:
    """Store float32 weights that are exactly float16 values as float16, with a Cast back.

    Lossless: only weights whose every value survives the round trip are converted, and
    onnxruntime folds each Cast into a float32 weight when the session loads, so the graph
    computes exactly as before. Checkpoints saved in fp16 halve their package size this way.
    Returns the number of weights converted.
    """
    import onnx
    from onnx import helper, numpy_helper

    model = _load(folder)
    casts = []
    for init in model.graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT or _size(init) < _MIN_WEIGHT_SIZE:
            continue
        weights = numpy_helper.to_array(init)
        half = weights.astype(np.float16)
        if not np.array_equal(half.astype(np.float32), weights, equal_nan=True):
            continue
        name = init.name
        init.CopyFrom(numpy_helper.from_array(half, f"{name}.fp16"))
        casts.append(helper.make_node("Cast", [f"{name}.fp16"], [name], to=onnx.TensorProto.FLOAT))
    if casts:
        nodes = [*casts, *model.graph.node]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        _save(model, folder)
    return len(casts)


def convert_fp16(folder: Path) -> None:
    """Compute in float16 (for GPUs): weights, activations, KV cache and logits."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    _save(convert_float_to_float16(_load(folder), keep_io_types=False), folder)


def quantize_weights(folder: Path, bits: int) -> None:
    """Block-wise symmetric weight-only quantization of every MatMul (MatMulNBits)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        _load(folder), bits=bits, block_size=QUANT_BLOCK_SIZE, is_symmetric=True
    )
    quantizer.process()
    _save(quantizer.model.model, folder)


def _load(folder: Path):
    import onnx

    return onnx.load(str(folder / "model.onnx"))


def _save(model, folder: Path) -> None:
    save_model(model, folder)


def _size(init) -> int:
    return int(np.prod(init.dims)) if init.dims else 1
