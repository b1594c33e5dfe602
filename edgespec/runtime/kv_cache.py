"""The key/value cache of one model, and its single rollback operation.

Invariant kept by the decoding loops (``speculative.py``): the cache covers a prefix of the
committed tokens that never includes the last one, so every run feeds at least one token and
gets logits for what comes next. For the target the prefix is exactly ``committed[:-1]``; the
draft's may be shorter (in greedy decoding it skips the last draft token of a fully accepted
round and every k = 0 round), and it catches up on its next run by feeding what it lacks.
llama.cpp and
transformers' assisted decoding keep the same "all but the last token" shape.
"""

from __future__ import annotations

import numpy as np


class CacheError(RuntimeError):
    """A cache and the tokens it should cover disagree: a bug in edgespec, never bad input.

    Raised, not asserted, so that the check holds under ``python -O`` too.
    """


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

    @property
    def nbytes(self) -> int:
        """Memory the arrays hold (a kept cache counts against prefix_cache.py's cap)."""
        return sum(a.nbytes for a in self._arrays)

    def feeds(self) -> dict[str, np.ndarray]:
        """The past_key_values inputs for the next run."""
        return dict(zip(self.names, self._arrays))

    def replace(self, presents: list[np.ndarray], added: int) -> None:
        """Take the graph's present outputs after a run that fed ``added`` new tokens."""
        expected = self.length + added
        if any(p.shape[2] != expected for p in presents):
            raise CacheError(f"the graph returned presents of {presents[0].shape[2]} positions "
                             f"after a past of {self.length} and {added} fed tokens")
        self._arrays = presents

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on: the only way the cache shrinks.

        Raises instead of returning a cache that would give wrong logits when asked to keep
        more positions than it has.
        """
        if not 0 <= length <= self.length:
            raise CacheError(f"cannot crop a KV cache of length {self.length} to {length}")
        if length < self.length:
            self._arrays = [a[:, :, :length] for a in self._arrays]


class InPlaceKVCache:
    """Per-layer buffers ``[1, kv_heads, capacity, head_dim]``, updated in place, grown on demand.

    For graphs whose attention writes new keys and values into the buffer it reads the past
    from (GroupQueryAttention, in fused graphs): the session binds each buffer as both past
    input and present output, so a run copies nothing, and a rollback only changes ``length``:
    positions past it are ignored by attention and overwritten by the next run. On a GPU the
    buffers live in device memory and never travel to the host.

    The buffers start at ``capacity`` positions, what the request needs (prompt, new tokens and
    one round's drafts), not the model's whole context: a 32,768-position Qwen2.5 would
    otherwise hold 0.8-1.9 GB per model whatever it generates. A run that would pass the end
    grows them (``reserve``) to twice the size, or what the run needs if more, never past
    ``limit`` (the manifest's ``max_positions``), which stays the hard limit.
    """

    def __init__(self, names: list[str], kv_heads: int, head_dim: int, capacity: int,
                 limit: int, dtype: np.dtype, device: str):
        from onnxruntime import OrtValue

        if not 0 < capacity <= limit:
            raise ValueError(f"KV cache capacity must be in 1..{limit} positions, got {capacity}")
        self.names, self.limit = names, limit
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        self.capacity = capacity
        shape = [1, kv_heads, capacity, head_dim]
        self.buffers = [OrtValue.ortvalue_from_shape_and_type(shape, dtype, device) for _ in names]
        self.binding = None  # the session's IO binding for these buffers (session.py), reused
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        """Memory the buffers hold, all ``capacity`` positions of them."""
        itemsize = np.dtype(self.dtype).itemsize
        return len(self.buffers) * self.kv_heads * self.capacity * self.head_dim * itemsize

    def reserve(self, added: int) -> None:
        """Make room for ``added`` more positions, growing the buffers if needed.

        Refuses a run that would pass ``limit``. Growth replaces ``buffers`` (a new list), so
        whoever bound the old ones must bind them again.
        """
        needed = self._length + added
        if needed > self.limit:
            raise CacheError(f"KV cache full: {self._length} + {added} > {self.limit} positions")
        if needed > self.capacity:
            self._grow(min(self.limit, max(needed, 2 * self.capacity)))

    def _grow(self, capacity: int) -> None:
        """New buffers of ``capacity`` positions holding the covered prefix of the old ones.

        Goes through host memory: ``numpy()`` of a CPU OrtValue is a view, of a CUDA one a copy
        to the host, and ``ortvalue_from_numpy`` copies to the device. A device-to-device copy
        would spare the round trip on a GPU; growth is rare (doubling) so it is not worth a
        provider-specific path yet.
        """
        from onnxruntime import OrtValue

        shape = (1, self.kv_heads, capacity, self.head_dim)
        grown = []
        for old in self.buffers:
            host = np.empty(shape, dtype=self.dtype)
            host[:, :, : self._length] = old.numpy()[:, :, : self._length]
            grown.append(OrtValue.ortvalue_from_numpy(host, self.device, 0))
        self.buffers, self.capacity = grown, capacity

    def advance(self, added: int) -> None:
        """Record that a run wrote ``added`` more positions into the buffers."""
        self._length += added

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (see KVCache.crop)."""
        if not 0 <= length <= self._length:
            raise CacheError(f"cannot crop a KV cache of length {self._length} to {length}")
        self._length = length
