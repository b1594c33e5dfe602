"""What a measurement ran on: the facts that make timings from two machines comparable or not.

Speed ratios move with the CPU (its caches decide whether a draft's weights stay close), the
cores edgespec may use, the onnxruntime build and how busy the machine was. Every bench result
carries these, and the calibration cache (calibration.py) is keyed by them.

Standard library only (benchmarks/common.py loads this file in the peers' environments, which
have no edgespec). CPU facts come from the kernel (/proc/cpuinfo, sysfs) rather than
py-cpuinfo, which is slow to import and can misreport a VM's caches (sysfs has them right).
"""

from __future__ import annotations

import os
import platform
import time
from importlib import metadata
from pathlib import Path

_CACHE_FOLDER = Path("/sys/devices/system/cpu/cpu0/cache")
# Distributions that all install the one `onnxruntime` module: with two of them installed, the
# last one written overwrote the other's files (pip install "edgespec[gpu]" brings the CPU
# build, a dependency, beside the GPU one, and the CPU build usually wins).
ONNXRUNTIME_BUILDS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml",
                      "onnxruntime-openvino", "onnxruntime-qnn", "onnxruntime-rocm",
                      "onnxruntime-migraphx", "onnxruntime-training")


def cpu_model() -> str:
    """The CPU's marketing name (Linux: /proc/cpuinfo), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction sets that pick onnxruntime's kernels (MLAS dispatches on them at run time), by
# the names numpy's CPUID reading gives them; each with the name edgespec prints
_NUMPY_ISA = (("AVX2", "AVX2"), ("FMA3", "FMA"), ("AVX512F", "AVX-512"),
              ("AVX512BW", "AVX-512BW"), ("AVX512VNNI", "AVX-512 VNNI"),
              ("AVX512BF16", "AVX-512 BF16"), ("AVX512FP16", "AVX-512 FP16"),
              ("ASIMD", "NEON"), ("ASIMDDP", "dot product"), ("ASIMDFHM", "FHM"),
              ("ASIMDHP", "FP16"), ("SVE", "SVE"))
# What numpy does not read, from the kernel's flags (x86 /proc/cpuinfo "flags", ARM "Features")
_KERNEL_ISA = (("avx_vnni", "AVX-VNNI"), ("amx_int8", "AMX-INT8"), ("amx_bf16", "AMX-BF16"),
               ("i8mm", "i8mm"), ("bf16", "BF16"), ("sve2", "SVE2"))


def instruction_sets() -> tuple[str, ...]:
    """The instruction sets of _NUMPY_ISA and _KERNEL_ISA this process can use, e.g.
    ("AVX2", "FMA", "AVX-512", ...). numpy's reading runs CPUID in this process, so it is what
    onnxruntime sees (under an emulator, the emulated CPU); the kernel's flags describe the
    host, so they are read only where they agree with numpy's on AVX-512 and NEON (an emulated
    CPU without AVX-512 does not get the host's AMX)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as features
        except ImportError:  # no numpy (a peer's environment): the kernel's word alone
            features = None
    flags = _kernel_flags()
    if features is None:
        names = {"avx2": "AVX2", "fma": "FMA", "avx512f": "AVX-512", "avx512_vnni":
                 "AVX-512 VNNI", "asimd": "NEON", "asimddp": "dot product", "sve": "SVE"}
        found = [label for flag, label in names.items() if flag in flags]
    else:
        found = [label for name, label in _NUMPY_ISA if features.get(name)]
        host = ("avx512f" in flags, "asimd" in flags)
        if host != (bool(features.get("AVX512F")), bool(features.get("ASIMD"))):
            flags = set()  # an emulated or masked CPU: the kernel describes another one
    return tuple(found + [label for flag, label in _KERNEL_ISA if flag in flags])


def _kernel_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_caches() -> dict[str, str]:
    """Cache sizes as the kernel reports them for one core, e.g. {"L1d": "32K", "L2": "1024K",
    "L3": "32768K"}; L3 is usually shared by several cores. Empty where sysfs has none."""
    caches = {}
    for index in sorted(_CACHE_FOLDER.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        caches[name] = size
    return caches


def memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def onnxruntime_build() -> str:
    """The installed onnxruntime distribution and version, e.g. "onnxruntime 1.32.0"."""
    for name in ONNXRUNTIME_BUILDS:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "onnxruntime (unknown build)"


def load_average() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


# Other processes using more than this share of every core's time while costs are measured
# make them a busy machine's: a timing then says more about the neighbours than the graphs.
BUSY_SHARE = 0.25


def _machine_cpu_s() -> float | None:
    """CPU seconds every process has used since boot, all cores together (Linux: /proc/stat's
    first line, all but idle and iowait; steal counted, as a neighbour's use); None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        ticks = [int(v) for v in fields[1:9]]
    except (OSError, ValueError):
        return None
    if fields[0] != "cpu" or len(ticks) < 8:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """How much of the machine other processes used while a ``with`` block ran: ``share``,
    their CPU time over the block's wall time on every core (0..1; None where the system does
    not say: not Linux, or a block too short to tell), and ``busy``, whether it passed
    BUSY_SHARE."""

    def __enter__(self) -> OtherLoad:
        self.share = None
        self._start = (_machine_cpu_s(), time.process_time(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        machine, own, wall = (_machine_cpu_s(), time.process_time(), time.perf_counter())
        machine0, own0, wall0 = self._start
        if machine is None or machine0 is None or wall - wall0 < 0.1:
            return
        others = max(0.0, (machine - machine0) - (own - own0))
        self.share = min(1.0, others / ((wall - wall0) * (os.cpu_count() or 1)))

    @property
    def busy(self) -> bool:
        return self.share is not None and self.share > BUSY_SHARE


def machine_info() -> dict:
    """Everything above, for a results file."""
    return {
        "cpu": cpu_model(),
        "instruction_sets": list(instruction_sets()),
        "cores": usable_cores(),
        "cpu_count": os.cpu_count(),
        "caches": cpu_caches(),
        "memory_bytes": memory_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime_build(),
        "load_average_at_start": load_average(),
    }


def describe(info: dict) -> str:
    """One line for a table's header: CPU, cores, caches, onnxruntime, load."""
    caches = ", ".join(f"{k} {v}" for k, v in info["caches"].items() if k != "L1i")
    load = info.get("load_average_at_start")
    busy = f"; load average {load[0]:.2f} at start" if load else ""
    return (f"{info['cpu']}, {info['cores']} cores ({caches or 'caches unknown'}); "
            f"{info['onnxruntime']}{busy}")
