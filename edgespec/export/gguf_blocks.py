"""GGUF blocks as MatMulNBits blocks: llama.cpp's quantized formats repacked, the same numbers.

**Repacked, not re-quantized** where onnxruntime's MatMulNBits holds the same numbers (``repack``):

    Q4_0  w = d (q - 8)        4 bits, block 32, the default zero point 8
    Q4_1  w = d q + m          4 bits, block 32, scale d, zero point 0, the block's minimum m
    Q4_K  w = d sc q - dmin m  4 bits, blocks of 32 (its sub-blocks), zero point 0, minimums
    Q5_0  w = d (q - 16)       8 bits, block 32, q + 112 against the default zero point 128
    Q5_1  w = d q + m          8 bits, block 32, zero point 0, the block's minimum m
    Q5_K  w = d sc q - dmin m  8 bits, blocks of 32 (its sub-blocks), zero point 0, minimums
    Q8_0  w = d q              8 bits, block 32, q + 128 against the default zero point 128
    Q6_K  w = d sc (q - 32)    8 bits, block 16 (its sub-blocks), q + 96, zero point 128

So every type of the common GGUF mixes (Q4_K_M, Q5_K_M, Q5_0, Q6_K, Q8_0) stays in blocks of
its own size or near it: a 5- or 6-bit value takes a byte (1.25x Q5_0's bytes, 1.2x Q6_K's).
Graphs whose MatMuls compute with int8 activations read 8-bit blocks with MatMulNBits; in
float compute the blocks are dequantized by constant operators that onnxruntime folds when the
session loads (fused.py says why): the file keeps the blocks, the session the same floats.

A block with a minimum is computed as llama.cpp computes it: x . w = d (x . q) + m sum(x), the
MatMulNBits with zero point 0 plus the block sums of x times the minimums (a float MatMul of
K / 32 columns; fused.py). MatMulNBits' float zero points (-m / d) would hold the same numbers,
but onnxruntime's CPU kernel takes a slower path for them. The graph then equals
llama.cpp's dequantization exactly for the types without a minimum, and to float rounding (the
order of a sum) with one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

REPACKED = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q8_0": 8,
            "Q6_K": 8}  # -> MatMulNBits bits
_QK_K = 256  # a K-quant super-block


@dataclass(frozen=True)
class Factors:
    """Per-block floats as a file stores them: ``unit`` float16 ``[N, S]`` (one a super-block of
    B / S blocks) times ``steps`` (uint8 or int8 ``[N, B]``, a K-quant's 6-bit sub-block
    scales or minimums), or ``unit`` alone (``[N, B]``: a block's float16 scale or minimum).

    The float32 value is the product llama.cpp's dequantization takes (float(d) * float(sc)),
    so a graph that stores the factors and multiplies them (folded once, at load) holds the
    same numbers as ``value`` in a third to a sixth of the bytes of float32 per block."""

    unit: np.ndarray
    steps: np.ndarray | None = None

    def value(self) -> np.ndarray:
        """float32 ``[N, B]``."""
        unit = self.unit.astype(np.float32)
        if self.steps is None:
            return unit
        group = self.steps.shape[1] // unit.shape[1]
        return np.repeat(unit, group, axis=1) * self.steps.astype(np.float32)

    def rows(self, ids: np.ndarray) -> "Factors":
        return Factors(np.ascontiguousarray(self.unit[ids]),
                       None if self.steps is None else np.ascontiguousarray(self.steps[ids]))

    @property
    def layout(self) -> tuple:
        return (self.steps is None, None if self.steps is None else self.steps.dtype,
                self.unit.shape[1] if self.steps is None else
                self.steps.shape[1] // self.unit.shape[1])


@dataclass(frozen=True)
class Packed:
    """A weight ``[N, K]`` as MatMulNBits computes with it: ``data`` uint8 ``[N, K / block_size,
    block_size * bits / 8]`` (4 bits: two values a byte, low nibble first), ``scales`` float32
    ``[N, K / block_size]``, ``minimums`` float32 like the scales, or None. Each weight is
    scale * (q - 2^(bits - 1)) (MatMulNBits' default zero point), or with minimums
    scale * q + minimum (zero point 0).

    How the file holds them, for a package that keeps its size: the scales and minimums as
    ``Factors``; 8-bit data whose values take only ``value_bits`` (5 or 6: Q5_*, Q6_K) as
    ``offset`` + a value of that many bits, stored in a 4-bit plane and a plane of the rest
    (fused.py unpacks them with constant operators, folded when the session loads)."""

    bits: int
    block_size: int
    data: np.ndarray
    scale_parts: Factors
    minimum_parts: Factors | None = None
    value_bits: int | None = None  # None: every bit of ``bits`` is used
    offset: int = 0  # data = offset + value

    @property
    def scales(self) -> np.ndarray:
        return self.scale_parts.value()

    @property
    def minimums(self) -> np.ndarray | None:
        return None if self.minimum_parts is None else self.minimum_parts.value()

    @property
    def shape(self) -> tuple[int, int]:
        n, blocks, _ = self.data.shape
        return n, blocks * self.block_size

    @property
    def layout(self) -> tuple:
        """What two weights must share to be stacked into one MatMul (q|k|v, gate|up)."""
        lows = self.minimum_parts
        return (self.bits, self.block_size, self.shape[1], self.value_bits, self.offset,
                self.scale_parts.layout, None if lows is None else lows.layout)

    def rows(self, ids: np.ndarray) -> "Packed":
        """Rows ``ids`` only (an output layer restricted to some tokens; a row permutation)."""
        lows = None if self.minimum_parts is None else self.minimum_parts.rows(ids)
        return replace(self, data=np.ascontiguousarray(self.data[ids]),
                       scale_parts=self.scale_parts.rows(ids), minimum_parts=lows)

    def dequantize(self) -> np.ndarray:
        """float32 ``[N, K]``: what MatMulNBits computes with (the tests' check)."""
        q = self.data
        if self.bits == 4:
            q = np.stack([q & 15, q >> 4], -1).reshape(*q.shape[:2], -1)
        if self.minimums is None:
            w = (q.astype(np.float32) - np.float32(1 << (self.bits - 1))) * self.scales[..., None]
        else:
            w = q.astype(np.float32) * self.scales[..., None] + self.minimums[..., None]
        return w.reshape(self.shape)


def concat(parts: list[Packed]) -> Packed | None:
    """Weights stacked along N (q|k|v, gate|up) if they share one layout, else None."""
    first = parts[0]
    if len({p.layout for p in parts}) > 1:
        return None
    if len(parts) == 1:
        return first
    join = lambda arrays: np.concatenate(arrays)  # noqa: E731
    factors = lambda fs: Factors(join([f.unit for f in fs]),  # noqa: E731
                                 None if fs[0].steps is None else join([f.steps for f in fs]))
    lows = None if first.minimum_parts is None else factors([p.minimum_parts for p in parts])
    return replace(first, data=join([p.data for p in parts]),
                   scale_parts=factors([p.scale_parts for p in parts]), minimum_parts=lows)


def repack(raw: np.ndarray, qtype: str) -> Packed:
    """llama.cpp blocks ``raw`` (uint8 ``[N, bytes a row]``) of type ``qtype`` (one of
    REPACKED) as MatMulNBits blocks holding the same numbers."""
    n = len(raw)
    half = lambda a: a.copy().view(np.float16)[..., 0]  # noqa: E731  (float16 [..., 1] -> [...])
    if qtype in ("Q4_0", "Q4_1"):
        head = 2 if qtype == "Q4_0" else 4
        blocks = raw.reshape(n, -1, head + 16)
        qs = blocks[..., head:]
        q = np.concatenate([qs & 15, qs >> 4], -1)  # [N, B, 32]: low nibbles are the first 16
        lows = None if qtype == "Q4_0" else Factors(half(blocks[..., 2:4]))
        return Packed(4, 32, _pack4(q), Factors(half(blocks[..., :2])), lows)
    if qtype in ("Q5_0", "Q5_1"):
        head = 2 if qtype == "Q5_0" else 4
        blocks = raw.reshape(n, -1, head + 20)
        high = _bits(blocks[..., head:head + 4])  # [N, B, 32]: bit e of qh is value e's 5th bit
        qs = blocks[..., head + 4:]
        q = np.concatenate([qs & 15, qs >> 4], -1) | (high << 4)  # 0..31, in order
        scales = Factors(half(blocks[..., :2]))
        if qtype == "Q5_0":  # q - 16 + 128
            return Packed(8, 32, q + np.uint8(112), scales, value_bits=5, offset=112)
        return Packed(8, 32, q, scales, Factors(half(blocks[..., 2:4])), value_bits=5)
    if qtype == "Q8_0":
        blocks = raw.reshape(n, -1, 34)
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128
        return Packed(8, 32, q.astype(np.uint8), Factors(half(blocks[..., :2])))
    if qtype in ("Q4_K", "Q5_K"):
        size = 144 if qtype == "Q4_K" else 176
        blocks = raw.reshape(n * (raw.shape[1] // size), size)  # super-blocks of 256
        d, dmin = half(blocks[:, 0:2]).reshape(n, -1), half(blocks[:, 2:4]).reshape(n, -1)
        sc, m = _q4k_scale_min(blocks[:, 4:16])  # [S, 8] 6-bit each
        scales = Factors(d, sc.reshape(n, -1))
        lows = Factors(-dmin, m.reshape(n, -1))  # minimum -(dmin m), negated exactly
        qs = blocks[:, size - 128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        q = (qs & 15).reshape(-1, 8, 32)  # sub-block 2c: low nibbles of chunk c, 2c+1: high
        if qtype == "Q4_K":
            return Packed(4, 32, _pack4(q.reshape(n, -1, 32)), scales, lows)
        high = _bits(blocks[:, 16:48])  # [S, 256]: bit j of qh[l] is sub-block j's 5th bit
        q = q | (high.reshape(-1, 32, 8).transpose(0, 2, 1) << 4)
        return Packed(8, 32, q.reshape(n, -1, 32), scales, lows, value_bits=5)
    if qtype == "Q6_K":
        blocks = raw.reshape(-1, 210)
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].copy().view(np.int8)
        d = half(blocks[:, 208:210]).reshape(n, -1)
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 15
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = low.reshape(-1, 2, 4, 32) | (high.reshape(-1, 2, 4, 32) << 4)  # 0..63, in order
        data = (q.reshape(n, -1, 16).astype(np.uint16) + 96).astype(np.uint8)  # q - 32 + 128
        return Packed(8, 16, data, Factors(d, sc.reshape(n, -1)), value_bits=6, offset=96)
    raise ValueError(f"{qtype} is not repacked")


def _bits(packed: np.ndarray) -> np.ndarray:
    """The bits of uint8 ``[..., B]``, least significant first: uint8 ``[..., 8 B]`` of 0/1."""
    return np.unpackbits(packed, axis=-1, bitorder="little")


def _pack4(q: np.ndarray) -> np.ndarray:
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's twelve bytes of 6-bit scales and minimums -> ([S, 8], [S, 8]) (gguf-py's layout)."""
    d, m, m_d = np.split(scales.reshape(-1, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(-1, 8), mn.reshape(-1, 8)


# -- the file -----------------------------------------------------------------------------------
