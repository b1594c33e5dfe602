"""How the target's runs are shaped: what its MatMuls compute in, and the fewest tokens a run feeds.

Speculative decoding verifies k drafts in one run of k + 1 tokens; target-only decoding feeds
one token a run. Greedy output is the same token for token only if a position gets the same
row of logits in both. onnxruntime computes a one-row run with kernels of its own (read in its
source: MLAS's M = 1 SGEMM routines, taken by GroupQueryAttention's probs x V; MatMulNBits'
M = 1 kernels for float compute, and for int8 compute on AVX2; KleidiAI's GEMV on ARM), while
every longer run of up to a hundred-odd rows computes each row alike, bit for bit: tiles of 128
rows (MatMulNBits) or of an L2-sized query block (GroupQueryAttention's flash path) are the
next boundary, far above k + 1 (benchmarks/row_identity.py measures it at real shapes).

So a target whose runs feed at least two tokens (a lone token gets a throw-away one after it,
runtime/session.py) gives every position the same row whatever the run, and greedy decoding
with and without a draft is token-identical by construction. Float32 graphs lose little to
that (a two-row run costs about a one-row run); int4/int8 graphs gain most: with int8
activations (MatMulNBits accuracy_level 4) a run of several tokens costs little more than one,
where float compute unpacks every weight per run (3 one-token steps for 2 tokens at
Qwen2.5-1.5B's shapes) and its one-row kernel is the only fast one.

``choose_runs`` measures the candidates on the exported graph, on this machine: their rows
(bit-identical from two tokens on, or not) and their costs (a one-token step, a five-token
run), and picks one per package, used by target-only and speculative decoding alike. Other CPUs
compute otherwise (ARM64's attention needs runs that also end on a multiple of four positions),
so every load checks the shape again on its own CPU and changes it where it does not hold
there (runtime/numerics.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from edgespec.errors import ExportError
from edgespec.export.precision import INT8_COMPUTE
from edgespec.manifest import ModelSpec
from edgespec.runtime.machine import load_average, usable_cores
from edgespec.runtime.numerics import SHAPES
from edgespec.runtime.providers import SessionConfig
from edgespec.runtime.run_checks import PADDED, VERIFY, rows_identical, run_costs
from edgespec.runtime.session import ModelSession

TARGET_COMPUTES = ("auto", "float", "int8")
EXACT_MARGIN = 1.05  # an exact candidate is chosen unless it costs more than this x the best


@dataclass(frozen=True)
class Candidate:
    compute: str  # "float" or "int8"
    min_run_tokens: int  # 1: as fed; 2: a lone token padded

    @property
    def name(self) -> str:
        return f"{self.compute}, runs of >= {self.min_run_tokens}"


def set_compute(folder: Path, compute: str) -> None:
    """Rewrite folder/model.onnx's MatMulNBits nodes to compute in ``compute`` (weights kept)."""
    import onnx
    from onnx import helper

    path = folder / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend(kept)
            if compute == "int8":
                node.attribute.append(helper.make_attribute("accuracy_level", INT8_COMPUTE))
    onnx.save(model, str(path))


def choose_runs(root: Path, spec: ModelSpec, max_positions: int, requested: str = "auto",
                report=lambda line: None) -> tuple[ModelSpec, dict]:
    """The spec with the chosen ``compute`` and ``min_run_tokens``, and the figures behind it.

    Candidates: float compute with runs as fed or padded to two tokens, and for a quantized
    graph int8 compute padded (int8 compute as fed is never exact: its one-row runs differ by
    up to 5e-2 of a logit). A padded candidate is exact only if its rows are bit-identical
    across run sizes and offsets on this machine. Chosen: the cheapest of step + verify (a
    one-token step plus a five-token run), an exact candidate unless it costs more than
    EXACT_MARGIN x the cheapest. ``requested`` "float" or "int8" fixes the compute.
    """
    folder = root / Path(spec.path).parent
    quantized = spec.quantization is not None
    computes = ["float", "int8"] if quantized else ["float"]
    if requested != "auto":
        if requested == "int8" and not quantized:
            raise ExportError("target_compute int8 needs a quantized target (quantize int4 or int8)")
        computes = [requested]
    figures: dict = {"candidates": {}, "load_average": busy()}
    if figures["load_average"]:
        report(f"the machine is busy (load average {figures['load_average']:.1f} on "
               f"{usable_cores()} cores): the run shape is chosen from noisy timings; "
               "--target-compute fixes the compute")
    for compute in computes:
        if quantized:
            set_compute(folder, compute)
        session = _session(root, spec, max_positions)
        align = exact_align(session)
        pads = (1, PADDED) if compute == "float" else (PADDED,)
        for pad, costs in run_costs(session, pads).items():
            figures["candidates"][Candidate(compute, pad).name] = {
                "compute": compute, "min_run_tokens": pad, "exact": pad > 1 and bool(align),
                **costs, **({"align": align} if pad > 1 and align else {})}
        del session
    chosen = _pick(figures["candidates"])
    if chosen is None:
        raise ExportError("int8 compute gives rows that differ with the run's size on this "
                          "machine; export with target_compute float")
    figures["chosen"] = chosen.name
    if quantized:
        set_compute(folder, chosen.compute)
    picked = figures["candidates"][chosen.name]
    exact = ("not bit-exact" if not picked["exact"] else "exact" if picked.get("align", 1) == 1
             else f"exact with runs ending on multiples of {picked['align']} positions here")
    others = [f"{n}: {c['step_ms']:.1f} / {c['verify_ms']:.1f} ms"
              for n, c in figures["candidates"].items() if n != chosen.name]
    report(f"target runs: {chosen.name} ({exact}: "
           f"step {picked['step_ms']:.1f} ms, {VERIFY}-token run {picked['verify_ms']:.1f} ms"
           + "".join(f"; {other}" for other in others) + ")")
    return replace(spec, compute=chosen.compute, min_run_tokens=chosen.min_run_tokens), figures


def exact_align(session: ModelSession) -> int | None:
    """The alignment with which runs padded to two tokens give bit-identical rows here: 1 (none
    needed), a larger one of runtime/numerics.py's SHAPES (ARM64's attention), None if none
    does. A package's loads check it again on their own CPU, so the manifest keeps the
    padding only."""
    return next((align for runs, align in SHAPES if runs == PADDED
                 and rows_identical(session, runs, align)), None)


def busy() -> float | None:
    """The load average over the last minute when it shows other work on more than half the
    cores export may time on, else None."""
    load = load_average()
    return load[0] if load and load[0] > 0.5 * usable_cores() else None


def _pick(candidates: dict) -> Candidate | None:
    usable = {name: c for name, c in candidates.items()
              if c["compute"] == "float" or c["exact"]}  # int8 only where it is exact
    if not usable:
        return None
    score = {name: c["step_ms"] + c["verify_ms"] for name, c in usable.items()}
    best = min(score.values())
    exact = [name for name in usable if usable[name]["exact"]
             and score[name] <= EXACT_MARGIN * best]
    name = min(exact, key=score.__getitem__) if exact else min(score, key=score.__getitem__)
    return Candidate(usable[name]["compute"], usable[name]["min_run_tokens"])


def _session(root: Path, spec: ModelSpec, max_positions: int) -> ModelSession:
    return ModelSession(root / spec.path, spec, spec.vocab_size, max_positions,
                        SessionConfig("cpu", spin=True))
