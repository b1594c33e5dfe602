"""The oldest onnxruntime pyproject.toml accepts runs the packages exactly as the current one.

A fresh virtual environment gets that release from the package index (with the rest of the
runtime's dependencies as pyproject.toml lists them) and edgespec itself without dependencies,
then decodes greedily; the token ids must equal this environment's. Skipped only when pip cannot reach an index.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_files import LLAMA_K, write_gguf

from edgespec.models import demo_package

REPO = Path(__file__).resolve().parents[1]
TIED = REPO / "checkpoints" / "demo" / "target"  # tied embeddings: one int4 table
PIP_LIMITS = ["--timeout", "15", "--retries", "1"]  # offline: fail in seconds, not minutes
NETWORK_ERRORS = ("NewConnectionError", "Failed to establish a new connection",
                  "Temporary failure in name resolution", "Network is unreachable",
                  "Max retries exceeded", "ConnectTimeoutError", "ReadTimeoutError")

# Run by both interpreters: greedy ids for each package, speculative and target-only.
GREEDY_IDS = """
import json, sys
import edgespec, onnxruntime
out = {"onnxruntime": onnxruntime.__version__}
for path in sys.argv[1:]:
    pipe = edgespec.load(path, provider="cpu")
    out[path] = [pipe.generate(p, max_new_tokens=24, **s).token_ids
                 for p in ("def fibonacci(n):", "The quick brown")
                 for s in ({"draft_length": 4}, {"drafter": "none"})]
print(json.dumps(out))
"""


# Run by both interpreters: are the target's rows bit-identical across runs of 2..9 tokens?
ROWS_IDENTICAL = """
import json, sys
import edgespec
from edgespec.runtime.run_checks import rows_identical
print(json.dumps({path: rows_identical(edgespec.load(path, provider="cpu").target, trials=3)
                  for path in sys.argv[1:]}))
"""


def greedy_ids(python: Path | str, paths: list[str], script: str = GREEDY_IDS) -> dict:
    proc = subprocess.run([str(python), "-c", script, *paths], capture_output=True,
                          text=True, cwd=REPO / "tests")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def declared_floor() -> str:
    found = re.search(r'"onnxruntime>=([0-9.]+)"', (REPO / "pyproject.toml").read_text())
    assert found, "pyproject.toml declares no onnxruntime>= floor"
    return found.group(1)


def runtime_requirements() -> list[str]:
    """pyproject.toml's runtime dependencies, onnxruntime pinned to its floor."""
    block = re.search(r"^dependencies = \[(.*?)^\]", (REPO / "pyproject.toml").read_text(),
                      re.S | re.M)
    assert block, "pyproject.toml lists no dependencies"
    found = re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)
    return [f"onnxruntime=={declared_floor()}" if r.startswith("onnxruntime") else r
            for r in found]


def pip(python: Path, *args: str) -> None:
    proc = subprocess.run([str(python), "-m", "pip", *args, *PIP_LIMITS, "--quiet",
                           "--disable-pip-version-check"], capture_output=True, text=True)
    if proc.returncode == 0:
        return
    if any(e in proc.stdout + proc.stderr for e in NETWORK_ERRORS):
        pytest.skip(f"pip cannot reach a package index: {proc.stderr.strip().splitlines()[-1]}")
    pytest.fail(f"pip {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="module")
def floor_python(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("floor") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = folder / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    pip(python, "install", *runtime_requirements())
    pip(python, "install", "--no-deps", "-e", str(REPO))
    return python


@pytest.mark.slow
def test_the_floor_onnxruntime_gives_the_same_greedy_tokens(floor_python, packages, checkpoints,
                                                            tmp_path):
    """The demo package and fresh fused exports (fp32, int4 MatMulNBits) of the tiny pairs."""
    from edgespec.export import export_pair

    # float compute: int8 compute (the other choice export may make) rounds differently from
    # one onnxruntime build to another; within a build, its rows: the test below
    int4 = tmp_path / "int4"
    export_pair(checkpoints["llama_target"], checkpoints["llama_noisy"], int4, quantize="int4",
                target_compute="float")
    tied = tmp_path / "tied-int4"  # one int4 table read by GatherBlockQuantized and MatMulNBits
    export_pair(TIED, TIED, tied, quantize="int4", target_compute="float")
    # a GGUF file's blocks kept compact (Q4_K, Q5_0 and Q6_K: the tensors onnxruntime reads
    # made at load, runtime/unpack.py, and handed over as external initializers)
    mixed = write_gguf(tmp_path / "k.gguf", "llama", {**LLAMA_K, "ffn_up": "Q5_0"}, seed=5,
                       hidden=256)
    gguf_pair = tmp_path / "gguf"
    export_pair(mixed, mixed, gguf_pair, target_compute="float")
    paths = [str(demo_package()), str(packages["llama"]), str(packages["llama_noisy"]), str(int4),
             str(tied), str(gguf_pair)]
    floor, current = greedy_ids(floor_python, paths), greedy_ids(sys.executable, paths)
    assert floor.pop("onnxruntime") == declared_floor()
    current.pop("onnxruntime")
    assert floor == current


@pytest.mark.slow
def test_the_floor_onnxruntime_gives_bit_identical_rows_from_two_tokens_on(
        floor_python, packages, checkpoints, tmp_path):
    """What padded target runs rely on (export/runs.py), in the oldest onnxruntime too: fp32
    graphs (fused and optimum's) and an int4 target computing in int8; and greedy output with
    and without drafting identical there."""
    from edgespec.export import export_pair

    int8 = tmp_path / "int4-int8"
    export_pair(checkpoints["llama_target"], checkpoints["llama_noisy"], int8, quantize="int4",
                target_compute="int8", validation="skip")
    gguf_int8 = tmp_path / "gguf-int8"  # compact blocks computing in int8
    export_pair(write_gguf(tmp_path / "k.gguf", "llama", LLAMA_K, seed=5, hidden=256), None,
                gguf_int8, target_compute="int8", validation="skip")
    paths = [str(packages["llama"]), str(packages["gpt2"]), str(int8), str(gguf_int8)]
    for python in (floor_python, sys.executable):
        assert all(greedy_ids(python, paths, ROWS_IDENTICAL).values()), python
        ids = greedy_ids(python, [str(int8)])[str(int8)]  # [spec, alone] per prompt
        assert ids[0] == ids[1] and ids[2] == ids[3]
