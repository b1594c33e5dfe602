"""The calibration cache: step costs measured once per package, machine and settings."""

from __future__ import annotations

import json
import os

import pytest

import edgespec
from edgespec.models import demo_package
from edgespec.runtime import calibration
from edgespec.runtime.schedule import StepCosts

COSTS = StepCosts(0.25, (2.5, 2.9, 3.1), ((17, 9.0), (33, 16.5)))


def test_costs_round_trip_under_their_key(tmp_path):
    assert calibration.load_costs("k", 2, tmp_path) is None
    assert calibration.store_costs("k", COSTS, tmp_path)
    assert calibration.load_costs("k", 2, tmp_path) == COSTS
    assert calibration.load_costs("other", 2, tmp_path) is None
    # an entry made before the long runs were timed is measured again, not read short
    calibration.store_entry("old", {"draft_step_ms": 0.25, "target_ms": [2.5, 2.9, 3.1]},
                            tmp_path)
    assert calibration.load_costs("old", 2, tmp_path) is None
    assert [p.name for p in tmp_path.iterdir()] == [calibration.FILE_NAME]  # no temp file left


@pytest.mark.parametrize("content", ["{not json", '{"format": 99, "entries": {}}', "[]",
                                     '{"format": 1, "entries": {"k": {"draft_step_ms": "x"}}}'])
def test_an_unreadable_or_foreign_file_is_ignored_then_replaced(tmp_path, content):
    (tmp_path / calibration.FILE_NAME).write_text(content)
    assert calibration.load_costs("k", 2, tmp_path) is None
    assert calibration.store_costs("k", COSTS, tmp_path)
    assert calibration.load_costs("k", 2, tmp_path) == COSTS


def test_a_folder_that_cannot_be_written_leaves_the_costs_unstored(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert not calibration.store_costs("k", COSTS, blocker / "cache")  # a file in the way
    assert calibration.load_costs("k", 2, blocker / "cache") is None


def test_the_store_keeps_only_the_newest_entries(tmp_path):
    for i in range(calibration.MAX_ENTRIES + 5):
        calibration.store_costs(f"k{i}", COSTS, tmp_path)
    entries = json.loads((tmp_path / calibration.FILE_NAME).read_text())["entries"]
    assert len(entries) == calibration.MAX_ENTRIES and f"k{calibration.MAX_ENTRIES + 4}" in entries


def test_the_key_follows_the_package_settings_and_kmax(tmp_path):
    package = tmp_path / "pkg"
    (package / "target").mkdir(parents=True)
    (package / "draft").mkdir()
    (package / "edgespec.json").write_text("{}")
    for role in ("target", "draft"):
        (package / role / "model.onnx").write_bytes(b"graph")
    models = ["target/model.onnx", "draft/model.onnx"]
    stamp = calibration.package_stamp(package, models)
    key = calibration.cache_key(stamp, {"threads": 2}, 8, 128)
    assert key == calibration.cache_key(stamp, {"threads": 2}, 8, 128)
    assert key != calibration.cache_key(stamp, {"threads": 1}, 8, 128)
    assert key != calibration.cache_key(stamp, {"threads": 2}, 4, 128)
    os.utime(package / "draft" / "model.onnx", ns=(1, 1))  # a re-exported draft
    assert calibration.package_stamp(package, models) != stamp


@pytest.mark.parametrize("entry", [
    {"draft_step_ms": 0.2, "target_ms": []},  # no target runs
    {"draft_step_ms": 0.2, "target_ms": [2.5, 2.9]},  # another kmax
    {"draft_step_ms": float("nan"), "target_ms": [2.5, 2.9, 3.1]},
    {"draft_step_ms": -1, "target_ms": [2.5, 2.9, 3.1]},
    {"draft_step_ms": 0.2, "target_ms": ["2.5", None, 3.1]},
])
def test_entries_that_are_not_costs_for_this_kmax_are_ignored(tmp_path, entry):
    (tmp_path / calibration.FILE_NAME).write_text(json.dumps(
        {"format": calibration.FORMAT, "entries": {"k": entry, "old": {"measured_at": "x"}}}))
    assert calibration.load_costs("k", 2, tmp_path) is None
    assert calibration.store_costs("k", COSTS, tmp_path)  # a foreign entry's date is no crash
    assert calibration.load_costs("k", 2, tmp_path) == COSTS


def test_without_a_home_folder_costs_are_measured_not_stored(monkeypatch):
    for name in ("EDGESPEC_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    # what os.path.expanduser does without HOME for a user id with no passwd entry
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)
    assert calibration.cache_folder() is None
    assert calibration.load_costs("k", 2) is None and not calibration.store_costs("k", COSTS)
    stats = edgespec.load(demo_package()).generate("x = 1", max_new_tokens=4).stats
    assert stats.calibration == "measured"


def test_the_stored_file_is_readable_as_the_users_files_are(tmp_path):
    calibration.store_costs("k", COSTS, tmp_path)
    mode = (tmp_path / calibration.FILE_NAME).stat().st_mode & 0o777
    assert mode == 0o666 & ~calibration._umask()


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "a"))
    assert calibration.cache_folder() == tmp_path / "a"
    monkeypatch.delenv("EDGESPEC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibration.cache_folder() == tmp_path / "xdg" / "edgespec"


def test_a_second_process_reads_the_costs_the_first_measured(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))
    settings = dict(max_new_tokens=8, schedule="adaptive", draft_length=4, seed=0)
    first = edgespec.load(demo_package())
    measured = first.generate("def add(a, b):", **settings).stats
    assert measured.calibration == "measured" and measured.calibration_s > 0
    again = first.generate("def add(a, b):", **settings).stats  # same process: kept
    assert again.calibration == "reused" and again.calibration_s == 0.0

    def no_measuring(*args, **kwargs):
        raise AssertionError("costs measured again although they were stored")

    monkeypatch.setattr("edgespec.runtime.pipeline.calibrate", no_measuring)
    second = edgespec.load(demo_package())  # a new process, as far as the costs go
    result = second.generate("def add(a, b):", **settings)
    assert result.stats.calibration == "stored"
    assert second.step_costs(4) == first.step_costs(4)
    assert "calibration cache" in result.stats.summary()
    assert result.token_ids == first.generate("def add(a, b):", **settings).token_ids


def test_without_the_cache_costs_are_measured_and_nothing_is_written(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    pipe = edgespec.load(demo_package(), calibration_cache=False)
    stats = pipe.generate("x = 1", max_new_tokens=4, schedule="adaptive", draft_length=2).stats
    assert stats.calibration == "measured"
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the kernel's CPU counters: Linux")
def test_another_process_using_the_cpu_makes_the_machine_busy_and_this_one_does_not(
        monkeypatch):
    import subprocess
    import sys
    import time

    from edgespec.runtime import machine

    monkeypatch.setattr(machine, "BUSY_SHARE", 0.25)  # conftest makes every machine quiet
    with machine.OtherLoad() as resting:  # what the neighbours use anyway (none, in CI)
        time.sleep(0.4)
    with machine.OtherLoad() as own:  # this process spinning: not a neighbour
        end = time.perf_counter() + 0.4
        while time.perf_counter() < end:
            pass
    assert own.share is not None and own.share < resting.share + 0.15
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.2)  # started
        with machine.OtherLoad() as shared:
            time.sleep(0.5)
    finally:
        for spinner in spinners:
            spinner.kill()
    assert shared.busy and shared.share > 0.5


def test_costs_measured_on_a_busy_machine_are_used_not_stored(monkeypatch, tmp_path):
    from edgespec.runtime import pipeline

    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))

    class Busy:
        busy, share = True, 0.6

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(pipeline, "OtherLoad", Busy)
    settings = dict(max_new_tokens=8, schedule="adaptive", draft_length=4, seed=0)
    first = edgespec.load(demo_package()).generate("def add(a, b):", **settings).stats
    assert first.calibration == "measured busy" and "busy: not stored" in first.summary()
    # the numerics' checks (not timings) are kept; no costs are
    assert not [e for e in calibration._read(tmp_path).values() if "target_ms" in e]
    monkeypatch.undo()
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))
    second = edgespec.load(demo_package()).generate("def add(a, b):", **settings).stats
    assert second.calibration == "measured"  # measured again, quiet this time: stored
    third = edgespec.load(demo_package()).generate("def add(a, b):", **settings).stats
    assert third.calibration == "stored"
