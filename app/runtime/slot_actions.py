"""Slot save, restore and erase (`POST /slots/{id}?action=...`): a slot's tokens and state to and from disk.

The engine thread only copies the state out or in (between steps, on an idle slot); the file work (write with
fsync and rename, read with checksum) runs in a worker thread so neither the loop nor the engine waits on disk.
File format and name rules: app/runtime/slotfile.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from app.runtime.slotfile import model_identity, read_slot_file, slot_path, write_slot_file


class SlotActions:
    def __init__(self, runtime: Any, save_dir: str):
        self.rt = runtime
        self.save_dir = save_dir
        self._model_id: str | None = None

    async def _identity(self) -> str:
        if self._model_id is None:
            s, info = self.rt.settings, self.rt.info
            extra = f"n_ctx_slot={info.n_ctx_slot};k={s.type_k};v={s.type_v}"
            self._model_id = await asyncio.to_thread(model_identity, s.model.path, info.arch, extra)
        return self._model_id

    async def save(self, id_slot: int, filename: str) -> dict:
        path = slot_path(self.save_dir, filename)
        t0 = time.perf_counter()

        def grab(sched):
            slot = sched.idle_slot(id_slot)
            return list(slot.tokens), sched.ctx.state_seq_get(slot.id)

        tokens, state = await self.rt.on_engine(grab)
        n_written = await asyncio.to_thread(write_slot_file, path, await self._identity(), tokens, state)
        return {"id_slot": id_slot, "filename": path.name, "n_saved": len(tokens), "n_written": n_written,
                "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}

    async def restore(self, id_slot: int, filename: str) -> dict:
        path = slot_path(self.save_dir, filename)
        t0 = time.perf_counter()
        info = self.rt.info
        tokens, state = await asyncio.to_thread(read_slot_file, path, await self._identity(),
                                                max_tokens=info.n_ctx_slot, n_vocab=info.n_vocab)

        def load(sched):
            slot = sched.idle_slot(id_slot)
            sched.ctx.seq_rm(slot.id, 0, -1)
            sched.memory.wipe(slot)
            try:
                sched.ctx.state_seq_set(state, slot.id)
            except Exception:
                sched.ctx.seq_rm(slot.id, 0, -1)
                raise
            slot.tokens[:] = tokens

        await self.rt.on_engine(load)
        return {"id_slot": id_slot, "filename": path.name, "n_restored": len(tokens), "n_read": int(state.nbytes),
                "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}

    async def erase(self, id_slot: int) -> dict:
        def wipe(sched):
            slot = sched.idle_slot(id_slot)
            n = len(slot.tokens)
            sched.ctx.seq_rm(slot.id, 0, -1)
            sched.memory.wipe(slot)
            return n

        return {"id_slot": id_slot, "n_erased": await self.rt.on_engine(wipe)}
