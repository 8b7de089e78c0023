"""`app bench engine`: our binding against upstream llama-bench, same build, same model, one run.

Both measure the same things the same way: prompt processing of N tokens in one llama_decode (split into
ubatches by the engine) and token generation one token per decode, each at a KV depth prefilled beforehand,
averaged over repetitions after a warm-up. The ratio shows what our Python layer costs over the C++ tool.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from app.bench.report import lib_tool, print_table, save_plot


@dataclass
class EngineBenchConfig:
    model: Path
    n_gpu_layers: int = 99
    flash_attn: str = "on"
    prompts: list[int] = None  # type: ignore[assignment]
    n_gen: int = 128
    depths: list[int] = None  # type: ignore[assignment]
    threads: int = 0
    ubatch: int = 512
    reps: int = 3
    out: Path = Path("bench-results")


def _upstream(cfg: EngineBenchConfig) -> dict[tuple[str, int, int], float]:
    fa = {"on": "1", "off": "0"}.get(cfg.flash_attn, "1")
    cmd = [str(lib_tool("llama-bench")), "-m", str(cfg.model), "-ngl", str(cfg.n_gpu_layers), "-fa", fa,
           "-p", ",".join(map(str, cfg.prompts)), "-n", str(cfg.n_gen), "-d", ",".join(map(str, cfg.depths)),
           "-ub", str(cfg.ubatch), "-b", str(max(cfg.prompts + [cfg.ubatch])), "-r", str(cfg.reps), "-o", "json"]
    if cfg.threads:
        cmd += ["-t", str(cfg.threads)]
    print("[bench] upstream:", " ".join(cmd), file=sys.stderr, flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"llama-bench failed ({res.returncode}):\n{res.stderr[-3000:]}")
    out = {}
    for e in json.loads(res.stdout):
        kind = "pp" if e["n_prompt"] else "tg"
        out[(kind, e["n_prompt"] or e["n_gen"], e.get("n_depth", 0))] = float(e["avg_ts"])
    return out


def _ours(cfg: EngineBenchConfig) -> dict[tuple[str, int, int], float]:
    from app.engine import Batch, Context, Model, backend_init

    backend_init()
    rng = np.random.default_rng(0)
    out = {}
    n_batch = max(cfg.prompts + [cfg.ubatch])
    with Model(str(cfg.model), n_gpu_layers=cfg.n_gpu_layers) as model:
        n_vocab = model.vocab.n_tokens
        for depth in cfg.depths:
            n_ctx = depth + max(cfg.prompts + [cfg.n_gen]) + 16
            kw = {"n_threads": cfg.threads, "n_threads_batch": cfg.threads} if cfg.threads else {}
            with Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=cfg.ubatch, n_seq_max=1,
                         flash_attn=cfg.flash_attn, no_perf=True, **kw) as ctx, Batch(n_batch) as batch:
                def fill(tokens, pos0, last_logits=True):
                    for i in range(0, len(tokens), n_batch):
                        batch.clear()
                        chunk = tokens[i : i + n_batch]
                        batch.add_many(chunk, pos0 + i, 0, logits_last=last_logits)
                        ctx.decode(batch)

                def prefill_depth():
                    ctx.memory_clear()
                    if depth:
                        fill(rng.integers(0, n_vocab, depth).tolist(), 0)
                    ctx.synchronize()

                for n in cfg.prompts:
                    out[("pp", n, depth)] = _timed(cfg.reps, prefill_depth, lambda: fill(
                        rng.integers(0, n_vocab, n).tolist(), depth), ctx, n)

                def gen():
                    for i in range(cfg.n_gen):
                        batch.clear()
                        batch.add(int(rng.integers(0, n_vocab)), depth + i, 0, True)
                        ctx.decode(batch)

                out[("tg", cfg.n_gen, depth)] = _timed(cfg.reps, prefill_depth, gen, ctx, cfg.n_gen)
                print(f"[bench] ours: depth {depth} done", file=sys.stderr, flush=True)
    return out


def _timed(reps: int, setup, body, ctx, n_tokens: int) -> float:
    setup()
    body()  # warm-up, as llama-bench does
    rates = []
    for _ in range(reps):
        setup()
        t0 = time.perf_counter()
        body()
        ctx.synchronize()
        rates.append(n_tokens / (time.perf_counter() - t0))
    return float(np.mean(rates))


def run_engine_bench(cfg: EngineBenchConfig) -> int:
    cfg.out.mkdir(parents=True, exist_ok=True)
    up = _upstream(cfg)
    ours = _ours(cfg)
    keys = sorted(set(up) & set(ours), key=lambda k: (k[2], k[0] != "pp", k[1]))
    rows = [(f"{k[0]}{k[1]} @ d{k[2]} (t/s)", [ours[k], up[k]]) for k in keys]
    print_table(f"app bench engine: {cfg.model.name}", ["ours", "upstream"], rows)
    data = {"config": {**asdict(cfg), "model": str(cfg.model), "out": str(cfg.out)},
            "results": [{"test": f"{k[0]}{k[1]}", "depth": k[2], "ours": ours[k], "upstream": up[k]} for k in keys]}
    (cfg.out / "engine-bench.json").write_text(json.dumps(data, indent=2))
    labels = [f"{k[0]}{k[1]}@{k[2]}" for k in keys]
    save_plot(cfg.out / "engine-bench.png", labels, {"ours / upstream": [ours[k] / up[k] for k in keys]},
              "test", "ratio", f"engine speed ratio, {cfg.model.name}")
    return 0
