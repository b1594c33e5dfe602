"""Provider choice: one onnxruntime build per install, one line per fallback, no onnxruntime log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import onnxruntime as ort
import pytest

import edgespec
from edgespec.runtime import providers
from edgespec.runtime.providers import (
    SessionConfig,
    fallback_warning,
    install_warning,
    installed_builds,
    library_failure,
    provider_chain,
)

BOTH = ("onnxruntime 1.32.0", "onnxruntime-gpu 1.31.1")
CPU_ONLY = ["AzureExecutionProvider", "CPUExecutionProvider"]
FIX = "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu"


def test_the_installed_build_is_found():
    builds = installed_builds()
    assert any(b.split()[1] == ort.__version__ for b in builds), builds


def test_two_builds_give_one_line_that_says_how_to_keep_the_gpu_one():
    line = install_warning(BOTH, CPU_ONLY, missing="cuda")
    assert line.startswith("onnxruntime 1.32.0 and onnxruntime-gpu 1.31.1 are both installed")
    assert "provider 'cuda' is not in this onnxruntime" in line and "running on CPU" in line
    assert line.endswith(f"Keep only onnxruntime-gpu: {FIX}") and "\n" not in line
    auto = install_warning(BOTH, CPU_ONLY, missing=None)  # auto: nothing missing, still said
    assert auto.endswith(FIX) and "running on CPU" not in auto
    other = install_warning(("onnxruntime 1.32.0", "onnxruntime-directml 1.24.4"), CPU_ONLY, None)
    assert other.endswith("pip uninstall -y onnxruntime onnxruntime-directml && "
                          "pip install onnxruntime-directml")


def test_one_build_warns_only_when_it_lacks_the_provider():
    assert install_warning(("onnxruntime 1.32.0",), CPU_ONLY, missing=None) is None
    line = install_warning(("onnxruntime 1.32.0",), CPU_ONLY, missing="tensorrt")
    assert line == (
        "provider 'tensorrt' is not in this onnxruntime (it has AzureExecutionProvider, "
        "CPUExecutionProvider); running on CPU. For GPUs: pip uninstall -y onnxruntime && "
        "pip install onnxruntime-gpu"
    )


@pytest.mark.parametrize("provider", ["auto", "cuda", "tensorrt"])
def test_two_builds_are_named_when_a_gpu_is_asked_for(monkeypatch, provider):
    monkeypatch.setattr(providers, "INSTALLED_BUILDS", BOTH)
    _, warning = provider_chain(SessionConfig(provider))
    assert warning.endswith(FIX)


def test_two_builds_are_not_mentioned_for_the_cpu(monkeypatch):
    monkeypatch.setattr(providers, "INSTALLED_BUILDS", BOTH)
    assert provider_chain(SessionConfig("cpu")) == (["CPUExecutionProvider"], None)


def test_loading_with_two_builds_warns_once(monkeypatch, packages):
    monkeypatch.setattr(providers, "INSTALLED_BUILDS", BOTH)
    with pytest.warns(UserWarning) as caught:
        edgespec.load(packages["llama"], provider="auto")
    assert len(caught) == 1 and str(caught[0].message).endswith(FIX)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        edgespec.load(packages["llama"], provider="cpu")


def test_a_fallback_names_each_provider_that_could_not_start():
    chain = [("TensorrtExecutionProvider", {}), "CUDAExecutionProvider", "CPUExecutionProvider"]
    line = fallback_warning(chain, ["CPUExecutionProvider"])
    trt, cuda = line.split("), ")
    assert trt.startswith("TensorrtExecutionProvider could not start (")
    assert cuda.startswith("CUDAExecutionProvider could not start (")
    assert line.endswith("); running on CPUExecutionProvider") and "\n" not in line
    if "CUDAExecutionProvider" not in ort.get_available_providers():  # the CPU build
        assert "(libonnxruntime_providers_cuda.so is missing from this onnxruntime" in cuda
    on_cuda = fallback_warning(chain, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert on_cuda.startswith("TensorrtExecutionProvider could not start")
    assert on_cuda.endswith("; running on CUDAExecutionProvider")
    assert "CUDAExecutionProvider could not" not in on_cuda
    assert fallback_warning(chain[1:], ["CUDAExecutionProvider", "CPUExecutionProvider"]) is None


def test_the_reason_is_the_first_library_the_provider_lacks(monkeypatch, tmp_path):
    library = tmp_path / "libonnxruntime_providers_cuda.so"
    missing = "libonnxruntime_providers_cuda.so is missing from this onnxruntime"
    assert library_failure(library) == missing
    library.write_bytes(b"")

    def cdll(path):
        raise OSError("libcudnn.so.9: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(providers.ctypes, "CDLL", cdll)
    assert library_failure(library) == "libcudnn.so.9 not found"
    monkeypatch.setattr(providers.ctypes, "CDLL", lambda path: None)
    assert library_failure(library) is None


UNUSED_INITIALIZER = """
import sys
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

if sys.argv[2] == "load":
    import edgespec
    edgespec.load(sys.argv[1], provider="cpu")
x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in "xy")
graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y],
                          [numpy_helper.from_array(np.zeros(1, np.float32), "unused")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
"""


def test_onnxruntime_logs_nothing_once_edgespec_loaded_a_package(packages):
    """A graph with an unused initializer makes onnxruntime log a warning, unless silenced."""
    def stderr(mode: str) -> str:
        args = [sys.executable, "-c", UNUSED_INITIALIZER, str(packages["llama"]), mode]
        return subprocess.run(args, capture_output=True, text=True, check=True).stderr

    assert "Removing initializer 'unused'" in stderr("plain")  # the check can see a log line
    assert stderr("load") == ""


def test_thread_defaults_follow_the_drafts_size():
    from edgespec.runtime.providers import LARGE_DRAFT_PARAMETERS, default_session_configs

    cores = os.cpu_count() or 1
    pool = lambda c: (c.threads, c.spin, c.shared_pool)  # noqa: E731
    target, draft = default_session_configs("cpu", draft_parameters=1_600_000)  # the demo's
    assert (pool(target), pool(draft)) == ((cores, True, False), (1, False, False))
    target, draft = default_session_configs("cpu", draft_parameters=LARGE_DRAFT_PARAMETERS)
    assert (pool(target), pool(draft)) == ((cores, True, False), (cores, False, False))
    # a real draft shares one pool with its target, every core spinning; a tiny one does not
    target, draft = default_session_configs("cpu", draft_parameters=LARGE_DRAFT_PARAMETERS,
                                            shared_pool=True)
    assert pool(target) == pool(draft) == (cores, True, True)
    target, draft = default_session_configs("cpu", draft_parameters=1_600_000, shared_pool=True)
    assert (pool(target), pool(draft)) == ((cores, True, False), (1, False, False))


SHARED_POOL = """
import sys
from edgespec.runtime import providers
from edgespec.runtime.providers import SessionConfig
if sys.argv[1] == "made elsewhere":  # a host application made onnxruntime's global pools first
    from onnxruntime.capi._pybind_state import set_global_thread_pool_sizes
    set_global_thread_pool_sizes(2, 1)
own, shared = SessionConfig("cpu", threads=1), SessionConfig("cpu", threads=2, shared_pool=True)
print([providers.on_shared_pool(own), providers.on_shared_pool(shared),
       providers.on_shared_pool(own), providers.shared_pool_threads()])
"""


@pytest.mark.parametrize("before, answers", [
    ("nothing", [False, True, True, 2]),  # once made, every session is on it
    ("made elsewhere", [False, True, True, None]),  # its size unknown
])
def test_the_pool_is_made_once_and_then_every_session_runs_on_it(before, answers):
    """In a process of its own: onnxruntime makes its global pools once per process."""
    out = subprocess.run([sys.executable, "-c", SHARED_POOL, before], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == str(answers)


PAIR_ON_POOLS = """
import json, sys
import edgespec
if sys.argv[2] == "made elsewhere":  # a host application made onnxruntime's global pools first
    from onnxruntime.capi._pybind_state import set_global_thread_pool_sizes
    set_global_thread_pool_sizes(2, 1)
from edgespec.runtime.providers import SessionConfig
# a large draft's settings: each on two threads, of its own pool or of the shared one
shared = sys.argv[2] == "shared"
target = SessionConfig("cpu", threads=2, spin=True, shared_pool=shared)
pipe = edgespec.load(sys.argv[1], target=target, draft=SessionConfig("cpu", threads=2,
                                                                     shared_pool=shared))
tokens = []
for temperature in (0.0, 0.8):
    result = pipe.generate("def add(a, b):", max_new_tokens=12, schedule="fixed",
                           draft_length=3, temperature=temperature, seed=5)
    assert result.stats.drafted > 0
    tokens.append(result.token_ids)
sessions = pipe.describe_sessions()
print(json.dumps([tokens, [sessions[r]["on_shared_pool"] for r in ("target", "draft")]]))
"""


def test_a_pair_on_the_shared_pool_gives_the_tokens_of_its_own_pools(packages):
    """The shared pool changes where work runs, not what it computes: greedy and seeded
    tokens as on pools of their own of as many threads. Where a host made onnxruntime's
    global pools first, a load that did not ask for them runs on them (as onnxruntime
    requires) instead of failing; the results file says which pool ran."""
    def run(mode: str) -> list:
        args = [sys.executable, "-c", PAIR_ON_POOLS, str(packages["llama"]), mode]
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        return json.loads(out.splitlines()[-1])

    own, shared, elsewhere = run("own"), run("shared"), run("made elsewhere")
    assert own[1] == [False, False] and shared[1] == elsewhere[1] == [True, True]
    assert own[0] == shared[0] == elsewhere[0]


def test_the_stats_say_which_threads_ran(packages):
    import edgespec

    stats = edgespec.load(packages["llama"]).generate("def add(a, b):", max_new_tokens=4,
                                                     schedule="fixed").stats
    assert stats.threads == {"target": os.cpu_count() or 1, "draft": 1}
    assert stats.as_dict()["threads"] == stats.threads and stats.calibration_s == 0.0
