"""``edgespec export``: check the pair, export and validate both graphs, write the package.

The destination is checked before any work and the package is built in a hidden temporary
folder renamed into place at the end (``destination.py``): a failed or interrupted export leaves
nothing behind, and ``--overwrite`` replaces only an edgespec package.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import edgespec
from edgespec.errors import ExportError
from edgespec.export.destination import atomic_folder, check_destination
from edgespec.export.fused import build_fused_graph, can_fuse
from edgespec.export.graph import describe_graph, export_graph, load_model
from edgespec.export.onnx_io import pin_ir_version
from edgespec.export.precision import (
    DTYPES,
    QUANTIZATIONS,
    convert_fp16,
    quantize_weights,
    store_exact_fp16,
)
from edgespec.export.pair import Checkpoint, check_pair, read_checkpoint
from edgespec.export.validate import validate_graph
from edgespec.manifest import Manifest, ModelSpec

Progress = Callable[[str], None]
GRAPHS = ("auto", "optimum", "fused")
VALIDATION_LENGTH = 24  # tokens compared against PyTorch


def export_pair(
    target: str | Path,
    draft: str | Path,
    out: str | Path,
    overwrite: bool = False,
    dtype: str = "fp32",
    quantize: str | None = None,
    graph: str = "auto",
    progress: Progress | None = None,
) -> Manifest:
    """Export a target/draft pair of Hugging Face causal LMs into the package folder ``out``.

    dtype: "fp32" (CPU; weights that are exact fp16 values are stored as fp16, losslessly) or
        "fp16" (compute in fp16, for GPUs).
    quantize: None, "int8" or "int4": block-wise weight-only quantization of the MatMuls.
    graph: "optimum" (optimum's exporter, any causal LM it supports), "fused" (edgespec's
        builder for Llama-family models: fused onnxruntime operators, in-place KV cache) or
        "auto" (fused where the model allows it, else optimum).
    progress: receives one line as each step starts and ends.
    """
    out = Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantize not in (None, *QUANTIZATIONS):
        raise ExportError(f"--quantize must be one of {', '.join(QUANTIZATIONS)}, got {quantize!r}")
    if quantize and dtype != "fp32":
        raise ExportError("--quantize works on fp32 graphs; drop --dtype fp16 or --quantize")
    if graph not in GRAPHS:
        raise ExportError(f"--graph must be one of {', '.join(GRAPHS)}, got {graph!r}")
    variant = quantize or dtype
    report = _Steps(progress or (lambda line: None), total=4)
    out = check_destination(out, overwrite)

    with report.step("checking the pair"):
        target_ckpt = read_checkpoint(Path(target), "target")
        draft_ckpt = read_checkpoint(Path(draft), "draft")
        vocab_size = check_pair(target_ckpt, draft_ckpt)

    with atomic_folder(out) as tmp:
        specs = {}
        for role, ckpt in (("target", target_ckpt), ("draft", draft_ckpt)):
            with report.step(f"exporting and validating the {role} ({ckpt.path})"):
                specs[role] = _export_model(ckpt, tmp, role, variant, graph)
        with report.step("writing tokenizer and manifest"):
            manifest = _write_package(tmp, target_ckpt, draft_ckpt, specs, vocab_size)
    return manifest


def _export_model(
    ckpt: Checkpoint, root: Path, role: str, variant: str, graph: str
) -> ModelSpec:
    model = load_model(ckpt.path)
    folder = root / role
    if graph == "auto":
        graph = "optimum" if can_fuse(model) else "fused"
    if graph == "fused":
        build_fused_graph(model, folder)
    else:
        export_graph(model, folder)
    pin_ir_version(folder)
    stored_fp16 = 0
    if variant == "fp16":
        convert_fp16(folder)
    elif variant in QUANTIZATIONS:
        quantize_weights(folder, bits=int(variant[3:]))
    else:
        stored_fp16 = store_exact_fp16(folder)
    spec = replace(
        describe_graph(folder, root, model),
        graph=graph,
        weights_stored_fp16=stored_fp16,
        quantization=variant if variant in QUANTIZATIONS else None,
    )
    length = min(VALIDATION_LENGTH, ckpt.max_positions)
    deviations, failures = validate_graph(model, root, spec, ckpt.max_positions, variant, length)
    if failures:
        lines = "\n  ".join(failures)
        raise ExportError(f"the {role} graph failed validation against PyTorch:\n  {lines}")
    return replace(spec, validation=deviations)


def _write_package(
    tmp: Path, target: Checkpoint, draft: Checkpoint, specs: dict, vocab_size: int
) -> Manifest:
    tokenizer = target.tokenizer
    tokenizer.backend_tokenizer.save(str(tmp / "tokenizer.json"))
    manifest = Manifest(
        target=specs["target"],
        draft=specs["draft"],
        vocab_size=vocab_size,
        max_positions=min(target.max_positions, draft.max_positions),
        eos_token_ids=target.eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        add_bos_token=_adds_bos(tokenizer),
        source={"target": str(target.path.resolve()), "draft": str(draft.path.resolve())},
        edgespec_version=edgespec.__version__,
    )
    manifest.write(tmp)
    return manifest


def _adds_bos(tokenizer) -> bool:
    """Whether the Hugging Face tokenizer starts every prompt with BOS (Llama-style)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("x").input_ids[:1] == [bos]


class _Steps:
    """Numbered progress lines with the time each step took."""

    def __init__(self, progress: Progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.done += 1
        self.progress(f"[{self.done}/{self.total}] {what}...")
        start = time.perf_counter()
        yield
        self.progress(f"[{self.done}/{self.total}] done in {time.perf_counter() - start:.1f}s")
