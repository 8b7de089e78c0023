"""The host side of a rig: CPU cores and memory (psutil), CPU model and NUMA nodes (Linux sysfs/procfs).

Physical cores decide the default thread count and available memory decides how many MoE experts can live in
host RAM, so both are read fresh on every call.
"""

from __future__ import annotations

import platform
from pathlib import Path

import psutil

from app.devices.types import HostInfo


def _cpu_model() -> str | None:
    # platform.processor() is often empty on Linux; /proc/cpuinfo has the marketing name.
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Hardware", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _numa_nodes() -> int | None:
    try:
        nodes = [p for p in Path("/sys/devices/system/node").glob("node[0-9]*") if p.is_dir()]
    except OSError:
        return None
    return len(nodes) or None


def host_info() -> HostInfo:
    """Cores and memory of this machine; fields the OS does not report are None."""
    vm = psutil.virtual_memory()
    return HostInfo(
        cpu_model=_cpu_model(),
        n_cores_physical=psutil.cpu_count(logical=False),
        n_cores_logical=psutil.cpu_count(logical=True),
        memory_total_bytes=int(vm.total),
        memory_available_bytes=int(vm.available),
        n_numa_nodes=_numa_nodes(),
    )
