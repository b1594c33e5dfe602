"""Writing ONNX files that every supported onnxruntime build loads.

One place decides the IR version and when weights go to an external data file.

IR version: ``onnx`` stamps a model with the newest IR version it knows (14 for onnx 1.23),
which onnxruntime-gpu 1.31.1 and every onnxruntime before 1.32 refuse ("Unsupported model IR
version"). A graph needs only the IR version that introduced the operator sets it imports
(opset 17 -> IR 8), so that is what is written.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from edgespec.manifest import DATA_NAME, LOCATION, UNPACK_NAME

PROTOBUF_LIMIT = 2**31 - 2**26  # a .onnx file holds at most 2 GB; leave room for the graph
EXTERNAL_ABOVE = 2**26  # graphs built here keep larger weights in model.onnx_data: inline
# weights are held until the protobuf is written, and copied twice then (graph, serialized)
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
        self.written = 0  # bytes of weights stored so far
        self.keep_precision = keep_precision
        self.folder, self.external = folder, external
        self._data = open(folder / DATA_NAME, "wb") if external else None
        self.recipes: dict[str, dict] = {}  # tensors made at load (runtime/unpack.py)

    def __enter__(self) -> "WeightStore":
        return self

    def __exit__(self, *exc) -> None:
        if self._data:
            self._data.close()
        if self.recipes and exc[0] is None:
            (self.folder / UNPACK_NAME).write_text(json.dumps(self.recipes) + "\n")
            # onnxruntime checks that an external location exists even for initializers the
            # session is handed in place (runtime/loader.py): an empty file under that name
            (self.folder / LOCATION).write_bytes(b"")

    def mark_packed(self, nodes) -> None:
        """Mark the made tensors that only kernels which pack their weights as the session
        loads read (recipe key ``"packed"``, one of manifest.py's ``PACKED_GROUPS``: it hands
        them over in place and lets go of the groups no run reads): ``"weights"`` for
        MatMulNBits' weights and MatMul's right-hand side, ``"scales"`` and ``"zero_points"``
        for MatMulNBits' (packed with the weights by int8 compute, read at every run by float
        compute)."""
        kinds = {("MatMulNBits", 1): "weights", ("MatMul", 1): "weights",
                 ("MatMulNBits", 2): "scales", ("MatMulNBits", 3): "zero_points"}
        readers: dict[str, set] = {}
        for node in nodes:
            for slot, name in enumerate(node.input):
                if name in self.recipes:
                    readers.setdefault(name, set()).add(kinds.get((node.op_type, slot)))
        for name, seen in readers.items():
            if len(seen) == 1 and None not in seen:
                self.recipes[name]["packed"] = seen.pop()

    def add_unpacked(self, name: str, recipe: dict, dtype, shape: tuple[int, ...]) -> str:
        """A tensor made when the graph loads (runtime/unpack.py) from ``recipe``, whose
        ``{"op": "part", "array": a}`` leaves are written to the data file here; the graph
        declares it as an initializer at unpack.LOCATION. Returns ``name``."""
        from onnx import TensorProto, helper

        if self._data is None:  # parts always go to the data file, however small the graph
            self._data = open(self.folder / DATA_NAME, "wb")
        self.recipes[name] = self._write_parts(recipe)
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(
            np.dtype(dtype)), dims=list(shape))
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value=LOCATION)
        self.initializers.append(tensor)
        return name

    def _write_parts(self, recipe: dict) -> dict:
        out = {}
        for key, value in recipe.items():
            if isinstance(value, dict):
                out[key] = self._write_parts(value)
            elif key == "array":
                array = np.ascontiguousarray(value)
                offset = self._append(array)
                out.update(offset=offset, length=array.nbytes, dtype=array.dtype.name,
                           shape=list(array.shape))
            else:
                out[key] = value
        return out

    def _append(self, array: np.ndarray) -> int:
        """Write ``array`` at the data file's next aligned offset; returns the offset."""
        offset = -self._data.tell() % _ALIGN + self._data.tell()
        self._data.seek(offset)
        self._data.write(array.data)  # the array's own bytes, no copy
        self.written += array.nbytes
        return offset

    def add(self, name: str, value, nodes: list, counted: bool = True) -> str:
        """Store ``value`` (a torch tensor or NumPy array) as ``name``; returns the name to use.

        A Cast node, when one is needed, is appended to ``nodes``. ``counted``: a float weight
        goes into ``counts`` (not the scales of quantized weights, which stay float32).
        """
        from onnx import TensorProto, helper

        array, data_type = _array(value, self.keep_precision)
        dims = list(array.shape)
        if data_type in (TensorProto.BFLOAT16, TensorProto.FLOAT16) and array.size >= _MIN_CAST_SIZE:
            stored = f"{name}.{'bf16' if data_type == TensorProto.BFLOAT16 else 'fp16'}"
            nodes.append(helper.make_node("Cast", [stored], [name], to=TensorProto.FLOAT,
                                          name=f"Cast_{stored}"))
        else:
            stored = name
            if data_type in (TensorProto.BFLOAT16, TensorProto.FLOAT16):  # small: upcast
                array, data_type = _upcast(array, data_type), TensorProto.FLOAT
        if counted and data_type in (TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.FLOAT16):
            self.counts[TensorProto.DataType.Name(data_type).lower()] += 1
        tensor = TensorProto(name=stored, data_type=data_type, dims=dims)
        if not self.external or array.nbytes < _MIN_EXTERNAL_BYTES:  # shapes and axes stay
            # inline: onnxruntime's shape inference reads them before external data is loaded
            tensor.raw_data = array.tobytes()
            self.written += array.nbytes
        else:
            offset = self._append(array)
            tensor.data_location = TensorProto.EXTERNAL
            for key, val in (("location", DATA_NAME), ("offset", str(offset)),
                             ("length", str(array.nbytes))):
                tensor.external_data.add(key=key, value=val)
        self.initializers.append(tensor)
        return name


def _array(value, keep_precision: bool) -> tuple[np.ndarray, int]:
    """(a C-contiguous little-endian array, its ONNX data type) of a torch tensor or NumPy
    array; bf16 travels as its uint16 bits."""
    from onnx import TensorProto, helper

    if hasattr(value, "detach"):  # a torch tensor
        import torch

        tensor = value.detach().contiguous()
        if keep_precision and tensor.dtype == torch.bfloat16:
            return tensor.view(torch.uint16).numpy(), TensorProto.BFLOAT16
        if keep_precision and tensor.dtype == torch.float16:
            return tensor.numpy(), TensorProto.FLOAT16
        value = tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
    array = np.ascontiguousarray(value)
    return array, helper.np_dtype_to_tensor_dtype(array.dtype)


def _upcast(array: np.ndarray, data_type: int) -> np.ndarray:
    from onnx import TensorProto

    if data_type == TensorProto.FLOAT16:
        return array.astype(np.float32)
    return (array.astype(np.uint32) << 16).view(np.float32)  # bf16 bits -> float32


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

    if (folder / UNPACK_NAME).exists():  # its parts live in the data file removed below
        raise RuntimeError(f"{folder}: a graph with tensors made at load is not rewritten")
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
