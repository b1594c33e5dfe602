"""The KV cache: one crop operation, refused past its length, cached == uncached logits, and an
in-place cache that grows to the request without changing them."""

from __future__ import annotations

import numpy as np
import pytest

import edgespec
from edgespec.runtime.kv_cache import CacheError, InPlaceKVCache, KVCache
from edgespec.manifest import LOGITS_TO_KEEP
from edgespec.runtime.session import ModelSession


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
    with pytest.raises(CacheError, match="cannot crop a KV cache of length 6"):
        cache.crop(length)
    assert cache.length == 6


def test_replace_checks_the_presents_grew_by_the_fed_tokens():
    cache = filled_cache(3)
    with pytest.raises(CacheError, match="presents of 5 positions after a past of 3"):
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
    cache = session.new_cache(16)
    assert session.in_place and cache.capacity == 16 and cache.limit == 128
    session.forward(np.arange(1, 11), cache)
    buffers = [id(b) for b in cache.buffers]
    cache.crop(4)
    assert cache.length == 4 and [id(b) for b in cache.buffers] == buffers  # nothing copied
    with pytest.raises(CacheError, match="cannot crop a KV cache of length 4 to 5"):
        cache.crop(5)
    with pytest.raises(CacheError, match="KV cache full: 4 \\+ 125 > 128"):
        session.forward(np.ones(125, dtype=np.int64), cache)
    assert cache.length == 4


def in_place_cache(capacity: int, limit: int = 64) -> InPlaceKVCache:
    names = ["past_key_values.0.key", "past_key_values.0.value"]
    return InPlaceKVCache(names, kv_heads=2, head_dim=4, capacity=capacity, limit=limit,
                          dtype=np.float32, device="cpu")


def test_the_in_place_cache_doubles_and_keeps_what_it_covers():
    cache = in_place_cache(4)
    rng = np.random.default_rng(0)
    for buffer in cache.buffers:  # what a run of 3 tokens would have written
        buffer.numpy()[:, :, :3] = rng.standard_normal((1, 2, 3, 4))
    cache.advance(3)
    before = [b.numpy()[:, :, :3].copy() for b in cache.buffers]
    old = cache.buffers

    cache.reserve(1)  # 4 positions fit: nothing moves
    assert cache.buffers is old and cache.capacity == 4
    cache.reserve(2)  # 5 do not: twice the size
    assert cache.buffers is not old and cache.capacity == 8
    for buffer, expected in zip(cache.buffers, before):
        assert buffer.numpy().shape == (1, 2, 8, 4)
        np.testing.assert_array_equal(buffer.numpy()[:, :, :3], expected)
    cache.reserve(20)  # more than double: what the run needs
    assert cache.capacity == 23
    cache.reserve(61)  # never past the limit
    assert cache.capacity == 64
    with pytest.raises(CacheError, match="KV cache full: 3 \\+ 62 > 64"):
        cache.reserve(62)
    for buffer, expected in zip(cache.buffers, before):
        np.testing.assert_array_equal(buffer.numpy()[:, :, :3], expected)


@pytest.mark.parametrize("capacity", [0, 65])
def test_the_in_place_cache_refuses_a_capacity_outside_its_limit(capacity):
    with pytest.raises(ValueError, match="capacity must be in 1..64"):
        in_place_cache(capacity)


def plain_in_place_run(session: ModelSession, tokens: np.ndarray, cache: InPlaceKVCache):
    """The oracle: the binding built afresh every run, as before it was kept with the cache."""
    start, n = cache.length, len(tokens)
    cache.reserve(n)
    binding = session.session.io_binding()
    binding.bind_output("logits", "cpu")
    binding.bind_cpu_input("input_ids", np.asarray(tokens, dtype=np.int64)[None, :])
    binding.bind_cpu_input("attention_mask", np.ones((1, start + n), dtype=np.int64))
    binding.bind_cpu_input(LOGITS_TO_KEEP, np.zeros(1, np.int64))  # every row
    for past, present, buffer in zip(session.kv_inputs, session.kv_outputs, cache.buffers):
        binding.bind_ortvalue_input(past, buffer)
        binding.bind_ortvalue_output(present, buffer)
    session.session.run_with_iobinding(binding)
    cache.advance(n)
    return binding.get_outputs()[0].numpy()[0, :, : session.vocab_size]


def test_a_kept_binding_gives_the_plain_paths_logits_through_growth_and_rollback(packages):
    session = edgespec.load(packages["llama"]).target
    rng = np.random.default_rng(2)
    chunks = [rng.integers(0, session.vocab_size, size=n) for n in (3, 1, 1, 5, 2, 9, 1, 30)]
    kept, plain = session.new_cache(2), session.new_cache(128)  # kept grows 2 -> ... -> 64
    outputs, expected, bindings = [], [], set()
    for i, chunk in enumerate(chunks):
        outputs.append(session.forward(chunk, kept))
        expected.append(plain_in_place_run(session, chunk, plain))
        bindings.add(id(kept.binding))
        if i % 3 == 2:  # a rejected draft: roll both back by two positions
            kept.crop(kept.length - 2)
            plain.crop(plain.length - 2)
    assert kept.capacity == 64 and kept.length == plain.length
    assert len(bindings) == 1  # one binding for the cache's life, through three growths
    for output, oracle in zip(outputs, expected):  # compared at the end: no run overwrote one
        np.testing.assert_allclose(output, oracle, rtol=0, atol=1e-5)


def spy_on_new_cache(monkeypatch, positions=None) -> list:
    """Record every cache a generation makes; ``positions`` overrides the size it asks for."""
    original, caches = ModelSession.new_cache, []

    def new_cache(session, requested=None):
        caches.append(original(session, positions or requested))
        return caches[-1]

    monkeypatch.setattr(ModelSession, "new_cache", new_cache)
    return caches


@pytest.mark.parametrize("settings", [{"draft_length": 4, "schedule": "fixed"},
                                      {"draft_length": 3, "schedule": "heuristic"},
                                      {"draft_length": 4, "schedule": "fixed", "temperature": 0.8,
                                       "seed": 3},
                                      {"draft_length": 8, "schedule": "adaptive"},
                                      {"drafter": "none"}])
def test_generation_is_the_same_from_a_tiny_cache_that_grows(packages, monkeypatch, settings):
    pipe = edgespec.load(packages["llama_noisy"], prefix_cache_slots=0)  # new caches each time
    pipe.step_costs(8)  # the adaptive schedule's timing runs make caches of their own
    with monkeypatch.context() as m:
        spy_on_new_cache(m, positions=128)  # the declared context, never grown
        whole = pipe.generate("def add(a, b):", max_new_tokens=60, ignore_eos=True, **settings)
    caches = spy_on_new_cache(monkeypatch, positions=1)
    tiny = pipe.generate("def add(a, b):", max_new_tokens=60, ignore_eos=True, **settings)
    assert tiny.token_ids == whole.token_ids and len(tiny.token_ids) == 60
    assert max(c.capacity for c in caches) >= 64  # the target's grew 1 -> 2 -> ... -> 64


def test_decoding_sizes_the_caches_to_the_request(packages, monkeypatch):
    pipe = edgespec.load(packages["llama_noisy"], prefix_cache_slots=0)  # new caches each time
    caches = spy_on_new_cache(monkeypatch)
    prompt = "def add(a, b):"
    pipe.generate(prompt, max_new_tokens=10, draft_length=3, schedule="fixed")
    expected = len(pipe.encode(prompt)) + 10 + 3 + 1  # prompt, new tokens, one round's drafts
    assert [c.capacity for c in caches] == [expected, expected]  # target and draft
    pipe.generate(prompt, max_new_tokens=500, draft_length=3, schedule="fixed")
    assert caches[-1].capacity == pipe.manifest.max_positions  # capped at the context
