"""discover(): one Inventory of every GPU (NVIDIA via NVML, then AMD via amdsmi) and the host.

This is the entry point presets, `app devices` and the MoE cache sizing use. Each vendor backend reports
its own failure as a status line, so discover() always returns, on any machine.
"""

from __future__ import annotations

from types import ModuleType

from app.devices import amd, nvidia
from app.devices.host import host_info
from app.devices.types import Inventory, normalize_pci_bus_id


def discover(nvml: ModuleType | None = None, amdsmi: ModuleType | None = None) -> Inventory:
    """Query all vendor libraries and the host. nvml/amdsmi replace the real modules (for tests)."""
    nv_gpus, nv_links, nv_status = nvidia.probe(nvml)
    amd_gpus, amd_links, amd_status = amd.probe(amdsmi, first_index=len(nv_gpus))
    return Inventory(
        gpus=tuple(nv_gpus + amd_gpus),
        # NVIDIA-AMD pairs have no link entry: no library can describe a path between vendors.
        links=tuple(nv_links + amd_links),
        host=host_info(),
        backends=(nv_status, amd_status),
    )


def free_vram_bytes(pci_bus_id: str, nvml: ModuleType | None = None, amdsmi: ModuleType | None = None) -> int | None:
    """Free memory of one GPU, read live (not from a discover() snapshot); None when no GPU has that id.

    The MoE cache sizes itself from this right before allocating, when other processes may have taken
    memory since discovery.
    """
    if normalize_pci_bus_id(pci_bus_id) is None:
        return None
    free = nvidia.free_bytes(pci_bus_id, nvml)
    if free is None:
        free = amd.free_bytes(pci_bus_id, amdsmi)
    return free
