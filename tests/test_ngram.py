"""N-gram (prompt lookup) drafting through real onnxruntime sessions: exact against target-only
decoding, and target-only packages made by the real exporter."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from stats_check import ALPHA, fit_pvalue
from helpers import (
    PROMPTS,
    SAMPLED,
    exact_two_token_distribution,
    texts_by_schedule,
    two_token_samples,
)

import edgespec
from edgespec.cli import main
from edgespec.config import SamplingConfig
from edgespec.errors import ConfigError
from edgespec.manifest import MANIFEST_NAME
from edgespec.runtime import acceptance as sampler

# Copy-heavy: the output can repeat what the prompt holds, so lookups match long spans.
COPY_PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):\n",
    "for i in range(10):\n    print(i * i)\nfor i in range(10):\n    print(",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\nclass Point:\n",
    "a b a b a b a b a",
]
ALL_PROMPTS = PROMPTS + COPY_PROMPTS


@pytest.fixture(scope="module")
def pipes(packages):
    return {name: edgespec.load(packages[name]) for name in ("llama", "gpt2", "words")}


@pytest.fixture(scope="module")
def target_only(checkpoints, tmp_path_factory):
    """A package exported with no draft, by the real exporter."""
    from edgespec.export import export_pair

    out = tmp_path_factory.mktemp("target_only") / "pkg"
    export_pair(checkpoints["llama_target"], None, out)
    return out


@pytest.mark.parametrize("pair", ["llama", "gpt2"])
def test_greedy_ngram_equals_target_only_on_every_prompt(pipes, pair):
    pipe = pipes[pair]
    drafted = accepted = 0
    for prompt in ALL_PROMPTS:
        baseline = pipe.generate(prompt, max_new_tokens=48, drafter="none").token_ids
        for gamma in (1, 2, 3, 4, 6, 8):
            result = pipe.generate(prompt, max_new_tokens=48, draft_length=gamma, drafter="ngram")
            assert result.token_ids == baseline, (prompt, gamma)
            drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
        for schedule in ("heuristic", "adaptive"):
            result = pipe.generate(prompt, max_new_tokens=48, draft_length=8, schedule=schedule,
                                   drafter="ngram")
            assert result.token_ids == baseline, (prompt, schedule)
            assert sum(result.stats.draft_lengths.values()) == result.stats.target_calls
    assert 0 < accepted < drafted  # long matches accepted, and rejections exercised


def test_greedy_ngram_output_equals_target_only_on_the_target_only_package(target_only, pipes):
    pipe = edgespec.load(target_only)
    for prompt in ALL_PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=32, draft_length=4)  # auto: ngram here
        assert result.stats.drafter == "ngram"
        assert result.token_ids == pipes["llama"].generate(prompt, max_new_tokens=32,
                                                           drafter="none").token_ids


@pytest.mark.parametrize("setting", SAMPLED)
@pytest.mark.parametrize("pair", ["llama", "gpt2"])
def test_an_ngram_seed_gives_the_same_text_whatever_the_draft_lengths(pipes, pair, setting):
    pipe = pipes[pair]
    for seed, prompt in enumerate(COPY_PROMPTS):
        settings = dict(max_new_tokens=40, seed=seed, ignore_eos=True, drafter="ngram",
                        **SAMPLED[setting])
        texts = texts_by_schedule(pipe, prompt, **settings)
        assert all(t == texts["k=1"] for t in texts.values()), (prompt, seed, texts)


# End-to-end distribution through the real sessions: the first two tokens after a prompt whose
# last words occurred before, so the lookup proposes from the first position on. One setting
# (T = 1); the others, on NumPy fake sessions (test_drafters.py).

NGRAM_PROMPT = "a b c a b"
T1 = SamplingConfig(1.0)


def test_ngram_sampling_matches_the_target_distribution(pipes):
    expected = exact_two_token_distribution(pipes["words"], T1, NGRAM_PROMPT)
    samples, drafted, accepted = two_token_samples(pipes["words"], T1, 3000, NGRAM_PROMPT,
                                                   drafter="ngram")
    assert drafted >= 3000 and 0.05 * drafted < accepted < 0.95 * drafted
    assert fit_pvalue(samples, expected) > ALPHA


def always_accept(x, p, q, u):
    """Wrong: the point mass is never tested against p."""
    return True, x


def residual_with_x(x, p, q, u):
    """Wrong: the right test, but a rejected proposal is replaced by a draw from p, x included."""
    return (True, x) if u[1] * q.prob(x) < p.prob(x) else (False, p.draw(u[2]))


@pytest.mark.parametrize("wrong", [always_accept, residual_with_x])
def test_the_ngram_distribution_check_rejects_a_wrong_rule(pipes, monkeypatch, wrong):
    expected = exact_two_token_distribution(pipes["words"], T1, NGRAM_PROMPT)
    monkeypatch.setattr(sampler, "accept_or_replace", wrong)
    samples, _, _ = two_token_samples(pipes["words"], T1, 1500, NGRAM_PROMPT, drafter="ngram")
    assert fit_pvalue(samples, expected) < 1e-6


# ---------------------------------------------------------------------------------------------
# Target-only packages


def test_a_target_only_package_has_no_draft_in_its_manifest(target_only):
    raw = json.loads((target_only / MANIFEST_NAME).read_text())
    assert raw["draft"] is None and "draft" not in raw["source"]
    assert not (target_only / "draft").exists()
    pipe = edgespec.load(target_only)
    assert pipe.draft is None and pipe.manifest.draft is None
    assert set(pipe.session_configs) == {"target"}
    result = pipe.generate("a b", max_new_tokens=4, drafter="none")
    assert result.stats.drafter == "none" and result.stats.drafted == 0


def test_a_target_only_package_times_no_long_runs_only_the_mixed_drafter_reads(
        target_only, packages):
    """Runs of 17 and 33 tokens are what a text match is verified in by the mixed drafter: a
    package without a draft model does not spend its load timing them; one with does."""
    assert edgespec.load(target_only).step_costs(4).long_ms == ()
    assert [n for n, _ in edgespec.load(packages["llama"]).step_costs(4).long_ms] == [17, 33]


def test_asking_a_target_only_package_for_the_draft_model_is_one_line(target_only):
    pipe = edgespec.load(target_only)
    with pytest.raises(ConfigError, match="drafter 'model' needs a draft model"):
        pipe.generate("a b", drafter="model")
    result = CliRunner().invoke(main, ["generate", str(target_only), "a b", "--drafter", "model"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: drafter 'model' needs a draft model and this package is target only; "
        "use drafter ngram or none"
    ]


def test_models_list_and_export_name_a_target_only_package(target_only, checkpoints, tmp_path):
    result = CliRunner().invoke(main, ["models", "list", str(target_only)])
    assert result.exit_code == 0, result.output
    assert "no draft: target only (decodes with n-gram drafting)" in result.output
    out = tmp_path / "cli_pkg"
    result = CliRunner().invoke(main, ["export", "--target", str(checkpoints["gpt2_target"]),
                                       "--out", str(out), "--validate", "skip"])
    assert result.exit_code == 0, result.output
    assert "no draft (target only: n-gram drafting)" in result.output
    assert json.loads((out / MANIFEST_NAME).read_text())["draft"] is None


def test_adaptive_ngram_works_on_a_target_only_package(target_only):
    pipe = edgespec.load(target_only)
    result = pipe.generate(COPY_PROMPTS[0], max_new_tokens=24, draft_length=8, schedule="adaptive")
    assert result.stats.drafter == "ngram" and len(result.token_ids) > 0
    costs = pipe.step_costs(8)
    assert costs.draft_step_ms == 0.0 and len(costs.target_ms) == 9
