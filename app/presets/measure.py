"""Short engine timings for `app tune`: one prompt pass (pp) and a few decode steps (tg) per setting.

The model is loaded once; each setting gets its own Context, because ubatch size, flash attention and KV
types are fixed when a context is made. Timing follows llama-bench's method (a warm-up pass first, so CUDA
graphs and buffers are allocated outside the timed region; random token ids, since speed does not depend on
them; a synchronize before the clock stops) but with fewer repetitions, since tune sweeps many settings.

Thread contract: a Bench and its Model belong to the thread that made them (the engine's rule for contexts).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True)
class Measurement:
    """The result of one setting: t/s for the prompt pass and for decoding, or the error that stopped it."""

    settings: Mapping[str, Any]
    pp_tps: float | None = None
    tg_tps: float | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


class Bench:
    """A loaded model plus the fixed parts of every trial (thread count, layers on the GPU)."""

    def __init__(self, model_path: Path, *, n_gpu_layers: int = 999, split_mode: str = "layer",
                 threads: int = 0, seed: int = 0):
        from app.engine import Model, backend_init

        backend_init()
        self.model = Model(str(model_path), n_gpu_layers=n_gpu_layers, split_mode=split_mode)
        self.threads = threads
        self._rng = np.random.default_rng(seed)

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> "Bench":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _tokens(self, n: int) -> np.ndarray:
        # ids 0..9 are often control tokens some vocabularies treat specially; random ids above them are fine
        n_vocab = self.model.vocab.n_tokens
        return self._rng.integers(min(10, n_vocab - 1), n_vocab, n).astype(np.int32)

    def run(self, settings: Mapping[str, Any], n_prompt: int, n_gen: int, reps: int) -> Measurement:
        """Time one setting (canonical flag names: ubatch-size, flash-attn, cache-type-k/v)."""
        from app.engine import Batch, Context, EngineError

        t0 = time.perf_counter()
        kw = {"n_threads": self.threads, "n_threads_batch": self.threads} if self.threads else {}
        try:
            with Context(self.model, n_ctx=n_prompt + n_gen + 16, n_batch=n_prompt,
                         n_ubatch=int(settings.get("ubatch-size", 512)), n_seq_max=1,
                         flash_attn=str(settings.get("flash-attn", "auto")),
                         type_k=str(settings.get("cache-type-k", "f16")),
                         type_v=str(settings.get("cache-type-v", "f16")), no_perf=True, **kw) as ctx, \
                    Batch(n_prompt) as batch:
                pp, tg = self._timed(ctx, batch, n_prompt, n_gen, reps)
        except (EngineError, ValueError) as e:  # e.g. out of memory for a large ubatch: a result, not a crash
            return Measurement(dict(settings), error=str(e).splitlines()[0][:200], seconds=time.perf_counter() - t0)
        return Measurement(dict(settings), pp_tps=pp, tg_tps=tg, seconds=time.perf_counter() - t0)

    def _timed(self, ctx, batch, n_prompt: int, n_gen: int, reps: int) -> tuple[float, float]:
        def prompt() -> float:
            ctx.memory_clear()
            batch.clear()
            batch.add_many(self._tokens(n_prompt), 0, 0, logits_last=True)
            start = time.perf_counter()
            ctx.decode(batch)  # one call; the engine splits it into ubatches, which is what is being tuned
            ctx.synchronize()
            return time.perf_counter() - start

        def generate() -> float:  # at depth n_prompt, right after a prompt pass
            toks = self._tokens(n_gen)
            start = time.perf_counter()
            for i in range(n_gen):
                batch.clear()
                batch.add(int(toks[i]), n_prompt + i, 0, True)
                ctx.decode(batch)
            ctx.synchronize()
            return time.perf_counter() - start

        prompt()  # warm-up: graph allocation (and CUDA graph capture) stay out of the timings
        generate()
        pp_times, tg_times = [], []
        for _ in range(max(1, reps)):
            pp_times.append(prompt())
            tg_times.append(generate())
        # the median: one slow repetition (another process on the GPU) should not decide the choice
        return n_prompt / statistics.median(pp_times), n_gen / statistics.median(tg_times)
