"""GPU and host discovery (NVML, amdsmi, psutil) and its mapping onto the engine's device order.

A leaf helper: it imports nothing else from `app`, so presets, the runtime and the CLI can all use it.
"""

from app.devices.inventory import discover, free_vram_bytes
from app.devices.mapping import EngineDeviceMatch, gpus_in_engine_order, map_engine_devices
from app.devices.types import BackendStatus, GpuInfo, GpuLink, HostInfo, Inventory, normalize_pci_bus_id

__all__ = [
    "BackendStatus",
    "EngineDeviceMatch",
    "GpuInfo",
    "GpuLink",
    "HostInfo",
    "Inventory",
    "discover",
    "free_vram_bytes",
    "gpus_in_engine_order",
    "map_engine_devices",
    "normalize_pci_bus_id",
]
