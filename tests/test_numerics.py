"""Numerics decided on this CPU at load (runtime/numerics.py), and the export's fallback for a
draft whose one-token runs compute otherwise (export/package.py).

The faults other CPUs have are simulated here on the sessions' runs, as they were measured under
emulation (tests/test_portable.py runs the real ones): ARM64's GroupQueryAttention, whose rows
depend on where the run ends modulo four, and AVX2's one-row int8 kernel reading a tensor the
load let go, which makes every one-token draft step wrong. Each simulation is first shown to
break what the load must fix, so that the load's fix is what the test sees.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import greedy_is_target_only
from test_runs import PROMPTS

import edgespec
from edgespec.cli import main
from edgespec.export import export_pair
from edgespec.manifest import MANIFEST_NAME, Manifest
from edgespec.runtime import calibration, numerics
from edgespec.runtime.numerics import Numerics
from edgespec.runtime.run_checks import DRAFT_CONSISTENCY, draft_gap, rows_identical
from edgespec.runtime.session import ModelSession

TILE = 4  # ARM64's GroupQueryAttention: rows in tiles of four counted from the run's end


def faulty(monkeypatch, role: str, fault) -> None:
    """Runs of the sessions loaded from ``role``/ (target or draft) return
    ``fault(logits, start, n)`` (start: the cached positions before the run, n: its tokens)."""
    plain_init, plain_run = ModelSession.__init__, ModelSession._run

    def init(self, path, *args, **kwargs):
        self.simulated_fault = role in Path(path).parts
        plain_init(self, path, *args, **kwargs)

    def run(self, tokens, cache, features, keep=0):
        start = cache.length
        logits, rows = plain_run(self, tokens, cache, features, keep)
        if getattr(self, "simulated_fault", False):
            logits = fault(logits, start, len(tokens)).astype(np.float32)
        return logits, rows

    monkeypatch.setattr(ModelSession, "__init__", init)
    monkeypatch.setattr(ModelSession, "_run", run)


def tiles_from_the_run_end(logits, start, n):
    """ARM64's attention kernel: a row's last bits depend on its distance from the run's end
    modulo TILE."""
    end = start + n
    return logits + ((end - np.arange(end - len(logits), end)) % TILE)[:, None] * 1e-4


def wrong_one_token_steps(logits, start, n):
    """AVX2's draft: runs of one token far from the right logits (a freed tensor read by the
    one-row kernel)."""
    if n > 1:
        return logits
    noise = np.random.default_rng(start).standard_normal(logits.shape)
    return logits + 3 * max(1.0, np.abs(logits).max()) * noise


def load_quiet(package, **kwargs):
    """(pipeline, the warnings its load gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = edgespec.load(package, **kwargs)
    return pipe, [str(w.message) for w in caught]


def edited(package, tmp_path, **fields):
    """A copy of ``package`` whose manifest's target entry says ``fields`` (a manifest copied
    from another machine, or edited by hand)."""
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(package, copy)
    data = json.loads((copy / MANIFEST_NAME).read_text())
    data["target"] |= fields
    (copy / MANIFEST_NAME).write_text(json.dumps(data))
    return copy


@pytest.fixture(scope="module")
def exact_package(checkpoints, tmp_path_factory):
    """A package that promises token-identical greedy output: an int4 target computing in int8,
    its runs padded to two tokens by the export (export/runs.py)."""
    package = tmp_path_factory.mktemp("exact") / "p"
    export_pair(checkpoints["llama_target"], checkpoints["llama_noisy"], package,
                quantize="int4", draft_quantize="int8", validation="skip",
                target_compute="int8")
    assert Manifest.read(package).target.min_run_tokens == 2
    return package


def test_shapes_pad_to_the_run_end_alignment():
    """ModelSession.padding: up to min_run_tokens, then to a multiple of run_align positions,
    never past the window."""
    class Shape:
        padding = ModelSession.padding

    s = Shape()
    s.min_run_tokens, s.run_align, s.max_positions = 2, 4, 64
    assert [s.padding(start, 1) for start in range(4)] == [3, 2, 1, 4]
    assert s.padding(6, 2) == 0 and s.padding(5, 2) == 1 and s.padding(62, 1) == 1
    s.run_align = 1
    assert [s.padding(10, n) for n in (1, 2, 5)] == [1, 0, 0]


def test_an_exact_package_loads_as_exported_here(exact_package):
    pipe, said = load_quiet(exact_package, calibration_cache=False)
    found = pipe.numerics
    assert found.line().startswith("numerics on this CPU (") and not said
    assert (found.target_runs, found.target_align, found.target_exact) == (2, 1, True)
    assert found.requires_exact and not found.fell_back and found.draft_gap is not None


def test_a_float_target_run_as_fed_is_reported_not_padded(packages, tmp_path):
    """The export found padding dearer than the float rounding it removes: said, not changed.
    (That choice is timed at export, export/runs.py, and on a busy machine may go the other
    way: the manifest is made to say it here.)"""
    package = edited(packages["llama"], tmp_path, compute="float", min_run_tokens=1)
    pipe, said = load_quiet(package, calibration_cache=False)
    assert not pipe.numerics.requires_exact and pipe.target.min_run_tokens == 1 and not said
    assert "as exported" in pipe.numerics.line() or pipe.numerics.target_exact


def test_a_target_whose_rows_follow_the_run_end_is_run_aligned(exact_package, monkeypatch):
    """The ARM64 fault: runs padded to two tokens alone (every package's shape) give rows that
    differ, and the load picks runs ending on multiples of four positions, which are exact."""
    pipe = edgespec.load(exact_package, calibration_cache=False)
    pipe.target.simulated_fault = True
    faulty(monkeypatch, "target", tiles_from_the_run_end)
    assert not rows_identical(pipe.target, 2, 1)  # the simulated fault breaks the manifest's
    assert rows_identical(pipe.target, 2, TILE)
    pipe, said = load_quiet(exact_package, calibration_cache=False)
    found = pipe.numerics
    assert (found.target_runs, found.target_align, found.target_exact) == (2, TILE, True)
    assert (pipe.target.min_run_tokens, pipe.target.run_align) == (2, TILE)
    assert found.fell_back and len(said) == 1 and "ending on multiples of 4" in said[0]
    drafted, accepted = greedy_is_target_only(pipe, PROMPTS, draft_length=3)
    assert drafted > 0 and accepted > 0


def test_a_target_exact_with_no_shape_says_so(exact_package, monkeypatch):
    """Rows that differ whatever the shape: the load keeps the manifest's and warns that greedy
    output may differ from target-only at near-ties."""
    plain = ModelSession._run

    def run(self, tokens, cache, features, keep=0):  # a change that follows the run's size
        logits, rows = plain(self, tokens, cache, features, keep)
        return logits + np.float32(1e-4 * len(tokens)), rows

    monkeypatch.setattr(ModelSession, "_run", run)
    pipe, said = load_quiet(exact_package, calibration_cache=False)
    assert not pipe.numerics.target_exact and pipe.numerics.fell_back
    assert pipe.target.min_run_tokens == pipe.manifest.target.min_run_tokens
    assert any("no run shape tried gives bit-identical rows" in s for s in said)


def test_a_draft_whose_one_token_steps_are_wrong_runs_padded(packages, monkeypatch):
    """The AVX2 fault: the draft's one-token steps are wrong (every draft token rejected); the
    load pads its runs to two tokens, where they agree, and its drafts are accepted again."""
    pipe = edgespec.load(packages["llama_noisy"], calibration_cache=False)
    faulty(monkeypatch, "draft", wrong_one_token_steps)
    pipe.draft.simulated_fault = True
    assert draft_gap(pipe.draft, 1) > DRAFT_CONSISTENCY >= draft_gap(pipe.draft, 2)
    pipe, said = load_quiet(packages["llama_noisy"], calibration_cache=False)
    assert (pipe.numerics.draft_runs, pipe.numerics.manifest_draft_runs) == (2, 1)
    assert pipe.draft.min_run_tokens == 2
    assert any("draft runs padded to >= 2 tokens" in s for s in said)
    drafted, accepted = greedy_is_target_only(pipe, PROMPTS, draft_length=3)
    assert drafted > 0 and accepted > 0.5 * drafted  # a noisy copy of the target: mostly right


def test_a_draft_wrong_however_run_is_kept_and_said(packages, monkeypatch):
    def after_a_cache(logits, start, n):  # runs after a cache wrong, whatever their size
        return logits[:, ::-1] if start else logits

    faulty(monkeypatch, "draft", after_a_cache)
    pipe, said = load_quiet(packages["llama_noisy"], calibration_cache=False)
    assert pipe.numerics.draft_runs == 1 and pipe.numerics.draft_gap > DRAFT_CONSISTENCY
    assert any("will mostly be rejected" in s for s in said)


def test_a_manifest_edited_to_one_token_runs_is_padded_again(exact_package, tmp_path):
    """An int8-compute target whose manifest says runs as fed (copied, or edited): its lone
    tokens round otherwise, the load pads again and says so, and the second load reads what
    the first found."""
    copy = edited(exact_package, tmp_path, min_run_tokens=1)
    pipe, said = load_quiet(copy)
    found = pipe.numerics
    assert found.manifest_target_runs == 1 and found.source == "measured"
    assert found.target_exact and rows_identical(pipe.target, found.target_runs,
                                                 found.target_align)
    if found.target_runs == 1:  # one-row kernels agreeing on some CPU: nothing to fix there
        assert not said
    else:
        assert said and "the manifest says runs as fed, whose rows differ here" in said[0]
    drafted, accepted = greedy_is_target_only(pipe, PROMPTS, draft_length=3)
    assert drafted > 0 and accepted > 0
    again, said_again = load_quiet(copy)
    assert again.numerics.source == "stored" and said_again == said
    assert again.numerics.record() == found.record()


@pytest.mark.parametrize("change", [
    {"target_runs": 0}, {"target_runs": True}, {"target_runs": 10**9}, {"target_align": "4"},
    {"draft_gap": float("nan")}, {"draft_gap": -1}, {"format": 2}, {"instruction_sets": 7},
    {"manifest_target_runs": 1},
])
def test_a_stored_result_that_is_not_one_is_measured_again(exact_package, change):
    pipe = edgespec.load(exact_package)
    record = pipe.numerics.record()
    assert Numerics.from_record(record, 2, 1) == Numerics(**{**pipe.numerics.__dict__,
                                                              "source": "stored",
                                                              "seconds": 0.0})
    assert Numerics.from_record({**record, **change}, 2, 1) is None
    assert Numerics.from_record("not a record", 2, 1) is None
    key = calibration.numerics_key(pipe._package_stamp, pipe.describe_sessions())
    calibration.store_entry(key, {**record, **change})
    assert edgespec.load(exact_package).numerics.source == "measured"


def test_the_check_leaves_the_sessions_as_loaded(packages):
    pipe = edgespec.load(packages["llama"], calibration_cache=False)
    before = (pipe.target.min_run_tokens, pipe.target.run_align, pipe.draft.min_run_tokens)
    numerics.check(pipe.target, pipe.draft, requires_exact=True)
    assert (pipe.target.min_run_tokens, pipe.target.run_align,
            pipe.draft.min_run_tokens) == before


def test_export_runs_a_draft_with_wrong_one_token_steps_padded(checkpoints, tmp_path,
                                                              monkeypatch):
    """The build that failed on AVX2 ("cached and uncached runs of the graph differ"): the
    export validates the draft padded to two tokens and ships that, saying why."""
    faulty(monkeypatch, "draft", wrong_one_token_steps)
    lines = []
    export_pair(checkpoints["llama_target"], checkpoints["llama_draft"], tmp_path / "p",
                progress=lines.append)
    spec = Manifest.read(tmp_path / "p").draft
    assert spec.min_run_tokens == 2
    assert spec.validation["fallback"]["cached_vs_uncached"] > 1
    assert any("it runs with its runs padded to 2 tokens instead" in line for line in lines)
    pipe = edgespec.load(tmp_path / "p", calibration_cache=False)
    assert pipe.numerics.draft_runs == 2 and not pipe.numerics.fell_back


def test_export_without_the_fault_keeps_the_draft_as_fed(packages):
    assert Manifest.read(packages["llama"]).draft.min_run_tokens == 1
    assert "fallback" not in Manifest.read(packages["llama"]).draft.validation


def test_doctor_names_the_cpu_and_each_package(packages):
    result = CliRunner().invoke(main, ["doctor", str(packages["llama"]), str(packages["gpt2"])])
    assert result.exit_code == 0, result.output
    assert "instruction sets: " in result.output and "onnxruntime: " in result.output
    for name in ("llama", "gpt2"):
        assert f"{packages[name]} (" in result.output
    assert result.output.count("numerics on this CPU") >= 3  # the demo pair's too
    assert result.output.count("fell back: nothing") >= 3


def test_doctor_refuses_a_folder_that_is_not_a_package(tmp_path):
    result = CliRunner().invoke(main, ["doctor", str(tmp_path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.count("\n") == 1 and result.output.startswith("Error:")
