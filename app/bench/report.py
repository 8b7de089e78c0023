"""Shared benchmark plumbing: upstream tool paths, server start-up waits, tables with ratios, PNG plots."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.table import Table

LIB_DIR = Path(__file__).resolve().parent.parent / "_lib"


def lib_tool(name: str) -> Path:
    path = LIB_DIR / "bin" / name
    if not path.exists():
        raise SystemExit(f"{name} is not built: run `python3 build.py engine --with-upstream-tools` (looked in {path})")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready; see {log_path}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.25)
    raise SystemExit(f"server not ready after {timeout_s:.0f}s; see {log_path}")


def stop_process(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    """Terminate a server process, killing it if it does not exit in time, and reap it."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _fmt(v: float) -> str:
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:,.2f}"
    return f"{v:.3f}"


def print_table(title: str, columns: list[str], rows: list[tuple[str, list[float]]]) -> None:
    """One row per metric, one column per system, and ours/upstream when both are there."""
    t = Table(title=title)
    t.add_column("metric")
    for c in columns:
        t.add_column(c, justify="right")
    ratio = "ours" in columns and "upstream" in columns
    if ratio:
        t.add_column("ours / upstream", justify="right")
    for label, vals in rows:
        cells = [_fmt(v) for v in vals]
        if ratio:
            o, u = vals[columns.index("ours")], vals[columns.index("upstream")]
            cells.append(f"{o / u:.2f}x" if u else "-")
        t.add_row(label, *cells)
    Console().print(t)


def save_plot(path: Path, xs: list, series: dict[str, list[float]], xlabel: str, ylabel: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot: matplotlib is not installed; `pip install matplotlib` to get {path.name})")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
