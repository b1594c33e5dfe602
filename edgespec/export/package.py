"""``edgespec export``: check the pair, export and validate both graphs, write the package.

(Over 400 lines on purpose: the export's steps in order, from the arguments to the folder
renamed into place; each step's work lives in the module it calls.)

The destination is checked before any work and the package is built in a hidden temporary
folder renamed into place at the end (``destination.py``): a failed or interrupted export leaves
nothing behind, and ``--overwrite`` replaces only an edgespec package.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

import edgespec
from edgespec.config import EXPORT_DTYPES, EXPORT_GRAPHS, EXPORT_QUANTIZATIONS
from edgespec.errors import ExportError
from edgespec.export.checkpoint import Checkpoint
from edgespec.export.destination import atomic_folder, check_destination
from edgespec.export.eagle3 import HeadConfig, HeadTensors, is_eagle3_head, read_head_config
from edgespec.export.eagle3_graph import export_head
from edgespec.export.families import why_not_fused, widest_window
from edgespec.export.fused import build_fused_graph
from edgespec.export.graph import describe_graph, export_graph, load_model, meta_model
from edgespec.export.memory import usage
from edgespec.export.onnx_io import pin_ir_version
from edgespec.export.precision import (
    QUANT_BLOCK_SIZE,
    convert_fp16,
    draft_block_size,
    quantize_weights,
    store_exact_halves,
)
from edgespec.export.gguf import GGUFCheckpoint, GGUFTensors, find_gguf, forget_reader
from edgespec.export.gguf_blocks import REPACKED
from edgespec.export.pair import check_pair
from edgespec.export.runs import TARGET_COMPUTES, choose_runs, set_compute
from edgespec.export.source import read_checkpoint
from edgespec.export.tensors import CheckpointTensors, ModelTensors, safetensors_files
from edgespec.export.vocab import TOKEN_IDS_NAME, coverage, frequent_tokens, given_tokens
from edgespec.export.validate import (
    VALIDATIONS,
    reference_logits,
    reference_logits_by_layer,
    validate_graph,
    validation_ids,
)
from edgespec.manifest import CHAT_TEMPLATE_NAME, TOKENIZER_NAME, Manifest, ModelSpec
from edgespec.runtime.package_checks import tokenizer_fingerprint
from edgespec.runtime.run_checks import PADDED
from edgespec.runtime.loader import give_back_freed_memory

Progress = Callable[[str], None]
VALIDATION_LENGTH = 32  # tokens compared against PyTorch (past the widest sliding window)


def export_pair(
    target: str | Path,
    draft: str | Path | None,
    out: str | Path,
    overwrite: bool = False,
    dtype: str = "fp32",
    quantize: str | None = None,
    graph: str = "auto",
    progress: Progress | None = None,
    validation: str = "strict",
    draft_quantize: str | None = "same",
    target_compute: str = "auto",
    draft_vocab: int | None = None,
    draft_vocab_texts: tuple[Path, ...] = (),
    draft_token_ids: np.ndarray | None = None,
) -> Manifest:
    """Export a target/draft pair of Hugging Face causal LMs into the package folder ``out``.

    target, draft: Hugging Face model folders, or GGUF files (a .gguf, or a folder holding one):
    their quantized blocks are repacked as they are where onnxruntime can hold them
    (export/gguf.py), and ``quantize`` applies to the weights that could not be.

    draft None: a target-only package (no draft graph; the manifest's draft is null), which
    decodes with n-gram drafting (runtime/drafters.py) or the target alone.

    dtype: "fp32" (CPU; weights that are exact fp16 values are stored as fp16, losslessly) or
        "fp16" (compute in fp16, for GPUs).
    quantize: None, "int8" or "int4": block-wise weight-only quantization of the MatMuls.
    graph: "optimum" (optimum's exporter, any causal LM it supports), "fused" (edgespec's
        builder for Llama-family models: fused onnxruntime operators, in-place KV cache) or
        "auto" (fused where the model allows it, else optimum).
    progress: receives one line as each step starts and ends.
    validation: "strict" (a graph that fails validation stops the export), "report" (the
        package is written and the figures and failures recorded) or "skip".
    draft_quantize: the draft's own quantization, "same" (as ``quantize``), None, "int8" or
        "int4". The draft's precision never changes the output, only how often its tokens are
        accepted, so a quantized draft beside an exact target is safe; a checkpoint paired with
        itself this way is self-speculation with a quantized copy.
    target_compute: what a quantized target's MatMuls compute in, "float" or "int8", or
        "auto": measured on this machine with the shape of its runs (export/runs.py).
    draft_vocab: the draft scores only this many tokens, the most frequent in
        ``draft_vocab_texts`` (export/vocab.py; FR-Spec): a cheaper draft step, exact output.
    draft_token_ids: the ids the draft scores, given (a draft trained with its head restricted
        to them, models/smollm2_draft); instead of draft_vocab.

    A draft folder holding an EAGLE-3 head (export/eagle3.py: its config names the
    architecture) makes an EAGLE-3 package: the target's fused graph also outputs the head's
    input (eagle_features), and the head is the draft graph (export/eagle3_graph.py),
    quantized as ``draft_quantize`` says.
    """
    out = Path(out)
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    if quantize not in (None, *EXPORT_QUANTIZATIONS):
        raise ExportError(f"quantize must be None or one of {', '.join(EXPORT_QUANTIZATIONS)}, "
                          f"got {quantize!r}")
    if quantize and dtype != "fp32":
        raise ExportError("quantize works on fp32 graphs; use dtype fp32 or no quantize")
    if graph not in EXPORT_GRAPHS:
        raise ExportError(f"graph must be one of {', '.join(EXPORT_GRAPHS)}, got {graph!r}")
    if target_compute not in TARGET_COMPUTES:
        raise ExportError(f"target_compute must be one of {', '.join(TARGET_COMPUTES)}, "
                          f"got {target_compute!r}")
    if target_compute == "int8" and not quantize and find_gguf(Path(target), "target") is None:
        raise ExportError("target_compute int8 needs a quantized target; quantize it int4 "
                          "or int8")
    if validation not in VALIDATIONS:
        raise ExportError(f"validation must be one of {', '.join(VALIDATIONS)}, got {validation!r}")
    draft_quantize = quantize if draft_quantize == "same" else draft_quantize
    if draft_quantize not in (None, *EXPORT_QUANTIZATIONS):
        raise ExportError("draft_quantize must be None, \"same\" or one of "
                          f"{', '.join(EXPORT_QUANTIZATIONS)}, "
                          f"got {draft_quantize!r}")
    if draft_quantize and dtype != "fp32":
        raise ExportError("draft_quantize works on fp32 graphs; use dtype fp32")
    if (draft_vocab is not None or draft_token_ids is not None) and draft is None:
        raise ExportError("draft_vocab restricts a draft's output; this export has no draft")
    if draft_vocab is not None and draft_token_ids is not None:
        raise ExportError("pass draft_vocab or draft_token_ids, not both")
    variants = {"target": quantize or dtype, "draft": draft_quantize or dtype}
    report = _Steps(progress or (lambda line: None), total=4 if draft is not None else 3)
    out = check_destination(out, overwrite)

    with report.step("checking the pair" if draft is not None else "reading the target"):
        target_ckpt = read_checkpoint(Path(target), "target")
        head = _eagle3_head(draft, target_ckpt, graph, dtype, draft_vocab)
        draft_ckpt = (read_checkpoint(Path(draft), "draft") if draft is not None and head is None
                      else None)
        vocab_size = (check_pair(target_ckpt, draft_ckpt) if draft_ckpt
                      else target_ckpt.vocab_size)
        if isinstance(draft_ckpt, GGUFCheckpoint):  # parsed again at its turn: not held
            forget_reader(draft_ckpt.path)  # through the target's export (0.5 GB at 152k tokens)

    with atomic_folder(out) as tmp:
        specs = {"draft": None}
        roles = (("target", target_ckpt), ("draft", draft_ckpt)) if draft_ckpt else (
            ("target", target_ckpt),)
        for role, ckpt in roles:
            with report.step(f"exporting and validating the {role} ({ckpt.path})"):
                token_ids = None
                if role == "draft" and draft_token_ids is not None:
                    token_ids = given_tokens(draft_token_ids, vocab_size)
                    report.detail(f"the draft scores the {len(token_ids):,} of {vocab_size:,} "
                                  "tokens it was trained on")
                if role == "draft" and draft_vocab is not None:
                    token_ids = frequent_tokens(target_ckpt.tokenizer, vocab_size, draft_vocab,
                                                list(draft_vocab_texts),
                                                always=target_ckpt.eos_token_ids)
                    covered = coverage(target_ckpt.tokenizer, token_ids, list(draft_vocab_texts))
                    report.detail(f"the draft scores {len(token_ids):,} of {vocab_size:,} tokens"
                                  + (f" ({covered:.1%} of the calibration text's tokens)"
                                     if covered is not None else " (the lowest ids: no text)"))
                eagle_fc = head and (head.aux_layers, HeadTensors(head).read("fc.weight"))
                specs[role] = _export_model(ckpt, tmp, role, variants[role], graph, validation,
                                            report, target_compute, token_ids, eagle_fc)
        if head is not None:
            with report.step(f"exporting and validating the EAGLE-3 head ({head.path})"):
                target_tensors = (GGUFTensors(target_ckpt.path, meta_model(target_ckpt.config))
                                  if isinstance(target_ckpt, GGUFCheckpoint)
                                  else CheckpointTensors(target_ckpt.path))
                specs["draft"] = export_head(head, target_tensors, tmp, variants["draft"],
                                             validation, report.detail)
        with report.step("writing tokenizer and manifest"):
            defaults, ignored = target_ckpt.sampling_defaults
            if defaults:
                shown = ", ".join(f"{k} {v:g}" for k, v in defaults.items())
                report.detail(f"sampling defaults from generation_config.json: {shown}")
            if ignored:
                report.detail(f"in generation_config.json but not applied: {', '.join(ignored)}")
            manifest = _write_package(tmp, target_ckpt, draft_ckpt, specs, vocab_size, defaults,
                                      head.path if head else None)
    return manifest


def _eagle3_head(draft: str | Path | None, target: Checkpoint, graph: str, dtype: str,
                 draft_vocab: int | None) -> HeadConfig | None:
    """The draft's EAGLE-3 head config, checked against the target; None if it is not one.

    A head reads the target's fused graph's eagle_features output: optimum's graphs have no
    such output, so a target exported with optimum (asked, or not a Llama-family model) is
    refused, as are fp16 graphs, targets without safetensors or GGUF files (the head's graph
    reads their embedding a tensor at a time) and draft_vocab (a head has its own vocabulary).
    """
    if draft is None or not is_eagle3_head(Path(draft)):
        return None
    reason = why_not_fused(target.config)
    if graph == "optimum" or reason:
        raise ExportError(f"an EAGLE-3 head reads the target's hidden states, which only "
                          f"edgespec's fused target graph outputs, and "
                          f"{reason or 'optimum was asked for'}; drop --graph optimum or "
                          "pair the target with a draft model")
    readable = isinstance(target, GGUFCheckpoint) or safetensors_files(target.path)
    if dtype != "fp32" or draft_vocab is not None or not readable:
        raise ExportError("an EAGLE-3 head is exported beside an fp32 (or quantized) target "
                          "from safetensors or a GGUF file, without --draft-vocab (the head "
                          "has its own vocabulary); drop --dtype fp16 / --draft-vocab, or "
                          "convert the target to safetensors")
    config = read_head_config(Path(draft), target.config)
    HeadTensors(config)  # its files, headers and shapes checked before the target's export
    return config


def _export_model(ckpt: Checkpoint, root: Path, role: str, variant: str, graph: str,
                  validation: str, report: "_Steps", target_compute: str = "auto",
                  token_ids: np.ndarray | None = None, eagle_fc=None) -> ModelSpec:
    """Build, shrink and validate one graph, with at most one model in memory at a time.

    A fused graph is written from the checkpoint one tensor at a time, quantized as it is
    written, and PyTorch's reference runs one layer at a time (``_write_fused``); optimum's
    graph is exported from the loaded model, which computes the reference and is freed before
    anything else loads the graph (``_write_optimum``). A CPU target's runs are then shaped
    (export/runs.py) before it is validated as it will run.
    """
    folder = root / role
    reason = why_not_fused(ckpt.config)
    if isinstance(ckpt, GGUFCheckpoint):
        if reason or graph == "optimum":
            raise ExportError(f"--{role} {ckpt.path}: GGUF files are exported with edgespec's "
                              f"fused graph, and {reason or 'optimum was asked for'}; "
                              + ("drop --graph optimum" if not reason else
                                 "export the model's Hugging Face folder instead"))
        if variant == "fp16":
            raise ExportError(f"--{role} {ckpt.path}: a GGUF file's blocks compute in float32; "
                              "drop --dtype fp16")
    if graph == "auto":
        graph = "optimum" if reason else "fused"
        if reason:
            report.detail(f"optimum's graph for the {role}: {reason}")
    if token_ids is not None and graph != "fused":
        raise ExportError(f"draft_vocab needs edgespec's fused graph for the draft, and "
                          f"{reason or 'optimum was asked for'}; export without draft_vocab")
    ids = validation_ids(ckpt.tokenizer, ckpt.vocab_size,
                         min(VALIDATION_LENGTH + widest_window(ckpt.config), ckpt.max_positions))
    # int8 activations where the graph will compute with them: a quantized draft's (a GGUF
    # draft's blocks are quantized: its precision moves acceptance, never the output), and a
    # target's whose compute was fixed to int8 (the user's choice, stated in the manifest)
    int8_compute = (role == "draft" and (variant in EXPORT_QUANTIZATIONS
                                         or isinstance(ckpt, GGUFCheckpoint))
                    or role == "target" and target_compute == "int8")
    write = _write_fused if graph == "fused" else _write_optimum
    stored, about, expected, reference = write(ckpt, folder, role, variant, token_ids,
                                               ids if validation != "skip" else None, report,
                                               int8_compute, eagle_fc)
    if token_ids is not None and expected is not None:
        expected = expected[:, token_ids]  # the columns the graph scores
    weights = about.pop("gguf", None)  # a GGUF file's tensors: repacked, kept, dequantized
    quantization = (weights["quantization"] if weights else
                    variant if variant in EXPORT_QUANTIZATIONS else None)
    spec = replace(describe_graph(folder, root, **about), graph=graph, stored=dict(stored),
                   quantization=quantization,
                   compute="int8" if role == "draft" and int8_compute and quantization
                   else "float")
    extra = {"gguf": weights} if weights else {}
    if token_ids is not None:
        np.save(folder / TOKEN_IDS_NAME, token_ids)
        spec = replace(spec, token_ids=f"{role}/{TOKEN_IDS_NAME}")
    runs = {}
    if weights and target_compute == "auto":  # the file's numbers: int8 activations round
        target_compute = "float"  # (on SmolLM2-135M they changed its chat answers)
    if role == "target" and variant != "fp16":
        report.detail("measuring the target's runs: compute, rows, costs")
        spec, runs = choose_runs(root, spec, ckpt.max_positions, target_compute, report.detail)
    eight_bit = weights and any(REPACKED[kind] == 8 for kind in
                                weights["tensors"].get("repacked", {}))
    if weights and validation != "skip" and not weights["requantized"] and spec.compute != "float" \
            and eight_bit:  # float compute would dequantize every 8-bit matrix on every run
        # (gigabytes for a 1.5B model): the blocks are the float package's, checked there
        weights["repack_check"] = {"skipped": "8-bit blocks; a float-compute export of the "
                                              "same file checks them at fp32's gate"}
    elif weights and validation != "skip" and not weights["requantized"] and \
            spec.compute != "float":
        report.detail("checking the repacked blocks against PyTorch in float compute (fp32's gate)")
        exact, failures = _check_repacked(expected, ids, root, spec, ckpt.max_positions, role)
        _refuse_failures(failures, validation, role, report)
        report.detail(f"repacked blocks: {_figures_line(exact)}")
        weights["repack_check"] = {k: exact[k] for k in (
            "max_abs_diff_no_cache", "tolerance", "mean_tv", "top1_agreement")}
    if weights:  # repacked blocks compute as the dequantized model does: fp32's gate, unless
        # weights were quantized again or the MatMuls compute with int8 activations
        variant = (quantization if weights["requantized"] or spec.compute == "int8"
                   else "fp32")
    if validation == "skip":
        return replace(spec, validation={"variant": variant, "skipped": True,
                                         **({"runs": runs} if runs else {}), **extra})

    report.detail(f"validating against PyTorch ({reference})")
    figures, failures = validate_graph(expected, ids, root, spec, ckpt.max_positions, variant,
                                       role)
    if role == "draft" and not figures["consistent"]:
        spec, figures, failures = _consistent_draft(expected, ids, root, spec,
                                                    ckpt.max_positions, variant, figures,
                                                    failures, report)
    _refuse_failures(failures, validation, role, report)
    report.detail(_figures_line(figures))
    return replace(spec, validation={**figures, "reference": reference, "failures": failures,
                                     **({"runs": runs} if runs else {}), **extra})


def _consistent_draft(expected: np.ndarray, ids: np.ndarray, root: Path, spec, max_positions: int,
                      variant: str, figures: dict, failures: list[str], report: "_Steps"):
    """A draft whose one-token runs disagree with its longer ones on this CPU (a kernel of
    onnxruntime's that computes otherwise with one row), run in a layout that agrees: its
    runs padded to two tokens, else float compute; (spec, figures, failures) of the first
    that passes every gate (so what failed came of the one-token runs), else of the draft as
    it was. Its precision moves acceptance, never the output,
    so a fallback is better than a failed build; the package's loads check it again
    (runtime/numerics.py)."""
    folder = root / Path(spec.path).parent
    gap = figures["max_abs_diff_cached_vs_uncached"]
    tries = [replace(spec, min_run_tokens=PADDED)]
    if spec.compute == "int8":
        tries.append(replace(spec, compute="float", min_run_tokens=1))
    for layout in tries:
        if layout.compute != spec.compute:
            set_compute(folder, layout.compute)
        found, failed = validate_graph(expected, ids, root, layout, max_positions, variant,
                                       "draft")
        if not failed:
            how = (f"its runs padded to {PADDED} tokens" if layout.compute == spec.compute
                   else "float compute")
            report.detail(f"the draft's one-token runs differ from its longer runs by "
                          f"{gap:.2e} on this CPU: it runs with {how} instead "
                          f"({found['max_abs_diff_cached_vs_uncached']:.2e})")
            return layout, {**found, "fallback": {"from": f"{spec.compute}, runs as fed",
                                                  "cached_vs_uncached": gap}}, failed
    if tries[-1].compute != spec.compute:
        set_compute(folder, spec.compute)
    return spec, figures, failures


def _refuse_failures(failures: list[str], validation: str, role: str, report: "_Steps") -> None:
    if failures and validation == "strict":
        lines = "\n  ".join(failures)
        raise ExportError(
            f"the {role} graph failed validation against PyTorch:\n  {lines}\n"
            "(--validate report writes the package anyway and records these figures)"
        )
    for failure in failures:
        report.detail(f"validation failed (--validate report): {failure}")


def _check_repacked(expected: np.ndarray, ids: np.ndarray, root: Path, spec, max_positions: int,
                    role: str) -> tuple[dict, list[str]]:
    """A GGUF graph's repacked blocks against the dequantized weights in PyTorch, with float
    compute and fp32's gate whatever the graph will compute in (int8 activations round)."""
    folder = root / Path(spec.path).parent
    if spec.compute != "float":
        set_compute(folder, "float")
    try:
        return validate_graph(expected, ids, root, replace(spec, compute="float"), max_positions,
                              "fp32", role)
    finally:
        if spec.compute != "float":
            set_compute(folder, spec.compute)


def _write_fused(ckpt: Checkpoint, folder: Path, role: str, variant: str,
                 token_ids: np.ndarray | None, ids: np.ndarray | None, report: "_Steps",
                 int8_compute: bool = False, eagle_fc=None):
    """Write the fused graph in its final precision; (stored types, about, reference logits,
    how they were computed).

    From the safetensors files (or a GGUF file) a tensor at a time, the reference a layer at a
    time; a checkpoint without them (pytorch_model.bin) is loaded whole, as optimum's is.
    A GGUF file's reference is its dequantized weights.
    """
    model = meta_model(ckpt.config)
    if isinstance(ckpt, GGUFCheckpoint):
        tensors, loaded = GGUFTensors(ckpt.path, model), None
    elif safetensors_files(ckpt.path):
        tensors, loaded = CheckpointTensors(ckpt.path), None
    else:
        loaded = load_model(ckpt.path)
        tensors = ModelTensors(loaded)
    bits = int(variant[3:]) if variant in EXPORT_QUANTIZATIONS else None
    block_size = (draft_block_size(ckpt.config) if role == "draft" and bits == 4
                  else QUANT_BLOCK_SIZE)
    report.detail(f"writing the fused graph ({variant}"
                  f"{f', blocks of {block_size}' if bits else ''}, "
                  f"{'one tensor at a time' if loaded is None else 'from the loaded model'})")
    stored = build_fused_graph(model, tensors, folder, keep_precision=variant != "fp16",
                               bits=bits, int8_compute=int8_compute,
                               token_ids=token_ids, progress=report.detail, eagle_fc=eagle_fc,
                               block_size=block_size)
    about = {"architecture": ckpt.config.model_type,
             "parameters": sum(p.numel() for p in model.parameters())}
    if isinstance(tensors, GGUFTensors):
        about["gguf"] = _gguf_weights(tensors, bits)
        report.detail("GGUF tensors: " + "; ".join(
            f"{how} {', '.join(f'{n} {kind}' for kind, n in kinds.items())}"
            for how, kinds in about["gguf"]["tensors"].items()))
    expected = reference = None
    if ids is not None and loaded is None:
        reference = "PyTorch, layer by layer"
        report.detail("computing PyTorch's reference logits, one layer at a time")
        expected = reference_logits_by_layer(model, tensors, ids, progress=report.detail)
    elif ids is not None:
        reference = "PyTorch, whole model"
        report.detail("computing PyTorch's reference logits")
        expected = reference_logits(loaded, ids)
    del model, tensors, loaded
    if isinstance(ckpt, GGUFCheckpoint):
        forget_reader(ckpt.path)  # read whole: its metadata is not needed again
    gc.collect()
    give_back_freed_memory()  # before the graph's sessions load
    if variant == "fp16":
        report.detail("converting to fp16")
        convert_fp16(folder)
    return stored, about, expected, reference


def _gguf_weights(tensors: GGUFTensors, bits: int | None) -> dict:
    """What became of a GGUF file's tensors, and the graph's quantization: the --quantize
    asked if it quantized matrices again, else that of the repacked blocks (int4 where any are
    4-bit)."""
    requantized = bool(bits) and tensors.requantizable
    repacked = tensors.repacked_bits
    quantization = (f"int{bits}" if requantized else
                    f"int{min(repacked)}" if repacked else None)
    return {"tensors": tensors.summary, "requantized": requantized,
            "quantization": quantization}


def _write_optimum(ckpt: Checkpoint, folder: Path, role: str, variant: str,
                   token_ids: np.ndarray | None, ids: np.ndarray | None, report: "_Steps",
                   int8_compute: bool = False, eagle_fc=None):
    """Export optimum's graph from the loaded model, then shrink it; as ``_write_fused``."""
    model = load_model(ckpt.path)
    report.detail("writing the optimum graph")
    export_graph(model.float(), folder)
    pin_ir_version(folder)
    about = {"architecture": model.config.model_type,
             "parameters": sum(p.numel() for p in model.parameters())}
    expected = reference = None
    if ids is not None:
        reference = "PyTorch, whole model"
        report.detail("computing PyTorch's reference logits")
        expected = reference_logits(model, ids)
    del model
    gc.collect()
    if variant == "fp16":
        report.detail("converting to fp16")
        convert_fp16(folder)
        return {}, about, expected, reference
    if variant in EXPORT_QUANTIZATIONS:
        report.detail(f"quantizing the weights to {variant}")
        quantize_weights(folder, bits=int(variant[3:]), int8_compute=int8_compute)
    return store_exact_halves(folder), about, expected, reference  # what stayed float


def _figures_line(figures: dict) -> str:
    clear = figures["clear_top1_agreement"]
    return (
        f"{figures['variant']}: max |dlogit| {figures['max_abs_diff_no_cache']:.2e}, mean total "
        f"variation {figures['mean_tv']:.4f}, top-1 agreement {figures['top1_agreement']:.0%}"
        + (f" ({clear:.0%} of {figures['clear_positions']} clear positions)" if clear is not None
           else "")
    )


def _write_package(
    tmp: Path, target: Checkpoint, draft: Checkpoint | None, specs: dict, vocab_size: int,
    generation: dict, head: Path | None = None,
) -> Manifest:
    tokenizer = target.tokenizer
    tokenizer.backend_tokenizer.save(str(tmp / TOKENIZER_NAME))
    saved = Tokenizer.from_file(str(tmp / TOKENIZER_NAME))  # as the runtime will load it
    template = _chat_template(tokenizer)
    if template is not None:
        (tmp / CHAT_TEMPLATE_NAME).write_text(template, encoding="utf-8")
    manifest = Manifest(
        target=specs["target"],
        draft=specs["draft"],
        vocab_size=vocab_size,
        max_positions=min(target.max_positions, draft.max_positions if draft else math.inf),
        eos_token_ids=target.eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        add_bos_token=_adds_bos(tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(saved),
        chat_template=None if template is None else CHAT_TEMPLATE_NAME,
        special_tokens=dict(tokenizer.special_tokens_map) if template is not None else {},
        generation=generation,
        source={"target": str(target.path.resolve()),
                **({"draft": str(draft.path.resolve())} if draft else {}),
                **({"draft": str(head.resolve())} if head else {})},
        edgespec_version=edgespec.__version__,
    )
    manifest.write(tmp)
    return manifest


def _chat_template(tokenizer) -> str | None:
    """The tokenizer's chat template (tokenizer_config.json or chat_template.jinja): the string,
    or the one named "default" of several; None if it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def _adds_bos(tokenizer) -> bool:
    """Whether the Hugging Face tokenizer starts every prompt with BOS (Llama-style)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("x").input_ids[:1] == [bos]


class _Steps:
    """Numbered progress lines with the time each step took and the memory in use."""

    def __init__(self, progress: Progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.done += 1
        self.progress(f"[{self.done}/{self.total}] {what}...")
        start = time.perf_counter()
        yield
        self.progress(f"[{self.done}/{self.total}] done in {time.perf_counter() - start:.1f}s "
                      f"({usage()})")

    def detail(self, what: str) -> None:
        self.progress(f"      {what} ({usage()})")
