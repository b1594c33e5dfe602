"""Smaller or faster graphs after export: fp16 compute, int8/int4 weights, exact bf16/fp16 storage.

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

from edgespec.config import EXPORT_DTYPES, EXPORT_QUANTIZATIONS
from edgespec.export.onnx_io import save_model

DTYPES = EXPORT_DTYPES
QUANTIZATIONS = EXPORT_QUANTIZATIONS
QUANT_BLOCK_SIZE = 32
_MIN_WEIGHT_SIZE = 1024  # smaller constants are not worth a Cast node


def store_exact_halves(folder: Path) -> dict[str, int]:
    """Store float32 weights that are exactly bf16 or fp16 values in that type, with a Cast back.

    For graphs written by optimum, which upcasts every weight: lossless, since only weights
    whose every value survives the round trip are converted, and onnxruntime folds each Cast
    into a float32 weight when the session loads, so the graph computes exactly as before.
    A checkpoint saved in bf16 or fp16 gets back to its own size this way. Returns the number
    of float weights per stored type.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = _load(folder)
    counts = {"float": 0, "bfloat16": 0, "float16": 0}
    casts = []
    for init in model.graph.initializer:
        if init.data_type != TensorProto.FLOAT:
            continue
        weights = numpy_helper.to_array(init)
        half = _exact_half(weights) if weights.size >= _MIN_WEIGHT_SIZE else None
        if half is None:
            counts["float"] += 1
            continue
        raw, data_type, tag = half
        name = init.name
        stored = TensorProto(name=f"{name}.{tag}", data_type=data_type, dims=init.dims,
                             raw_data=raw)
        init.CopyFrom(stored)
        counts[TensorProto.DataType.Name(data_type).lower()] += 1
        casts.append(helper.make_node("Cast", [stored.name], [name], to=TensorProto.FLOAT))
    if casts:
        nodes = [*casts, *model.graph.node]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        _save(model, folder)
    return {k: v for k, v in counts.items() if v}


def _exact_half(weights: np.ndarray) -> tuple[bytes, int, str] | None:
    """(bytes, type, tag) of the weights as fp16 or bf16 if either holds them exactly."""
    from onnx import TensorProto

    half = weights.astype(np.float16)
    if np.array_equal(half.astype(np.float32), weights, equal_nan=True):
        return half.tobytes(), TensorProto.FLOAT16, "fp16"
    bits = np.ascontiguousarray(weights).view(np.uint32)
    if not (bits & 0xFFFF).any():  # the low half of every float32 is zero: exact bf16
        return (bits >> 16).astype(np.uint16).tobytes(), TensorProto.BFLOAT16, "bf16"
    return None


def convert_fp16(folder: Path) -> None:
    """Compute in float16 (for GPUs): weights, activations, KV cache and logits."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    _save(convert_float_to_float16(_load(folder), keep_io_types=False), folder)


def quantize_weights(folder: Path, bits: int) -> None:
    """Block-wise symmetric weight-only quantization of every MatMul and the embedding table.

    MatMuls become MatMulNBits, the embedding Gather becomes GatherBlockQuantized (blocks along
    the hidden axis): an int4 package holds no full-precision copy of the vocabulary.
    """
    from edgespec.export.graph import quiet

    log = "onnxruntime.quantization.matmul_nbits_quantizer"
    with quiet(log):  # it logs every node at INFO, and configures the root logger on import
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        _load(folder), bits=bits, block_size=QUANT_BLOCK_SIZE, is_symmetric=True,
        op_types_to_quantize=("MatMul", "Gather"),  # the embedding table too
    )
    with quiet(log), np.errstate(divide="ignore", invalid="ignore"):  # all-zero blocks: scale 0
        quantizer.process()
    _save(quantizer.model.model, folder)


def _load(folder: Path):
    import onnx

    return onnx.load(str(folder / "model.onnx"))


def _save(model, folder: Path) -> None:
    save_model(model, folder)


def _size(init) -> int:
    return int(np.prod(init.dims)) if init.dims else 1
