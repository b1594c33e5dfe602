"""The facts a package's exactness rests on, checked on this CPU when the package loads.

onnxruntime picks its kernels at run time, by instruction set (MLAS: AVX2, AVX-VNNI, AVX-512
VNNI, AMX on x86; NEON, dot product, i8mm on ARM) and by the number of rows a run has. The
export chose its target's run shape on the machine that exported it (export/runs.py), and a
package is then copied to others: what its manifest says is a hint here, never trusted.

- **The target.** Greedy output with and without a draft is token-identical only if a
  position gets the same row of logits whatever run it shares. A package that promises it (int8
  compute, or float runs padded to two tokens) is checked with its ``min_run_tokens``
  (run_checks.rows_identical); where that fails here, the first run shape of ``SHAPES`` that
  holds is taken; where none holds, a warning says greedy output may differ from target-only
  at near-ties. A float target that runs as fed (the export found padding too dear, and rows
  differing by float rounding) is checked and reported, not padded.

  Measured (tests/test_portable.py, RESULTS.md "Portable numerics"): on x86-64 with AVX2 or
  AVX-512, runs of two tokens or more give every row alike (onnxruntime's one-row kernels
  differ); on ARM64 (NEON, dot product, i8mm), GroupQueryAttention computes a run's rows in
  tiles of four counted from the run's end, so a row is the same only in runs that end on the
  same position modulo four: runs padded to at least two tokens and then to end on a
  multiple of four positions (``ModelSession.run_align``) are exact there.
- **The draft.** Its logits move only acceptance, but a one-token kernel that computes
  something else (or a tensor it reads that a wrong probe let go) makes every draft token
  wrong. Its one-token steps are compared with one run of the same tokens; beyond
  run_checks.DRAFT_CONSISTENCY its runs are padded to two tokens, and checked again.

Measured once per package, machine (its instruction sets), onnxruntime build and session
settings, and kept with the step costs (calibration.py): the first load on a machine pays a few
probe runs (about 2 s for a 1.5B target on two cores), later ones read the result back.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from edgespec.runtime.machine import instruction_sets
from edgespec.runtime.run_checks import DRAFT_CONSISTENCY, PADDED, draft_gap, rows_identical

# (min_run_tokens, run_align) tried, in order, for a target that must be exact
SHAPES = ((PADDED, 1), (PADDED, 4), (PADDED, 8), (PADDED, 16))
FORMAT = 1  # of a stored result


@dataclass(frozen=True)
class Numerics:
    """What the load found on this CPU and chose.

    target_runs / draft_runs: the min_run_tokens the sessions run with here (the manifest's:
    ``manifest_target_runs`` / ``manifest_draft_runs``); target_align: the target's runs end
    on a multiple of this many positions (1: anywhere); target_exact: its rows bit-identical
    across run sizes here with that shape; draft_gap: the largest difference of the draft's
    one-token rows from one run's, as a fraction of its largest |logit| (None: not checked);
    source: "measured" now or "stored" (read back from the cache); seconds: what the probes
    took (0 when stored).
    """

    instruction_sets: tuple[str, ...]
    target_runs: int
    target_exact: bool
    manifest_target_runs: int
    requires_exact: bool
    target_align: int = 1
    draft_runs: int | None = None
    manifest_draft_runs: int | None = None
    draft_gap: float | None = None
    source: str = "measured"
    seconds: float = 0.0

    @property
    def fell_back(self) -> bool:
        """Whether anything runs otherwise than the manifest says, or an exact target is not."""
        return (self.target_runs != self.manifest_target_runs or self.target_align != 1
                or self.draft_runs != self.manifest_draft_runs
                or (self.requires_exact and not self.target_exact)
                or (self.draft_gap is not None and self.draft_gap > DRAFT_CONSISTENCY))

    def line(self) -> str:
        """One line: the CPU, then what the target and the draft run as here."""
        isa = ", ".join(self.instruction_sets) or "no SIMD extensions read"
        parts = [self._target_part()]
        if self.draft_runs is not None:
            parts.append(self._draft_part())
        return f"numerics on this CPU ({isa}): " + "; ".join(parts)

    def warnings(self) -> list[str]:
        """The lines a user must see: every fallback from the manifest, and any loss of
        token-identical greedy output."""
        found = []
        if self.target_runs != self.manifest_target_runs or self.target_align != 1 or (
                self.requires_exact and not self.target_exact):
            found.append(self._target_part())
        if self.draft_runs is not None and (self.draft_runs != self.manifest_draft_runs or
                                            (self.draft_gap or 0) > DRAFT_CONSISTENCY):
            found.append(self._draft_part())
        return [f"on this CPU ({', '.join(self.instruction_sets) or 'no SIMD'}): {w}"
                for w in found]

    def _target_part(self) -> str:
        runs = _runs(self.target_runs, self.target_align)
        moved = (f" (the manifest says {_runs(self.manifest_target_runs)}, whose rows differ "
                 "here)" if (self.target_runs, self.target_align) !=
                 (self.manifest_target_runs, 1) else "")
        if self.target_exact:
            return f"target {runs}, rows bit-identical: greedy output token-identical{moved}"
        if self.requires_exact:
            return (f"target {runs}: no run shape tried gives bit-identical rows, so greedy "
                    "output may differ from target-only where the two best logits are within "
                    "rounding (--drafter none gives target-only output)")
        return (f"target {runs}, as exported: rows differ across run sizes by float rounding, "
                "so greedy output may differ from target-only at near-ties")

    def _draft_part(self) -> str:
        if self.draft_gap is None:
            return f"draft {_runs(self.draft_runs)} (not checked: an EAGLE-3 head)"
        gap = f"one-token rows within {self.draft_gap:.2g} of a run's"
        if self.draft_runs != self.manifest_draft_runs:
            return (f"draft {_runs(self.draft_runs)}: its one-token kernel computes something "
                    f"else here ({gap} once padded)")
        if self.draft_gap > DRAFT_CONSISTENCY:
            return (f"draft {_runs(self.draft_runs)}: {gap}, over {DRAFT_CONSISTENCY}; its "
                    "tokens will mostly be rejected (output exact, slower)")
        return f"draft {_runs(self.draft_runs)}, {gap}"

    def record(self) -> dict:
        """What is stored in the cache."""
        return {"format": FORMAT, **{k: v for k, v in asdict(self).items()
                                     if k not in ("source", "seconds")}}

    @classmethod
    def from_record(cls, record: object, manifest_target_runs: int,
                    manifest_draft_runs: int | None) -> "Numerics | None":
        """A stored result, None if ``record`` is not one for these manifest values (the cache
        file is the user's, and may hold anything)."""
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            return None
        try:
            found = cls(tuple(str(i)[:40] for i in record["instruction_sets"][:32]),
                        _count(record["target_runs"]), record["target_exact"] is True,
                        _count(record["manifest_target_runs"]), record["requires_exact"] is True,
                        _count(record["target_align"]),
                        _count_or_none(record.get("draft_runs")),
                        _count_or_none(record.get("manifest_draft_runs")),
                        _gap_or_none(record.get("draft_gap")), "stored", 0.0)
        except (KeyError, TypeError, ValueError):
            return None
        if (found.manifest_target_runs, found.manifest_draft_runs) != (
                manifest_target_runs, manifest_draft_runs):
            return None
        return found


def check(target, draft, requires_exact: bool) -> Numerics:
    """Probe the sessions (runtime/session.py's ModelSession) as they are loaded and return
    what holds here; the sessions are left as they were (``apply`` sets the choice)."""
    start = time.perf_counter()
    manifest_runs, align = target.min_run_tokens, 1
    if requires_exact:  # the manifest's shape first, then SHAPES in order
        shapes = list(dict.fromkeys([(manifest_runs, 1), *SHAPES]))
        found = next((shape for shape in shapes if rows_identical(target, *shape, trials=1)),
                     None)
        exact = found is not None
        runs, align = found or (manifest_runs, 1)
    else:  # as fed, by the export's choice: said, not changed
        runs, exact = manifest_runs, rows_identical(target, manifest_runs, trials=1)
    draft_runs = gap = None
    if draft is not None:
        draft_runs = draft.min_run_tokens
        if not draft.reads_features:
            gap = draft_gap(draft, draft_runs)
            if gap > DRAFT_CONSISTENCY and draft_runs < PADDED:
                padded = draft_gap(draft, PADDED)
                if padded <= DRAFT_CONSISTENCY:
                    draft_runs, gap = PADDED, padded
    return Numerics(instruction_sets(), runs, exact, manifest_runs, requires_exact, align,
                    draft_runs, None if draft is None else draft.min_run_tokens, gap, "measured",
                    time.perf_counter() - start)


def apply(numerics: Numerics, target, draft) -> None:
    """Run the sessions as ``numerics`` chose."""
    target.min_run_tokens, target.run_align = numerics.target_runs, numerics.target_align
    if draft is not None and numerics.draft_runs is not None:
        draft.min_run_tokens = numerics.draft_runs


def requires_exact(spec) -> bool:
    """Whether a target's manifest entry promises bit-identical rows: int8 compute (whose
    one-row kernels always round differently) or runs padded at export for exactness."""
    return spec.compute == "int8" or spec.min_run_tokens >= PADDED


def _runs(n: int | None, align: int = 1) -> str:
    shape = "runs as fed" if not n or n <= 1 else f"runs padded to >= {n} tokens"
    return shape + (f", ending on multiples of {align} positions" if align > 1 else "")


def _count(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
        raise ValueError(value)
    return value


def _count_or_none(value) -> int | None:
    return None if value is None else _count(value)


def _gap_or_none(value) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not \
            0 <= value < np.inf:
        raise ValueError(value)
    return float(value)
