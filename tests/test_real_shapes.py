"""benchmarks/real_shapes.py on tiny packages: the arithmetic, a child's own peak memory, one
measurement, the self-speculation package and the tables. No real shapes; seconds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "real_shapes.py"


@pytest.fixture(scope="module")
def rs():
    spec = importlib.util.spec_from_file_location("real_shapes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_shapes"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["real_shapes"]


def test_expected_speedup_is_leviathans_with_sampling(rs):
    """The runtime's cost model (schedule.py) with the sampling of each verified row counted."""
    target_ms = {n: 10.0 + n for n in range(1, rs.KMAX + 2)}

    def speedup(alpha, k):  # (1 - a^(k+1)) / (1 - a) tokens for k + (11 + k) + (k+1) 0.5 ms
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
        return tokens * 11.5 / (k * 1.0 + 11 + k + (k + 1) * 0.5)

    best = max(range(1, rs.KMAX + 1), key=lambda k: speedup(0.5, k))
    k, value = rs.best_k(0.5, 1.0, target_ms, 0.5, 0.5)
    assert k == best and value == pytest.approx(speedup(0.5, best))
    # alpha 1 (every draft accepted): k + 1 tokens a round, no division by zero
    assert rs.best_k(1.0, 0.0, dict.fromkeys(target_ms, 10.0), 0.0, 0.0) == (rs.KMAX, rs.KMAX + 1)
    # a free draft and flat verify cost: the largest k wins; a draft as dear as the target: k = 1
    flat = dict.fromkeys(target_ms, 10.0)
    assert rs.best_k(0.8, 0.0, flat, 0.0, 0.0)[0] == rs.KMAX
    k, speedup = rs.best_k(0.6, 10.0, flat, 0.0, 0.0)
    assert k == 1 and speedup < 1


def test_each_child_reports_its_own_peak_memory(rs, tmp_path):
    big = rs.run_child([sys.executable, "-c", "x = bytearray(300 << 20)"], tmp_path / "big.log")
    small = rs.run_child([sys.executable, "-c", "pass"], tmp_path / "small.log")
    assert big.returncode == small.returncode == 0
    assert big.peak_bytes > 300 << 20 > small.peak_bytes


def test_pairs_parse_and_self_speculation_has_one_row(rs):
    pair, self_pair = rs.parse_pairs("smollm2-135m:smollm2-360m,llama-3.2-1b")
    assert pair.variants(["fp32", "int4"]) == ["fp32", "int4"]
    assert self_pair.is_self and self_pair.variants(["fp32", "int4"]) == [rs.SELF_VARIANT]
    with pytest.raises(SystemExit):
        rs.parse_pairs("gpt-5:smollm2-360m")


def test_measure_assemble_and_tables(rs, packages, tmp_path):
    # the self-speculation package: the target of one package with the draft of another,
    # made again over its earlier self, never over someone else's folder
    assembled = rs.assemble_self(packages["llama_self"], packages["llama"], tmp_path / "self")
    assembled = rs.assemble_self(packages["llama_self"], packages["llama"], tmp_path / "self")
    sizes = rs.package_bytes(assembled)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a package")
    with pytest.raises(rs.Skipped, match="not a package this script made"):
        rs.assemble_self(packages["llama_self"], packages["llama"], tmp_path / "mine")
    assert sizes == {"target": rs.package_bytes(packages["llama_self"])["target"],
                     "draft": rs.package_bytes(packages["llama"])["draft"]}

    runs = {}
    for setting in rs.SETTINGS:
        result = rs.measure(assembled, setting, context=8, steps=2, sampling_tokens=6)
        runs[setting.name] = [{**json.loads(json.dumps(result)), "peak_bytes": 1 << 20}]
    default = runs["default"][0]
    assert sorted(map(int, default["target_ms"])) == list(range(1, rs.KMAX + 2))
    assert all(len(t) == 2 and min(t) > 0 for t in default["target_ms"].values())
    assert set(default["sampling"]) == set(rs.SAMPLINGS)

    figures = rs.costs(runs)
    expected = rs.speedups(figures)
    assert set(expected) == set(rs.SAMPLINGS)
    assert all(set(by_threads) == {"1", "all"} for by_threads in expected.values())
    pair = rs.Pair("smollm2-135m", "smollm2-135m")
    row = {"package": str(assembled), "package_bytes": sizes, "figures": figures,
           "expected": expected, "exports": {"fp32": {"seconds": 1.0, "peak_bytes": 1 << 30}}}
    results = {"pairs": {pair.name: {"checkpoint_bytes": {pair.target: 1 << 20},
                                     "rows": {rs.SELF_VARIANT: row}}}}
    info = {"machine": "x86_64", "cpu_count": 2, "date": "today", "versions": {"numpy": "2"}}
    table = rs.markdown(results, [pair], info).splitlines()
    rows = [line for line in table if line.startswith(f"| {pair.name} |")]
    assert len(rows) == 1 + len(rs.SAMPLINGS)  # one cost row, a speedup row per sampling


def test_checkpoints_are_made_shard_by_shard_and_load(rs, tmp_path, monkeypatch):
    """Tied and untied shapes, in shards (SHARD_BYTES made small): from_pretrained loads
    them, with the public shapes' distributions (norms 1, weights ~ N(0, 0.02)); a Qwen3 keeps
    its own head size and q/k norms."""
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(rs, "SHARD_BYTES", 200_000)
    bases = {"tiny-qwen2": ("qwen2.5-0.5b", True), "tiny-llama": ("llama-3.1-8b", False),
             "tiny-qwen3": ("qwen3-0.6b", True)}
    for name, (shape, tied) in bases.items():
        base = rs.SHAPES[shape]
        head = {"head_dim": 32} if "head_dim" in base else {}
        monkeypatch.setitem(rs.SHAPES, name, {**base, "hidden_size": 64, "intermediate_size": 96,
                                              "num_hidden_layers": 2, "num_attention_heads": 4,
                                              "num_key_value_heads": 2, "vocab_size": 1100,
                                              **head})
        path = rs.make_checkpoint(name, tmp_path / name)
        assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
        weights = {name: p.detach() for name, p in model.named_parameters()}
        assert model.dtype == torch.bfloat16
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        assert torch.equal(weights["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
        assert abs(float(weights["model.layers.1.mlp.down_proj.weight"].float().std()) - 0.02) < 2e-3
        if head:  # heads of 32 where hidden / heads is 16, their norms 1
            assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
            assert torch.equal(weights["model.layers.0.self_attn.k_norm.weight"],
                               torch.ones(32, dtype=torch.bfloat16))


def test_eagle_steps_times_a_head_and_its_target(rs, checkpoints, tmp_path):
    """The EAGLE-3 cost child on a tiny package: a head's step (fed a feature row) and the
    target's, both timed."""
    from transformers import AutoConfig

    from edgespec.export import export_pair

    head = rs.make_head(checkpoints["llama_target"], tmp_path / "head", draft_vocab=100)
    config = json.loads((head / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}  # 2 layers
    (head / "config.json").write_text(json.dumps(config))
    assert AutoConfig.from_pretrained(checkpoints["llama_target"]).num_hidden_layers == 2
    export_pair(checkpoints["llama_target"], head, tmp_path / "pkg", validation="skip")
    steps = rs.eagle_steps(tmp_path / "pkg", context=8, steps=3, threads=1)
    assert steps["target_step_ms"] > 0 and steps["draft_step_ms"] > 0
    assert steps["draft_parameters"] > 0
