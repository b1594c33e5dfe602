"""Writing ONNX files that every supported onnxruntime build loads.

One place decides the IR version and when weights go to an external data file.

IR version: ``onnx`` stamps a model with the newest IR version it knows (14 for onnx 1.23),
which onnxruntime-gpu 1.31.1 and every onnxruntime before 1.32 refuse ("Unsupported model IR
version"). A graph needs only the IR version that introduced the operator sets it imports
(opset 17 -> IR 8), so that is what is written.
"""

from __future__ import annotations

from pathlib import Path

PROTOBUF_LIMIT = 2**31 - 2**26  # a .onnx file holds at most 2 GB; leave room for the graph
DATA_NAME = "model.onnx_data"


def min_ir_version(model) -> int:
    """The oldest IR version that carries the model's default-domain operator set."""
    from onnx import helper

    default = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    return helper.find_min_ir_version_for(default, ignore_unknown=True)


def save_model(model, folder: Path) -> None:
    """Replace folder/model.onnx (and its external data when the weights pass 2 GB)."""
    import onnx

    model.ir_version = min_ir_version(model)
    for stale in folder.glob("model.onnx*"):
        stale.unlink()
    big = weight_bytes(model) > PROTOBUF_LIMIT
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=big, location=DATA_NAME)


def weight_bytes(model) -> int:
    """Bytes of the initializers held in the protobuf (external ones are not counted)."""
    return sum(init.ByteSize() for init in model.graph.initializer)


def pin_ir_version(folder: Path) -> None:
    """Rewrite folder/model.onnx's IR version down to the oldest its opsets allow, in place.

    For graphs written by other tools (optimum through torch.onnx); external weights are left
    where they are.
    """
    import onnx

    path = folder / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    wanted = min_ir_version(model)
    if model.ir_version != wanted:
        model.ir_version = wanted
        onnx.save(model, str(path))
