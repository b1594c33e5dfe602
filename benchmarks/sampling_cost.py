"""What one speculative round's sampling costs in NumPy, at a large vocabulary.

Times the sampling work of a whole round, draft rows and verification, without the models:
``speculative_round`` runs on fake decoders that hand out prepared float32 logits (as
onnxruntime does), and the round's own timer (``stats.sampling_s``) gives its sampling time.
The reference is the dense path the loop used before: ``process_logits`` on each draft row and
``sample``, then ``process_logits`` on the k+1 target rows and ``verify``.

Logits: normal(0, 1) * 3 per token, a quarter of the rows peaked (one token +12). Three cases:
"independent", the target's rows unrelated to the draft's (the round usually ends at its first
drafted token); "related", the target's rows the draft's plus normal(0, 0.5) noise (about 4 of
k = 8 drafts accepted); "agreeing", the same rows for both (every draft token accepted: all
k+1 target rows read, and for sampling the draft's extra row at position k: the most work a
round can do). Medians over repeats; other work on the machine shows as noise, so run it twice.

    python benchmarks/sampling_cost.py                      # V = 151,936 and 256,000, k = 8
    python benchmarks/sampling_cost.py --vocab 151936 --repeats 400 --reference-repeats 0
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from edgespec.config import SamplingConfig
from edgespec.runtime.acceptance import PositionUniforms

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from reference import process_logits, sample, verify  # noqa: E402  the tests' dense oracle
from edgespec.runtime.drafters import ModelDrafter
from edgespec.runtime.speculative import TargetRunner, speculative_round
from edgespec.runtime.stats import GenerationStats

SETTINGS = {
    "greedy": SamplingConfig(temperature=0.0),
    "T=0.7 top-p 0.9": SamplingConfig(temperature=0.7, top_p=0.9),
    "T=1": SamplingConfig(temperature=1.0),
    "T=0.8 top-k 50": SamplingConfig(temperature=0.8, top_k=50),
}
CONTEXT = 16  # committed tokens before the round


class FakeCache:
    def __init__(self, length: int):
        self.length = length

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length


class FakeSession:
    """Logits by position: ``rows[j]`` follows the j-th token after the context."""

    token_ids = None  # scores the whole vocabulary (ModelDrafter reads it)

    def __init__(self, rows: np.ndarray):
        self.rows = rows  # [k+1, V] float32

    def new_cache(self, positions: int | None = None) -> FakeCache:
        return FakeCache(CONTEXT - 1)

    def forward(self, tokens: np.ndarray, cache: FakeCache, keep: int = 0) -> np.ndarray:
        start = cache.length - (CONTEXT - 1)
        cache.length += len(tokens)
        rows = self.rows[start : start + len(tokens)]
        return (rows[-keep:] if keep else rows).copy()  # fresh, as onnxruntime's output

    def forward_rows(self, tokens: np.ndarray, cache: FakeCache, features=None, keep: int = 0):
        """ModelSession's: (logits, None), a graph without feature rows (TargetRunner's call)."""
        return self.forward(tokens, cache, keep), None


def make_rows(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    rows = (rng.standard_normal((n, vocab), dtype=np.float32) * 3).astype(np.float32)
    for i in rng.choice(n, size=max(1, n // 4), replace=False):
        rows[i, rng.integers(vocab)] += 12.0  # peaked: one token holds almost all the mass
    return rows


def fast_round(draft_rows, target_rows, k, sampling, seed) -> tuple[float, int]:
    """Seconds of sampling in one ``speculative_round``, and tokens it committed."""
    committed = list(range(CONTEXT))
    stats = GenerationStats(speculative=True)
    draft = ModelDrafter(FakeSession(draft_rows), stats)
    target = TargetRunner(FakeSession(target_rows), FakeCache(CONTEXT - 1), stats, draft)
    uniforms = PositionUniforms(seed, first=CONTEXT)
    done = speculative_round(target, draft, committed, k, sampling, uniforms, stats)
    return stats.sampling_s, len(done.tokens)


def reference_round(draft_rows, target_rows, k, sampling, seed) -> tuple[float, int]:
    """Seconds of the dense path's sampling for the same round, and tokens it committed."""
    rng = np.random.default_rng(seed)
    draft_rows, target_rows = draft_rows.copy(), target_rows.copy()  # fresh, as for fast_round
    start = time.perf_counter()
    draft_tokens, q_rows = [], []
    for row in draft_rows[:k]:
        q = process_logits(row[None], sampling)[0]
        draft_tokens.append(sample(q, rng))
        q_rows.append(q)
    p_target = process_logits(target_rows, sampling)
    n_accepted, _ = verify(np.array(draft_tokens), np.stack(q_rows), p_target, rng)
    return time.perf_counter() - start, n_accepted + 1


def measure(round_fn, pool, k, sampling, repeats) -> tuple[float, float]:
    """Median ms per round and mean tokens per round over ``repeats`` rounds."""
    times, tokens = [], []
    round_fn(*pool[0], k, sampling, 0)  # warm-up
    for r in range(repeats):
        draft_rows, target_rows = pool[r % len(pool)]
        seconds, n = round_fn(draft_rows, target_rows, k, sampling, r)
        times.append(seconds)
        tokens.append(n)
    return 1e3 * statistics.median(times), statistics.mean(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[151_936, 256_000])
    parser.add_argument("--k", type=int, default=8, help="draft tokens per round")
    parser.add_argument("--repeats", type=int, default=200, help="rounds timed, fast path")
    parser.add_argument("--reference-repeats", type=int, default=8,
                        help="rounds timed, dense reference (0: skip it)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--pool", type=int, default=16, help="distinct rounds of logits")
    args = parser.parse_args()

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"numpy {np.__version__}, k = {args.k}; medians, ms of sampling per round")
    print(f"{'V':>7} {'setting':<16} {'case':<12} {'tokens':>6} {'fast ms':>8} "
          f"{'reference ms':>12} {'speedup':>7}")
    for vocab in args.vocab:
        rng = np.random.default_rng(vocab)
        independent = [(make_rows(rng, args.k + 1, vocab), make_rows(rng, args.k + 1, vocab))
                       for _ in range(args.pool)]
        related = [(rows, rows + rng.standard_normal(rows.shape, dtype=np.float32) * 0.5)
                   for rows, _ in independent]
        agreeing = [(rows, rows) for rows, _ in independent]
        for name in args.settings:
            sampling = SETTINGS[name]
            cases = (("independent", independent), ("related", related), ("agreeing", agreeing))
            for case, pool in cases:
                fast_ms, tokens = measure(fast_round, pool, args.k, sampling, args.repeats)
                ref = "-"
                speedup = "-"
                if args.reference_repeats:
                    ref_ms, _ = measure(reference_round, pool, args.k, sampling,
                                        args.reference_repeats)
                    ref, speedup = f"{ref_ms:.1f}", f"{ref_ms / fast_ms:.0f}x"
                print(f"{vocab:>7} {name:<16} {case:<12} {tokens:>6.2f} {fast_ms:>8.3f} "
                      f"{ref:>12} {speedup:>7}", flush=True)


if __name__ == "__main__":
    main()
