"""What a slot's sequence keeps between requests: its own prefix, a prompt-cache entry, or checkpoints.

One owner for the engine-thread side of issue 5's pieces (bufpool, prompt_cache, checkpoints):
- when a slot takes a new request, the state it held goes to the host prompt cache (if the new prompt
  diverges from it), and the slot keeps whichever is longer: its own common prefix (a tail cut, or the newest
  checkpoint at or before it on models that can't be cut) or a cached entry sharing more of the prompt;
- while a prompt is prefilled on such models, checkpoints are taken at chunk starts chosen by the policy.
Engine thread only.
"""

from __future__ import annotations

import logging
from typing import Any

from app.engine import STATE_SEQ_FLAGS_PARTIAL_ONLY
from app.runtime.bufpool import BufferPool
from app.runtime.checkpoints import CheckpointPolicy, SlotCheckpoints, keep_prefix, save_checkpoint, usable_prefix
from app.runtime.prompt_cache import PromptCache

log = logging.getLogger("app.runtime")
MiB = 1 << 20


class SlotMemory:
    def __init__(self, ctx: Any, model: Any, n_slots: int, *, cache_ram_mib: int, ctx_checkpoints: int,
                 checkpoint_min_step: int, swa_full: bool):
        self.ctx = ctx
        budget = -1 if cache_ram_mib < 0 else cache_ram_mib * MiB
        # The pool holds the cache's buffers plus the checkpoints of the slots; a GiB of slack for the latter.
        self.pool = BufferPool(max(budget, 0) + (1 << 30))
        self.cache = PromptCache(budget, self.pool)
        self.n_swa = 0 if swa_full else int(model.n_swa)
        self.needs_ckpt = bool(model.is_recurrent or model.is_hybrid or self.n_swa > 0)
        self.policy = CheckpointPolicy(max_n=ctx_checkpoints if self.needs_ckpt else 0,
                                       min_step=checkpoint_min_step, n_ubatch=ctx.n_ubatch, n_batch=ctx.n_batch)
        self.ckpts = [SlotCheckpoints(self.policy.max_n, checkpoint_min_step) for _ in range(n_slots)]

    def prepare(self, slot: Any, prompt: list[int], n_keep: int, use_cache: bool) -> int:
        """Make the slot's sequence hold a prefix of `prompt` (n_keep tokens are shared); return its length.

        slot.tokens is updated to exactly what the sequence holds.
        """
        ck = self.ckpts[slot.id]
        if use_cache and n_keep < len(slot.tokens):
            self.cache.store(slot.tokens, self.ctx, slot.id, ck.items)
        own = usable_prefix(self.ctx, slot.id, n_keep, ck, self.n_swa)
        entry, n = self.cache.lookup(prompt, can_truncate=not self.needs_ckpt) if use_cache else (None, 0)
        if entry is not None and n > own:
            try:
                r = self.cache.restore(entry, self.ctx, slot.id, n, can_truncate=not self.needs_ckpt)
            except Exception as e:  # noqa: BLE001 - a refused state costs a prefill, not the request
                log.warning("slot %d: prompt-cache restore failed (%s); prefilling instead", slot.id, e)
                self.wipe(slot)
                return 0
            slot.tokens[:] = entry.tokens[: r.n_tokens]
            ck.replace(r.checkpoints)
            return r.n_tokens
        n = keep_prefix(self.ctx, slot.id, n_keep, ck, self.n_swa)
        del slot.tokens[n:]
        return n

    def chunk_end(self, slot: Any, task: Any, budget: int) -> int:
        """End of the slot's next prompt chunk; takes a checkpoint first when the policy wants one."""
        ck = self.ckpts[slot.id]
        start, n_prompt = task.n_past_prompt, len(task.prompt)
        starts = task.req.user_starts
        end = self.policy.chunk_end(start, n_prompt, budget, starts, ck.last_n_tokens)
        if not task.embedding and self.policy.want(start, end, n_prompt, starts, ck.last_n_tokens):
            ck.add(save_checkpoint(self.ctx, slot.id, len(slot.tokens), self.pool, STATE_SEQ_FLAGS_PARTIAL_ONLY,
                                   id_task=task.req.id))
        return end

    def wipe(self, slot: Any) -> None:
        """The sequence was emptied: its checkpoints describe nothing any more."""
        self.ckpts[slot.id].clear()
        slot.tokens.clear()

    def stats(self) -> dict:
        return {"prompt_cache": self.cache.stats(), "pool": self.pool.stats().as_dict(),
                "checkpoints": [{"n": len(c), "bytes": c.nbytes} for c in self.ckpts]}
