"""Counters and timings of one generation, and the figures derived from them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields


@dataclass
class GenerationStats:
    """Filled in by the decoding loop; every ratio is derived, never stored.

    ``accepted_at[i]`` counts rounds whose i-th draft token was accepted and ``drafted_at[i]``
    rounds that drafted an i-th token, so per-position acceptance is the chance that a round
    gets at least i+1 tokens from the draft.
    """

    speculative: bool
    drafter: str = ""  # "mixed", "model", "eagle3", "ngram" or "none" (runtime/drafters.py)
    # the prompt as decoded: with token healing, the user's without its last token
    prompt_tokens: int = 0
    # of them, those whose KV an earlier generation's caches held (runtime/prefix_cache.py):
    # not prefilled again
    prompt_tokens_reused: int = 0
    # token healing (runtime/healing.py): the text of the prompt's last token, backed off and
    # regrown by the first generated token; "" when the prompt was not healed
    healed: str = ""
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that ended at a rejected draft token
    target_calls: int = 0
    draft_calls: int = 0
    forced: int = 0  # of the drafted, tokens a constraint's grammar forced (no drafter run)
    # per source (a drafter's name, or "forced"): tokens proposed, accepted, seconds its runs took
    drafted_by: dict[str, int] = field(default_factory=dict)
    accepted_by: dict[str, int] = field(default_factory=dict)
    draft_s_by: dict[str, float] = field(default_factory=dict)
    draft_lengths: dict[int, int] = field(default_factory=dict)  # k -> rounds; 0: target step
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    sampling_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""
    threads: dict[str, int] = field(default_factory=dict)  # intra-op threads per model
    calibration_s: float = 0.0  # finding the adaptive schedule's step costs, before decoding
    # where those costs came from: "measured" now ("measured busy": while other processes
    # used the CPU, so not stored), "stored" in the calibration cache by an
    # earlier process, "reused" from an earlier request of this process; "" without adaptive
    calibration: str = ""

    @classmethod
    def combined(cls, runs: Iterable[GenerationStats]) -> GenerationStats:
        """Several runs as one: counters, times and per-position counts added up, so that
        every derived figure (alpha, per-position acceptance, tokens/s) pools all their rounds.

        ``speculative`` if any run was; ``finish_reason`` the runs' common one, else "mixed".
        """
        runs = list(runs)
        total = cls(speculative=any(r.speculative for r in runs))
        for run in runs:
            for f in fields(cls):
                value = getattr(run, f.name)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    setattr(total, f.name, getattr(total, f.name) + value)
            for name in ("draft_lengths", "drafted_by", "accepted_by", "draft_s_by"):
                mine = getattr(total, name)
                for key, value in getattr(run, name).items():
                    mine[key] = mine.get(key, 0) + value
            total.accepted_at = _added(total.accepted_at, run.accepted_at)
            total.drafted_at = _added(total.drafted_at, run.drafted_at)
        total.threads = runs[0].threads if runs else {}
        total.drafter = "/".join(sorted({r.drafter for r in runs}))
        reasons = {r.finish_reason for r in runs}
        total.finish_reason = reasons.pop() if len(reasons) == 1 else "mixed" if reasons else ""
        return total

    def record_round(self, done, paced: str, drafts: bool = True) -> None:
        """Count a round (speculative.Round: its drafts, their sources, the accepted prefix);
        ``paced``: the source whose k the schedule picks, whose proposals ``draft_lengths``
        counts (a k = 0 round, a target step, included while ``drafts``)."""
        k, n_accepted = done.drafted, done.accepted
        if drafts:
            own, _, _ = done.of(paced)
            self.draft_lengths[own] = self.draft_lengths.get(own, 0) + 1
        if not k:
            return
        for i, source in enumerate(done.sources):
            self.drafted_by[source] = self.drafted_by.get(source, 0) + 1
            self.accepted_by[source] = self.accepted_by.get(source, 0) + (i < n_accepted)
        grow = k - len(self.drafted_at)
        if grow > 0:
            self.accepted_at += [0] * grow
            self.drafted_at += [0] * grow
        for i in range(k):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted
        self.rounds += 1
        self.drafted += k
        self.accepted += n_accepted
        self.rejected += n_accepted < k

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha(self) -> float:
        """Chance that the target accepts one draft token, estimated from the rounds.

        Verification looks at draft tokens until the first rejection, so each looked-at token
        was either accepted or the one rejection of its round: alpha = accepted / looked at.
        Unlike ``acceptance_rate`` it does not count the tokens after a rejection, which were
        never looked at (Leviathan et al.'s alpha).
        """
        looked_at = self.accepted + self.rejected
        return self.accepted / looked_at if looked_at else 0.0

    def by_source(self) -> str:
        """Each source's share, as "ngram 90 at 95%, model 30 at 40%" (most drafted first)."""
        return ", ".join(f"{source} {n} at {self.accepted_by.get(source, 0) / n:.0%}"
                         for source, n in sorted(self.drafted_by.items(), key=lambda i: -i[1]))

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def tokens_per_target_call(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def other_s(self) -> float:
        """Decoding time outside the draft's and target's runs and the sampling: the loop's own
        Python (feeds, bookkeeping, text), which a C++ loop would mostly save."""
        return max(0.0, self.decode_s - self.draft_s - self.target_s - self.sampling_s)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of decoding (the prompt's prefill not counted)."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        figures = {
            "acceptance_rate": self.acceptance_rate,
            "alpha": self.alpha,
            "per_position_acceptance": self.per_position_acceptance,
            "tokens_per_target_call": self.tokens_per_target_call,
            "decode_s": self.decode_s,
            "other_s": self.other_s,
            "tokens_per_s": self.tokens_per_s,
        }
        counters = {k: v for k, v in vars(self).items() if k not in ("accepted_at", "drafted_at")}
        return {**counters, **figures}

    def summary(self) -> str:
        """One line for humans: the figures a user checks first."""
        line = f"{self.new_tokens} tokens in {self.total_s:.2f}s, {self.tokens_per_s:.1f} tok/s"
        if self.speculative:
            line += (
                f", acceptance {self.acceptance_rate:.0%} of {self.drafted} drafted"
                f"{f' by {self.drafter}' if self.drafter else ''}"
            )
            if len(self.drafted_by) > 1 or self.drafter == "mixed":
                line += f" ({self.by_source()})"
            line += f", {self.tokens_per_target_call:.2f} tokens/target call"
        if self.prompt_tokens_reused:
            line += f", {self.prompt_tokens_reused} of {self.prompt_tokens} prompt tokens reused"
        if self.calibration.startswith("measured"):
            line += f", {self.calibration_s:.1f}s measuring step costs first"
            if self.calibration == "measured busy":
                line += " (the machine was busy: not stored)"
        elif self.calibration == "stored":
            line += ", step costs from the calibration cache"
        return f"{line} ({self.finish_reason})"


def _added(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists, the shorter padded with zeros."""
    width = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (width - len(a)), b + [0] * (width - len(b)))]
