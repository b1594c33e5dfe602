"""Generation settings: small frozen dataclasses, validated once where they are built."""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULES = ("fixed", "heuristic", "adaptive")  # how the draft length k is chosen each round


@dataclass(frozen=True)
class SamplingConfig:
    """How a row of logits becomes a distribution; the same for draft and target.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: keep the smallest set of tokens whose probability mass reaches top_p; 1 keeps all.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationConfig:
    """One generation request.

    max_new_tokens: stop after this many generated tokens.
    gamma: tokens the draft proposes per round (k in the papers); the most it may propose
        with the "heuristic" and "adaptive" schedules.
    schedule: "fixed" (always gamma), "heuristic" (transformers' +2/-1 rule) or "adaptive"
        (k maximising expected tokens/s from measured costs; see runtime/schedule.py).
    use_draft: False decodes with the target alone (the baseline speculative decoding must match).
    seed: seeds the sampler; the same seed gives the same text.
    stop: strings that end generation; the text is cut before the first one found.
    ignore_eos: keep generating after EOS until max_new_tokens (for benchmarks: runs of equal
        length whatever they sample).
    """

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    gamma: int = 4
    schedule: str = "fixed"
    use_draft: bool = True
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1 (tokens drafted per round), got {self.gamma}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
