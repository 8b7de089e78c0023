"""`app presets list|show NAME` and `app tune`: rich tables over the catalog, and the tuning run's UI.

The heavy imports (engine, synthetic writer) happen inside the tune command, so `app --help` and
`app presets list` stay fast on any machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from app.presets.catalog import Catalog, Preset, load_catalog, user_dir
from app.presets.flags import PresetError

presets_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _matches(p: Preset) -> str:
    m = p.match
    parts = list(m.names) + [f"arch {a}" for a in m.arch]
    if m.cpu:
        parts.append("no GPU")
    if m.fallback:
        parts.append("any unmatched GPU")
    return ", ".join(parts) or "-"


def _catalog_or_exit(console: Console) -> Catalog:
    try:
        return load_catalog()
    except PresetError as e:
        console.print(f"error: {e}", markup=False, highlight=False)
        raise typer.Exit(2) from None


@presets_app.command("list")
def list_command() -> None:
    """Every preset (user ones first), what it matches, its main values, and the one this machine gets."""
    from app.devices import discover
    from app.presets.matching import select_preset

    console = Console()
    catalog = _catalog_or_exit(console)
    chosen, reason = select_preset(discover(), catalog)
    chosen_names = set(chosen.name.removeprefix("mixed:").split("+")) if chosen else set()
    t = Table(title="Presets", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("", "name", "origin", "matches", "ubatch", "flash-attn", "KV k/v"):
        t.add_column(col, overflow="fold", no_wrap=col in ("name", "KV k/v"))
    for p in catalog.presets:
        s = p.applicable()
        t.add_row("*" if p.name in chosen_names else "", p.name, p.origin, _matches(p),
                  str(s.get("ubatch-size", "-")), str(s.get("flash-attn", "-")),
                  f"{s.get('cache-type-k', '-')}/{s.get('cache-type-v', '-')}")
    console.print(t)
    for p in catalog.shadowed:
        console.print(f"shipped preset {p.name} is replaced by the user preset of that name", style="dim")
    console.print(f"* this machine: {reason}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"user presets: {user_dir()}", style="dim", markup=False, highlight=False)


@presets_app.command("show")
def show_command(name: str = typer.Argument(..., help="preset name (see `app presets list`)")) -> None:
    """One preset's values, whether each applies today, and the comment saying where its number came from."""
    console = Console()
    catalog = _catalog_or_exit(console)
    p = catalog.get(name)
    if p is None:
        console.print(f"error: unknown preset `{name}`; known: {', '.join(catalog.names())}", markup=False)
        raise typer.Exit(2)
    console.print(f"{p.name}: {p.description}", markup=False, highlight=False)
    console.print(f"{p.origin} {p.path or ''}; matches: {_matches(p)}", style="dim", markup=False, highlight=False)
    t = Table(box=box.SIMPLE_HEAD, show_lines=False)
    t.add_column("flag", no_wrap=True)
    t.add_column("value", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("why", overflow="fold")
    pending = p.pending()
    for table, values in (("settings", p.settings), ("later", p.later)):
        for key, value in values.items():
            status = "pending" if key in pending else "applied"
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            t.add_row(key, shown, status, p.notes.get(f"{table}.{key}", ""))
    console.print(t)
    if pending:
        console.print("pending: the flag is not in `app serve` yet; the value applies once it lands",
                      style="dim", markup=False, highlight=False)


def _parse_ubatches(text: Optional[str]) -> Optional[tuple[int, ...]]:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"--ubatch {text!r}: a comma list of integers, e.g. 256,512,1024") from None


def tune_command(
    model: Optional[Path] = typer.Option(None, "-m", "--model", help="GGUF model to tune on."),
    synth: Optional[str] = typer.Option(None, "--synth", help="Tune on a synthetic model of this shape instead, "
                                        "ARCH:SHAPE[:TYPE] (e.g. llama:8b, qwen3moe:30b-a3b); written once, cached."),
    ubatch: Optional[str] = typer.Option(None, "--ubatch", help="ubatch sizes to try, comma list "
                                         "(default: 256..4096 with a GPU, 128..512 without)."),
    n_prompt: Optional[int] = typer.Option(None, "--prompt", help="prompt tokens per pass (default: max(512, "
                                           "largest ubatch))."),
    n_gen: int = typer.Option(32, "--gen", help="decode steps per pass."),
    reps: int = typer.Option(2, "--reps", help="timed passes per setting (after one warm-up)."),
    n_gpu_layers: int = typer.Option(999, "-ngl", "--n-gpu-layers", help="layers on the GPU (default: all)."),
    threads: int = typer.Option(0, "-t", "--threads", help="CPU threads (0: the engine's default)."),
    out: Optional[Path] = typer.Option(None, "--out", help="preset file to write (default: "
                                       "~/.config/rigserve/presets/<name>.toml, where app serve finds it)."),
    name: Optional[str] = typer.Option(None, "--name", help="preset name (default: from the GPU model)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan and its estimated time; run nothing."),
) -> None:
    """Sweep the settings that matter on this machine and write a preset that `app serve` then uses."""
    from app.devices import discover
    from app.presets import tune as tn
    from app.presets import tune_ui

    console = Console()
    opts = tn.TuneOptions(model=model, synth=synth, ubatches=_parse_ubatches(ubatch), n_prompt=n_prompt,
                          n_gen=n_gen, reps=reps, n_gpu_layers=n_gpu_layers, threads=threads, out=out, name=name)
    inventory = discover()
    try:
        plan = tn.build_plan(opts, inventory, _catalog_or_exit(console))
    except (ValueError, FileNotFoundError) as e:
        console.print(f"error: {e}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    tune_ui.print_plan(plan, console)
    if dry_run:
        return
    raise typer.Exit(tune_ui.run(plan, opts, inventory, console))
