"""AMD GPUs through amdsmi, the Python binding that ships with ROCm (optional extra `rigserve[amd]`).

amdsmi is absent on most machines and, where present, can fail in its own import when the ROCm library it
wraps is missing or of another version. Any such failure is reported as a BackendStatus line, never raised:
AMD support must not be able to break an NVIDIA or CPU-only machine.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

from app.devices.types import BackendStatus, GpuInfo, GpuLink, normalize_pci_bus_id

_XGMI_LINK_TYPE = 2  # AMDSMI_IOLINK_TYPE_XGMI, used when the binding does not expose its enum
_MIB = 1 << 20


def _load(amdsmi: ModuleType | None) -> ModuleType:
    return amdsmi if amdsmi is not None else importlib.import_module("amdsmi")


def _installed() -> bool:
    """Whether an amdsmi binding is present at all, without importing (and so without loading ROCm)."""
    if "amdsmi" in sys.modules:  # a None entry there means "import blocked", as tests do
        return sys.modules["amdsmi"] is not None
    try:
        return importlib.util.find_spec("amdsmi") is not None
    except (ImportError, ValueError):
        return False


class _Session:
    """amdsmi_init/amdsmi_shut_down around a block; call() turns library errors into None."""

    def __init__(self, mod: ModuleType):
        self.mod = mod
        self.error = getattr(mod, "AmdSmiException", Exception)

    def __enter__(self) -> _Session:
        flags = getattr(self.mod, "AmdSmiInitFlags", None)
        # GPUs only: initialising the CPU side needs the HSMP driver and fails on most hosts.
        if flags is not None and hasattr(flags, "INIT_AMD_GPUS"):
            self.mod.amdsmi_init(flags.INIT_AMD_GPUS)
        else:
            self.mod.amdsmi_init()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.mod.amdsmi_shut_down()
        except Exception:
            pass  # nothing useful to do about a failing shutdown

    def call(self, name: str, *args: Any) -> Any:
        fn = getattr(self.mod, name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.error:
            return None


def _memory(s: _Session, handle: Any) -> tuple[int, int]:
    """(total, used) VRAM in bytes, from the byte-exact calls or the older MiB-granular one."""
    mem_type = getattr(getattr(s.mod, "AmdSmiMemoryType", None), "VRAM", None)
    if mem_type is not None:
        total = s.call("amdsmi_get_gpu_memory_total", handle, mem_type)
        used = s.call("amdsmi_get_gpu_memory_usage", handle, mem_type)
        if total is not None and used is not None:
            return int(total), int(used)
    usage = s.call("amdsmi_get_gpu_vram_usage", handle) or {}
    return int(usage.get("vram_total", 0)) * _MIB, int(usage.get("vram_used", 0)) * _MIB


def _gfx_target(asic: dict[str, Any]) -> str | None:
    raw = asic.get("target_graphics_version")
    if raw in (None, "", "N/A"):
        return None
    # Some releases print "gfx942:sramecc+:xnack-"; the feature suffix is not part of the target name.
    return str(raw).split(":")[0].lower()


def _read_gpu(s: _Session, index: int, vendor_index: int, handle: Any) -> GpuInfo:
    asic = s.call("amdsmi_get_gpu_asic_info", handle) or {}
    driver = s.call("amdsmi_get_gpu_driver_info", handle) or {}
    total, used = _memory(s, handle)
    uuid = s.call("amdsmi_get_gpu_device_uuid", handle)
    return GpuInfo(
        index=index,
        vendor="amd",
        vendor_index=vendor_index,
        name=str(asic.get("market_name") or f"AMD GPU {vendor_index}"),
        pci_bus_id=normalize_pci_bus_id(s.call("amdsmi_get_gpu_device_bdf", handle)),
        memory_total_bytes=total,
        memory_free_bytes=max(total - used, 0),
        memory_used_bytes=used,
        driver_version=str(driver.get("driver_version")) if driver.get("driver_version") else None,
        gfx_target=_gfx_target(asic),
        uuid=str(uuid) if uuid else None,
    )


def _is_xgmi(mod: ModuleType, link_type: Any) -> bool:
    name = getattr(link_type, "name", None)
    if isinstance(name, str):
        return "XGMI" in name.upper()
    enum = getattr(mod, "AmdSmiIoLinkType", None)
    xgmi = getattr(enum, "XGMI", _XGMI_LINK_TYPE)
    try:
        return int(link_type) == int(xgmi)
    except (TypeError, ValueError):
        return False


def _read_link(s: _Session, a: GpuInfo, b: GpuInfo, ha: Any, hb: Any) -> GpuLink:
    info = s.call("amdsmi_topo_get_link_type", ha, hb) or {}
    p2p = s.call("amdsmi_is_P2P_accessible", ha, hb)
    xgmi = _is_xgmi(s.mod, info.get("type")) if "type" in info else False
    hops = info.get("hops")
    return GpuLink(
        a=a.index,
        b=b.index,
        topology=None if xgmi else ("PCIE" if info else None),
        xgmi=xgmi,
        hops=int(hops) if hops is not None else None,
        p2p=None if p2p is None else bool(p2p),
    )


def probe(amdsmi: ModuleType | None = None, first_index: int = 0) -> tuple[list[GpuInfo], list[GpuLink], BackendStatus]:
    """All AMD GPUs (indices numbered from first_index) and their links; never raises."""
    if amdsmi is None and not _installed():
        return [], [], BackendStatus("amd", False, "AMD SMI not installed")
    try:
        mod = _load(amdsmi)
    except Exception as exc:  # the binding exists but its native library (ROCm) does not load
        return [], [], BackendStatus("amd", False, f"AMD SMI not available ({exc})")
    try:
        with _Session(mod) as s:
            handles = list(s.mod.amdsmi_get_processor_handles())
            gpus = [_read_gpu(s, first_index + k, k, h) for k, h in enumerate(handles)]
            links = [
                _read_link(s, gpus[i], gpus[j], handles[i], handles[j])
                for i in range(len(gpus))
                for j in range(i + 1, len(gpus))
            ]
    except Exception as exc:  # amdgpu driver not loaded, or no permission on /dev/kfd
        return [], [], BackendStatus("amd", False, f"AMD SMI not available ({exc})")
    detail = f"AMD SMI: {len(gpus)} AMD GPU(s)" if gpus else "AMD SMI: no AMD GPU"
    return gpus, links, BackendStatus("amd", True, detail)


def free_bytes(pci_bus_id: str, amdsmi: ModuleType | None = None) -> int | None:
    """Free VRAM of the AMD GPU at that PCI bus id right now, or None if amdsmi has no such GPU."""
    wanted = normalize_pci_bus_id(pci_bus_id)
    if wanted is None:
        return None
    try:
        mod = _load(amdsmi)
        with _Session(mod) as s:
            for handle in s.mod.amdsmi_get_processor_handles():
                if normalize_pci_bus_id(s.call("amdsmi_get_gpu_device_bdf", handle)) == wanted:
                    total, used = _memory(s, handle)
                    return max(total - used, 0)
    except Exception:  # missing library or driver: "unknown" to the caller
        return None
    return None
