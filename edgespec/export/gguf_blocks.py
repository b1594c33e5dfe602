"""GGUF blocks as MatMulNBits blocks: llama.cpp's quantized formats repacked, the same numbers.

**Repacked, not re-quantized** where onnxruntime's MatMulNBits holds the same numbers (``repack``):

    Q4_0  w = d (q - 8)        4 bits, block 32, the default zero point 8
    Q4_1  w = d q + m          4 bits, block 32, scale d, zero point 0, the block's minimum m
    Q4_K  w = d sc q - dmin m  4 bits, blocks of 32 (its sub-blocks), zero point 0, minimums
    Q8_0  w = d q              8 bits, block 32, q + 128 against the default zero point 128
    Q6_K  w = d sc (q - 32)    8 bits, block 16 (its sub-blocks), q + 96, zero point 128

8-bit blocks are handed over only to graphs whose MatMuls compute with int8 activations (a
quantized draft, or a target whose compute the user fixed to int8): in float compute they are
read as floats (fused.py says why), the same numbers.

A block with a minimum is computed as llama.cpp computes it: x . w = d (x . q) + m sum(x), the
MatMulNBits with zero point 0 plus the block sums of x times the minimums (a float MatMul of
K / 32 columns; fused.py). MatMulNBits' float zero points (-m / d) would hold the same numbers,
but onnxruntime 1.32's CPU kernel takes a path about 20x slower for them. The graph then equals
llama.cpp's dequantization exactly for the types without a minimum, and to float rounding (the
order of a sum) with one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

REPACKED = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q6_K": 8}  # -> MatMulNBits bits
_QK_K = 256  # a K-quant super-block


@dataclass(frozen=True)
class Packed:
    """A weight ``[N, K]`` as MatMulNBits stores it: ``data`` uint8 ``[N, K / block_size,
    block_size * bits / 8]`` (4 bits: two values a byte, low nibble first), ``scales`` float32
    ``[N, K / block_size]``, ``minimums`` float32 like the scales, or None. Each weight is
    scale * (q - 2^(bits - 1)) (MatMulNBits' default zero point), or with minimums
    scale * q + minimum (zero point 0)."""

    bits: int
    block_size: int
    data: np.ndarray
    scales: np.ndarray
    minimums: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, blocks, _ = self.data.shape
        return n, blocks * self.block_size

    def rows(self, ids: np.ndarray) -> "Packed":
        """Rows ``ids`` only (an output layer restricted to some tokens; a row permutation)."""
        take = lambda a: None if a is None else np.ascontiguousarray(a[ids])  # noqa: E731
        return Packed(self.bits, self.block_size, take(self.data), take(self.scales),
                      take(self.minimums))

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
    layouts = {(p.bits, p.block_size, p.minimums is None, p.shape[1]) for p in parts}
    if len(layouts) > 1:
        return None
    if len(parts) == 1:
        return first
    lows = None if first.minimums is None else np.concatenate([p.minimums for p in parts])
    return Packed(first.bits, first.block_size, np.concatenate([p.data for p in parts]),
                  np.concatenate([p.scales for p in parts]), lows)


def repack(raw: np.ndarray, qtype: str) -> Packed:
    """llama.cpp blocks ``raw`` (uint8 ``[N, bytes a row]``) of type ``qtype`` (one of
    REPACKED) as MatMulNBits blocks holding the same numbers."""
    n = len(raw)
    half = lambda a: a.view(np.float16).astype(np.float32)[..., 0]  # noqa: E731
    if qtype in ("Q4_0", "Q4_1"):
        head = 2 if qtype == "Q4_0" else 4
        blocks = raw.reshape(n, -1, head + 16)
        d = half(blocks[..., :2].copy())
        qs = blocks[..., head:]
        q = np.concatenate([qs & 15, qs >> 4], -1)  # [N, B, 32]: low nibbles are the first 16
        if qtype == "Q4_0":
            return Packed(4, 32, _pack4(q), d)
        return Packed(4, 32, _pack4(q), d, half(blocks[..., 2:4].copy()))
    if qtype == "Q8_0":
        blocks = raw.reshape(n, -1, 34)
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128
        return Packed(8, 32, q.astype(np.uint8), half(blocks[..., :2].copy()))
    if qtype == "Q4_K":
        blocks = raw.reshape(n * (raw.shape[1] // 144), 144)  # super-blocks of 256
        d, dmin = half(blocks[:, 0:2].copy()), half(blocks[:, 2:4].copy())
        sc, m = _q4k_scale_min(blocks[:, 4:16])  # [S, 8] 6-bit each
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        q = (qs & 15).reshape(n, -1, 32)  # sub-block 2c: low nibbles of chunk c, 2c+1: high
        scale = (d[:, None] * sc.astype(np.float32)).reshape(n, -1)
        minimum = -(dmin[:, None] * m.astype(np.float32)).reshape(n, -1)
        return Packed(4, 32, _pack4(q), scale, minimum)
    if qtype == "Q6_K":
        blocks = raw.reshape(-1, 210)
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        d = half(blocks[:, 208:210].copy())
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 15
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = low.reshape(-1, 2, 4, 32) | (high.reshape(-1, 2, 4, 32) << 4)  # 0..63, in order
        data = (q.reshape(n, -1, 16).astype(np.uint16) + 96).astype(np.uint8)  # q - 32 + 128
        return Packed(8, 16, data, (d[:, None] * sc).reshape(n, -1))
    raise ValueError(f"{qtype} is not repacked")


def _pack4(q: np.ndarray) -> np.ndarray:
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's twelve bytes of 6-bit scales and minimums -> ([S, 8], [S, 8]) (gguf-py's layout)."""
    d, m, m_d = np.split(scales.reshape(-1, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(-1, 8), mn.reshape(-1, 8)


# -- the file -----------------------------------------------------------------------------------
