"""`app devices`: print what discover() found, as rich tables or as JSON (`--json`)."""

from __future__ import annotations

import json

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from app.devices.inventory import discover
from app.devices.types import Inventory

_GIB = 1 << 30
_LINK_MEANINGS = {
    "NV": "NV<n>: n NVLinks (direct or through NVSwitch)",
    "XGMI": "XGMI: AMD Infinity Fabric",
    "BOARD": "BOARD: same board",
    "PIX": "PIX: one PCIe switch",
    "PXB": "PXB: several PCIe switches",
    "PHB": "PHB: through a PCIe host bridge",
    "NODE": "NODE: between host bridges of one NUMA node",
    "SYS": "SYS: across NUMA nodes",
    "PCIE": "PCIE: PCIe",
    "?": "?: not reported",
}


def _gib(n_bytes: int | None) -> str:
    return "-" if n_bytes is None else f"{n_bytes / _GIB:.1f} GiB"


def _gpu_table(inv: Inventory) -> Table:
    # Six columns without vertical rules fit an 80-column terminal even with long names; "used" and
    # the UUID are in --json.
    table = Table(title="GPUs", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("#", justify="right")
    table.add_column("name")
    table.add_column("PCI bus id", no_wrap=True)
    table.add_column("free / total", justify="right", no_wrap=True)
    table.add_column("driver", no_wrap=True)
    table.add_column("arch", no_wrap=True)
    for g in inv.gpus:
        arch = f"sm {g.compute_capability}" if g.compute_capability else (g.gfx_target or "-")
        memory = f"{g.memory_free_bytes / _GIB:.1f} / {_gib(g.memory_total_bytes)}"
        table.add_row(str(g.index), g.name, g.pci_bus_id or "-", memory, g.driver_version or "-", arch)
    return table


def _links_table(inv: Inventory) -> Table:
    table = Table(title="Links between GPUs", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("")
    for g in inv.gpus:
        table.add_column(f"GPU{g.index}", justify="center", no_wrap=True)
    for row in inv.gpus:
        cells = []
        for col in inv.gpus:
            link = inv.link(row.index, col.index) if row.index != col.index else None
            if row.index == col.index:
                cells.append("X")
            elif link is None:
                cells.append("-")
            else:
                cells.append(link.label + (" (no P2P)" if link.p2p is False else ""))
        table.add_row(f"GPU{row.index}", *cells)
    return table


def _link_legend(inv: Inventory) -> str:
    """Explain only the labels that appear, so the common case stays one short line."""
    kinds = {"NV" if lk.nvlink_count else lk.label for lk in inv.links}
    parts = [text for key, text in _LINK_MEANINGS.items() if key in kinds]
    if any(lk.p2p is False for lk in inv.links):
        parts.append("(no P2P): peer-to-peer access unsupported")
    return "; ".join(parts)


def _host_table(inv: Inventory) -> Table:
    h = inv.host
    table = Table(title="Host", title_justify="left", show_header=False, box=box.SIMPLE)
    table.add_column("what")
    table.add_column("value")
    cores = f"{h.n_cores_physical or '?'} physical, {h.n_cores_logical or '?'} logical"
    table.add_row("CPU", h.cpu_model or "-")
    table.add_row("cores", cores)
    table.add_row("memory", f"{_gib(h.memory_total_bytes)} total, {_gib(h.memory_available_bytes)} available")
    if h.n_numa_nodes:
        table.add_row("NUMA nodes", str(h.n_numa_nodes))
    return table


def render_inventory(inv: Inventory, console: Console) -> None:
    """Print the GPU table (or the no-GPU line), the links matrix for 2+ GPUs, then the host table."""
    if inv.gpus:
        console.print(_gpu_table(inv))
        if len(inv.gpus) > 1:
            console.print(_links_table(inv))
            console.print(_link_legend(inv), style="dim", markup=False, highlight=False)
    else:
        # Plain text, not markup: the reason carries library messages that may contain brackets.
        console.print(f"No GPU found: {inv.no_gpu_reason()}", markup=False, highlight=False, soft_wrap=True)
    console.print(_host_table(inv))


def devices_command(
    json_output: bool = typer.Option(False, "--json", help="Print the inventory as JSON instead of tables."),
) -> None:
    """List GPUs (memory, driver, architecture, links) and host memory and cores."""
    inv = discover()
    if json_output:
        # typer.echo, not rich: JSON must reach pipes unwrapped and uncoloured.
        typer.echo(json.dumps(inv.to_dict(), indent=2))
        return
    render_inventory(inv, Console())
