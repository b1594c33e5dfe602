"""The caches of earlier generations, kept so that the next starts from what it shares with them.

A chat's next prompt is the conversation so far: the last prompt, the reply, a new message. A
generation leaves its target's KV cache and its drafter's state covering its committed text
but the last token (the invariant of kv_cache.py). The next generation takes the kept caches
whose text shares the longest token prefix with its prompt, crops them to that prefix (the one
rollback call, which refuses to crop past what a cache covers) and prefills only the rest, as
llama.cpp's server does with ``cache_prompt``. The kept positions hold the keys and values of
the same tokens at the same positions as a fresh prefill would, so the output is the same:
token for token in greedy decoding, the same distribution (and, for a seed, the same text) in
sampling, up to the float rounding of runs cut at other places.

Kept caches are taken out while a generation uses them, and put back only at a point where
they agree with the text committed so far (between rounds: a finished, stopped or cancelled
generation); a generation that fails part-way, or whose stream is dropped unfinished, never
puts them back. So no two generations share caches, and partial work (a round's rejected
drafts) is never taken for committed text.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from edgespec.config import is_int
from edgespec.errors import ConfigError
from edgespec.runtime.drafters import Drafter
from edgespec.runtime.kv_cache import CacheError, InPlaceKVCache, KVCache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def reusable_length(text: Sequence[int], covered: int, prompt: Sequence[int]) -> int:
    """Positions of a cache computed on ``text`` (its first ``covered`` tokens) that hold for
    ``prompt``: the prefix they share, no more than the cache covers, and never the prompt's
    last token (the cache invariant: a run always feeds at least one token)."""
    return min(common_prefix(text, prompt), covered, len(prompt) - 1)


@dataclass
class KeptCaches:
    """A generation's caches and the text they were computed on."""

    text: list[int]  # the committed text (prompt and generated tokens)
    target: KVCache | InPlaceKVCache  # covers text[:-1]
    drafter: Drafter  # covers a prefix of text[:-1]
    key: tuple  # Drafter.key: the drafter's state goes on only with the same key

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + self.drafter.nbytes


class PrefixCache:
    """Up to ``slots`` kept caches, least recently used dropped first, and no more than
    ``max_bytes`` of memory (None: no cap); ``slots`` 0 keeps nothing.

    ``take`` and ``put`` may come from several threads (a server's worker, a library user's):
    a taken entry belongs to one generation until it is put back. Counts what was reused:
    ``hits`` (generations that reused at least one position), ``misses``, ``reused_tokens``.
    """

    def __init__(self, slots: int = 1, max_bytes: int | None = None):
        if not (is_int(slots) and slots >= 0):
            raise ConfigError(f"prefix_cache_slots must be an integer >= 0 (0 keeps none), "
                              f"got {slots!r}")
        if max_bytes is not None and not (is_int(max_bytes) and max_bytes >= 0):
            raise ConfigError(f"prefix_cache_bytes must be None (no cap) or an integer >= 0, "
                              f"got {max_bytes!r}")
        self.slots, self.max_bytes = slots, max_bytes
        self._entries: list[KeptCaches] = []  # least recently used first
        self._lock = threading.Lock()
        self.hits = self.misses = self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries)

    def take(self, prompt: Sequence[int], key: tuple) -> tuple[KeptCaches | None, int]:
        """The kept caches (drafter of ``key``) that share the most positions with ``prompt``,
        cropped to them and no longer kept, with that number; (None, 0) if none shares any.

        Cropping loses the rest of an entry's text, so one is taken only if it shares at
        least half of what it covers (another conversation's, sharing a system prompt, stays
        for that conversation's next turn), or if it is the one the next ``put`` drops anyway:
        the least recently used of a full store (with one slot, the only one).
        """
        with self._lock:
            best, reused = None, 0
            full = len(self._entries) >= self.slots
            for entry in self._entries:
                n = reusable_length(entry.text, entry.target.length, prompt)
                worth = 2 * n >= entry.target.length or (full and entry is self._entries[0])
                if entry.key == key and worth and n > reused:
                    best, reused = entry, n
            if best is None:
                self.misses += 1
                return None, 0
            self._entries.remove(best)
            self.hits += 1
            self.reused_tokens += reused
        # 1. both caches back to the shared prefix: crop refuses to go past what one covers
        best.target.crop(reused)
        best.drafter.rollback(reused)
        best.text = list(prompt[:reused])
        return best, reused

    def put(self, kept: KeptCaches) -> None:
        """Keep ``kept`` (its caches agree with its text), as the most recently used; drop the
        least recently used while there are more than ``slots`` or more than ``max_bytes``."""
        if kept.target.length > len(kept.text) - 1:
            raise CacheError(f"a cache of {kept.target.length} positions cannot be kept for a "
                             f"text of {len(kept.text)} tokens: it covers every token but the "
                             "last")
        with self._lock:
            self._entries.append(kept)
            while self._entries and (len(self._entries) > self.slots or (
                    self.max_bytes is not None
                    and sum(e.nbytes for e in self._entries) > self.max_bytes)):
                del self._entries[0]

    def clear(self) -> None:
        """Drop every kept cache (a benchmark's cold runs, a test's fresh start)."""
        with self._lock:
            self._entries.clear()
