"""Portable numerics: packages exported here, decoded on the CPUs users have, through emulation.

onnxruntime picks its kernels by instruction set at run time, so what a package's exactness
rests on (rows of the target bit-identical across run sizes, the draft's one-token runs
agreeing with its longer ones) must hold on every CPU, and the load checks it there
(runtime/numerics.py). qemu-user runs Python under another CPU model:

- x86-64 without AVX-512 (``-cpu Haswell``: AVX2 and FMA, the kernels of AMD Zen 2/3 and of
  Intel Core before AVX-512) with this machine's own Python and virtual environment;
- ARM64 over an arm64 userland (.ci/arm64_userland.sh: Debian's Python for arm64, unpacked, and
  the runtime's aarch64 wheels from PyPI): NEON with dot product (``-cpu neoverse-n1``,
  Graviton 2, Raspberry Pi 5 class) and with i8mm, SVE and BF16 (``-cpu max``).

tests/emulated_probe.py runs there and reports; the figures are judged here. Each check has
its wrong variant shown to fail where it failed: the load's release probe as it was (runs of
two tokens only) breaks the draft on AVX2, and runs padded to two tokens alone (the shape every
package was exported with) give rows that differ on ARM64.

Without qemu (or the userland for ARM64) these tests skip, unless EDGESPEC_REQUIRE_EMULATION
is set (CI sets it, and .ci/run installs both).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from gguf_files import LLAMA_K, write_gguf
from stats_check import ALPHA, fit_pvalue

from edgespec.export import export_pair
from edgespec.runtime.machine import instruction_sets
from edgespec.runtime.run_checks import DRAFT_CONSISTENCY

pytestmark = pytest.mark.slow
PROBE = Path(__file__).parent / "emulated_probe.py"
REPO = Path(__file__).parents[1]
REQUIRED = bool(os.environ.get("EDGESPEC_REQUIRE_EMULATION"))
USERLAND = os.environ.get("EDGESPEC_ARM64_USERLAND")


@dataclass(frozen=True)
class Emulated:
    """A CPU model of qemu-user's, and what /proc/cpuinfo says of it on ARM64 (qemu-user shows
    the host's file; onnxruntime's cpuinfo library reads it and fails on an x86 one)."""

    title: str
    arch: str  # "x86_64" or "aarch64"
    model: str
    has: tuple[str, ...]  # instruction sets (machine.instruction_sets' names) it must show
    lacks: tuple[str, ...] = ()
    features: str = ""  # ARM64: the cpuinfo "Features" line

    def command(self) -> list[str]:
        """The prefix that runs this machine's Python (x86-64) or the userland's under it."""
        _wait_for_setup()
        if self.arch == "x86_64":
            if platform.machine() != "x86_64" or not shutil.which("qemu-x86_64"):
                self._missing("qemu-x86_64 on an x86-64 machine (apt-get install qemu-user)")
            return ["qemu-x86_64", "-cpu", self.model, sys.executable]
        root = Path(USERLAND or "/nonexistent") / "root"
        if not shutil.which("qemu-aarch64") or not (root / "usr/bin/python3.11").is_file():
            self._missing("qemu-aarch64 and an arm64 userland (bash .ci/arm64_userland.sh DIR; "
                          "EDGESPEC_ARM64_USERLAND=DIR)")
        (root / "proc").mkdir(exist_ok=True)
        (root / "proc/cpuinfo").write_text("".join(
            f"processor\t: {i}\nBogoMIPS\t: 50.00\nFeatures\t: {self.features}\n"
            "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\n"
            "CPU part\t: 0xd0c\nCPU revision\t: 1\n\n" for i in range(2)))
        return ["qemu-aarch64", "-cpu", self.model, "-L", str(root),
                str(root / "usr/bin/python3.11")]

    def env(self) -> dict:
        prefix = self.command()[:-1]
        env = {**os.environ, "EDGESPEC_PROBE_CHILD_PREFIX": json.dumps(prefix)}
        if self.arch == "aarch64":
            env["PYTHONPATH"] = os.pathsep.join([str(Path(USERLAND) / "site"), str(REPO)])
        return env

    def _missing(self, what: str) -> None:
        message = f"emulating {self.title} needs {what}"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)


def _wait_for_setup(limit_s: float = 900) -> None:
    """Where qemu and the userland are being made in the background (.ci/run), wait for the
    file EDGESPEC_EMULATION_SETUP that then holds the setup's exit status; fail on a bad one."""
    import time

    status = os.environ.get("EDGESPEC_EMULATION_SETUP")
    if not status:
        return
    deadline = time.monotonic() + limit_s
    while not os.path.exists(status):
        if time.monotonic() > deadline:
            pytest.fail(f"the emulation setup did not end within {limit_s:g} s ({status}.log)")
        time.sleep(2)
    code = Path(status).read_text().strip()
    if code != "0":
        log = Path(status + ".log")
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        pytest.fail(f"the emulation setup failed (exit {code}): {tail}")


_N1 = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc "
       "dcpop asimddp")
CPUS = {
    "avx2": Emulated("x86-64 AVX2 without AVX-512 (Haswell)", "x86_64", "Haswell",
                     has=("AVX2", "FMA"), lacks=("AVX-512", "AVX-512 VNNI")),
    "arm64-dotprod": Emulated("ARM64 NEON with dot product (Neoverse N1)", "aarch64",
                              "neoverse-n1", has=("NEON", "dot product"), lacks=("SVE",),
                              features=_N1),
    "arm64-i8mm": Emulated("ARM64 with i8mm, SVE and BF16 (qemu's max)", "aarch64", "max",
                           has=("NEON", "dot product", "SVE"),
                           features=_N1 + " sve asimdfhm i8mm bf16 sve2"),
}


def probe(cpu: Emulated | None, pair: Path, *args: str, timeout: int = 600) -> dict:
    """emulated_probe.py's report on ``pair`` under ``cpu`` (None: natively)."""
    command = [sys.executable] if cpu is None else cpu.command()
    env = os.environ if cpu is None else cpu.env()
    done = subprocess.run([*command, str(PROBE), "--pair", str(pair), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    """A GGUF pair with llama.cpp's K-quant blocks: a target computing in int8, its runs padded
    at export, and a draft computing in int8 whose Q4_K blocks carry zero points (the real
    coder pair's draft has 12 such matrices), exported on this machine."""
    root = tmp_path_factory.mktemp("portable")
    target = write_gguf(root / "t.gguf", "llama", LLAMA_K, seed=5, hidden=256)
    draft = write_gguf(root / "d.gguf", "llama", LLAMA_K, seed=6, hidden=256)
    export_pair(target, draft, root / "pair", target_compute="int8")
    return root / "pair"


def check_report(report: dict, cpu: Emulated | None) -> None:
    """What must hold on every CPU: the load chose an exact shape, the draft agrees with
    itself, greedy output with and without the draft is the same tokens from the same rows."""
    isa = report["instruction_sets"]
    if cpu is not None:
        assert all(name in isa for name in cpu.has), isa
        assert not any(name in isa for name in cpu.lacks), isa
    numerics = report["numerics"]
    assert numerics["target_exact"] and report["rows_identical_chosen"], numerics
    assert numerics["draft_gap"] <= DRAFT_CONSISTENCY, numerics
    assert report["draft_gap_as_fed"] <= DRAFT_CONSISTENCY, report["draft_gap_as_fed"]
    for run in report["greedy"]:
        assert run["drafted"] == run["target_only"], run["prompt"]
        assert run["tokens_drafted"] > 0 and run["rows_shared"] >= 24, run
        assert run["rows_differing"] == 0, run


def check_sampled(stats: dict) -> None:
    exact = {tuple(outcome): p for outcome, p in stats["exact"]}
    samples = [tuple(s) for s in stats["samples"]]
    assert stats["drafted"] > 0 and stats["accepted"] > 0
    assert fit_pvalue(samples, exact) > ALPHA


def test_native_machine_holds_what_the_emulated_ones_must(pair, packages):
    check_report(report := probe(None, pair, "--stats", str(packages["words"])), None)
    check_sampled(report["stats"])


@pytest.mark.parametrize("name", list(CPUS))
def test_emulated_cpu_decodes_exactly(pair, packages, name):
    """On each CPU: the shape its load chose gives bit-identical rows, greedy output with the
    draft at k = 3 is target-only's from the same rows, and sampling through the sessions
    (k = 2) fits the target's exact distribution (chi-square). On ARM64, runs padded to two
    tokens alone (the exported shape) give rows that differ: the wrong variant."""
    cpu = CPUS[name]
    stats = ("--stats", str(packages["words"])) if name != "arm64-i8mm" else ()
    report = probe(cpu, pair, *stats, timeout=900)
    check_report(report, cpu)
    if stats:
        check_sampled(report["stats"])
    numerics = report["numerics"]
    if cpu.arch == "aarch64":
        assert numerics["target_align"] > 1 and not report["rows_identical_padded"]
        assert sum(run["rows_differing"] for run in report["greedy_padded"]) > 0
    else:
        assert numerics["target_align"] == 1 and report["rows_identical_padded"]
        assert not numerics["fell_back"], numerics


def test_the_release_probe_before_its_fix_breaks_the_avx2_draft(pair):
    """The load's release probe as it was, runs of two tokens only: on AVX2 the draft's
    one-token kernel then reads zero points the load had let go (its logits off by most of
    their range, as on the AMD EPYC where the named pair failed to build), and the load's
    numerics check catches it by padding the draft's runs."""
    report = probe(CPUS["avx2"], pair, "--probe-runs", "2")
    assert report["draft_gap_as_fed"] > DRAFT_CONSISTENCY
    numerics = report["numerics"]
    assert numerics["draft_runs"] == 2 and numerics["draft_gap"] <= DRAFT_CONSISTENCY
    assert numerics["fell_back"]
    # natively too, on x86: a real AVX2-only CPU breaks as the emulated one does, while
    # AVX-512's kernels read no zero point
    here = instruction_sets()
    if "AVX-512" in here or "AVX2" in here:
        native = probe(None, pair, "--probe-runs", "2")
        broken = native["draft_gap_as_fed"] > DRAFT_CONSISTENCY
        assert broken == ("AVX-512" not in here), native


def test_a_package_exported_under_avx2_decodes_exactly_here(tmp_path):
    """The reverse: the export itself (its run-shape measurement and its validation against
    PyTorch) on an emulated AVX2 CPU, the package loaded and decoded natively."""
    cpu = CPUS["avx2"]
    target = write_gguf(tmp_path / "t.gguf", "llama", LLAMA_K, seed=5, hidden=256)
    draft = write_gguf(tmp_path / "d.gguf", "llama", LLAMA_K, seed=6, hidden=256)
    done = subprocess.run([*cpu.command(), "-m", "edgespec", "export", "--target", str(target),
                           "--draft", str(draft), "--out", str(tmp_path / "pkg"),
                           "--target-compute", "int8"], env=cpu.env(), capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    check_report(probe(None, tmp_path / "pkg"), None)
