"""Qwen3 through the fused builder: the exported graphs pass the validation gate against PyTorch
(fp32 and int4, through `edgespec export --target --draft`), greedy output with drafting is
target-only output, the gate rejects a graph that drops the per-head q/k norm or applies it
after the rotation, and the config options the builder lacks are refused in one line.

The checkpoints are tiny random Qwen3s (conftest.qwen3): head_dim 32 where hidden / heads is 16,
q/k norm weights away from 1.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import _hf_tokenizer, _save, _train_bpe, greedy_is_target_only, noisy_copy, qwen3
from helpers import PROMPTS

import edgespec
from edgespec.cli import main
from edgespec.errors import ExportError
from edgespec.export import export_pair
from edgespec.export.families import why_not_fused
from edgespec.export.graph import load_model
from edgespec.export.validate import FP32_TOLERANCE, reference_logits, validate_graph
from edgespec.manifest import Manifest

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A bf16 tied target (as Qwen3 ships up to 4B), a noisy copy as its draft, and an fp32
    untied one with q/k/v/o biases and YaRN rope scaling (Qwen3's long-context setting)."""
    root = tmp_path_factory.mktemp("qwen3")
    bpe = _hf_tokenizer(_train_bpe(400))
    target = qwen3(len(bpe), 64, 2, seed=1)
    return {
        "target": _save(target.to(torch.bfloat16), bpe, root / "target"),
        "draft": _save(noisy_copy(target.float(), 0.15, seed=2).to(torch.bfloat16), bpe,
                       root / "draft"),
        "yarn": _save(qwen3(len(bpe), 64, 2, seed=3, tie_word_embeddings=False,
                            attention_bias=True, rope_scaling=dict(YARN)), bpe, root / "yarn"),
    }


@pytest.fixture(scope="module")
def packages(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """The pair exported by the CLI, fp32 and int4 (the draft computing in int8)."""
    root = tmp_path_factory.mktemp("qwen3_packages")
    for name, flags in (("fp32", []), ("int4", ["--quantize", "int4"])):
        result = CliRunner().invoke(main, ["export", "--target", str(checkpoints["target"]),
                                           "--draft", str(checkpoints["draft"]),
                                           "--out", str(root / name), *flags])
        assert result.exit_code == 0, result.output
    return {name: root / name for name in ("fp32", "int4")}


@pytest.mark.parametrize("variant", ["fp32", "int4"])
def test_the_cli_exports_a_qwen3_pair_that_passes_the_gate(packages, variant):
    manifest = Manifest.read(packages[variant])
    for spec in (manifest.target, manifest.draft):
        validation = spec.validation
        assert spec.graph == "fused" and spec.architecture == "qwen3" and spec.head_dim == 32
        assert validation["reference"] == "PyTorch, layer by layer"
        assert validation["failures"] == [] and validation["variant"] == variant
        if variant == "fp32":
            assert validation["max_abs_diff_no_cache"] <= validation["tolerance"]
            assert validation["max_abs_diff_one_token_steps"] <= validation["tolerance"]


def test_biases_and_yarn_scaling_pass_the_gate(checkpoints, tmp_path):
    manifest = export_pair(checkpoints["yarn"], None, tmp_path / "yarn")
    validation = manifest.target.validation
    assert manifest.target.graph == "fused" and validation["failures"] == []
    assert validation["max_abs_diff_no_cache"] <= validation["tolerance"]


@pytest.mark.parametrize("variant", ["fp32", "int4"])
def test_greedy_output_with_the_draft_is_target_only_output(packages, variant):
    pipe = edgespec.load(packages[variant])
    drafted, accepted = greedy_is_target_only(pipe, PROMPTS[:3], 3)
    assert drafted > 0 and accepted > 0  # the draft proposed, and the target kept some


# -- the gate tells the order of norm and rotation ---------------------------------------------

def test_a_graph_without_the_qk_norm_fails_the_gate(checkpoints, tmp_path, monkeypatch):
    """The builder made to treat Qwen3 as Qwen2 (no q/k norm): the same export refuses it."""
    from edgespec.export import fused

    monkeypatch.setattr(fused, "QK_NORM", ())
    with pytest.raises(ExportError, match="no_cache logits differ from PyTorch"):
        export_pair(checkpoints["target"], None, tmp_path / "dropped")
    assert not (tmp_path / "dropped").exists()


@contextmanager
def _norm_after_rotation(model):
    """``model`` (a loaded Qwen3) computing the wrong order: rotate q and k, then q_norm /
    k_norm. Each attention's norms are swapped for identities and applied by the rotation
    function transformers' attention calls next."""
    from transformers.models.qwen3 import modeling_qwen3

    rotate = modeling_qwen3.apply_rotary_pos_emb
    norms, current, hooks = {}, [], []
    for layer in model.model.layers:
        attn = layer.self_attn
        norms[attn] = (attn.q_norm, attn.k_norm)
        attn.q_norm, attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
        hooks.append(attn.register_forward_pre_hook(lambda module, args: current.append(module)))

    def rotate_then_norm(q, k, cos, sin, *args, **kwargs):
        q, k = rotate(q, k, cos, sin)  # [1, heads, S, D]
        q_norm, k_norm = norms[current[-1]]
        return q_norm(q), k_norm(k)

    modeling_qwen3.apply_rotary_pos_emb = rotate_then_norm
    try:
        yield model
    finally:
        modeling_qwen3.apply_rotary_pos_emb = rotate
        for hook in hooks:
            hook.remove()
        for attn, (q_norm, k_norm) in norms.items():
            attn.q_norm, attn.k_norm = q_norm, k_norm


def test_a_norm_after_the_rotation_fails_the_gate(checkpoints, packages):
    """A graph that normalized after rotating would compute what PyTorch computes in that
    order: the gate, given those logits as PyTorch's, refuses the (right) graph, so it refuses
    the wrong one. With unit norm weights the two orders agree (RMSNorm commutes with a
    rotation then), which is why conftest.qwen3 draws them away from 1."""
    root = packages["fp32"]
    spec = Manifest.read(root).target
    ids = np.random.default_rng(0).integers(0, 400, size=48)
    model = load_model(checkpoints["target"])
    right = reference_logits(model, ids)
    with _norm_after_rotation(model):
        late = reference_logits(model, ids)
    _, failures = validate_graph(right, ids, root, spec, max_positions=128)
    assert failures == []
    _, failures = validate_graph(late, ids, root, spec, max_positions=128)
    assert any("no_cache logits differ from PyTorch" in f for f in failures)

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    unit = reference_logits(model, ids)
    with _norm_after_rotation(model):
        unit_late = reference_logits(model, ids)
    scale = max(1.0, float(np.abs(unit).max()))
    assert np.abs(unit - unit_late).max() <= 0.01 * FP32_TOLERANCE * scale


# -- what the builder does not do ---------------------------------------------------------------

@pytest.mark.parametrize("options,named", [
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
     "sliding-window attention (sliding_window 16 on 1 of 2 layers)"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_scaling of rope_type 'dynamic'"),
])
def test_unsupported_options_are_one_line_errors_naming_them(tmp_path, options, named):
    bpe = _hf_tokenizer(_train_bpe(400))
    folder = _save(qwen3(len(bpe), 64, 2, seed=4, **options), bpe, tmp_path / "model")
    result = CliRunner().invoke(main, ["export", "--target", str(folder), "--graph", "fused",
                                       "--out", str(tmp_path / "out")])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 1 and len(errors) == 1 and named in errors[0], result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_a_sliding_window_no_layer_uses_is_not_refused():
    """use_sliding_window with max_window_layers >= the layers: transformers gives every layer
    full attention (layer_types), and so does the graph."""
    from transformers import Qwen3Config

    config = Qwen3Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=16,
                         max_window_layers=2)
    assert why_not_fused(config) is None
    assert config.layer_types == ["full_attention"] * 2
