"""The key/value cache of one model, and its single rollback operation.

Invariant kept by the decoding loops (``speculative.py``): the cache covers a prefix of the
committed tokens that never includes the last one, so every run feeds at least one token and
gets logits for what comes next. For the target the prefix is exactly ``committed[:-1]``; the
draft may be one token further behind after a round in which every draft token was accepted
(it never ran on the last draft token), and catches up on its next run. llama.cpp and
transformers' assisted decoding keep the same "all but the last token" shape.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    """Per-layer key and value arrays ``[1, kv_heads, length, head_dim]``, in graph input order."""

    def __init__(self, names: list[str], kv_heads: int, head_dim: int, dtype: np.dtype):
        self.names = names
        empty = np.zeros((1, kv_heads, 0, head_dim), dtype=dtype)
        self._arrays = [empty] * len(names)

    @property
    def length(self) -> int:
        """Number of token positions the cache covers."""
        return self._arrays[0].shape[2]

    def feeds(self) -> dict[str, np.ndarray]:
        """The past_key_values inputs for the next run."""
        return dict(zip(self.names, self._arrays))

    def replace(self, presents: list[np.ndarray], added: int) -> None:
        """Take the graph's present outputs after a run that fed ``added`` new tokens."""
        expected = self.length + added
        assert all(p.shape[2] == expected for p in presents), "present length != past + fed"
        self._arrays = presents

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on: the only way the cache shrinks.

        Raises instead of returning a cache that would give wrong logits when asked to keep
        more positions than it has.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a KV cache of length {self.length} to {length}")
        if length < self.length:
            self._arrays = [a[:, :, :length] for a in self._arrays]


class InPlaceKVCache:
    """Preallocated per-layer buffers ``[1, kv_heads, max_positions, head_dim]``, updated in place.

    For graphs whose attention writes new keys and values into the buffer it reads the past
    from (GroupQueryAttention, in fused graphs): the session binds each buffer as both past
    input and present output, so a run copies nothing, and a rollback only changes ``length``:
    positions past it are ignored by attention and overwritten by the next run. On a GPU the
    buffers live in device memory and never travel to the host.
    """

    def __init__(self, names: list[str], kv_heads: int, head_dim: int, max_positions: int,
                 dtype: np.dtype, device: str):
        from onnxruntime import OrtValue

        self.names = names
        self.capacity = max_positions
        shape = [1, kv_heads, max_positions, head_dim]
        self.buffers = [OrtValue.ortvalue_from_shape_and_type(shape, dtype, device) for _ in names]
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def check_room(self, added: int) -> None:
        """Refuse a run that would write past the end of the buffers."""
        if self._length + added > self.capacity:
            raise ValueError(f"KV cache full: {self._length} + {added} > {self.capacity} positions")

    def advance(self, added: int) -> None:
        """Record that a run wrote ``added`` more positions into the buffers."""
        self._length += added

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (see KVCache.crop)."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot crop a KV cache of length {self._length} to {length}")
        self._length = length
