"""One checkpoint to one ONNX decoder graph with KV-cache inputs and outputs, via optimum."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
import warnings
from pathlib import Path

from transformers import AutoModelForCausalLM, PreTrainedModel

from edgespec.errors import ExportError
from edgespec.manifest import ModelSpec

TASK = "text-generation-with-past"
_ONNX_DTYPES = {1: "float32", 10: "float16"}  # TensorProto.FLOAT, FLOAT16


def load_model(path: Path) -> PreTrainedModel:
    """The checkpoint in its own dtype (bf16 stays bf16: half the memory of an fp32 upcast).

    The graphs compute in float32 all the same: the fused builder stores the weights as they
    are behind a Cast, optimum's export upcasts the model first.
    """
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # torch/transformers/safetensors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"{path}: cannot load the model's weights ({first})") from None
    return model.eval()


def meta_model(config) -> PreTrainedModel:
    """The model's modules without weights, on PyTorch's meta device (no memory, no reading):
    what tensors are tied, how many parameters there are, the classes of its layers and its
    rotary embedding, for a checkpoint read one tensor at a time (export/tensors.py)."""
    import copy

    import torch

    with torch.device("meta"), quiet():
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return model.eval()


def export_graph(model: PreTrainedModel, folder: Path) -> None:
    """Write ``folder/model.onnx`` (plus external data for models over 2 GB)."""
    from optimum.exporters.onnx import onnx_export_from_model

    scratch = folder.with_name(folder.name + ".optimum")
    try:
        with quiet():
            onnx_export_from_model(model, scratch, task=TASK, do_validation=False)
    except Exception as e:  # optimum raises many types; the user needs the message
        shutil.rmtree(scratch, ignore_errors=True)
        raise ExportError(f"optimum could not export {model.config.model_type}: {e}") from e
    folder.mkdir(parents=True)
    for path in scratch.glob("model.onnx*"):  # the graph and its external data, nothing else
        path.rename(folder / path.name)
    shutil.rmtree(scratch)


def describe_graph(folder: Path, root: Path, architecture: str, parameters: int) -> ModelSpec:
    """Read KV names and shapes from the exported graph itself, not from the config.

    Reads the graph's declared inputs and outputs only: the weights are not loaded.
    """
    import onnx

    path = folder / "model.onnx"
    graph = onnx.load(str(path), load_external_data=False).graph
    inputs = {i.name: i.type.tensor_type for i in graph.input}
    outputs = {o.name: o.type.tensor_type for o in graph.output}
    kv_inputs = [n for n in inputs if n.startswith("past_key_values.")]
    kv_outputs = [n for n in outputs if n.startswith("present.")]
    if not kv_inputs or len(kv_inputs) != len(kv_outputs):
        raise ExportError(f"{path.name}: the graph has no KV-cache inputs/outputs to pair")
    _, kv_heads, _, head_dim = (d.dim_value for d in inputs[kv_inputs[0]].shape.dim)
    return ModelSpec(
        path=str(path.relative_to(root)),
        architecture=architecture,
        layers=len(kv_inputs) // 2,
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        vocab_size=int(outputs["logits"].shape.dim[-1].dim_value),
        kv_inputs=kv_inputs,
        kv_outputs=kv_outputs,
        dtype=_ONNX_DTYPES[outputs["logits"].elem_type],
        parameters=parameters,
    )


@contextmanager
def quiet(*names: str) -> Iterator[None]:
    """Silence warnings and the named loggers' info logs (torch.onnx, optimum, onnxruntime's
    quantizer print pages of them), and undo any logging set-up done on import in the block."""
    names = names or ("optimum", "transformers", "torch.onnx")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    root = logging.getLogger()
    root_state = root.level, list(root.handlers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
            root.setLevel(root_state[0])
            root.handlers[:] = root_state[1]
