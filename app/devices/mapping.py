"""Which discovered GPU each engine (ggml backend) device is: a pure function of the two lists.

The engine numbers devices its own way (CUDA0.. in CUDA's order, which by default is fastest first, and
CUDA_VISIBLE_DEVICES may hide or reorder GPUs); NVML numbers them in PCI order. Only the PCI bus id is
shared, so that is the key. ggml reports it in its device props (`device_id`, lower-case `dddd:bb:dd.f`, with
`-vN` for virtual devices); when a backend leaves it empty we fall back to the device name, and say so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.devices.types import GpuInfo, normalize_pci_bus_id

# Field names an engine device record may use for the PCI bus id; ggml calls it device_id.
_PCI_FIELDS = ("pci_bus_id", "device_id", "bus_id")


@dataclass(frozen=True)
class EngineDeviceMatch:
    """The GPU behind one engine device, and how sure we are of it."""

    engine_index: int  # position in the engine's device list
    engine_name: str  # e.g. "CUDA0"
    gpu_index: int | None  # index into Inventory.gpus, None for CPU/unmatched devices
    pci_bus_id: str | None
    # "pci_bus_id": exact; "name": only one unmatched GPU had this name; "order": several identical GPUs,
    # assigned in PCI order (right when CUDA_DEVICE_ORDER=PCI_BUS_ID); "host": a CPU device; "none".
    matched_by: str


def _field(device: Any, *names: str) -> Any:
    """Read the first present field from a dict-like or attribute-style engine device record."""
    for name in names:
        value = device.get(name) if isinstance(device, Mapping) else getattr(device, name, None)
        if value not in (None, ""):
            return value
    return None


def _is_host_device(device: Any) -> bool:
    kind = _field(device, "type", "kind")
    kind_text = str(getattr(kind, "name", kind) or "").lower()
    name = str(_field(device, "name") or "").lower()
    # ggml's CPU device and its accelerator-on-CPU helpers (BLAS, AMX) are not GPUs.
    return kind_text in ("cpu", "accel") or kind_text.endswith(".cpu") or name in ("cpu", "blas")


def _name_candidates(device: Any, gpus: Sequence[GpuInfo], used: set[int]) -> list[GpuInfo]:
    text = " ".join(str(_field(device, f) or "") for f in ("description", "name")).lower()
    return [g for g in gpus if g.index not in used and g.name.lower() in text]


def _match_by_name(device: Any, gpus: Sequence[GpuInfo], used: set[int]) -> tuple[GpuInfo | None, str]:
    candidates = _name_candidates(device, gpus, used)
    if not candidates:
        return None, "none"
    chosen = min(candidates, key=lambda g: g.pci_bus_id or "")
    return chosen, "name" if len(candidates) == 1 else "order"


def map_engine_devices(gpus: Sequence[GpuInfo], engine_devices: Sequence[Any]) -> list[EngineDeviceMatch]:
    """Match each engine device (dicts or objects with name/description/type/device_id) to a GpuInfo.

    Exact PCI matches are made first, for all devices, so a name fallback can never take a GPU that another
    engine device owns by bus id. Several engine devices may share one GPU (ggml's virtual devices).
    """
    by_pci = {g.pci_bus_id: g for g in gpus if g.pci_bus_id}
    exact: dict[int, GpuInfo] = {}
    for i, dev in enumerate(engine_devices):
        pci = normalize_pci_bus_id(_field(dev, *_PCI_FIELDS))
        if pci in by_pci and not _is_host_device(dev):
            exact[i] = by_pci[pci]
    used = {g.index for g in exact.values()}
    result: list[EngineDeviceMatch] = []
    for i, dev in enumerate(engine_devices):
        name = str(_field(dev, "name") or f"device{i}")
        pci = normalize_pci_bus_id(_field(dev, *_PCI_FIELDS))
        if i in exact:
            gpu, how = exact[i], "pci_bus_id"
        elif _is_host_device(dev):
            gpu, how = None, "host"
        else:
            gpu, how = _match_by_name(dev, gpus, used)
            if gpu is not None:
                used.add(gpu.index)
        result.append(EngineDeviceMatch(i, name, gpu.index if gpu else None, gpu.pci_bus_id if gpu else pci, how))
    return result


def gpus_in_engine_order(gpus: Sequence[GpuInfo], engine_devices: Sequence[Any]) -> list[GpuInfo | None]:
    """GpuInfo for each engine device, in the engine's order (None for CPU or unknown devices)."""
    by_index = {g.index: g for g in gpus}
    matches = map_engine_devices(gpus, engine_devices)
    return [by_index.get(m.gpu_index) if m.gpu_index is not None else None for m in matches]
