"""EAGLE-3 heads: the PyTorch reference, the target's eagle_features output, the head graph
against the reference, and the checks that refuse malformed heads."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import llama  # noqa: E402

from edgespec.errors import ExportError  # noqa: E402
from edgespec.export.aux_layers import check_aux_layers, default_aux_layers  # noqa: E402
from edgespec.export.eagle3 import (  # noqa: E402
    Eagle3Head,
    HeadTensors,
    aux_features,
    is_eagle3_head,
    read_head_config,
    write_random_head,
)
from edgespec.export.tensors import CheckpointTensors, ModelTensors  # noqa: E402

AUX = (0, 1, 2)
SEQ = 12


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 3-layer random Llama (heads of 16) and its saved folder."""
    model = llama(200, 64, 3, seed=11, init=0.1)
    folder = tmp_path_factory.mktemp("eagle_target") / "target"
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    model, _ = target
    folder = write_random_head(tmp_path_factory.mktemp("eagle_head") / "head", model.config,
                               draft_vocab=80, seed=3, aux_layers=AUX, init=0.1)
    config = read_head_config(folder, model.config)
    tensors = HeadTensors(config)
    reference = Eagle3Head.load(config, tensors, model.model.embed_tokens.weight.detach())
    return config, tensors, reference


def _inputs(model, config):
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 200, SEQ))[None]
    return ids, aux_features(model, ids, config)


def test_the_written_head_reads_back_in_the_published_format(head):
    config, tensors, _ = head
    assert is_eagle3_head(config.path)
    assert config.aux_layers == AUX and config.draft_vocab == 80
    ids = tensors.target_ids(config)
    assert (ids == 2 * np.arange(80)).all()  # draft id + d2t[draft id]
    t2d = tensors.read("t2d").numpy()
    assert t2d.sum() == 80 and t2d[ids].all()


def test_reference_through_its_cache_equals_one_run(target, head):
    """Rows run in two calls (the second reading the first's keys and values) equal one call:
    the cache and positions line up. A reference that restarts positions at 0 for the second
    call (rotary at the wrong place) fails this."""
    model, _ = target
    config, _, reference = head
    ids, features = _inputs(model, config)
    whole = reference(ids, features, torch.arange(SEQ)[None])
    first = reference(ids[:, :5], features[:, :5], torch.arange(5)[None])
    second = reference(ids[:, 5:], features[:, 5:], torch.arange(5, SEQ)[None], first[2])
    torch.testing.assert_close(torch.cat([first[0], second[0]], 1), whole[0])
    torch.testing.assert_close(torch.cat([first[1], second[1]], 1), whole[1])
    wrong = reference(ids[:, 5:], features[:, 5:], torch.arange(SEQ - 5)[None], first[2])
    assert not torch.allclose(wrong[0], whole[0][:, 5:], atol=1e-4)
    # fc applied before the call is the same input
    fed = reference.fc(features)
    torch.testing.assert_close(reference(ids, fed, torch.arange(SEQ)[None])[0], whole[0])


def test_target_graph_outputs_fc_of_the_aux_streams(target, head, tmp_path):
    """eagle_features = fc(cat(hidden_states[a], [b], [c])): the residual streams entering the
    aux layers. The same check rejects the streams leaving them (hidden_states[i + 1])."""
    import onnxruntime as ort

    from edgespec.export.fused import EAGLE_FEATURES, build_fused_graph
    from edgespec.manifest import LOGITS_TO_KEEP

    model, _ = target
    config, tensors, reference = head
    build_fused_graph(model, ModelTensors(model), tmp_path / "t",
                      eagle_fc=(config.aux_layers, tensors.read("fc.weight")))
    session = ort.InferenceSession(str(tmp_path / "t" / "model.onnx"))
    ids, features = _inputs(model, config)
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones((1, SEQ), np.int64),
             LOGITS_TO_KEEP: np.zeros(1, np.int64)}
    for arg in session.get_inputs():
        if arg.name.startswith("past_key_values"):
            feeds[arg.name] = np.zeros((1, 2, 0, 16), np.float32)
    (out,) = session.run([EAGLE_FEATURES], feeds)
    expected = reference.fc(features).numpy()
    np.testing.assert_allclose(out, expected, atol=1e-4)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    leaving = reference.fc(torch.cat([states[i + 1] for i in AUX], -1)).numpy()
    assert np.abs(out - leaving).max() > 1e-2


@pytest.mark.parametrize("bits", [None, 4])
def test_head_graph_matches_the_reference(target, head, tmp_path, bits):
    """Float: within 1e-3 of PyTorch, run in two calls through its cache. int4: the argmax
    agrees on most rows (quantization moves logits, the check bounds it)."""
    from edgespec.export.eagle3_graph import build_head_graph, validate_head

    model, folder = target
    config, tensors, reference = head
    build_head_graph(config, tensors, CheckpointTensors(folder), tmp_path / "h", bits=bits)
    ids, features = _inputs(model, config)
    g = reference.fc(features)[0].numpy()
    if bits is None:
        figures = validate_head(tmp_path / "h" / "model.onnx", reference, ids[0].numpy(), g)
        assert figures["max_abs_logits"] < 1e-3
        return
    with pytest.raises(ExportError, match="differs from PyTorch"):
        validate_head(tmp_path / "h" / "model.onnx", reference, ids[0].numpy(), g,
                      tolerance=1e-6)


def test_a_norm_before_residual_head_adds_the_normed_feature(target, head, tmp_path):
    """A head whose config says norm_before_residual (SpecForge's option) adds RMSNorm_hidden(g)
    after attention instead of g: its graph matches its reference, and the reference reading
    the same weights without the flag is a different function (so the check can fail)."""
    from edgespec.export.eagle3_graph import build_head_graph, validate_head

    model, folder = target
    _, _, plain = head
    flagged = _broken_copy(head[0].path, tmp_path,
                           edit_config=lambda c: c.update(norm_before_residual=True))
    config = read_head_config(flagged, model.config)
    assert config.norm_before_residual
    tensors = HeadTensors(config)
    reference = Eagle3Head.load(config, tensors, model.model.embed_tokens.weight.detach())
    build_head_graph(config, tensors, CheckpointTensors(folder), tmp_path / "h")
    ids, features = _inputs(model, config)
    g = reference.fc(features)[0].numpy()
    figures = validate_head(tmp_path / "h" / "model.onnx", reference, ids[0].numpy(), g)
    assert figures["max_abs_logits"] < 1e-3
    with pytest.raises(ExportError, match="differs from PyTorch"):
        validate_head(tmp_path / "h" / "model.onnx", plain, ids[0].numpy(), g)


def _broken_copy(head_folder, tmp_path, edit_weights=None, edit_config=None):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "broken"
    out.mkdir()
    weights = load_file(str(head_folder / "model.safetensors"))
    config = json.loads((head_folder / "config.json").read_text())
    if edit_weights:
        edit_weights(weights)
    if edit_config:
        edit_config(config)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("breakage, message", [
    (dict(edit_config=lambda c: c.update(hidden_size=32)), "hidden_size 32 is not the target's"),
    (dict(edit_weights=lambda w: w.pop("d2t")), "d2t is missing"),
    (dict(edit_weights=lambda w: w.__setitem__("d2t", w["d2t"] + 500)),
     "outside the target's vocabulary"),
    (dict(edit_weights=lambda w: w.__setitem__("fc.weight", w["fc.weight"][:, :128])),
     r"fc.weight is \[64, 128\], not \[64, 192\]"),
    (dict(edit_config=lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids":
                                                       [0, 1, 5]})), "aux hidden-state layers"),
])
def test_malformed_heads_are_refused_with_one_clear_error(target, head, tmp_path, breakage,
                                                          message):
    model, _ = target
    broken = _broken_copy(head[0].path, tmp_path, **breakage)
    with pytest.raises(ExportError, match=message):
        HeadTensors(read_head_config(broken, model.config))


def test_default_aux_layers_need_a_deep_enough_target(target, tmp_path):
    model, _ = target  # 3 layers: (L/4, L/2, L-1) = (0, 1, 2); a 2-layer target has no default
    folder = write_random_head(tmp_path / "h", model.config)
    assert read_head_config(folder, model.config).aux_layers == (0, 1, 2)
    model.config.num_hidden_layers = 2
    try:
        with pytest.raises(ExportError, match="needs eagle_config"):
            read_head_config(folder, model.config)
    finally:
        model.config.num_hidden_layers = 3


@pytest.mark.parametrize("layers, expected", [(3, (0, 1, 2)), (4, (1, 2, 3)), (5, (1, 2, 4)),
                                              (6, (1, 3, 5)), (7, (2, 3, 4)), (32, (2, 16, 29))])
def test_one_rule_gives_three_different_aux_layers(layers, expected):
    """The paper's (2, L/2, L-3) from 7 layers; below, where it would repeat a layer (or leave
    the target), (L/4, L/2, L-1): never a repeat."""
    assert default_aux_layers(layers) == expected


def test_repeated_aux_layers_are_refused_in_one_line_where_they_are_chosen(target, tmp_path):
    """A head trained here (head_config, --aux-layers) may not repeat a layer; a head's own
    config says what it was trained on and is read as named."""
    model, _ = target
    with pytest.raises(ExportError, match=r"\(2, 2, 0\) repeat layer 2") as caught:
        check_aux_layers((2, 2, 0), None)
    assert "\n" not in str(caught.value)
    with pytest.raises(ExportError, match=r"repeat layer 1"):
        check_aux_layers([1, 1, 2], 3)
    assert check_aux_layers((2, 0, 1), 3) == (2, 0, 1)
    folder = write_random_head(tmp_path / "h", model.config, aux_layers=(1, 1, 2))
    assert read_head_config(folder, model.config).aux_layers == (1, 1, 2)
