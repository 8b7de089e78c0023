"""Context checkpoints: saved partial sequence states for models whose memory can't be cut back to a prefix.

Recurrent and hybrid models (Mamba, Qwen3-Next / Qwen3.5 gated delta net) keep one running state per sequence,
and sliding-window (SWA) models forget cells older than the window: for them `seq_rm(seq, n, -1)` can't
return to an arbitrary earlier point. A checkpoint is a copy of the part that can't be truncated (the
recurrent state, the SWA cells; `STATE_SEQ_FLAGS_PARTIAL_ONLY`) taken while a prompt is prefilled; the KV of
the full-attention layers needs no copy, it is truncated in place. A later request sharing a prefix restores
the newest checkpoint at or before that prefix and prefills only the rest.

A checkpoint taken at `n_tokens` is the state after the first n_tokens tokens of the slot, taken before the
batch holding token n_tokens is decoded (upstream does the same).

Policy (upstream tools/server semantics, flags `-ctxcp/--ctx-checkpoints` and `-cms/--checkpoint-min-step`):
prompt chunks are cut at user-message starts and at 4 + n_ubatch and 4 tokens before the prompt's end, and a
checkpoint is taken at the start of a chunk that begins a user message or ends near the prompt's end, unless
one was taken less than min_step tokens before (the last user message and the prompt's end are exempt). At
most max_n per slot: when full, old ones closer than min_step to their predecessor go first, then the oldest.

When a slot takes a new request, `keep_prefix()` is the one call: a tail cut where the memory allows it, else
the best checkpoint, else an empty sequence (`usable_prefix()` says which, without doing it).

Buffers come from a BufferPool and are shared by reference count: a slot and prompt-cache entries can hold the
same checkpoint without copying it; the buffer returns to the pool when the last holder lets go.

Thread contract: engine thread only, like the context the states come from.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

from app.runtime.bufpool import BufferPool, PooledBuffer

STATE_SEQ_FLAGS_PARTIAL_ONLY = 1  # mirrors app.engine (kept literal so this module imports without the engine)

# Upstream's defaults (common/common.h at the pinned commit).
DEFAULT_CTX_CHECKPOINTS = 32
DEFAULT_CHECKPOINT_MIN_STEP = 8192
# Upstream cuts prompt chunks this many tokens before the prompt's end (plus n_ubatch for the first), so that
# a checkpoint exists just before the tail a re-templated conversation changes (llama.cpp PR 20288).
END_OFFSET = 4


class StateContext(Protocol):
    """What checkpoints need of app.engine.Context (the tests pass a fake)."""

    def state_seq_size(self, seq_id: int, flags: int = 0) -> int: ...
    def state_seq_get_into(self, buf, seq_id: int, flags: int = 0) -> int: ...
    def state_seq_set(self, buf, seq_id: int, flags: int = 0) -> int: ...
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool: ...
    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...


# ---- one checkpoint --------------------------------------------------------------------------------------

@dataclass(eq=False)
class Checkpoint:
    n_tokens: int  # state after this many tokens of the slot
    pos_min: int  # positions the sequence's memory held when it was taken
    pos_max: int
    buffer: PooledBuffer | None
    nbytes: int
    id_task: int = -1  # the request that made it (kept from min-step thinning while that request runs)
    t_save_ms: float = 0.0
    refs: int = 1

    @property
    def data(self):
        """The saved bytes (a numpy view, no copy)."""
        if self.buffer is None:
            raise ValueError("checkpoint already released")
        return self.buffer.data[: self.nbytes]

    @property
    def capacity(self) -> int:
        """RAM held, counting the buffer's size-class rounding."""
        return self.buffer.capacity if self.buffer is not None else 0

    def retain(self) -> "Checkpoint":
        if self.refs <= 0:
            raise ValueError("retaining a released checkpoint")
        self.refs += 1
        return self

    def release(self) -> None:
        """Drop one reference; the last one hands the buffer back to its pool."""
        if self.refs <= 0:
            raise ValueError("checkpoint released twice")
        self.refs -= 1
        if self.refs == 0 and self.buffer is not None:
            self.buffer.release()
            self.buffer = None


@dataclass
class CheckpointTimings:
    nbytes: int = 0
    t_size_ms: float = 0.0  # state_seq_size (a dry run of the serializer upstream)
    t_alloc_ms: float = 0.0  # buffer from the pool, or fresh and faulted in
    t_copy_ms: float = 0.0  # state_seq_get_into / state_seq_set
    t_total_ms: float = 0.0


_last_save = CheckpointTimings()
_last_restore = CheckpointTimings()


def last_timings() -> dict[str, CheckpointTimings]:
    """Timings of the most recent save_checkpoint and restore_checkpoint (engine thread)."""
    return {"save": _last_save, "restore": _last_restore}


def save_checkpoint(ctx: StateContext, seq_id: int, n_tokens: int, pool: BufferPool,
                    flags: int = STATE_SEQ_FLAGS_PARTIAL_ONLY, *, id_task: int = -1) -> Checkpoint:
    """Copy sequence `seq_id`'s state (the partial part by default) into a pooled buffer.

    `n_tokens` is how many tokens of the slot the state covers now (the caller knows; the memory only
    knows positions). Raises what the engine raises (StateError) with the buffer given back.
    """
    global _last_save
    t0 = time.perf_counter()
    size = ctx.state_seq_size(seq_id, flags)
    t1 = time.perf_counter()
    buf = pool.acquire(size)
    t2 = time.perf_counter()
    try:
        n = ctx.state_seq_get_into(buf.data, seq_id, flags)
    except BaseException:
        buf.release()
        raise
    t3 = time.perf_counter()
    buf.nbytes = n
    ckpt = Checkpoint(n_tokens=n_tokens, pos_min=ctx.seq_pos_min(seq_id), pos_max=ctx.seq_pos_max(seq_id),
                      buffer=buf, nbytes=n, id_task=id_task, t_save_ms=(t3 - t0) * 1e3)
    _last_save = CheckpointTimings(nbytes=n, t_size_ms=(t1 - t0) * 1e3, t_alloc_ms=(t2 - t1) * 1e3,
                                   t_copy_ms=(t3 - t2) * 1e3, t_total_ms=(t3 - t0) * 1e3)
    return ckpt


def restore_checkpoint(ctx: StateContext, seq_id: int, ckpt: Checkpoint,
                       flags: int = STATE_SEQ_FLAGS_PARTIAL_ONLY) -> int:
    """Put `ckpt` back into `seq_id` and cut the rest of the memory to its n_tokens; return n_tokens.

    With PARTIAL_ONLY the full-attention KV is not in the checkpoint: it still holds the slot's longer
    history and is truncated here, after the partial state is set (a recurrent cell then sits at
    n_tokens - 1, so removing [n_tokens, end) is a plain tail cut). A refused cut clears the sequence and
    returns 0 (the caller prefills from scratch).
    """
    global _last_restore
    t0 = time.perf_counter()
    ctx.state_seq_set(ckpt.data, seq_id, flags)
    t1 = time.perf_counter()
    n = ckpt.n_tokens
    if not ctx.seq_rm(seq_id, n, -1):
        ctx.seq_rm(seq_id, 0, -1)
        n = 0
    t2 = time.perf_counter()
    _last_restore = CheckpointTimings(nbytes=ckpt.nbytes, t_copy_ms=(t1 - t0) * 1e3, t_total_ms=(t2 - t0) * 1e3)
    return n


def needs_checkpoint(ctx: StateContext, seq_id: int, n_keep: int, n_swa: int = 0) -> bool:
    """Whether keeping the first n_keep tokens of the sequence takes a checkpoint (upstream's test).

    The memory can continue from n_keep by a tail cut only if it still holds what the next token attends
    to: a recurrent state sits at the last position it consumed (its pos_min is that position), an SWA
    cache has dropped cells older than the window. Plain KV caches hold position 0: never.
    """
    if n_keep <= 0:
        return False
    pos_min = ctx.seq_pos_min(seq_id)
    return pos_min >= 0 and pos_min >= max(0, n_keep - n_swa)


def usable_prefix(ctx: StateContext, seq_id: int, n_keep: int, ckpts: "SlotCheckpoints", n_swa: int = 0) -> int:
    """How many tokens keep_prefix would leave (changing nothing): to weigh a prompt-cache entry against the
    slot's own memory."""
    if n_keep <= 0:
        return 0
    if not needs_checkpoint(ctx, seq_id, n_keep, n_swa):
        return n_keep
    c = ckpts.best_for(n_keep)
    return c.n_tokens if c is not None else 0


def keep_prefix(ctx: StateContext, seq_id: int, n_keep: int, ckpts: "SlotCheckpoints", n_swa: int = 0,
                flags: int = STATE_SEQ_FLAGS_PARTIAL_ONLY) -> int:
    """Make sequence `seq_id` hold its first n_keep tokens or fewer; return how many it holds.

    A tail cut where the memory allows it, else the newest checkpoint at or before n_keep, else an empty
    sequence. Checkpoints past the kept point are dropped (what they saved is being replaced).
    """
    n = max(0, n_keep)
    if needs_checkpoint(ctx, seq_id, n, n_swa):
        c = ckpts.best_for(n)
        n = restore_checkpoint(ctx, seq_id, c, flags) if c is not None else 0
        if c is not None and n:
            ckpts.n_restored += 1
        if n == 0:
            ctx.seq_rm(seq_id, 0, -1)
    elif not ctx.seq_rm(seq_id, n, -1):
        ctx.seq_rm(seq_id, 0, -1)
        n = 0
    ckpts.erase_after(n)
    return n


# ---- a slot's list ---------------------------------------------------------------------------------------

@dataclass
class SlotCheckpoints:
    """The checkpoints of one slot, oldest (fewest tokens) first, at most `max_n`."""

    max_n: int = DEFAULT_CTX_CHECKPOINTS
    min_step: int = DEFAULT_CHECKPOINT_MIN_STEP
    items: list[Checkpoint] = field(default_factory=list)
    n_created: int = 0
    n_restored: int = 0

    def __len__(self) -> int:
        return len(self.items)

    @property
    def nbytes(self) -> int:
        return sum(c.capacity for c in self.items)

    @property
    def last_n_tokens(self) -> int | None:
        return self.items[-1].n_tokens if self.items else None

    def add(self, ckpt: Checkpoint) -> None:
        """Take ownership of one reference to `ckpt`, making room as upstream does."""
        if self.max_n <= 0:
            ckpt.release()
            return
        # Replace a checkpoint at the same point rather than keep two copies of one state.
        self._erase(lambda c: c.n_tokens == ckpt.n_tokens)
        if len(self.items) + 1 >= self.max_n:
            self._thin(ckpt.id_task)
        while len(self.items) >= self.max_n:
            self.items.pop(0).release()
        # Prefill moves forward, so this is an append; insort keeps the order if a caller goes back.
        keys = [c.n_tokens for c in self.items]
        self.items.insert(bisect.bisect_right(keys, ckpt.n_tokens), ckpt)
        self.n_created += 1

    def _thin(self, id_task: int) -> None:
        # Drop checkpoints closer than min_step to the previous kept one, except the current request's own:
        # a full list of closely spaced old checkpoints would otherwise push out the distant, useful ones.
        kept: list[Checkpoint] = []
        last = None
        for c in self.items:
            if c.id_task != id_task and last is not None and c.n_tokens <= last + self.min_step:
                c.release()
                continue
            kept.append(c)
            last = c.n_tokens
        self.items = kept

    def best_for(self, n_common: int) -> Checkpoint | None:
        """The newest checkpoint covering at most `n_common` tokens (the shared prefix), or None.

        Callers pass n_common already capped at len(prompt) - 1, so at least one token is decoded after
        a restore (the logits for the first sampled token come from it).
        """
        keys = [c.n_tokens for c in self.items]
        i = bisect.bisect_right(keys, n_common)
        return self.items[i - 1] if i > 0 else None

    def erase_after(self, n_tokens: int) -> int:
        """Drop checkpoints that cover more than `n_tokens` tokens (their future was replaced); return count."""
        return self._erase(lambda c: c.n_tokens > n_tokens)

    def clear(self) -> None:
        for c in self.items:
            c.release()
        self.items = []

    def replace(self, ckpts: Iterable[Checkpoint]) -> None:
        """Make `ckpts` (references the caller hands over) the slot's list, e.g. from a prompt-cache entry."""
        self.clear()
        self.items = sorted(ckpts, key=lambda c: c.n_tokens)
        while len(self.items) > max(self.max_n, 0):
            self.items.pop(0).release()

    def shared(self, upto: int | None = None) -> list[Checkpoint]:
        """New references to the checkpoints (covering at most `upto` tokens): for a prompt-cache entry."""
        return [c.retain() for c in self.items if upto is None or c.n_tokens <= upto]

    def _erase(self, pred) -> int:
        keep, n = [], 0
        for c in self.items:
            if pred(c):
                c.release()
                n += 1
            else:
                keep.append(c)
        self.items = keep
        return n


# ---- when to take one ------------------------------------------------------------------------------------

def should_checkpoint(n_since_last: int | None, min_step: int, at_message_boundary: bool, *,
                      at_last_user: bool = False, near_end: bool = False) -> bool:
    """Whether to checkpoint at the start of a prompt chunk (before it is decoded); upstream's rule.

    n_since_last: tokens since the slot's newest checkpoint, None if it has none. at_message_boundary: the
    chunk starts a user message. near_end: after this chunk fewer than n_ubatch prompt tokens remain.
    Only those two kinds of chunk get one, and then not within min_step of the last checkpoint unless it's
    the last user message or the prompt's end.
    """
    if not (at_message_boundary or near_end):
        return False
    return n_since_last is None or at_last_user or near_end or n_since_last > min_step


@dataclass(frozen=True)
class CheckpointPolicy:
    """The prefill side of checkpointing: where prompt chunks stop and which chunk starts get one."""

    max_n: int = DEFAULT_CTX_CHECKPOINTS
    min_step: int = DEFAULT_CHECKPOINT_MIN_STEP
    n_ubatch: int = 512
    n_batch: int = 2048
    every: int = 0

    @property
    def enabled(self) -> bool:
        return self.max_n > 0

    def chunk_end(self, n_done: int, n_prompt: int, budget: int, user_starts: Sequence[int] = (),
                  n_last: int | None = None) -> int:
        """Exclusive end of the next prompt chunk starting at `n_done`, at most n_done + budget.

        Stops before a user-message start that will want a checkpoint, and at the tail offsets
        (4 + n_ubatch, 4 before the end), so the next chunk starts where a checkpoint is taken.
        """
        end = min(n_prompt, n_done + budget)
        if not self.enabled or end <= n_done:
            return end
        if self._wanted_at_start(n_done, user_starts, n_last):
            n_last = n_done  # taken before this chunk: later message starts are measured from here
        last_user = user_starts[-1] if user_starts else -1
        i = bisect.bisect_right(user_starts, n_done)
        while i < len(user_starts) and user_starts[i] < end:
            pos = user_starts[i]
            if pos == last_user or n_last is None or pos > n_last + self.min_step:
                end = pos
                break
            i += 1
        for off in (END_OFFSET + self.n_ubatch, END_OFFSET):
            cut = n_prompt - min(self.n_batch, off)
            if n_done < cut < end:
                end = cut
        return end

    def _wanted_at_start(self, n_start: int, user_starts: Sequence[int], n_last: int | None) -> bool:
        i = bisect.bisect_left(user_starts, n_start)
        if n_start <= 0 or i >= len(user_starts) or user_starts[i] != n_start:
            return False
        since = None if n_last is None else n_start - n_last
        return should_checkpoint(since, self.min_step, True, at_last_user=i == len(user_starts) - 1)

    def want(self, n_start: int, n_end: int, n_prompt: int, user_starts: Sequence[int] = (),
             n_last: int | None = None) -> bool:
        """Whether to checkpoint before decoding the chunk [n_start, n_end) of a prompt of n_prompt tokens.

        A slot whose memory is empty (n_start == 0) has nothing to save. `every` > 0 (ours, off by default)
        also takes one at any chunk start that many tokens past the last (or the prompt's start), for long
        prompts of one message.
        """
        if not self.enabled or n_start <= 0:
            return False
        if self.every > 0 and n_start - (n_last or 0) >= self.every:
            return True
        if self._wanted_at_start(n_start, user_starts, n_last):
            return True
        near_end = n_prompt - n_end < self.n_ubatch
        since = None if n_last is None else n_start - n_last
        return should_checkpoint(since, self.min_step, False, near_end=near_end)
