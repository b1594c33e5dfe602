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
# How far a draft's one-token rows may be from a longer run's, as a fraction of its largest
# |logit|: int8 compute's kernels round differently with the rows (up to about 0.02 on trained
# drafts), and a broken cache or kernel lands far beyond (0.6 of it, emulated AVX2, RESULTS.md)
DRAFT_CONSISTENCY = 0.05
DRAFT_STEPS = 8  # the one-token steps draft_gap compares, after as many tokens run at once


def rows_identical(session: ModelSession, min_run_tokens: int = PADDED, align: int = 1,
                   trials: int = 2, seed: int = 0) -> bool:
    """Whether, with runs shaped as decoding shapes them (padded to ``min_run_tokens``, then
    to end on a multiple of ``align`` positions: ModelSession.padding), every row of a run of
    1..CHECK_RUN tokens equals, bit for bit, the same row of a CHECK_RUN-token run on the
    same cache, wherever the run starts (CHECK_STARTS): a cache cropped back keeps what the
    long run wrote before the start, as a decoding cache keeps what earlier runs wrote. Runs
    shorter than ``min_run_tokens`` are compared as the padded runs they become."""
    rng = np.random.default_rng(seed)
    saved = session.min_run_tokens, session.run_align
    session.min_run_tokens, session.run_align = min_run_tokens, align
    try:
        for _ in range(trials):
            past = int(rng.integers(8, 40)) % max(1, session.max_positions - 2 * CHECK_RUN)
            ids = rng.integers(0, session.vocab_size, size=past + CHECK_RUN)
            cache = session.new_cache(past + 2 * CHECK_RUN)
            session.forward(ids[:past], cache)
            reference = session.forward(ids[past:], cache).copy()  # [CHECK_RUN, V]
            for start in CHECK_STARTS:
                for n in range(1, CHECK_RUN - start + 1):
                    cache.crop(past + start)
                    rows = session.forward(ids[past + start : past + start + n], cache)
                    if not np.array_equal(rows, reference[start : start + n]):
                        return False
        return True
    finally:
        session.min_run_tokens, session.run_align = saved


def draft_gap(session: ModelSession, min_run_tokens: int = 1, seed: int = 0) -> float:
    """The largest difference between the logits of DRAFT_STEPS one-token steps, run as a
    decoding draft runs them (padded to ``min_run_tokens``), and the same rows of one run of
    all the tokens, as a fraction of that run's largest |logit| (at least 1)."""
    ids = np.random.default_rng(seed).integers(0, session.vocab_size, size=2 * DRAFT_STEPS)
    saved = session.min_run_tokens
    try:
        session.min_run_tokens = 1
        whole = session.forward(ids, session.new_cache(len(ids)))[DRAFT_STEPS:].copy()
        session.min_run_tokens = min_run_tokens
        cache = session.new_cache(len(ids) + min_run_tokens)
        session.forward(ids[:DRAFT_STEPS], cache)
        steps = np.concatenate([session.forward(ids[i : i + 1], cache)
                                for i in range(DRAFT_STEPS, len(ids))])
    finally:
        session.min_run_tokens = saved
    return float(np.abs(steps - whole).max()) / max(1.0, float(np.abs(whole).max()))


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
