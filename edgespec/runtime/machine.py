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


def machine_info() -> dict:
    """Everything above, for a results file."""
    return {
        "cpu": cpu_model(),
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
