"""Checks and costs of a session's runs: are rows bit-identical across run sizes, what runs cost.

Used at export to shape a target's runs (export/runs.py) and by tests, in any environment that
has onnxruntime (no torch): the onnxruntime floor's included.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from edgespec.runtime.session import ModelSession

PADDED = 2  # tokens a padded run feeds at least
CHECK_RUN = 9  # the longest run the row check compares (a verify of 8 drafts)
CHECK_STARTS = (0, 3)  # where in that run the compared rows begin
PAST = 128  # tokens before the timed runs
VERIFY = 5  # the run timed beside a one-token step: a verify of 4 drafts


def rows_identical(session: ModelSession, from_tokens: int = PADDED, trials: int = 2,
                   seed: int = 0) -> bool:
    """Whether every row of runs of ``from_tokens``..CHECK_RUN tokens equals, bit for bit, the
    same row of a CHECK_RUN-token run on the same cache, wherever the run starts
    (CHECK_STARTS): a cache cropped back keeps what the long run wrote before the start, as a
    decoding cache keeps what earlier runs wrote."""
    rng = np.random.default_rng(seed)
    saved, session.min_run_tokens = session.min_run_tokens, 1
    try:
        for _ in range(trials):
            past = int(rng.integers(8, 40)) % max(1, session.max_positions - CHECK_RUN)
            ids = rng.integers(0, session.vocab_size, size=past + CHECK_RUN)
            cache = session.new_cache(past + CHECK_RUN)
            session.forward(ids[:past], cache)
            reference = session.forward(ids[past:], cache).copy()  # [CHECK_RUN, V]
            for start in CHECK_STARTS:
                for n in range(from_tokens, CHECK_RUN - start + 1):
                    cache.crop(past + start)
                    rows = session.forward(ids[past + start : past + start + n], cache)
                    if not np.array_equal(rows, reference[start : start + n]):
                        return False
        return True
    finally:
        session.min_run_tokens = saved


def run_costs(session: ModelSession, pads: tuple[int, ...] = (1,), repeats: int = 7
              ) -> dict[int, dict[str, float]]:
    """Per ``min_run_tokens`` in ``pads``: median ms of a one-token step and of a VERIFY-token
    run after PAST tokens (fewer if the context is shorter).

    The settings take turns within each repeat, so that a machine getting busier or quieter
    meanwhile moves them alike (they differ by a few percent, as noise does); the first
    repeat pays for allocations and is dropped.
    """
    past = max(1, min(PAST, session.max_positions - VERIFY - PADDED))
    ids = np.random.default_rng(1).integers(0, session.vocab_size, size=past + VERIFY)
    cache = session.new_cache(past + VERIFY + PADDED)
    session.forward(ids[:past], cache)
    times = {(pad, name): [] for pad in pads for name in ("step_ms", "verify_ms")}
    saved = session.min_run_tokens
    try:
        for repeat in range(repeats + 1):
            for pad in pads:
                session.min_run_tokens = pad
                for name, n in (("step_ms", 1), ("verify_ms", VERIFY)):
                    start = time.perf_counter()
                    session.forward(ids[past : past + n], cache)
                    elapsed = time.perf_counter() - start
                    cache.crop(past)
                    if repeat:
                        times[pad, name].append(1e3 * elapsed)
    finally:
        session.min_run_tokens = saved
    return {pad: {name: statistics.median(times[pad, name]) for name in ("step_ms", "verify_ms")}
            for pad in pads}
