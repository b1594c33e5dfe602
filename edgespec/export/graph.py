"""One checkpoint to one ONNX decoder graph with KV-cache inputs and outputs, via optimum."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
import warnings
from pathlib import Path

import onnxruntime as ort
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from edgespec.errors import ExportError
from edgespec.manifest import ModelSpec

TASK = "text-generation-with-past"
_ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16"}


def load_model(path: Path) -> PreTrainedModel:
    """The checkpoint in float32 (fp16/bf16 weights are upcast: the CPU graph runs in fp32)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def export_graph(model: PreTrainedModel, folder: Path) -> None:
    """Write ``folder/model.onnx`` (plus external data for models over 2 GB)."""
    from optimum.exporters.onnx import onnx_export_from_model

    scratch = folder.with_name(folder.name + ".optimum")
    try:
        with _quiet():
            onnx_export_from_model(model, scratch, task=TASK, do_validation=False)
    except Exception as e:  # optimum raises many types; the user needs the message
        shutil.rmtree(scratch, ignore_errors=True)
        raise ExportError(f"optimum could not export {model.config.model_type}: {e}") from e
    folder.mkdir(parents=True)
    for path in scratch.glob("model.onnx*"):  # the graph and its external data, nothing else
        path.rename(folder / path.name)
    shutil.rmtree(scratch)


def describe_graph(folder: Path, root: Path, model: PreTrainedModel) -> ModelSpec:
    """Read KV names and shapes from the exported graph itself, not from the config."""
    path = folder / "model.onnx"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    kv_inputs = [n for n in inputs if n.startswith("past_key_values.")]
    kv_outputs = [n for n in outputs if n.startswith("present.")]
    if not kv_inputs or len(kv_inputs) != len(kv_outputs):
        raise ExportError(f"{path.name}: the graph has no KV-cache inputs/outputs to pair")
    _, kv_heads, _, head_dim = inputs[kv_inputs[0]].shape
    return ModelSpec(
        path=str(path.relative_to(root)),
        architecture=model.config.model_type,
        layers=len(kv_inputs) // 2,
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        vocab_size=int(outputs["logits"].shape[-1]),
        kv_inputs=kv_inputs,
        kv_outputs=kv_outputs,
        dtype=_ORT_DTYPES[outputs["logits"].type],
        parameters=sum(p.numel() for p in model.parameters()),
    )


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence the tracer warnings and info logs that torch.onnx and optimum print on export."""
    loggers = [logging.getLogger(name) for name in ("optimum", "transformers", "torch.onnx")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
