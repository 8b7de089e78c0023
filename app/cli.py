"""The `app` command line: one typer application; each group lives beside the code it drives."""

from __future__ import annotations

import typer

from app.bench.cli import bench_app
from app.devices.cli import devices_command
from app.models.cli import model_app
from app.presets.cli import presets_app, tune_command

cli = typer.Typer(
    name="app",
    help="rigserve: a llama.cpp-compatible LLM server for GPU rigs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cli.add_typer(model_app, name="model", help="Synthetic and default models.")
cli.add_typer(bench_app, name="bench", help="Benchmarks against upstream tools from the same build.")
cli.command("devices", help="GPUs and host memory seen by this machine.")(devices_command)
cli.add_typer(presets_app, name="presets", help="Tuning presets per GPU model (list, show).")
cli.command("tune", help="Measure the settings that matter on this machine and write a preset for it.")(tune_command)


@cli.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
    help="Serve a model over HTTP (llama-server flags; `app serve --help` lists them).",
)
def serve_command(ctx: typer.Context) -> None:
    # The serve flags follow llama-server's names (short and long forms, LLAMA_ARG_* variables), so they are
    # parsed by app.config rather than typer.
    from app.server.main import run_server

    raise typer.Exit(run_server(list(ctx.args)))


def main() -> None:
    cli()
