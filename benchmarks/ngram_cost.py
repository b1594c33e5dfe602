"""What the n-gram drafter's lookup costs per round, at contexts of thousands of tokens.

A round of n-gram drafting (runtime/drafters.py) asks the index for up to k proposals (each a
fresh lookup after appending the previous draft), and after verification rolls the drafts back
and appends what was committed. The index is updated incrementally, so the cost should not
grow with the context; a scan of the whole text per lookup (as transformers' prompt lookup
unfolds the sequence every step) is timed beside it for scale.

    python benchmarks/ngram_cost.py                       # contexts 512..8192, k = 8
    python benchmarks/ngram_cost.py --contexts 4096 --k 4 --rounds 2000
    python benchmarks/ngram_cost.py --memory 100000      # the index's memory and build time

``--memory N`` builds the index (n = 1..3) of N tokens of hostile and ordinary kinds: one token
repeated N times, random ids from a 49,152-token vocabulary (every n-gram new: the most keys),
and the copied-spans text; it prints the seconds, the bytes tracemalloc counts and the bytes
per (token, n) entry that drafters.INDEX_BYTES_PER_ENTRY should cover.

Text: random ids from a 4096-token vocabulary with copied spans (a quarter of the text repeats
earlier stretches), so lookups both match and miss.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from edgespec.config import SamplingConfig
from edgespec.runtime.drafters import NgramDrafter
from edgespec.runtime.stats import GenerationStats


def make_text(n: int, vocab: int, rng: np.random.Generator) -> list[int]:
    text = rng.integers(0, vocab, size=n).tolist()
    for _ in range(n // 64):  # copied spans of 16 tokens: a quarter of the text
        src, dst = rng.integers(0, n - 16, size=2)
        text[dst : dst + 16] = text[src : src + 16]
    return text


def scan_lookup(tokens: list[int], min_n: int, max_n: int) -> int | None:
    """The lookup by scanning the whole text (longest suffix, latest occurrence)."""
    arr = np.asarray(tokens)
    for n in range(max_n, min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # ends before the last
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if len(hits):
            return int(arr[hits[-1] + n])
    return None


def measure(context: int, k: int, rounds: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    text = make_text(context + rounds * (k + 1), 4096, rng)
    stats = GenerationStats(speculative=True)
    drafter = NgramDrafter(1, 3, stats)
    start = time.perf_counter()
    drafter.prefill(text[:context])
    prefill_s = time.perf_counter() - start
    greedy = SamplingConfig()
    times, proposed, scans = [], 0, []
    length = context
    for r in range(rounds):
        committed = text[:length]
        start = time.perf_counter()
        drafted = drafter.propose(committed, k, greedy, None).tokens
        middle = time.perf_counter()
        # as verification would: keep the drafts that match the text (untimed), roll back
        kept = next((i for i, t in enumerate(drafted) if t != text[length + i]), len(drafted))
        end = time.perf_counter()
        drafter.rollback(length + kept)
        times.append(middle - start + time.perf_counter() - end)
        proposed += len(drafted)
        if r < 50:
            start = time.perf_counter()
            scan_lookup(committed, 1, 3)
            scans.append(time.perf_counter() - start)
        length += kept + 1
    return {
        "context": context,
        "prefill_ms": 1e3 * prefill_s,
        "round_us": 1e6 * statistics.fmean(times),  # rounds differ: a miss is one lookup
        "proposed_per_round": proposed / rounds,
        "us_per_lookup": 1e6 * stats.draft_s / stats.draft_calls,
        "scan_lookup_us": 1e6 * statistics.median(scans),
    }


def memory(n: int) -> None:
    import tracemalloc

    from edgespec.runtime.drafters import INDEX_BYTES_PER_ENTRY, NgramIndex

    rng = np.random.default_rng(0)
    texts = {"one token repeated": [7] * n,
             "random, 49k vocabulary": rng.integers(0, 49152, size=n).tolist(),
             "copied spans, 4k vocabulary": make_text(n, 4096, rng)}
    print(f"{'text':>28} {'tokens':>7} {'build s':>7} {'MB':>6} {'B/entry':>7} "
          f"(INDEX_BYTES_PER_ENTRY {INDEX_BYTES_PER_ENTRY})")
    for name, text in texts.items():
        tracemalloc.start()
        index, start = NgramIndex(1, 3), time.perf_counter()
        index.extend(text)
        seconds = time.perf_counter() - start
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        print(f"{name:>28} {n:>7} {seconds:>7.2f} {held / 1e6:>6.1f} {held / (3 * n):>7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="512,1024,4096,8192")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--memory", type=int, metavar="N")
    args = parser.parse_args()
    if args.memory:
        memory(args.memory)
        return
    print(f"{'context':>8} {'prefill ms':>10} {'round us':>9} {'proposed':>8} "
          f"{'us/lookup':>9} {'scan us/lookup':>14}")
    for context in (int(c) for c in args.contexts.split(",")):
        m = measure(context, args.k, args.rounds)
        print(f"{m['context']:>8} {m['prefill_ms']:>10.2f} {m['round_us']:>9.1f} "
              f"{m['proposed_per_round']:>8.2f} {m['us_per_lookup']:>9.2f} "
              f"{m['scan_lookup_us']:>14.1f}")


if __name__ == "__main__":
    main()
