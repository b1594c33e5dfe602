"""The shape of the target's runs: rows bit-identical across run sizes from two tokens on, the
compute and padding export chooses, and greedy identity by construction (export/runs.py).

The row check guards onnxruntime's kernels: if a build changed how a row of a run of 2..9
tokens is computed with the run's size or offset, these tests fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import recorded_target_rows

import edgespec
from edgespec.export import export_pair
from edgespec.export.runs import Candidate, _pick, set_compute
from edgespec.manifest import Manifest
from edgespec.runtime.providers import SessionConfig
from edgespec.runtime.run_checks import rows_identical
from edgespec.runtime.session import ModelSession

PROMPTS = ["def add(a, b):", "The quick brown", "for i in range(10):", "import numpy as np"]


@pytest.fixture(scope="module")
def int4_package(checkpoints, tmp_path_factory):
    """The Llama pair with an int4 target computing in int8, its runs shaped by export."""
    root = tmp_path_factory.mktemp("int4")
    export_pair(checkpoints["llama_target"], checkpoints["llama_noisy"], root / "p",
                quantize="int4", draft_quantize="int8", validation="skip",
                target_compute="int8")
    return root / "p"


def target_session(package, compute: str | None = None, tmp_path=None) -> ModelSession:
    manifest = Manifest.read(package)
    if compute is not None:  # a copy of the target graph computing in ``compute``
        import shutil

        shutil.copytree(package, tmp_path / compute)
        package = tmp_path / compute
        set_compute(package / "target", compute)
    spec = manifest.target
    return ModelSession(package / spec.path, spec, spec.vocab_size, manifest.max_positions,
                        SessionConfig("cpu"))


@pytest.mark.parametrize("compute", ["float", "int8"])
def test_quantized_rows_are_bit_identical_from_two_tokens_on(int4_package, tmp_path, compute):
    session = target_session(int4_package, compute, tmp_path)
    assert rows_identical(session, trials=4)


def test_fp32_rows_are_bit_identical_from_two_tokens_on(packages):
    assert rows_identical(target_session(packages["llama"]), trials=4)
    assert rows_identical(target_session(packages["gpt2"]), trials=4)  # optimum's graph


def test_the_row_check_sees_one_ulp(packages, monkeypatch):
    """A run that moves one logit of one row by one float32 ulp fails the check."""
    session = target_session(packages["llama"])
    forward = session.forward
    calls = []

    def nudged(tokens, cache, keep=0):
        rows = forward(tokens, cache, keep=keep).copy()
        calls.append(len(tokens))
        if len(calls) == 4:  # a shorter run's, after the prefill and the reference
            rows[-1, 7] = np.nextafter(rows[-1, 7], np.inf)
        return rows

    monkeypatch.setattr(session, "forward", nudged)
    assert not rows_identical(session, trials=1)


def test_export_records_the_chosen_runs_and_their_figures(int4_package):
    spec = Manifest.read(int4_package).target
    runs = spec.validation["runs"]
    chosen = runs["candidates"][runs["chosen"]]
    assert (spec.compute, spec.min_run_tokens) == (chosen["compute"], chosen["min_run_tokens"])
    assert set(runs["candidates"]) == {"int8, runs of >= 2"}  # --target-compute int8
    assert chosen["exact"] and spec.min_run_tokens == 2 and spec.compute == "int8"


def one_row_each(recorded: dict[tuple, list[np.ndarray]]) -> dict[tuple, bytes]:
    """The row of each prefix, checked to be one whenever the prefix was scored again."""
    rows = {prefix: found[0].tobytes() for prefix, found in recorded.items()}
    assert all(r.tobytes() == rows[p] for p, found in recorded.items() for r in found), \
        "one prefix, two rows"
    return rows


@pytest.mark.parametrize("package", ["int4", "llama", "gpt2"])
def test_greedy_speculative_and_target_only_see_the_same_rows(int4_package, packages, package):
    """Bit for bit: with runs of at least two tokens, every position both modes score gets the
    same row of logits, so greedy output is identical by construction (not up to float
    rounding). The target computes as a padded package of each kind would (int8 for int4)."""
    path = int4_package if package == "int4" else packages[package]
    pipe = edgespec.load(path, provider="cpu")
    assert package != "int4" or pipe.manifest.target.compute == "int8"
    pipe.target.min_run_tokens = 2
    for prompt in PROMPTS:
        for k in (1, 3, 4):
            with recorded_target_rows(pipe) as recorded:
                alone = pipe.generate(prompt, max_new_tokens=24, drafter="none", ignore_eos=True)
            alone_rows = one_row_each(recorded)
            with recorded_target_rows(pipe) as recorded:
                result = pipe.generate(prompt, max_new_tokens=24, draft_length=k, schedule="fixed",
                                       ignore_eos=True)
            spec_rows = one_row_each(recorded)
            assert result.stats.drafted > 0
            assert result.token_ids == alone.token_ids, (prompt, k)
            shared = set(alone_rows) & set(spec_rows)
            assert len(shared) >= 24
            assert all(alone_rows[n] == spec_rows[n] for n in shared), (prompt, k)


def test_one_token_runs_are_what_differs(packages):
    """The same comparison with runs as fed finds rows that differ (the one-row kernels): the
    check above is what padding buys, not a property every run has."""
    pipe = edgespec.load(packages["llama"], provider="cpu")
    pipe.target.min_run_tokens = 1
    differing = 0
    for prompt in PROMPTS:
        with recorded_target_rows(pipe) as recorded:
            pipe.generate(prompt, max_new_tokens=24, drafter="none", ignore_eos=True)
        alone_rows = one_row_each(recorded)
        with recorded_target_rows(pipe) as recorded:
            pipe.generate(prompt, max_new_tokens=24, draft_length=4, schedule="fixed",
                          ignore_eos=True)
        spec_rows = one_row_each(recorded)
        differing += sum(alone_rows[n] != spec_rows[n] for n in set(alone_rows) & set(spec_rows))
    assert differing > 0


def test_export_picks_an_exact_candidate_unless_it_costs_too_much():
    def cand(compute, pad, exact, step, verify):
        return {"compute": compute, "min_run_tokens": pad, "exact": exact, "step_ms": step,
                "verify_ms": verify}

    fp32 = {"a": cand("float", 1, False, 10.0, 11.0), "b": cand("float", 2, True, 10.2, 11.0)}
    assert _pick(fp32) == Candidate("float", 2)  # 1% dearer, exact: chosen
    fp32["b"]["step_ms"] = 12.0
    assert _pick(fp32) == Candidate("float", 1)  # 5% dearer: the faster one
    int4 = {"a": cand("float", 1, False, 2.2, 6.4), "b": cand("float", 2, True, 5.7, 6.4),
            "c": cand("int8", 2, True, 1.9, 2.7)}
    assert _pick(int4) == Candidate("int8", 2)
    int4["c"]["exact"] = False  # int8 whose rows differ is never used
    assert _pick(int4) == Candidate("float", 1)
