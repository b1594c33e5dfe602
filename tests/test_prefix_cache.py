"""Kept caches (runtime/prefix_cache.py): a generation that starts from the KV of the last one
gives what a fresh prefill gives, through real onnxruntime sessions; a cache kept one token too
far fails the same check."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import PROMPTS, reuse_mismatches

import edgespec
from edgespec.errors import ConfigError
from edgespec.runtime import prefix_cache
from edgespec.runtime.kv_cache import CacheError, KVCache
from edgespec.runtime.prefix_cache import KeptCaches, PrefixCache, common_prefix
from edgespec.runtime.drafters import NoDrafter

# exact settings: a fixed k that drafts
DRAFTED = dict(draft_length=2, schedule="fixed", max_new_tokens=12)


# ---------------------------------------------------------------------------------------------
# The rule and the store, in NumPy


def test_reusable_length_is_the_common_prefix_short_of_the_prompts_last_token():
    text = [5, 6, 7, 8, 9]  # a cache of 4 positions: text[:-1]
    assert prefix_cache.reusable_length(text, 4, [5, 6, 1, 2]) == 2  # they part at 2
    assert prefix_cache.reusable_length(text, 4, [5, 6, 7, 8, 9, 10]) == 4  # the cache's all
    assert prefix_cache.reusable_length(text, 4, [5, 6, 7]) == 2  # never the prompt's last
    assert prefix_cache.reusable_length(text, 4, [1, 6, 7]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2 and common_prefix([], [1]) == 0


def kept(text: list[int], covered: int, key=("none",), head_dim: int = 1) -> KeptCaches:
    """A cache of ``covered`` positions (4 * head_dim bytes each) kept for ``text``."""
    cache = KVCache(["k"], 1, head_dim, np.float32)
    cache.replace([np.zeros((1, 1, covered, head_dim), np.float32)], added=covered)
    return KeptCaches(list(text), cache, NoDrafter(), key)


def test_the_store_takes_the_longest_shared_prefix_and_crops_it_out_of_the_store():
    store = PrefixCache(slots=2)
    store.put(kept([1, 2, 3, 4], 3))
    store.put(kept([1, 2, 9, 9, 9], 4))
    entry, reused = store.take([1, 2, 9, 9, 5], ("none",))
    assert reused == 4 and entry.target.length == 4 and entry.text == [1, 2, 9, 9]
    assert len(store) == 1  # taken: no other generation gets it meanwhile
    assert store.take([7, 7], ("none",)) == (None, 0)  # shares nothing
    assert store.take([1, 2, 3], ("ngram", 1, 3)) == (None, 0)  # another drafter's state
    assert (store.hits, store.misses, store.reused_tokens) == (1, 2, 4)


def test_another_conversations_caches_stay_for_it():
    """Two conversations sharing a system prompt, taking turns: each next turn takes its own
    caches, not the other's (which would lose all but the shared prefix); with one slot the
    only entry is taken, since the next put drops it anyway."""
    store = PrefixCache(slots=2)
    store.put(kept([1, 2, 3, 4, 5, 6, 7], 6))  # conversation a, system prompt [1, 2]
    entry, reused = store.take([1, 2, 9, 9], ("none",))  # b's first turn
    assert entry is None and len(store) == 1
    store.put(kept([1, 2, 9, 9, 8], 4))
    entry, reused = store.take([1, 2, 3, 4, 5, 6, 7, 0], ("none",))  # a's next turn
    assert reused == 6 and entry.text == [1, 2, 3, 4, 5, 6]
    assert [e.text for e in store._entries] == [[1, 2, 9, 9, 8]]
    single = PrefixCache(slots=1)
    single.put(kept([1, 2, 3, 4, 5, 6, 7], 6))
    assert single.take([1, 2, 9, 9], ("none",))[1] == 2


def test_the_store_drops_the_least_recently_used_past_its_slots_and_bytes():
    store = PrefixCache(slots=2)
    for first in (1, 2, 3):
        store.put(kept([first, 0, 0], 2))
    assert [e.text[0] for e in store._entries] == [2, 3]
    capped = PrefixCache(slots=4, max_bytes=100)
    capped.put(kept([1, 0, 0], 2, head_dim=8))
    capped.put(kept([2, 0, 0], 2, head_dim=8))  # 128 bytes: the first goes
    assert [e.text[0] for e in capped._entries] == [2] and capped.nbytes <= 100
    assert len(PrefixCache(slots=0)) == 0
    nothing = PrefixCache(slots=0)
    nothing.put(kept([1, 0], 1))
    assert len(nothing) == 0
    with pytest.raises(ConfigError, match="prefix_cache_slots"):
        PrefixCache(slots=-1)


def test_a_cache_covering_its_last_token_is_not_kept():
    with pytest.raises(CacheError, match="every token but the last"):
        PrefixCache().put(kept([1, 2, 3], 3))


# ---------------------------------------------------------------------------------------------
# Through real sessions: the same tokens with and without the kept caches


@pytest.fixture(scope="module")
def pairs(packages):
    """Per package, a pipeline that keeps its caches and one that keeps none."""
    return {name: (edgespec.load(packages[name]),
                   edgespec.load(packages[name], prefix_cache_slots=0))
            for name in ("llama_noisy", "llama_noisy_optimum", "gpt2", "llama")}


@pytest.mark.parametrize("pair", ["llama_noisy", "llama_noisy_optimum", "gpt2"])
def test_greedy_output_is_the_same_with_kept_caches(pairs, pair):
    """In-place (fused) and growing (optimum) caches, a draft model at a fixed k = 2."""
    mismatches, reused, drafted = reuse_mismatches(*pairs[pair], PROMPTS, **DRAFTED)
    assert mismatches == []
    assert reused > 0 and drafted > 0


def test_a_cache_kept_one_token_too_far_fails_the_same_check(pairs, monkeypatch):
    """Keeping the first position where the texts part (its key and value are another
    token's) changes the output: the check above can fail."""
    monkeypatch.setattr(prefix_cache, "reusable_length", lambda text, covered, prompt: min(
        common_prefix(text, prompt) + 1, covered, len(prompt) - 1))
    mismatches, _, _ = reuse_mismatches(*pairs["llama_noisy"], PROMPTS, **DRAFTED)
    assert mismatches


def test_a_cache_kept_over_the_prompts_last_token_is_refused(pairs, monkeypatch):
    """Without the cap at the prompt's last token, the same prompt again would start from a
    cache covering all of it: the prefill refuses it (the cache invariant)."""
    monkeypatch.setattr(prefix_cache, "reusable_length", lambda text, covered, prompt: min(
        common_prefix(text, prompt), covered))
    reusing, _ = pairs["llama_noisy"]
    reusing.prefix_cache.clear()
    ids = reusing.encode(PROMPTS[0])
    reusing.generate(ids, **DRAFTED)
    with pytest.raises(CacheError, match="every token but the last"):
        reusing.generate(ids, **DRAFTED)
    reusing.prefix_cache.clear()


def test_padded_runs_keep_the_same_output(pairs):
    """A target exported with min_run_tokens 2 (a lone token padded by a throw-away one,
    cropped again): kept caches never hold the padding."""
    reusing, fresh = pairs["llama"]
    for pipe in (reusing, fresh):
        pipe.target.min_run_tokens = pipe.draft.min_run_tokens = 2
    try:
        mismatches, reused, drafted = reuse_mismatches(reusing, fresh, PROMPTS[:3], **DRAFTED)
    finally:
        for pipe in (reusing, fresh):
            pipe.target.min_run_tokens = pipe.draft.min_run_tokens = 1
    assert mismatches == [] and reused > 0 and drafted > 0


def test_the_ngram_index_follows_the_kept_prefix(pairs):
    mismatches, reused, drafted = reuse_mismatches(*pairs["llama"], PROMPTS, drafter="ngram",
                                                   **DRAFTED)
    assert mismatches == [] and reused > 0 and drafted > 0
    reusing = pairs["llama"][0]
    ids = reusing.encode(PROMPTS[1])
    reusing.prefix_cache.clear()
    reusing.generate(ids, drafter="ngram", **DRAFTED)
    entry, n = reusing.prefix_cache.take([*ids[:-2], 3, 4], ("ngram", 1, 3))
    assert n == len(ids) - 2 and entry.drafter.index.tokens == ids[: len(ids) - 2]


def test_sampling_with_a_seed_gives_the_same_text_with_kept_caches(pairs):
    """Uniforms are keyed by position, and kept positions hold what a prefill computes."""
    settings = dict(DRAFTED, temperature=1.0, seed=3, ignore_eos=True)
    mismatches, reused, drafted = reuse_mismatches(*pairs["llama_noisy"], PROMPTS[:3],
                                                   **settings)
    assert mismatches == [] and reused > 0 and drafted > 0


def test_another_drafter_starts_fresh(pairs):
    reusing, fresh = pairs["llama_noisy"]
    reusing.prefix_cache.clear()
    ids = reusing.encode(PROMPTS[0])
    reusing.generate(ids, **DRAFTED)
    other = reusing.generate(ids, drafter="none", max_new_tokens=12)
    assert other.stats.prompt_tokens_reused == 0
    assert other.token_ids == fresh.generate(ids, drafter="none", max_new_tokens=12).token_ids
    again = reusing.generate(ids, drafter="none", max_new_tokens=12)
    assert again.stats.prompt_tokens_reused == len(ids) - 1


def test_a_cancelled_stream_keeps_only_what_it_committed(pairs):
    """Cancelled after its first piece: the kept text is the prompt and the tokens the loop
    committed (those returned, and the round during which the cancel came, at most k + 1
    tokens), the cache one short of it; a next prompt that goes on past them (the whole
    reply, as if it had finished) reuses no more than was committed."""
    reusing, fresh = pairs["llama_noisy"]
    reusing.prefix_cache.clear()
    ids = reusing.encode(PROMPTS[3])
    settings = dict(DRAFTED, max_new_tokens=40, ignore_eos=True)
    whole = fresh.generate(ids, **settings).token_ids
    stream = reusing.stream(ids, **settings)
    pieces = iter(stream)
    next(pieces)
    stream.cancel()
    list(pieces)
    partial = stream.result.token_ids
    assert stream.result.stats.finish_reason == "cancelled" and len(partial) < len(whole)
    (entry,) = reusing.prefix_cache._entries
    committed = len(entry.text) - len(ids)
    assert entry.text == [*ids, *whole[:committed]] and entry.text[: len(ids)] == ids
    assert len(partial) <= committed <= len(partial) + 3 < len(whole)
    assert entry.text[len(ids) : len(ids) + len(partial)] == partial
    assert entry.target.length == len(entry.text) - 1
    assert entry.drafter.cache.length <= entry.target.length
    follow = [*ids, *whole, *reusing.tokenizer.encode(" and", add_special_tokens=False).ids]
    with_kept = reusing.generate(follow, **DRAFTED)
    assert with_kept.stats.prompt_tokens_reused == len(ids) + committed - 1
    assert with_kept.token_ids == fresh.generate(follow, **DRAFTED).token_ids


def test_a_failed_generation_keeps_nothing(pairs, monkeypatch):
    reusing, _ = pairs["llama_noisy"]
    reusing.prefix_cache.clear()
    ids = reusing.encode(PROMPTS[0])
    reusing.generate(ids, **DRAFTED)
    assert len(reusing.prefix_cache) == 1
    calls = []

    def failing(tokens, cache, features=None, keep=0):
        calls.append(len(tokens))
        if len(calls) == 2:  # the first round, after the prefill moved the caches on
            raise RuntimeError("a run failed")
        return type(reusing.target).forward_rows(reusing.target, tokens, cache, features,
                                                 keep=keep)

    monkeypatch.setattr(reusing.target, "forward_rows", failing)
    with pytest.raises(RuntimeError, match="a run failed"):
        reusing.generate([*ids, 5, 6], **DRAFTED)
    assert len(reusing.prefix_cache) == 0  # taken, never put back


def test_concurrent_generations_never_share_caches(pairs):
    """Two conversations on one pipeline from two threads: each generation takes kept caches
    alone (or new ones), so every answer is the one a pipeline keeping none gives."""
    reusing, fresh = pairs["llama_noisy"]
    more = fresh.tokenizer.encode(" and then", add_special_tokens=False).ids

    def turns(prompt: str) -> list[tuple[list[int], list[int]]]:
        ids, said = fresh.encode(prompt), []
        for _ in range(3):
            out = fresh.generate(ids, **DRAFTED).token_ids
            said.append((ids, out))
            ids = [*ids, *out, *more]
        return said

    expected = {prompt: turns(prompt) for prompt in PROMPTS[:3]}
    got: dict[str, list] = {prompt: [] for prompt in expected}

    def converse(prompt: str) -> None:
        for ids, _ in expected[prompt]:
            got[prompt].append(reusing.generate(ids, **DRAFTED).token_ids)

    reusing.prefix_cache.clear()
    threads = [threading.Thread(target=converse, args=(p,), daemon=True) for p in expected]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert got == {prompt: [out for _, out in said] for prompt, said in expected.items()}
