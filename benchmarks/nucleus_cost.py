"""What one top-p row costs when the nucleus is most of the vocabulary (near-flat logits).

Random weights give such rows; so can a trained model at a high temperature. Times the loop's
``process_row`` against the dense reference ``process_logits`` (a full sort) on the same rows,
and checks they keep the same tokens. Medians over rows; run it on an idle machine.

    python benchmarks/nucleus_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from edgespec.config import SamplingConfig
from edgespec.runtime.sampling import process_row

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from reference import process_logits  # noqa: E402  the tests' dense oracle

CONFIG = SamplingConfig(temperature=0.7, top_p=0.9)
ROWS = {"near-flat": 0.02, "flat": 0.3, "typical": 3.0}  # logits: normal(0, 1) x this


def median_ms(function, rows) -> float:
    times = []
    for row in rows:
        start = time.perf_counter()
        function(row)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"# T {CONFIG.temperature} / top-p {CONFIG.top_p}, ms a row, medians of 20 rows")
    for vocab in (49_152, 151_936):
        for name, scale in ROWS.items():
            rows = [(rng.standard_normal(vocab) * scale).astype(np.float32) for _ in range(20)]
            fast = median_ms(lambda r: process_row(r, CONFIG), rows)
            dense = median_ms(lambda r: process_logits(r[None], CONFIG), rows)
            kept = process_row(rows[0], CONFIG)
            same = np.array_equal(kept.ids, np.flatnonzero(process_logits(rows[0][None], CONFIG)[0]))
            print(f"V={vocab:7,} {name:9} fast {fast:6.2f}  reference {dense:6.2f}  "
                  f"nucleus {len(kept.ids):7,} tokens, same: {same}")


if __name__ == "__main__":
    main()
