"""The KV cache: one crop operation, refused past its length, and cached == uncached logits."""

from __future__ import annotations

import numpy as np
import pytest

import edgespec
from edgespec.runtime.kv_cache import KVCache


def filled_cache(length: int) -> KVCache:
    cache = KVCache(["past_key_values.0.key", "past_key_values.0.value"], 2, 4, np.float32)
    present = np.arange(2 * length * 4, dtype=np.float32).reshape(1, 2, length, 4)
    cache.replace([present, present + 1], added=length)
    return cache


def test_new_cache_is_empty_with_graph_shapes():
    cache = KVCache(["past_key_values.0.key"], kv_heads=3, head_dim=5, dtype=np.float16)
    assert cache.length == 0
    assert cache.feeds()["past_key_values.0.key"].shape == (1, 3, 0, 5)


def test_crop_keeps_the_prefix():
    cache = filled_cache(6)
    before = {k: v.copy() for k, v in cache.feeds().items()}
    cache.crop(4)
    assert cache.length == 4
    for name, array in cache.feeds().items():
        np.testing.assert_array_equal(array, before[name][:, :, :4])
    cache.crop(4)  # cropping to the current length changes nothing
    assert cache.length == 4
    cache.crop(0)
    assert cache.length == 0


@pytest.mark.parametrize("length", [7, 100, -1])
def test_crop_past_the_length_is_refused(length):
    cache = filled_cache(6)
    with pytest.raises(ValueError, match="cannot crop a KV cache of length 6"):
        cache.crop(length)
    assert cache.length == 6


def test_replace_checks_the_presents_grew_by_the_fed_tokens():
    cache = filled_cache(3)
    with pytest.raises(AssertionError):
        cache.replace([np.zeros((1, 2, 5, 4), np.float32)] * 2, added=1)


# "llama" has edgespec's fused graph (in-place cache), the others optimum's (copied cache)
GRAPHS = ["llama", "gpt2", "llama_noisy_optimum"]


@pytest.mark.parametrize("pair", GRAPHS)
def test_cached_logits_equal_uncached(packages, pair):
    session = edgespec.load(packages[pair]).target
    ids = np.random.default_rng(0).integers(0, session.vocab_size, size=20)
    uncached = session.forward(ids, session.new_cache())  # [20, V]

    cache = session.new_cache()
    pieces = [session.forward(chunk, cache) for chunk in (ids[:7], ids[7:8], ids[8:13], ids[13:])]
    np.testing.assert_allclose(np.concatenate(pieces), uncached, atol=1e-4)
    assert cache.length == 20


@pytest.mark.parametrize("pair", GRAPHS)
def test_logits_after_a_crop_equal_a_fresh_run(packages, pair):
    """Rollback: run a wrong continuation, crop it away, run the right one."""
    session = edgespec.load(packages[pair]).target
    rng = np.random.default_rng(1)
    prefix, wrong, right = (rng.integers(0, session.vocab_size, size=n) for n in (9, 4, 5))

    cache = session.new_cache()
    session.forward(prefix, cache)
    session.forward(wrong, cache)
    cache.crop(len(prefix))
    after_crop = session.forward(right, cache)

    fresh = session.forward(np.concatenate([prefix, right]), session.new_cache())[-5:]
    np.testing.assert_allclose(after_crop, fresh, atol=1e-4)


def test_the_in_place_cache_rolls_back_by_length_and_refuses_past_it(packages):
    session = edgespec.load(packages["llama"]).target
    cache = session.new_cache()
    assert session.in_place and cache.capacity == 128
    session.forward(np.arange(1, 11), cache)
    buffers = [id(b) for b in cache.buffers]
    cache.crop(4)
    assert cache.length == 4 and [id(b) for b in cache.buffers] == buffers  # nothing copied
    with pytest.raises(ValueError, match="cannot crop a KV cache of length 4 to 5"):
        cache.crop(5)
    with pytest.raises(ValueError, match="KV cache full"):
        session.forward(np.ones(125, dtype=np.int64), cache)
