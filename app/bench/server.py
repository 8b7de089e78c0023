"""`app bench server`: our server and upstream llama-server from the same build, same model, same load.

For each concurrency level both servers are started with `-np S` and a context of S x ctx-per-stream, then S
streaming /completion requests are sent at once (greedy, ignore_eos, distinct prompts so no prefix is shared).
Measured on the client: aggregate decode t/s = generated tokens / wall time of the whole wave, single-stream
decode t/s = tokens after the first / time after the first, TTFT p50/p99; and the prompt t/s of one long
prompt. Results: a table with ratios (ours / upstream), JSON and a PNG plot in --out.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from app.bench.report import free_port, lib_tool, print_table, save_plot, stop_process, wait_healthy


@dataclass
class ServerBenchConfig:
    model: Path
    streams: list[int]
    n_prompt: int = 512
    n_gen: int = 128
    long_prompt: int = 2000
    extra_args: list[str] = field(default_factory=list)
    ctx_per_stream: int = 1024
    servers: list[str] = field(default_factory=lambda: ["ours", "upstream"])
    out: Path = Path("bench-results")


def _server_cmd(kind: str, cfg: ServerBenchConfig, n_slots: int, port: int) -> list[str]:
    n_ctx = max(n_slots * cfg.ctx_per_stream, cfg.long_prompt + 256)
    common = ["-m", str(cfg.model), "-np", str(n_slots), "-c", str(n_ctx), "--host", "127.0.0.1",
              "--port", str(port), *cfg.extra_args]
    if kind == "ours":
        # The same flags as upstream and nothing else: no tuning preset.
        return [sys.executable, "-m", "app", "serve", "--preset", "none", "--metrics", *common]
    return [str(lib_tool("llama-server")), *common, *UPSTREAM_VARIANTS.get(kind, [])]


# Upstream configurations worth beating besides its defaults (--vs-upstream-variants).
UPSTREAM_VARIANTS = {"upstream": [], "upstream-bs": ["-bs"], "upstream-ub2048": ["-ub", "2048", "-b", "4096"]}


async def _words_prompt(session: aiohttp.ClientSession, base: str, n_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = " ".join(f"w{rng.randrange(100000)}" for _ in range(n_tokens))
    async with session.post(f"{base}/tokenize", json={"content": words}) as r:
        toks = (await r.json())["tokens"]
    return toks[:n_tokens]


async def _one(session, base, prompt, n_gen) -> dict:
    body = {"prompt": prompt, "n_predict": n_gen, "stream": True, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False}
    t0 = time.perf_counter()
    t_first, t_last, n = 0.0, 0.0, 0
    async with session.post(f"{base}/completion", json=body) as r:
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("stop"):
                n = chunk.get("tokens_predicted", n) or n
                break
            now = time.perf_counter()
            if not t_first:
                t_first = now
            t_last = now
            n += 1
    return {"ttft": t_first - t0, "n": n, "t_first": t_first, "t_last": t_last, "t0": t0}


async def _wave(base: str, cfg: ServerBenchConfig, n_streams: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        prompts = [await _words_prompt(s, base, cfg.n_prompt, 1000 + i) for i in range(n_streams)]
        await _one(s, base, prompts[0][:16], 4)  # warm-up
        t0 = time.perf_counter()
        res = await asyncio.gather(*[_one(s, base, p, cfg.n_gen) for p in prompts])
        wall = time.perf_counter() - t0
        out = {"aggregate_tps": sum(r["n"] for r in res) / wall, "wall_s": wall}
        ttfts = sorted(r["ttft"] for r in res)
        out["ttft_p50"] = statistics.median(ttfts)
        out["ttft_p99"] = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
        if n_streams == 1:
            r = res[0]
            out["decode_tps"] = (r["n"] - 1) / (r["t_last"] - r["t_first"]) if r["n"] > 1 else 0.0
            long = await _words_prompt(s, base, cfg.long_prompt, 7)
            t0 = time.perf_counter()
            lr = await _one(s, base, long, 1)
            out["prompt_tps"] = len(long) / lr["ttft"] if lr["ttft"] > 0 else 0.0
            del t0
        out.update(await _host_share(s, base))
        return out


async def _host_share(session: aiohttp.ClientSession, base: str) -> dict:
    """Our server's host (Python) share of its engine steps, from /metrics; {} for upstream."""
    async with session.get(f"{base}/metrics") as r:
        if r.status != 200:
            return {}
        text = await r.text()
    vals = {}
    for line in text.splitlines():
        for key in ("step_seconds_total", "step_engine_seconds_total"):
            if line.startswith(f"llamacpp:{key} "):
                vals[key] = float(line.split()[1])
    step = vals.get("step_seconds_total", 0.0)
    if step <= 0:
        return {}
    return {"host_share": 1.0 - vals.get("step_engine_seconds_total", 0.0) / step}


def _run_one(kind: str, cfg: ServerBenchConfig, n_streams: int, log_dir: Path) -> dict:
    port = free_port()
    log_path = log_dir / f"{kind}-np{n_streams}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_server_cmd(kind, cfg, n_streams, port), stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base, proc, timeout_s=600, log_path=log_path)
            return asyncio.run(_wave(base, cfg, n_streams))
        finally:
            stop_process(proc, 30)


def run_server_bench(cfg: ServerBenchConfig) -> int:
    cfg.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict]] = {k: {} for k in cfg.servers}
    for n in cfg.streams:
        for kind in cfg.servers:
            print(f"[bench] {kind}: {n} stream(s) ...", file=sys.stderr, flush=True)
            results[kind][n] = _run_one(kind, cfg, n, cfg.out)
    rows = []
    metrics = [("decode_tps", "1-stream decode t/s", 1), ("prompt_tps", f"prompt t/s ({cfg.long_prompt} tok)", 1)]
    metrics += [("aggregate_tps", f"aggregate t/s at {n}", n) for n in cfg.streams if n > 1]
    metrics += [("ttft_p50", f"TTFT p50 s at {n}", n) for n in cfg.streams]
    metrics += [("ttft_p99", f"TTFT p99 s at {n}", n) for n in cfg.streams]
    for n in cfg.streams:
        share = results.get("ours", {}).get(n, {}).get("host_share")
        if share is not None:
            print(f"ours at {n} stream(s): host (Python) share of engine steps {share:.1%}")
    for key, label, n in metrics:
        vals = [results[k].get(n, {}).get(key) for k in cfg.servers]
        if any(v is None for v in vals):
            continue
        rows.append((label, vals))
    print_table(f"app bench server: {cfg.model.name}, {cfg.n_prompt}+{cfg.n_gen} per stream", cfg.servers, rows)
    data = {"config": {**asdict(cfg), "model": str(cfg.model), "out": str(cfg.out)}, "results": results}
    (cfg.out / "server-bench.json").write_text(json.dumps(data, indent=2))
    series = {k: [results[k][n]["aggregate_tps"] for n in cfg.streams] for k in cfg.servers}
    save_plot(cfg.out / "server-bench.png", cfg.streams, series, "concurrent streams", "aggregate decode t/s",
              f"server throughput, {cfg.model.name}")
    return 0
