"""A draft that scores only the most frequent tokens (FR-Spec): the subset export picks, the
graph's columns, and exact output through real sessions (q is 0 outside the subset)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import PROMPTS, exact_two_token_distribution, two_token_samples
from stats_check import ALPHA, fit_pvalue

import edgespec
from edgespec.config import SamplingConfig
from edgespec.errors import ExportError, ManifestError
from edgespec.export import export_pair
from edgespec.export.vocab import frequent_tokens
from edgespec.manifest import Manifest
from edgespec.runtime import acceptance as sampler
from edgespec.runtime.sampling import Dist

CALIBRATION = "def add(a, b):\n    return a + b\n" * 20 + "The quick brown fox.\n" * 5


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibration") / "text.txt"
    path.write_text(CALIBRATION)
    return path


@pytest.fixture(scope="module")
def subset_package(checkpoints, calibration, tmp_path_factory):
    out = tmp_path_factory.mktemp("subset") / "p"
    export_pair(checkpoints["llama_target"], checkpoints["llama_noisy"], out, draft_vocab=120,
                draft_vocab_texts=(calibration,))
    return out


def test_the_subset_is_the_most_frequent_tokens_then_the_lowest_ids(checkpoints, calibration):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoints["llama_target"])
    ids = tokenizer(CALIBRATION, add_special_tokens=False).input_ids
    counts = np.bincount(ids)
    subset = frequent_tokens(tokenizer, 400, 10, [calibration], always=[0])
    assert list(subset) == sorted(subset) and 0 in subset  # ascending, EOS always in
    most = sorted(range(len(counts)), key=lambda i: (-counts[i], i))[:9]
    assert set(most) <= set(subset)
    no_text = frequent_tokens(tokenizer, 400, 10, [], always=[399])
    assert list(no_text) == [*range(9), 399]
    with pytest.raises(ExportError, match="draft_vocab must be in 1..400"):
        frequent_tokens(tokenizer, 400, 401, [], always=[])


def test_the_draft_scores_the_subset_columns(subset_package):
    manifest = Manifest.read(subset_package)
    draft = manifest.draft
    assert draft.vocab_size == 120 and draft.token_ids == "draft/token_ids.npy"
    assert manifest.target.vocab_size >= manifest.vocab_size > 120
    ids = np.load(subset_package / draft.token_ids)
    assert len(ids) == 120 and (np.diff(ids) > 0).all()
    # validated against PyTorch's logits of those columns
    assert not draft.validation["failures"]
    assert draft.validation["max_abs_diff_no_cache"] <= draft.validation["tolerance"]


def test_greedy_output_equals_target_only_with_a_subset_draft(subset_package):
    pipe = edgespec.load(subset_package)
    for prompt in PROMPTS:
        alone = pipe.generate(prompt, max_new_tokens=32, drafter="none")
        for k in (1, 4):
            result = pipe.generate(prompt, max_new_tokens=32, draft_length=k, schedule="fixed")
            assert result.stats.drafted > 0
            assert result.token_ids == alone.token_ids, (prompt, k)


def test_a_subset_q_is_zero_outside_the_subset(subset_package):
    pipe = edgespec.load(subset_package)
    ids = pipe.draft.token_ids
    logits = pipe.draft.forward(np.array(pipe.encode("def add")), pipe.draft.new_cache())[-1]
    q = sampler.process_row(logits, SamplingConfig(1.0)).relabel(ids)
    dense = q.dense(pipe.manifest.vocab_size)
    assert dense.sum() == pytest.approx(1.0)
    outside = np.setdiff1d(np.arange(pipe.manifest.vocab_size), ids)
    assert (dense[outside] == 0).all() and (dense[ids] > 0).all()


@pytest.fixture(scope="module")
def words_subset(checkpoints, tmp_path_factory):
    """The words pair (8 tokens, target and draft far apart), its draft scoring 4 of them: the
    target's mass outside the subset must come from the residual."""
    out = tmp_path_factory.mktemp("words_subset") / "p"
    export_pair(checkpoints["words_target_fused"], checkpoints["words_draft_fused"], out,
                draft_vocab=4)
    return edgespec.load(out)


WORDS_PROMPT = "a b c"


def test_subset_sampling_matches_the_target_distribution(words_subset):
    sampling = SamplingConfig(1.0)
    expected = exact_two_token_distribution(words_subset, sampling, WORDS_PROMPT)
    outside = set(range(8)) - set(words_subset.draft.token_ids.tolist())
    assert sum(p for seq, p in expected.items() if seq[0] in outside) > 0.1
    samples, drafted, accepted = two_token_samples(words_subset, sampling, 3000, WORDS_PROMPT)
    assert drafted >= 6000 and 0.05 * drafted < accepted < 0.95 * drafted
    assert fit_pvalue(samples, expected) > ALPHA


def residual_on_the_subset(p: Dist, q: Dist) -> Dist:
    """Wrong: the residual taken on q's support only, so a rejection never draws a token the
    draft cannot propose."""
    r = np.maximum(p.probs_at(q.ids) - q.probs_at(q.ids), 0.0)
    return Dist(q.ids, r, float(r.sum())) if r.sum() > 0 else p


def test_the_subset_check_rejects_a_residual_without_the_other_tokens(words_subset, monkeypatch):
    sampling = SamplingConfig(1.0)
    expected = exact_two_token_distribution(words_subset, sampling, WORDS_PROMPT)
    monkeypatch.setattr(sampler, "residual", residual_on_the_subset)
    samples, _, _ = two_token_samples(words_subset, sampling, 1500, WORDS_PROMPT)
    assert fit_pvalue(samples, expected) < 1e-6


def test_draft_vocab_needs_a_draft_and_a_fused_graph(checkpoints, tmp_path):
    with pytest.raises(ExportError, match="has no draft"):
        export_pair(checkpoints["llama_target"], None, tmp_path / "a", draft_vocab=10)
    with pytest.raises(ExportError, match="draft_vocab needs edgespec's fused graph"):
        export_pair(checkpoints["gpt2_target"], checkpoints["gpt2_draft"], tmp_path / "b",
                    draft_vocab=10)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_package_whose_subset_file_is_wrong_is_refused(subset_package, tmp_path):
    import shutil

    broken = tmp_path / "p"
    shutil.copytree(subset_package, broken)
    np.save(broken / "draft" / "token_ids.npy", np.arange(120)[::-1].copy())  # not ascending
    with pytest.raises(ManifestError, match="ascending token ids"):
        edgespec.load(broken)
