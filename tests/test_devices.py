"""GPU discovery without GPUs: the real (absent) NVML on this machine, fake NVML and amdsmi modules with two
GPUs and a link, the `app devices` command in both output forms, and the engine-order mapping."""

from __future__ import annotations

import json
import sys
from types import ModuleType, SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from app.devices import (
    GpuInfo,
    discover,
    free_vram_bytes,
    gpus_in_engine_order,
    map_engine_devices,
    normalize_pci_bus_id,
)
from app.devices.cli import devices_command

GIB = 1 << 30
BUS_IDS = [b"00000000:1B:00.0", b"00000000:2A:00.0"]


class FakeNVMLError(Exception):
    pass


def fake_nvml(
    n_gpus: int = 2, n_nvlinks: int = 4, init_error: str | None = None, broken: frozenset[int] = frozenset()
) -> ModuleType:
    """A stand-in for pynvml: n H200s, each pair joined by n_nvlinks direct NVLinks, under one host bridge."""
    m = ModuleType("pynvml")
    m.NVMLError = FakeNVMLError

    def init() -> None:
        if init_error:
            raise FakeNVMLError(init_error)

    def handle(i: int) -> int:
        if i in broken:
            raise FakeNVMLError("GPU is lost")
        return i

    def nvlink_state(h: int, link: int) -> int:
        if link >= n_nvlinks:
            raise FakeNVMLError("Not Supported")
        return 1

    def nvlink_remote(h: int, link: int) -> SimpleNamespace:
        return SimpleNamespace(busId=BUS_IDS[(h + 1) % n_gpus])

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: "570.86.15"
    m.nvmlDeviceGetCount = lambda: n_gpus
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    m.nvmlDeviceGetPciInfo = lambda h: SimpleNamespace(busId=BUS_IDS[h])
    m.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=141 * GIB, free=(140 - h) * GIB, used=(1 + h) * GIB)
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h:08d}"
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 30
    m.nvmlDeviceGetP2PStatus = lambda a, b, idx: 0
    m.nvmlDeviceGetNvLinkState = nvlink_state
    m.nvmlDeviceGetNvLinkRemotePciInfo = nvlink_remote
    return m


def fake_amdsmi() -> ModuleType:
    """A stand-in for amdsmi: two MI300X joined by XGMI."""
    m = ModuleType("amdsmi")
    m.AmdSmiException = type("AmdSmiException", (Exception,), {})
    m.AmdSmiMemoryType = SimpleNamespace(VRAM=0)
    m.amdsmi_init = lambda *flags: None
    m.amdsmi_shut_down = lambda: None
    m.amdsmi_get_processor_handles = lambda: ["h0", "h1"]
    m.amdsmi_get_gpu_device_bdf = lambda h: {"h0": "0000:05:00.0", "h1": "0000:26:00.0"}[h]
    m.amdsmi_get_gpu_asic_info = lambda h: {"market_name": "AMD Instinct MI300X", "target_graphics_version": "gfx942"}
    m.amdsmi_get_gpu_driver_info = lambda h: {"driver_name": "amdgpu", "driver_version": "6.8.5"}
    m.amdsmi_get_gpu_memory_total = lambda h, t: 192 * GIB
    m.amdsmi_get_gpu_memory_usage = lambda h, t: 2 * GIB
    m.amdsmi_topo_get_link_type = lambda a, b: {"hops": 1, "type": 2}
    m.amdsmi_is_P2P_accessible = lambda a, b: True
    return m


@pytest.fixture
def two_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # None blocks the import: "AMD SMI not installed"


def run_devices(*args: str):
    app = typer.Typer()
    app.command()(devices_command)
    return CliRunner().invoke(app, list(args))


# --- this machine (no GPU) ---


def test_discover_on_cpu_machine_has_host_and_no_gpu() -> None:
    inv = discover()
    if inv.gpus:
        pytest.skip("this machine has a GPU")
    assert inv.links == ()
    assert inv.host.memory_total_bytes > 0
    assert 0 < inv.host.memory_available_bytes <= inv.host.memory_total_bytes
    assert (inv.host.n_cores_logical or 0) >= 1
    assert "NVML not available" in inv.no_gpu_reason() or "no NVIDIA GPU" in inv.no_gpu_reason()
    assert free_vram_bytes("0000:01:00.0") is None


def test_command_without_gpu_says_so_and_exits_zero() -> None:
    if discover().gpus:
        pytest.skip("this machine has a GPU")
    result = run_devices()
    assert result.exit_code == 0, result.output
    assert "No GPU found: NVML not available (" in result.output
    assert "AMD SMI not installed" in result.output or "AMD SMI" in result.output
    assert "memory" in result.output


def test_json_without_gpu_parses() -> None:
    result = run_devices("--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert set(data) == {"gpus", "links", "host", "backends"}
    assert data["host"]["memory_total_bytes"] > 0
    assert [b["name"] for b in data["backends"]] == ["nvidia", "amd"]


# --- fake NVML ---


def test_fake_nvml_two_gpus_and_nvlink(two_h200: None) -> None:
    inv = discover()
    assert [g.name for g in inv.gpus] == ["NVIDIA H200", "NVIDIA H200"]
    g0, g1 = inv.gpus
    assert (g0.pci_bus_id, g1.pci_bus_id) == ("0000:1b:00.0", "0000:2a:00.0")
    assert g0.memory_total_bytes == 141 * GIB and g1.memory_free_bytes == 139 * GIB
    assert g0.compute_capability == "9.0" and g0.arch == "9.0"
    assert g0.driver_version == "570.86.15"
    (link,) = inv.links
    assert (link.a, link.b, link.nvlink_count, link.topology, link.p2p) == (0, 1, 4, "PHB", True)
    assert link.label == "NV4"
    assert inv.link(1, 0) is link
    assert inv.free_vram_bytes("00000000:2A:00.0") == 139 * GIB
    assert free_vram_bytes("0000:2a:00.0") == 139 * GIB  # live query through the same fake
    assert free_vram_bytes("0000:99:00.0") is None


def test_fake_nvml_table(two_h200: None) -> None:
    result = run_devices()
    assert result.exit_code == 0, result.output
    out = result.output
    assert "NVIDIA H200" in out and "0000:1b:00.0" in out and "0000:2a:00.0" in out
    assert "141.0 GiB" in out and "sm 9.0" in out and "570.86.15" in out
    assert "Links between GPUs" in out and "NV4" in out
    assert "No GPU found" not in out


def test_fake_nvml_json(two_h200: None) -> None:
    result = run_devices("--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert len(data["gpus"]) == 2
    assert data["gpus"][1]["pci_bus_id"] == "0000:2a:00.0"
    assert data["gpus"][0]["arch"] == "9.0"
    assert data["links"] == [
        {"a": 0, "b": 1, "topology": "PHB", "nvlink_count": 4, "xgmi": False, "hops": None, "p2p": True, "label": "NV4"}
    ]
    assert data["backends"][0]["available"] is True


def test_pcie_only_pair_shows_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_nvml(n_nvlinks=0)
    nvml.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 50
    nvml.nvmlDeviceGetP2PStatus = lambda a, b, idx: 5  # NVML_P2P_STATUS_NOT_SUPPORTED
    (link,) = discover(nvml=nvml, amdsmi=None).links
    assert (link.label, link.p2p) == ("SYS", False)


def test_nvml_init_failure_is_a_status_not_an_error() -> None:
    inv = discover(nvml=fake_nvml(init_error="Driver Not Loaded"))
    assert inv.gpus == ()
    assert inv.backends[0].detail == "NVML not available (Driver Not Loaded)"


def test_unreadable_gpu_is_skipped_and_named() -> None:
    inv = discover(nvml=fake_nvml(broken=frozenset({0})))
    assert [g.vendor_index for g in inv.gpus] == [1]
    assert inv.gpus[0].index == 0
    assert "GPU 0: GPU is lost" in inv.backends[0].detail


# --- fake amdsmi ---


def test_fake_amdsmi_after_nvidia(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = discover(nvml=fake_nvml(n_gpus=1), amdsmi=fake_amdsmi())
    assert [g.vendor for g in inv.gpus] == ["nvidia", "amd", "amd"]
    mi = inv.gpus[1]
    assert (mi.index, mi.vendor_index, mi.gfx_target, mi.arch) == (1, 0, "gfx942", "gfx942")
    assert mi.memory_free_bytes == 190 * GIB and mi.driver_version == "6.8.5"
    (link,) = inv.links
    assert (link.a, link.b, link.label, link.hops, link.p2p) == (1, 2, "XGMI", 1, True)


def test_broken_amdsmi_does_not_break_discovery() -> None:
    amd = fake_amdsmi()

    def init(*flags: object) -> None:
        raise OSError("librocm_smi64.so: cannot open shared object file")

    amd.amdsmi_init = init
    inv = discover(nvml=fake_nvml(), amdsmi=amd)
    assert len(inv.gpus) == 2
    assert inv.backends[1].available is False and "cannot open shared object" in inv.backends[1].detail


# --- PCI bus ids and engine order ---


@pytest.mark.parametrize(
    "raw, want",
    [
        (b"00000000:1B:00.0", "0000:1b:00.0"),
        ("0000:c1:00.0", "0000:c1:00.0"),
        ("0000:c1:00.0-v1", "0000:c1:00.0"),
        ("1b:00.0", "0000:1b:00.0"),
        ("00000001:03:00.1\x00", "0001:03:00.1"),
        ("CUDA0", None),
        ("", None),
        (None, None),
    ],
)
def test_normalize_pci_bus_id(raw: object, want: str | None) -> None:
    assert normalize_pci_bus_id(raw) == want


def gpu(index: int, name: str, pci: str | None) -> GpuInfo:
    return GpuInfo(index, "nvidia", index, name, pci, 24 * GIB, 23 * GIB, 1 * GIB)


RIG = [gpu(0, "NVIDIA GeForce RTX 4090", "0000:1b:00.0"), gpu(1, "NVIDIA GeForce RTX 3090", "0000:2a:00.0")]


def test_mapping_by_pci_bus_id_follows_engine_order() -> None:
    engine = [
        {"name": "CUDA0", "description": "NVIDIA GeForce RTX 3090", "type": "GPU", "device_id": "0000:2a:00.0"},
        {"name": "CUDA1", "description": "NVIDIA GeForce RTX 4090", "type": "GPU", "device_id": "0000:1b:00.0"},
        {"name": "CPU", "description": "AMD EPYC", "type": "CPU", "device_id": None},
    ]
    matches = map_engine_devices(RIG, engine)
    assert [(m.engine_name, m.gpu_index, m.matched_by) for m in matches] == [
        ("CUDA0", 1, "pci_bus_id"),
        ("CUDA1", 0, "pci_bus_id"),
        ("CPU", None, "host"),
    ]
    assert [g.name if g else None for g in gpus_in_engine_order(RIG, engine)] == [
        "NVIDIA GeForce RTX 3090",
        "NVIDIA GeForce RTX 4090",
        None,
    ]


def test_mapping_accepts_attribute_records_and_virtual_devices() -> None:
    engine = [
        SimpleNamespace(name="CUDA0", description="RTX 4090", type="GPU", pci_bus_id="0000:1b:00.0-v0"),
        SimpleNamespace(name="CUDA1", description="RTX 4090", type="GPU", pci_bus_id="0000:1b:00.0-v1"),
    ]
    assert [m.gpu_index for m in map_engine_devices(RIG, engine)] == [0, 0]


def test_mapping_falls_back_to_names_and_says_so() -> None:
    twins = [
        gpu(0, "NVIDIA H200", "0000:1b:00.0"),
        gpu(1, "NVIDIA H200", "0000:2a:00.0"),
        gpu(2, "NVIDIA GeForce RTX 4090", "0000:3c:00.0"),
    ]
    engine = [
        {"name": "Vulkan0", "description": "NVIDIA GeForce RTX 4090", "type": "GPU"},
        {"name": "Vulkan1", "description": "NVIDIA H200", "type": "GPU"},
        {"name": "Vulkan2", "description": "NVIDIA H200", "type": "GPU"},
        {"name": "Vulkan3", "description": "Unknown GPU", "type": "GPU"},
    ]
    matches = map_engine_devices(twins, engine)
    assert [(m.gpu_index, m.matched_by) for m in matches] == [(2, "name"), (0, "order"), (1, "name"), (None, "none")]


def test_exact_matches_win_over_name_guesses() -> None:
    engine = [
        {"name": "CUDA0", "description": "NVIDIA GeForce RTX 4090", "type": "GPU"},  # no id: guess
        {"name": "CUDA1", "description": "NVIDIA GeForce RTX 4090", "type": "GPU", "device_id": "0000:1b:00.0"},
    ]
    matches = map_engine_devices(RIG, engine)
    assert [(m.gpu_index, m.matched_by) for m in matches] == [(None, "none"), (0, "pci_bus_id")]


def test_mapping_reads_the_engine_list_devices_schema() -> None:
    # The shape app.engine.list_devices() returns: lower-case type names, device_id from ggml's props.
    engine = [
        {"name": "CUDA0", "description": "NVIDIA GeForce RTX 4090", "type": "gpu",
         "memory_free": 23 * GIB, "memory_total": 24 * GIB, "device_id": "0000:1b:00.0"},
        {"name": "BLAS", "description": "OpenBLAS", "type": "accel", "memory_free": 0, "memory_total": 0,
         "device_id": None},
        {"name": "CPU", "description": "Xeon", "type": "cpu", "memory_free": 0, "memory_total": 0,
         "device_id": None},
    ]
    assert [(m.gpu_index, m.matched_by) for m in map_engine_devices(RIG, engine)] == [
        (0, "pci_bus_id"),
        (None, "host"),
        (None, "host"),
    ]
