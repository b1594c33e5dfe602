"""Smaller or faster graphs after export: fp16 compute, int8/int4 weights, exact bf16/fp16 storage.

Every variant is validated against PyTorch afterwards (``validate.py``) with the tolerance of
its kind, and the measured deviation goes into the manifest.

Quantization is weight-only (onnxruntime's MatMulNBits, block-wise, symmetric): the fused
builder quantizes each weight as it writes it (``quantize_blocks``, the bytes onnxruntime's
quantizer would make), optimum's graphs go through onnxruntime's quantizer (``quantize_weights``).
Activations are kept in float32 between operators, and quantized, when at all, row by row inside
a MatMulNBits, so a row of logits does not depend on the other tokens of its run. Dynamic int8
quantization (``quantize_dynamic``) quantizes activations with one scale per tensor, which
makes a token's logits depend on the other tokens of the same run: the target's verify run and
a plain target step would then disagree, and speculative output would no longer equal
target-only output.

A draft's MatMulNBits compute with int8 activations (``accuracy_level`` 4, the level
onnxruntime-genai's builder is given for CPU int4 models): onnxruntime then uses its integer
dot-product kernels (VNNI, ARM SDOT) instead of unpacking every weight to float32 per run
(benchmarks/RESULTS.md has the step costs). A target's
compute is chosen at export with the shape of its runs (runs.py): int8 activations round a
one-token run differently from a longer one (by up to 5e-2 of a logit), so an int8 target
always runs at least two tokens, and rows of runs of two tokens or more are bit-identical.
A draft's logits only move its acceptance (a sampled draft runs one token at a time, except to
catch up after a round that drafted nothing).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec.export.onnx_io import save_model

QUANT_BLOCK_SIZE = 32
DRAFT_BLOCK_SIZES = (128, 64, QUANT_BLOCK_SIZE)  # draft_block_size
INT8_COMPUTE = 4  # MatMulNBits accuracy_level: int8 activations, integer dot products
_MIN_WEIGHT_SIZE = 1024  # smaller constants are not worth a Cast node


def store_exact_halves(folder: Path) -> dict[str, int]:
    """Store float32 weights that are exactly bf16 or fp16 values in that type, with a Cast back.

    For graphs written by optimum, which upcasts every weight: lossless, since only weights
    whose every value survives the round trip are converted, and onnxruntime folds each Cast
    into a float32 weight when the session loads, so the graph computes exactly as before.
    A checkpoint saved in bf16 or fp16 gets back to its own size this way. After int8
    quantization it keeps the embedding table, which stays float32 for the Gather, at its
    checkpoint's size; quantized operators' scales stay float32 initializers, as their kernels
    prepack them. Returns the number of float weights per stored type.
    """
    from onnx import TensorProto, helper, numpy_helper

    model = _load(folder)
    counts = {"float": 0, "bfloat16": 0, "float16": 0}
    casts = []
    quantized_inputs = {name for node in model.graph.node
                        if node.op_type in ("MatMulNBits", "GatherBlockQuantized")
                        for name in node.input}
    for init in model.graph.initializer:
        if init.data_type != TensorProto.FLOAT or init.name in quantized_inputs:
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


def quantize_weights(folder: Path, bits: int, int8_compute: bool = False) -> None:
    """Block-wise symmetric weight-only quantization of every MatMul and the embedding table,
    with onnxruntime's quantizer, for graphs written by optimum (the fused builder quantizes as
    it writes: ``quantize_blocks``).

    MatMuls become MatMulNBits, the embedding Gather becomes GatherBlockQuantized (blocks along
    the hidden axis): an int4 package holds no full-precision copy of the vocabulary.
    int8_compute: the MatMuls compute with int8 activations (drafts only; see above).
    """
    from edgespec.export.graph import quiet

    log = "onnxruntime.quantization.matmul_nbits_quantizer"
    with quiet(log):  # it logs every node at INFO, and configures the root logger on import
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        _load(folder), bits=bits, block_size=QUANT_BLOCK_SIZE, is_symmetric=True,
        accuracy_level=INT8_COMPUTE if int8_compute else None,
        # the embedding table too, in int4 (onnxruntime quantizes a Gather to 4 bits only)
        op_types_to_quantize=("MatMul", "Gather") if bits == 4 else ("MatMul",),
    )
    with quiet(log), np.errstate(divide="ignore", invalid="ignore"):  # all-zero blocks: scale 0
        quantizer.process()
    _save(quantizer.model.model, folder)


def draft_block_size(config) -> int:
    """The block a draft's int4 weights are quantized in: the widest of DRAFT_BLOCK_SIZES that
    divides the inputs of all its matrices. A draft's precision moves acceptance, never the
    output, and a wider block carries fewer scales: onnxruntime's int8-compute kernels read a
    4-bit weight in blocks of 32 as 6 bits (a float scale and a float block sum a block), in
    blocks of 128 as 4.5 (benchmarks/RESULTS-archive.md, "The real pair again": Qwen2.5-Coder-0.5B's
    draft is 13% smaller for the same acceptance)."""
    from edgespec.export.families import head_dim_of

    heads = config.num_attention_heads * head_dim_of(config)  # o_proj's input
    inputs = (config.hidden_size, heads, getattr(config, "intermediate_size", 0))
    return next((b for b in DRAFT_BLOCK_SIZES if all(k % b == 0 for k in inputs)),
                QUANT_BLOCK_SIZE)


def quantize_blocks(weight, bits: int, rows: int = 256, block_size: int = QUANT_BLOCK_SIZE
                    ) -> tuple[np.ndarray, np.ndarray]:
    """A Linear weight ``[N, K]`` (torch, any float type) as MatMulNBits stores it: the bytes
    ``[N, K/B, B * bits / 8]`` (uint8) and the scales ``[N, K/B]`` (float32), B = block_size.

    Bit for bit what onnxruntime's MatMulNBitsQuantizer makes of W^T with that block_size and
    is_symmetric (MLAS's BlockwiseQuantizer, read in its source and checked by the tests):
    per block of B inputs of one output, m = the value of largest magnitude (the negative one
    on a tie), scale = -m / 2^(bits-1), q = clamp(roundf(w * (1 / scale) + 2^(bits-1)), 0,
    2^bits - 1) in float32 (roundf: halves away from zero), two 4-bit values a byte, low
    nibble first. The default zero point of MatMulNBits and GatherBlockQuantized (8 or 128)
    undoes the bias. K is padded to a whole block as the quantizer pads it (zeros, whose
    bytes stay 0).
    ``rows`` outputs at a time bound the float32 temporaries. One thread: on small chunks of
    element-wise work a second OpenMP thread mostly waits, and on a busy machine its spinning
    slows a large layer several times over.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _quantize_blocks(weight, bits, rows, block_size)
    finally:
        torch.set_num_threads(threads)


def _quantize_blocks(weight, bits: int, rows: int, block: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    import torch

    n, k = weight.shape
    blocks = -(-k // block)
    kept = -(-(k % block) * bits // 8)  # bytes of a partial last block that hold weights
    half = float(1 << (bits - 1))
    packed = torch.empty((n, blocks, block * bits // 8), dtype=torch.uint8)
    scales = torch.empty((n, blocks), dtype=torch.float32)
    for start in range(0, n, rows):
        x = weight[start : start + rows].float()
        if k % block:
            x = torch.nn.functional.pad(x, (0, blocks * block - k))
        x = x.reshape(len(x), blocks, block)
        high, low = x.amax(-1), x.amin(-1)
        scale = torch.where(high.abs() > low.abs(), high, low).neg_().div_(half)
        reciprocal = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
        x.mul_(reciprocal[..., None]).add_(half)
        whole = torch.floor(x)
        up = x.sub_(whole).ge_(0.5)  # roundf: a fraction of a half or more rounds up
        q = whole.add_(up).clamp_(0, 2 * half - 1).to(torch.uint8)
        if bits == 4:
            q = q[..., 0::2] | (q[..., 1::2] << 4)
        if kept:  # the padding's bytes stay 0, as the quantizer leaves them
            q[:, -1, kept:] = 0
        packed[start : start + rows] = q
        scales[start : start + rows] = scale
    return packed.numpy(), scales.numpy()


def _load(folder: Path):
    import onnx

    return onnx.load(str(folder / "model.onnx"))


def _save(model, folder: Path) -> None:
    save_model(model, folder)

