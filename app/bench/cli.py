"""`app bench ...`: benchmarks that run our code and upstream's tools from the same build side by side."""

from __future__ import annotations

from pathlib import Path

import typer

bench_app = typer.Typer(no_args_is_help=True)


@bench_app.command("engine")
def bench_engine(
    model: Path = typer.Option(..., "-m", "--model", help="GGUF model to benchmark"),
    n_gpu_layers: int = typer.Option(99, "-ngl", "--n-gpu-layers"),
    flash_attn: str = typer.Option("on", "-fa", "--flash-attn"),
    prompts: str = typer.Option("512,2048", "-p", help="prompt sizes (comma list)"),
    n_gen: int = typer.Option(128, "-n", help="tokens to generate for the decode test"),
    depths: str = typer.Option("0,16384", "-d", "--depth", help="KV depths to test at (comma list)"),
    threads: int = typer.Option(0, "-t", "--threads", help="CPU threads (0 = engine default)"),
    ubatch: int = typer.Option(512, "-ub", "--ubatch-size"),
    reps: int = typer.Option(3, "-r", "--repetitions"),
    out: Path = typer.Option(Path("bench-results"), "-o", "--out", help="folder for JSON and PNG"),
) -> None:
    """Our binding vs upstream llama-bench: prompt and decode tokens/s, with ratios."""
    from app.bench.engine import EngineBenchConfig, run_engine_bench

    cfg = EngineBenchConfig(
        model=model, n_gpu_layers=n_gpu_layers, flash_attn=flash_attn,
        prompts=[int(x) for x in prompts.split(",") if x], n_gen=n_gen,
        depths=[int(x) for x in depths.split(",") if x], threads=threads, ubatch=ubatch, reps=reps, out=out,
    )
    raise typer.Exit(run_engine_bench(cfg))


@bench_app.command("server")
def bench_server(
    model: Path = typer.Option(..., "-m", "--model"),
    streams: str = typer.Option("1,8,32", "--streams", help="concurrent stream counts (comma list)"),
    n_prompt: int = typer.Option(512, "--prompt-tokens"),
    n_gen: int = typer.Option(128, "--gen-tokens"),
    long_prompt: int = typer.Option(2000, "--long-prompt", help="prompt size of the prompt-speed test"),
    extra: str = typer.Option("", "--server-args", help="extra flags for both servers, e.g. '-ngl 99 -fa on'"),
    ctx_per_stream: int = typer.Option(1024, "--ctx-per-stream"),
    which: str = typer.Option("ours,upstream", "--servers", help="ours, upstream, upstream-bs, upstream-ub2048"),
    variants: bool = typer.Option(False, "--vs-upstream-variants",
                                  help="also run upstream with -bs and with -ub 2048 -b 4096"),
    out: Path = typer.Option(Path("bench-results"), "-o", "--out"),
) -> None:
    """Our server vs upstream llama-server under the same load: decode, prompt, aggregate t/s, TTFT."""
    from app.bench.server import ServerBenchConfig, run_server_bench

    cfg = ServerBenchConfig(
        model=model, streams=[int(x) for x in streams.split(",") if x], n_prompt=n_prompt, n_gen=n_gen,
        long_prompt=long_prompt, extra_args=extra.split(), ctx_per_stream=ctx_per_stream,
        servers=[x for x in which.split(",") if x] + (["upstream-bs", "upstream-ub2048"] if variants else []),
        out=out,
    )
    raise typer.Exit(run_server_bench(cfg))
