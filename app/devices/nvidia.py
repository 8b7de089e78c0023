"""NVIDIA GPUs through NVML (the nvidia-ml-py package, imported as pynvml).

NVML ships with the driver, not with CUDA, so it answers even where no CUDA toolkit is installed, and it
never creates a CUDA context (no GPU memory is taken by asking). Every failure here becomes a BackendStatus
line rather than an exception: a machine without the driver is a normal machine.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from app.devices.types import BackendStatus, GpuInfo, GpuLink, normalize_pci_bus_id

# nvmlGpuTopologyLevel_t values -> nvidia-smi's `topo -m` vocabulary, so users see familiar words.
_TOPOLOGY_LABELS = {0: "BOARD", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
# Written out because some pynvml releases define NVML_P2P_CAPS_INDEX_READ as a one-element tuple.
_P2P_CAPS_READ = 0
_P2P_CAPS_NVLINK = 2
_P2P_STATUS_OK = 0
_MAX_NVLINKS = 36


def _load(nvml: ModuleType | None) -> ModuleType:
    return nvml if nvml is not None else importlib.import_module("pynvml")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _Session:
    """nvmlInit/nvmlShutdown around a block, with a helper that turns NVML errors into None."""

    def __init__(self, nvml: ModuleType):
        self.nvml = nvml
        self.error = getattr(nvml, "NVMLError", Exception)

    def __enter__(self) -> _Session:
        self.nvml.nvmlInit()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.error:
            pass  # shutting down a library that half-initialised is not worth a failure

    def call(self, name: str, *args: Any) -> Any:
        """Call nvml.<name>, or None when this driver lacks it or the device does not support it."""
        fn = getattr(self.nvml, name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.error:
            return None


def _read_gpu(s: _Session, index: int, i: int, handle: Any, driver: str | None) -> GpuInfo:
    mem = s.nvml.nvmlDeviceGetMemoryInfo(handle)  # allowed to raise: a GPU without memory info is unusable
    pci = s.call("nvmlDeviceGetPciInfo", handle)
    cc = s.call("nvmlDeviceGetCudaComputeCapability", handle)
    uuid = s.call("nvmlDeviceGetUUID", handle)
    return GpuInfo(
        index=index,
        vendor="nvidia",
        vendor_index=i,
        name=_text(s.call("nvmlDeviceGetName", handle) or f"NVIDIA GPU {i}"),
        pci_bus_id=normalize_pci_bus_id(getattr(pci, "busId", None)) if pci is not None else None,
        memory_total_bytes=int(mem.total),
        memory_free_bytes=int(mem.free),
        memory_used_bytes=int(mem.used),
        driver_version=driver,
        compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
        uuid=_text(uuid) if uuid else None,
    )


def _nvlink_remotes(s: _Session, handle: Any) -> list[str | None]:
    """PCI bus ids at the far end of each active NVLink (an NVSwitch's id on switched systems)."""
    remotes: list[str | None] = []
    for link in range(_MAX_NVLINKS):
        try:
            active = s.nvml.nvmlDeviceGetNvLinkState(handle, link)
        except (s.error, AttributeError):
            break  # links are numbered densely: the first unsupported one ends the list
        if not active:
            continue
        remote = s.call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        remotes.append(normalize_pci_bus_id(getattr(remote, "busId", None)) if remote is not None else None)
    return remotes


def _read_link(s: _Session, a: GpuInfo, b: GpuInfo, ha: Any, hb: Any, remotes_a: list[str | None]) -> GpuLink:
    level = s.call("nvmlDeviceGetTopologyCommonAncestor", ha, hb)
    p2p = s.call("nvmlDeviceGetP2PStatus", ha, hb, _P2P_CAPS_READ)
    nvlink_p2p = s.call("nvmlDeviceGetP2PStatus", ha, hb, _P2P_CAPS_NVLINK)
    n_direct = sum(1 for r in remotes_a if r is not None and r == b.pci_bus_id)
    # Behind NVSwitch no link ends at the peer; NVML's NVLink P2P status still says they talk over NVLink,
    # and every active link of the GPU carries that traffic (nvidia-smi prints NV18 on an HGX H100 the same way).
    n_links = n_direct or (len(remotes_a) if nvlink_p2p == _P2P_STATUS_OK else 0)
    return GpuLink(
        a=a.index,
        b=b.index,
        topology=_TOPOLOGY_LABELS.get(level) if level is not None else None,
        nvlink_count=n_links,
        p2p=None if p2p is None else p2p == _P2P_STATUS_OK,
    )


def probe(nvml: ModuleType | None = None) -> tuple[list[GpuInfo], list[GpuLink], BackendStatus]:
    """All NVIDIA GPUs and their pairwise links; never raises for a missing driver or library."""
    try:
        mod = _load(nvml)
    except Exception as exc:  # ImportError, or a broken install failing in its own import code
        return [], [], BackendStatus("nvidia", False, f"NVML not available (nvidia-ml-py: {exc})")
    try:
        with _Session(mod) as s:
            return _probe_devices(s)
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded are the common, normal cases
        return [], [], BackendStatus("nvidia", False, f"NVML not available ({_text(exc) or type(exc).__name__})")


def _probe_devices(s: _Session) -> tuple[list[GpuInfo], list[GpuLink], BackendStatus]:
    driver = s.call("nvmlSystemGetDriverVersion")
    driver = _text(driver) if driver else None
    n = int(s.nvml.nvmlDeviceGetCount())
    gpus: list[GpuInfo] = []
    handles: list[Any] = []
    skipped: list[str] = []
    for i in range(n):
        try:
            handle = s.nvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(_read_gpu(s, len(gpus), i, handle, driver))
            handles.append(handle)
        except s.error as exc:  # e.g. a GPU fallen off the bus: list the rest, say which one failed
            skipped.append(f"GPU {i}: {_text(exc)}")
    remotes = [_nvlink_remotes(s, h) for h in handles]
    links = [
        _read_link(s, gpus[i], gpus[j], handles[i], handles[j], remotes[i])
        for i in range(len(gpus))
        for j in range(i + 1, len(gpus))
    ]
    detail = f"NVML: {len(gpus)} NVIDIA GPU(s), driver {driver or 'unknown'}" if gpus else (
        f"NVML: no NVIDIA GPU (driver {driver or 'unknown'})"
    )
    if skipped:
        detail += f"; unreadable: {', '.join(skipped)}"
    return gpus, links, BackendStatus("nvidia", True, detail)


def free_bytes(pci_bus_id: str, nvml: ModuleType | None = None) -> int | None:
    """Free memory of the NVIDIA GPU at that PCI bus id right now, or None if NVML has no such GPU."""
    wanted = normalize_pci_bus_id(pci_bus_id)
    if wanted is None:
        return None
    try:
        mod = _load(nvml)
        with _Session(mod) as s:
            for i in range(int(mod.nvmlDeviceGetCount())):
                handle = mod.nvmlDeviceGetHandleByIndex(i)
                pci = s.call("nvmlDeviceGetPciInfo", handle)
                if pci is not None and normalize_pci_bus_id(getattr(pci, "busId", None)) == wanted:
                    return int(mod.nvmlDeviceGetMemoryInfo(handle).free)
    except Exception:  # no library, no driver, or the GPU vanished: the caller treats None as "unknown"
        return None
    return None
