"""Writing ONNX files that every supported onnxruntime build loads.

One place decides the IR version and when weights go to an external data file.

IR version: ``onnx`` stamps a model with the newest IR version it knows (14 for onnx 1.23),
which onnxruntime-gpu 1.31.1 and every onnxruntime before 1.32 refuse ("Unsupported model IR
version"). A graph needs only the IR version that introduced the operator sets it imports
(opset 17 -> IR 8), so that is what is written.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

PROTOBUF_LIMIT = 2**31 - 2**26  # a .onnx file holds at most 2 GB; leave room for the graph
EXTERNAL_ABOVE = 2**30  # graphs built here keep larger weights in model.onnx_data
DATA_NAME = "model.onnx_data"
_ALIGN = 4096  # external weights start on a page, so onnxruntime can map them
_MIN_CAST_SIZE = 1024  # smaller float weights are stored as float32: a Cast costs more
_MIN_EXTERNAL_BYTES = 4096


class WeightStore:
    """The initializers of a graph being built, written to disk as they are made.

    ``external``: each weight's bytes go straight to model.onnx_data and the protobuf holds
    only a reference, so no second copy of the weights is ever in memory. ``keep_precision``:
    bf16/fp16 tensors are stored as such, behind a Cast to float32 that onnxruntime folds at
    load (lossless: every bf16 or fp16 value is a float32 value).
    """

    def __init__(self, folder: Path, external: bool, keep_precision: bool):
        self.initializers: list = []
        self.counts: Counter = Counter()  # float weights per stored type
        self.keep_precision = keep_precision
        self._data = open(folder / DATA_NAME, "wb") if external else None

    def __enter__(self) -> "WeightStore":
        return self

    def __exit__(self, *exc) -> None:
        if self._data:
            self._data.close()

    def add(self, name: str, value, nodes: list) -> str:
        """Store ``value`` (a torch tensor or NumPy array) as ``name``; returns the name to use.

        A Cast node, when one is needed, is appended to ``nodes``.
        """
        from onnx import TensorProto, helper

        raw, data_type, dims = _raw(value, self.keep_precision)
        if data_type in (TensorProto.BFLOAT16, TensorProto.FLOAT16) and int(np.prod(dims)) >= _MIN_CAST_SIZE:
            stored = f"{name}.{'bf16' if data_type == TensorProto.BFLOAT16 else 'fp16'}"
            nodes.append(helper.make_node("Cast", [stored], [name], to=TensorProto.FLOAT,
                                          name=f"Cast_{stored}"))
        else:
            stored = name
            if data_type in (TensorProto.BFLOAT16, TensorProto.FLOAT16):  # small: upcast
                raw, data_type = _upcast(raw, data_type), TensorProto.FLOAT
        if data_type in (TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.FLOAT16):
            self.counts[TensorProto.DataType.Name(data_type).lower()] += 1
        tensor = TensorProto(name=stored, data_type=data_type, dims=dims)
        if self._data is None or len(raw) < _MIN_EXTERNAL_BYTES:  # shapes and axes stay inline:
            # onnxruntime's shape inference reads them before external data is loaded
            tensor.raw_data = raw
        else:
            offset = -self._data.tell() % _ALIGN + self._data.tell()
            self._data.seek(offset)
            self._data.write(raw)
            tensor.data_location = TensorProto.EXTERNAL
            for key, val in (("location", DATA_NAME), ("offset", str(offset)),
                             ("length", str(len(raw)))):
                tensor.external_data.add(key=key, value=val)
        self.initializers.append(tensor)
        return name


def _raw(value, keep_precision: bool) -> tuple[bytes, int, list[int]]:
    """(little-endian bytes, ONNX data type, dims) of a torch tensor or NumPy array."""
    from onnx import TensorProto, helper

    if hasattr(value, "detach"):  # a torch tensor
        import torch

        tensor = value.detach().contiguous()
        dims = list(tensor.shape)
        if keep_precision and tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().tobytes(), TensorProto.BFLOAT16, dims
        if keep_precision and tensor.dtype == torch.float16:
            return tensor.numpy().tobytes(), TensorProto.FLOAT16, dims
        value = tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
    array = np.ascontiguousarray(value)
    return array.tobytes(), helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape)


def _upcast(raw: bytes, data_type: int) -> bytes:
    from onnx import TensorProto

    if data_type == TensorProto.FLOAT16:
        return np.frombuffer(raw, np.float16).astype(np.float32).tobytes()
    return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).tobytes()  # bf16 -> f32


def write_graph(graph, folder: Path, opsets: list[tuple[str, int]]) -> None:
    """Save a graph built with a WeightStore as folder/model.onnx, at the oldest IR it allows."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets],
                              producer_name="edgespec")
    model.ir_version = min_ir_version(model)
    onnx.save(model, str(folder / "model.onnx"))


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
