"""Request handles: the event-loop side of a request, turning engine messages into text events.

The engine thread sends token ids; here they become UTF-8 text with stop strings held back, so a streamed
request and a non-streamed one produce exactly the same text. A stop string found here cancels the engine
task (its slot frees at the next step; the few tokens decoded meanwhile are dropped).
Runs on the event loop only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from app.runtime.api import (
    EmbeddingRequest,
    EngineFailed,
    Finished,
    FinishReason,
    GenerationRequest,
    TextDelta,
    Timings,
)
from app.runtime.textstream import TextStream


class TokenText:
    """Token id -> raw bytes, memoized (the vocabulary is fixed; a cffi call per token adds up)."""

    def __init__(self, vocab: Any):
        self._vocab = vocab
        self._cache: dict[int, bytes] = {}

    def piece(self, token: int) -> bytes:
        b = self._cache.get(token)
        if b is None:
            b = self._cache[token] = self._vocab.piece(token)
        return b


class RequestHandle:
    """Async iterator of TextDelta events ending with one Finished."""

    def __init__(self, req: GenerationRequest, text: TokenText, inbox: Any):
        self.req = req
        self._text = text
        self._inbox = inbox
        self._stream = TextStream(req.stop)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: Any = None
        self._done = False
        self._n_tokens = 0
        self._prompt_info: tuple[int, int, float] = (0, 0, 0.0)
        self._t_first = 0.0
        self.id_slot = -1

    def attach(self, task: Any) -> None:
        self._task = task

    def cancel(self) -> None:
        """Stop generating (client gone or stop string found); idempotent."""
        if self._task is not None and not self._task.cancelled:
            self._task.cancelled = True
            self._inbox.wake()
        self._done = True

    # ---- messages from the engine (event loop) -------------------------------------------------------------

    def on_message(self, msg: tuple) -> None:
        if self._done:
            return
        kind = msg[0]
        if kind == "tokens":
            self._on_tokens(msg[1], msg[2])
        elif kind == "prompt":
            self._prompt_info = (msg[1], msg[2], msg[3])
            self.id_slot = msg[4]
            self._t_first = time.perf_counter()
        elif kind == "done":
            self._on_done(*msg[1:])

    def _on_tokens(self, tokens: list[int], probs: list | None) -> None:
        text = []
        for tok in tokens:
            self._n_tokens += 1
            text.append(self._stream.push(self._text.piece(tok)))
            if self._stream.stopped is not None:
                break
        delta = "".join(text)
        if delta or self.req.return_tokens or probs:
            self._queue.put_nowait(TextDelta(delta, list(tokens), probs))
        if self._stream.stopped is not None:
            self._finish(FinishReason.STOP, None, stopping_word=self._stream.stopped.word)
            self.cancel()

    def _on_done(self, reason: FinishReason, timings: Timings, id_slot: int, stopped_eos: bool,
                 truncated: bool, error: str | None) -> None:
        tail = self._stream.finish()
        if tail:
            self._queue.put_nowait(TextDelta(tail, []))
        self._finish(reason, timings, id_slot=id_slot, stopped_eos=stopped_eos, truncated=truncated, error=error)

    def _finish(self, reason: FinishReason, timings: Timings | None, *, id_slot: int | None = None,
                stopped_eos: bool = False, truncated: bool = False, error: str | None = None,
                stopping_word: str = "") -> None:
        if timings is None:  # finished here (stop string): time it from this side
            n_prompt, n_cached, t_prompt = self._prompt_info
            t_gen = (time.perf_counter() - self._t_first) * 1e3 if self._t_first else 0.0
            timings = Timings(n_prompt, n_cached, self._n_tokens, t_prompt, t_gen)
        else:
            timings.n_predicted = self._n_tokens if not stopped_eos else timings.n_predicted
        slot = id_slot if id_slot is not None else self._slot_id()
        self._queue.put_nowait(Finished(
            reason=reason, timings=timings, id_slot=slot, stopping_word=stopping_word, stopped_eos=stopped_eos,
            truncated=truncated, n_prompt_tokens=len(self.req.prompt), error=error,
        ))
        self._done = True

    def _slot_id(self) -> int:
        return self.id_slot

    # ---- consumer side --------------------------------------------------------------------------------------

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> TextDelta | Finished:
        if self._queue is None:
            raise StopAsyncIteration
        ev = await self._queue.get()
        if isinstance(ev, Finished):
            self._queue = None  # type: ignore[assignment]
        return ev


class EmbeddingHandle:
    """Waits for one embedding vector."""

    def __init__(self, req: EmbeddingRequest):
        self.req = req
        self._fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task: Any = None

    def attach(self, task: Any) -> None:
        self._task = task

    def on_message(self, msg: tuple) -> None:
        if self._fut.done():
            return
        if msg[0] == "embedding":
            self._fut.set_result(msg[1])
        elif msg[0] == "done" and msg[1] is FinishReason.ERROR:
            self._fut.set_exception(EngineFailed(msg[6] or "embedding failed"))

    async def result(self, normalize: bool) -> list[float]:
        try:
            vec = await self._fut
        except asyncio.CancelledError:
            if self._task is not None:
                self._task.cancelled = True
            raise
        v = np.asarray(vec, dtype=np.float32)
        if normalize:
            n = float(np.linalg.norm(v))
            if n > 0:
                v = v / n
        return v.tolist()
