"""Plain records for what device discovery found: GPUs, the links between them, the host, the backends tried.

Everything here is data (frozen dataclasses and a PCI bus id normaliser), so presets, the MoE cache sizing and
tests can build and compare inventories without any vendor library present.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

_PCI_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-f]{1,8}):)?(?P<bus>[0-9a-f]{1,2}):(?P<dev>[0-9a-f]{1,2})\.(?P<fn>[0-7])$"
)


def normalize_pci_bus_id(raw: str | bytes | None) -> str | None:
    """Canonical lower-case `dddd:bb:dd.f`, or None when raw is not a PCI bus id.

    NVML reports an 8-digit upper-case domain (`00000000:1B:00.0`), CUDA and ggml a 4-digit lower-case one
    (`0000:1b:00.0`), amdsmi the 4-digit form; ggml appends `-vN` for virtual devices sharing one physical GPU.
    Comparing the canonical forms makes all of them meet.
    """
    if raw is None:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    text = text.strip().strip("\x00").lower()
    text = re.sub(r"-v\d+$", "", text)
    m = _PCI_RE.match(text)
    if not m:
        return None
    domain = int(m["domain"] or "0", 16)
    return f"{domain:04x}:{int(m['bus'], 16):02x}:{int(m['dev'], 16):02x}.{m['fn']}"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as its vendor library reports it. Memory is in bytes, sampled at discovery time."""

    index: int  # position in Inventory.gpus (NVIDIA first, then AMD; each in its library's order)
    vendor: str  # "nvidia" | "amd"
    vendor_index: int  # index in NVML / amdsmi enumeration
    name: str
    pci_bus_id: str | None  # canonical form, see normalize_pci_bus_id
    memory_total_bytes: int
    memory_free_bytes: int
    memory_used_bytes: int
    driver_version: str | None = None
    compute_capability: str | None = None  # NVIDIA, e.g. "9.0"
    gfx_target: str | None = None  # AMD, e.g. "gfx942"
    uuid: str | None = None

    @property
    def arch(self) -> str | None:
        """Compute capability or gfx target, whichever this vendor has."""
        return self.compute_capability or self.gfx_target


@dataclass(frozen=True)
class GpuLink:
    """How two GPUs (indices into Inventory.gpus, a < b) reach each other."""

    a: int
    b: int
    # Topology label in nvidia-smi's vocabulary: BOARD (same board), PIX (one PCIe switch), PXB (several
    # switches), PHB (through a host bridge), NODE (host bridges within a NUMA node), SYS (across NUMA nodes
    # / the CPU interconnect); None when the library did not say.
    topology: str | None = None
    nvlink_count: int = 0  # active NVLinks between the pair (direct or through NVSwitch)
    xgmi: bool = False  # AMD Infinity Fabric link
    hops: int | None = None  # amdsmi reports a hop count
    p2p: bool | None = None  # peer-to-peer reads supported; None when unknown

    @property
    def label(self) -> str:
        """Short cell text for a links matrix: NV<n>, XGMI, or the PCIe topology level."""
        if self.nvlink_count:
            return f"NV{self.nvlink_count}"
        if self.xgmi:
            return "XGMI"
        return self.topology or "?"


@dataclass(frozen=True)
class HostInfo:
    """The CPU side: cores and memory (bytes), for thread counts and host-RAM expert placement."""

    cpu_model: str | None
    n_cores_physical: int | None
    n_cores_logical: int | None
    memory_total_bytes: int
    memory_available_bytes: int
    n_numa_nodes: int | None = None


@dataclass(frozen=True)
class BackendStatus:
    """What one vendor library said: whether it worked, and a line saying why not or which driver."""

    name: str  # "nvidia" | "amd"
    available: bool
    detail: str


@dataclass(frozen=True)
class Inventory:
    """Everything discover() found. Memory figures are a snapshot; free_vram_bytes() in inventory.py
    re-reads one GPU live."""

    gpus: tuple[GpuInfo, ...]
    links: tuple[GpuLink, ...]
    host: HostInfo
    backends: tuple[BackendStatus, ...] = field(default_factory=tuple)

    def gpu_by_pci_bus_id(self, pci_bus_id: str) -> GpuInfo | None:
        wanted = normalize_pci_bus_id(pci_bus_id)
        return next((g for g in self.gpus if wanted is not None and g.pci_bus_id == wanted), None)

    def free_vram_bytes(self, pci_bus_id: str) -> int | None:
        """Free memory of that GPU at discovery time, None when no such GPU was found."""
        gpu = self.gpu_by_pci_bus_id(pci_bus_id)
        return gpu.memory_free_bytes if gpu else None

    def link(self, a: int, b: int) -> GpuLink | None:
        lo, hi = min(a, b), max(a, b)
        return next((lk for lk in self.links if lk.a == lo and lk.b == hi), None)

    def no_gpu_reason(self) -> str:
        """One line saying why no GPU is listed, from every backend tried."""
        return "; ".join(b.detail for b in self.backends) or "no GPU backend was tried"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the `app devices --json` schema)."""
        return {
            "gpus": [dict(asdict(g), arch=g.arch) for g in self.gpus],
            "links": [dict(asdict(lk), label=lk.label) for lk in self.links],
            "host": asdict(self.host),
            "backends": [asdict(b) for b in self.backends],
        }
