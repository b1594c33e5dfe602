"""One checkpoint to one ONNX decoder graph with KV-cache inputs and outputs, via optimum."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from edgespec.errors import ExportError
from edgespec.manifest import ModelSpec

TASK = "text-generation-with-past"
_MIN_WEIGHT_SIZE = 1024  # smaller constants are not worth a Cast node
_PROTOBUF_LIMIT = 2**31 - 2**26  # beyond this, weights go to model.onnx_data


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


def store_exact_fp16(folder: Path) -> int:
    """Store float32 weights that are exactly float16 values as float16, with a Cast back.

    Lossless: only weights whose every value survives the round trip are converted, and
    onnxruntime folds each Cast into a float32 weight when the session loads, so the graph
    computes exactly as before. Checkpoints saved in fp16 halve their package size this way.
    Returns the number of weights converted.
    """
    import onnx
    from onnx import helper, numpy_helper

    path = folder / "model.onnx"
    model = onnx.load(str(path))
    casts, converted = [], 0
    for init in model.graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT or _size(init) < _MIN_WEIGHT_SIZE:
            continue
        weights = numpy_helper.to_array(init)
        half = weights.astype(np.float16)
        if not np.array_equal(half.astype(np.float32), weights, equal_nan=True):
            continue
        name = init.name
        init.CopyFrom(numpy_helper.from_array(half, f"{name}.fp16"))
        casts.append(helper.make_node("Cast", [f"{name}.fp16"], [name], to=onnx.TensorProto.FLOAT))
        converted += 1
    if converted:
        nodes = [*casts, *model.graph.node]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        for stale in folder.glob("model.onnx*"):
            stale.unlink()
        big = sum(len(init.raw_data) for init in model.graph.initializer) > _PROTOBUF_LIMIT
        onnx.save(model, str(path), save_as_external_data=big, location="model.onnx_data")
    return converted


def _size(init) -> int:
    return int(np.prod(init.dims)) if init.dims else 1


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
        dtype="float32",
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
