"""What the host offers a backend: an NVIDIA driver (whether or not CuPy is installed), the memory
available to this process, the cores it may run on. Read from /proc and /sys (Linux) and NVML;
each answer degrades to "unknown" elsewhere rather than failing."""

from __future__ import annotations

import os
from pathlib import Path

_NVIDIA_PROC = Path("/proc/driver/nvidia/version")


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version when one is loaded (None: no NVIDIA GPU can be used here),
    asked through NVML (a BentoML dependency) or read from /proc."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, or no driver behind it: try /proc
        pass
    try:
        text = _NVIDIA_PROC.read_text()
    except OSError:
        return None
    words = text.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), "unknown version")


def cuda_major() -> int | None:
    """The CUDA major version the driver supports (12, 13, ...), from NVML; None when unknown."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlSystemGetCudaDriverVersion()) // 1000
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML: unknown
        return None


# the package's CuPy extras (pyproject.toml), by the CUDA major version of the driver
CUPY_EXTRAS = {12: ("cuda12", "cupy-cuda12x>=13"), 13: ("cuda13", "cupy-cuda13x>=14")}


def cupy_extra() -> str:
    """How to install the CuPy wheel for this driver, in words."""
    major = cuda_major()
    if major is not None and major >= 12:
        extra, wheel = CUPY_EXTRAS[min(major, max(CUPY_EXTRAS))]
        return f"install the [{extra}] extra: pip install '{wheel}'"
    return "install the [cuda12] extra: pip install 'cupy-cuda12x>=13' (cuda13 and 'cupy-cuda13x>=14' for a CUDA 13 driver)"


def cores() -> int:
    """The CPUs this process may run on (its affinity, as a container's cpuset limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes of memory this process can still take: the kernel's MemAvailable, or less where a
    cgroup (a container's memory limit) leaves less. None when unknown."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError):
        pass
    try:      # cgroup v2: the limit less what the group already uses
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            room = max(0, int(limit) - used)
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail
