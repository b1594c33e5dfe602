"""Tensors made at load from a package's recipes (runtime/unpack.py): what they make, and a
hostile recipe refused with one line before anything is read past the data file or allocated
beyond a bound."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgespec.errors import ManifestError
from edgespec.export.gguf_blocks import repack
from edgespec.runtime import loader, unpack


def _folder(tmp_path, recipes: dict, data: bytes = bytes(range(256)) * 4):
    (tmp_path / unpack.DATA_NAME).write_bytes(data)
    (tmp_path / unpack.UNPACK_NAME).write_text(json.dumps(recipes))
    return tmp_path


def _part(offset: int, shape: list[int], dtype: str = "uint8") -> dict:
    length = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return {"op": "part", "offset": offset, "length": length, "dtype": dtype, "shape": shape}


def test_recipes_written_by_the_exporter_make_the_blocks_matmulnbits_reads(tmp_path):
    """A Q6_K and a Q5_K weight through the exporter's recipes (5/6-bit values in two bit
    planes, scales and minimums as float16 x 6-bit factors) equal the repacked arrays."""
    from edgespec.export import fused
    from edgespec.export.onnx_io import WeightStore

    rng = np.random.default_rng(0)
    raw = {}
    for qtype, size in (("Q6_K", 210), ("Q5_K", 176)):
        blocks = rng.integers(0, 256, (8, 2, size), dtype=np.uint8)
        d = rng.uniform(1e-5, 1e-4, (8, 2, 1)).astype(np.float16).view(np.uint8)
        blocks[..., -2:] = d if qtype == "Q6_K" else blocks[..., -2:]
        if qtype == "Q5_K":
            blocks[..., 0:2], blocks[..., 2:4] = d, d
        raw[qtype] = repack(blocks.reshape(8, -1), qtype)
    with WeightStore(tmp_path, external=False, keep_precision=True) as store:
        for qtype, packed in raw.items():
            store.add_unpacked(f"{qtype}.values", fused._values(packed), np.uint8,
                               packed.data.shape)
            store.add_unpacked(f"{qtype}.scales", fused._factors(packed.scale_parts),
                               np.float32, packed.scales.shape)
        lows = raw["Q5_K"].minimum_parts
        store.add_unpacked("Q5_K.minimums", {"op": "transpose", "of": fused._factors(lows)},
                           np.float32, raw["Q5_K"].minimums.T.shape)
    made = unpack.read(tmp_path)
    for qtype, packed in raw.items():
        np.testing.assert_array_equal(made[f"{qtype}.values"], packed.data)
        np.testing.assert_array_equal(made[f"{qtype}.scales"], packed.scales)
    np.testing.assert_array_equal(made["Q5_K.minimums"], raw["Q5_K"].minimums.T)


@pytest.mark.parametrize("recipe,match", [
    (_part(1000, [100]), "does not lie in the data file"),
    ({**_part(0, [4]), "length": 3}, "does not lie in the data file"),
    ({**_part(0, [4]), "dtype": "object"}, "cannot be made"),
    ({"op": "bits", "width": 3, "shape": [8], "of": _part(0, [3])}, "3-bit fields"),
    ({"op": "zeros", "shape": [2**30, 2**30]}, "far more bytes than its data file"),
    ({"op": "zeros", "shape": [2**20, 64]}, "far more bytes than its data file"),
    ({"op": "transpose", "of": {"op": "transpose", "of": {"op": "transpose", "of": {
        "op": "transpose", "of": {"op": "transpose", "of": {"op": "transpose", "of": {
            "op": "transpose", "of": _part(0, [2, 2])}}}}}}}, "at most a few levels deep"),
    ({"op": "exec", "code": "1"}, "unknown op"),
    ([1, 2], "at most a few levels deep"),
])
def test_a_hostile_recipe_is_one_line(tmp_path, recipe, match):
    folder = _folder(tmp_path, {"w": recipe})
    with pytest.raises(ManifestError, match=match) as error:
        unpack.read(folder)
    assert "\n" not in str(error.value) and "re-export" in str(error.value)


def test_a_data_file_that_is_a_link_is_refused(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(bytes(64))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / unpack.DATA_NAME).symlink_to(outside)
    (tmp_path / "pkg" / unpack.UNPACK_NAME).write_text(json.dumps({"w": _part(0, [4])}))
    with pytest.raises(ManifestError, match="missing"):
        unpack.read(tmp_path / "pkg")


@pytest.mark.parametrize("base,scaling", [(10_000.0, None), (1_000_000.0, None),
                                          (1_000_000.0, {"rope_type": "linear", "factor": 8.0}),
                                          (10_000.0, {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 4096})])
def test_rotary_tables_made_at_load_are_transformers(tmp_path, base, scaling):
    """Gemma 3's rotary tables from the module's frequencies (its two bases, the global one
    scaled) equal what its rotary module computes, within a unit in the last place of cos and
    sin (the recipe rounds a float64 cos once; PyTorch's float32 cos is within one ulp)."""
    import torch
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = Gemma3TextConfig(head_dim=256, rope_theta=base, rope_scaling=scaling,
                              max_position_embeddings=16384)
    rotary = Gemma3RotaryEmbedding(config)
    frequencies = rotary.inv_freq.float().numpy()
    folder = _folder(tmp_path, {fn: {"op": "rotary", "frequencies": _part(0, [128], "float32"),
                                     "positions": 16384, "fn": fn,
                                     "scale": float(rotary.attention_scaling)}
                                for fn in ("cos", "sin")}, frequencies.tobytes())
    made = unpack.read(folder)
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1), torch.arange(16384)[None])
    for fn, expected in (("cos", cos), ("sin", sin)):
        assert made[fn].shape == (16384, 128) and made[fn].dtype == np.float32
        np.testing.assert_allclose(made[fn], expected[0, :, :128].numpy(), rtol=0, atol=2.4e-7)


def test_rotary_tables_have_a_budget_of_their_own(tmp_path):
    """Tables larger than a long context's are refused, and so are many of them."""
    part = _part(0, [64], "float32")
    table = {"op": "rotary", "frequencies": part, "positions": 1 << 21, "fn": "cos", "scale": 1}
    with pytest.raises(ManifestError, match="far more bytes"):
        unpack.read(_folder(tmp_path, {"big": table}))
    many = {str(i): {**table, "positions": 1 << 16} for i in range(17)}  # 17 x 16 MB
    with pytest.raises(ManifestError, match="far more bytes"):
        unpack.read(_folder(tmp_path, many))


class _Session:
    """What release_unpacked sees of an onnxruntime session."""

    def __init__(self, folder, provider="CPUExecutionProvider", groups=None):
        self.edgespec_unpacked, self.edgespec_folder = unpack.read(folder), folder
        self.provider = provider
        if groups is not None:  # handed over in place, grouped as the export marked them
            self.edgespec_groups = groups

    def get_providers(self):
        return [self.provider]


def _two_tensors(tmp_path):
    return _folder(tmp_path, {"a": _part(0, [4, 8]), "b": _part(32, [2, 4], "float32")})


def test_tensors_nothing_reads_are_let_go(tmp_path):
    session = _Session(_two_tensors(tmp_path))
    assert loader.release_unpacked(session, lambda: [np.ones(3)]) == 32 + 32
    assert session.edgespec_unpacked == {}


def test_tensors_a_run_still_reads_are_made_again_and_kept(tmp_path):
    """A probe whose outputs come from the tensors (a kernel that reads them at each run): the
    zeroed tensors change them, so every tensor is made again and kept (dropped or left
    zeroed, the graph's outputs would be garbage)."""
    folder = _two_tensors(tmp_path)
    session = _Session(folder)
    made = session.edgespec_unpacked
    assert loader.release_unpacked(session, lambda: [made["a"].sum()]) == 0
    assert set(made) == {"a", "b"}
    for name, array in unpack.read(folder).items():
        np.testing.assert_array_equal(made[name], array)


def test_tensors_of_other_providers_are_kept(tmp_path):
    """TensorRT builds its engines at the first run, from the weights as given."""
    session = _Session(_two_tensors(tmp_path), "TensorrtExecutionProvider")
    assert loader.release_unpacked(session, lambda: [np.ones(3)]) == 0
    assert set(session.edgespec_unpacked) == {"a", "b"}


def test_in_place_groups_are_let_go_one_by_one(tmp_path):
    """Tensors handed over in place: a group nothing reads goes, a group a run reads is made
    again in place and kept, and a tensor in no group (read at every run) is never zeroed."""
    folder = _folder(tmp_path, {"a": _part(0, [4, 8]), "b": _part(32, [2, 4], "float32"),
                                "c": _part(64, [8])})
    session = _Session(folder, groups=[["a"], ["b"]])
    made = session.edgespec_unpacked
    runs = []
    reads = lambda: runs.append(1) or [made["b"].sum(), made["c"].sum()]  # noqa: E731
    assert loader.release_unpacked(session, reads) == 32
    assert set(made) == {"b", "c"}
    assert len(runs) == 4  # before, both groups at once, then each
    unread = _Session(folder, groups=[["a"], ["b"]])
    runs.clear()
    assert loader.release_unpacked(unread, lambda: runs.append(1) or [np.ones(2)]) == 64
    assert unread.edgespec_unpacked == {"c": unread.edgespec_unpacked["c"]} and len(runs) == 2
    fresh = unpack.read(folder)
    for name in ("b", "c"):
        np.testing.assert_array_equal(made[name], fresh[name])


def test_the_export_marks_what_packing_kernels_alone_read():
    """MatMulNBits' weights and MatMul's right-hand side are "weights", MatMulNBits' scales
    and zero points "scales" and "zero_points"; a tensor a gather also reads, or that feeds a
    MatMul's left side, is not marked."""
    from onnx import helper

    from edgespec.export.onnx_io import WeightStore

    store = WeightStore.__new__(WeightStore)
    store.recipes = {name: {"op": "zeros", "shape": [1]} for name in "wszmtgl"}
    store.mark_packed([
        helper.make_node("MatMulNBits", ["x", "w", "s", "z"], ["y"]),
        helper.make_node("MatMul", ["x", "m"], ["y1"]),
        helper.make_node("MatMulNBits", ["x", "t", "g"], ["y2"]),
        helper.make_node("GatherBlockQuantized", ["t", "i", "g"], ["e"]),
        helper.make_node("MatMul", ["l", "m"], ["y3"]),
    ])
    marks = {name: recipe.get("packed") for name, recipe in store.recipes.items()}
    assert marks == {"w": "weights", "s": "scales", "z": "zero_points", "m": "weights",
                     "t": None, "g": None, "l": None}


def test_a_read_of_zeros_is_seen(tmp_path):
    """Zero points are zeros: a probe that reads a tensor of zeros sees it read (its bits are
    flipped, not zeroed), and the tensor is kept as it was."""
    folder = _folder(tmp_path, {"zeros": {"op": "zeros", "shape": [4, 4]}})
    session = _Session(folder)
    made = session.edgespec_unpacked
    assert loader.release_unpacked(session, lambda: [made["zeros"].sum()]) == 0
    np.testing.assert_array_equal(made["zeros"], np.zeros((4, 4), np.uint8))


def test_only_an_empty_location_file_hands_tensors_over_in_place(tmp_path):
    """The location file must be the export's empty one: a link (to a file of anyone's) or a
    file with bytes in it falls back to copies."""
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    location = tmp_path / unpack.LOCATION
    assert not loader._empty_file(location)
    location.write_bytes(b"")
    assert loader._empty_file(location)
    location.write_bytes(b"x")
    assert not loader._empty_file(location)
    location.unlink()
    location.symlink_to(target)
    assert not loader._empty_file(location)
