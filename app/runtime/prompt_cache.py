"""Host-RAM prompt cache: whole sequence states keyed by their tokens, LRU within a byte budget.

When a slot must take a request with a different prefix, the scheduler stores the slot's state here first
(`store`); a later request whose prompt shares a cached prefix restores it (`lookup`, `restore`) and prefills
only the rest. This is upstream's `--cache-ram` cache (server_prompt_cache), with differences:
- an entry stays cached after a restore (upstream moves it into the slot): two conversations sharing one
  system prompt can both come back to it; the entry a continued conversation extends is dropped when the
  longer state is stored (a cached prefix of a stored prompt is obsolete);
- an entry carries the slot's checkpoints by reference (checkpoints.py), not as copies, so a model that
  can't truncate (recurrent, hybrid, SWA) can use an entry up to a checkpoint at or before the shared prefix;
- lookups are indexed by the first INDEX_K tokens, so a stream of distinct prompts doesn't make every lookup
  compare against every entry. Prompts shorter than INDEX_K tokens are not cached (too cheap to matter).

Budget accounting counts what the cache keeps alive: each entry's state buffer (its pool size class, i.e. the
RAM it really holds) plus each distinct checkpoint buffer its entries reference. A state larger than the whole
budget is not stored. `budget_bytes < 0` means no limit, 0 disables the cache (upstream's -1 / 0).

Thread contract: engine thread only (it holds states of that thread's context).
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Sequence

from app.runtime.bufpool import BufferPool, PooledBuffer, size_class
from app.runtime.checkpoints import STATE_SEQ_FLAGS_PARTIAL_ONLY, Checkpoint, StateContext
from app.runtime.slots import common_prefix

INDEX_K = 32  # tokens hashed for the lookup index; also the shortest prompt worth caching
DEFAULT_CACHE_RAM_MIB = 8192  # upstream's -cram default
MIN_KEEP_FRAC = 0.25  # upstream: don't restore an entry when less than this fraction of it would be used


@dataclass(eq=False)
class CacheEntry:
    tokens: list[int]
    buffer: PooledBuffer | None
    nbytes: int
    checkpoints: list[Checkpoint] = field(default_factory=list)
    id: int = 0
    t_stored: float = 0.0
    n_hits: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def data(self):
        if self.buffer is None:
            raise ValueError("cache entry already dropped")
        return self.buffer.data[: self.nbytes]

    def best_checkpoint(self, n: int) -> Checkpoint | None:
        """The entry's newest checkpoint covering at most n tokens."""
        best = None
        for c in self.checkpoints:
            if c.n_tokens <= n and (best is None or c.n_tokens > best.n_tokens):
                best = c
        return best

    def usable(self, n_common: int, can_truncate: bool) -> int:
        """Tokens of this entry a prompt sharing n_common tokens with it could keep after a restore."""
        n = min(n_common, self.n_tokens)
        if n == self.n_tokens or can_truncate:
            return n
        c = self.best_checkpoint(n)
        return c.n_tokens if c is not None else 0

    def _drop(self) -> None:
        for c in self.checkpoints:
            c.release()
        self.checkpoints = []
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None


@dataclass
class RestoreResult:
    n_tokens: int  # tokens of the entry the slot now holds (its KV/state covers exactly these)
    checkpoints: list[Checkpoint]  # references for the slot's SlotCheckpoints.replace()
    t_ms: float = 0.0


class PromptCache:
    """Sequence states in host RAM (see the module docstring)."""

    def __init__(self, budget_bytes: int, pool: BufferPool, *, index_k: int = INDEX_K,
                 min_keep_frac: float = MIN_KEEP_FRAC) -> None:
        self.budget_bytes = int(budget_bytes)
        self.pool = pool
        self.index_k = max(1, int(index_k))
        self.min_keep_frac = min_keep_frac
        self._entries: collections.OrderedDict[int, CacheEntry] = collections.OrderedDict()  # LRU first
        self._index: dict[tuple, set[int]] = collections.defaultdict(set)
        # Checkpoints the entries reference, counted once however many entries share one: id -> [ckpt, n].
        self._ckpts: dict[int, list] = {}
        self._bytes_states = 0
        self._bytes_ckpts = 0
        self._ids = itertools.count(1)
        self.n_stored = self.n_skipped = self.n_evicted = 0
        self.n_hits = self.n_misses = 0
        self.n_tokens_restored = 0
        self.t_store_ms = self.t_restore_ms = 0.0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes != 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CacheEntry]:
        """Entries, least recently used first."""
        return list(self._entries.values())

    # ---- finding ----------------------------------------------------------------------------------------

    def _key(self, tokens: Sequence[int]) -> tuple:
        return tuple(tokens[: self.index_k])

    def _candidates(self, tokens: Sequence[int]) -> list[CacheEntry]:
        if len(tokens) < self.index_k:
            return []
        return [self._entries[i] for i in self._index.get(self._key(tokens), ())]

    def lookup(self, prompt: Sequence[int], *, can_truncate: bool = True) -> tuple[CacheEntry | None, int]:
        """The entry most useful for `prompt` and how many of its tokens a restore keeps (0 if none).

        n is capped at len(prompt) - 1 (one token must be decoded for logits) and, on a model that can't
        truncate (`can_truncate=False`), rounded down to the entry's checkpoints. Entries of which less than
        min_keep_frac would be used are passed over, as upstream does. Whether the result beats what the slot
        already holds is the caller's call; counting a hit is `restore`'s.
        """
        if not self.enabled:
            return None, 0
        prompt = list(prompt)
        cap = len(prompt) - 1
        best, best_n = None, 0
        for e in self._candidates(prompt):
            n = e.usable(min(common_prefix(e.tokens, prompt), cap), can_truncate)
            if n <= 0 or n < self.min_keep_frac * e.n_tokens:
                continue
            # More tokens kept wins; on a tie the smaller entry (less state to copy back).
            if n > best_n or (n == best_n and best is not None and e.n_tokens <= best.n_tokens):
                best, best_n = e, n
        if best is None:
            self.n_misses += 1
        return best, best_n

    def covered(self, tokens: Sequence[int]) -> CacheEntry | None:
        """An entry whose tokens start with all of `tokens` (storing them again would add nothing)."""
        tokens, n = list(tokens), len(tokens)
        for e in self._candidates(tokens):
            if e.n_tokens >= n and common_prefix(e.tokens, tokens) == n:
                return e
        return None

    # ---- storing ----------------------------------------------------------------------------------------

    def store(self, tokens: Sequence[int], ctx: StateContext, seq_id: int,
              checkpoints: Sequence[Checkpoint] = ()) -> CacheEntry | None:
        """Save sequence `seq_id` (whose memory holds exactly `tokens`) and its `checkpoints`.

        The entry takes its own references to the checkpoints (no copies): pass the slot's list as it is.

        Skipped (None) when the cache is off, the prompt is shorter than index_k, a cached entry already
        covers it (that entry is refreshed instead), or the state alone exceeds the budget.
        """
        if not self.enabled or len(tokens) < self.index_k:
            return None
        t0 = time.perf_counter()
        tokens = list(tokens)
        hit = self.covered(tokens)
        if hit is not None:
            self._entries.move_to_end(hit.id)
            self.n_skipped += 1
            return None
        size = ctx.state_seq_size(seq_id, 0)
        cap = size_class(size)
        if 0 < self.budget_bytes < cap + sum(c.capacity for c in checkpoints):
            self.n_skipped += 1
            return None
        self._drop_prefixes_of(tokens)
        # Evict before allocating, so the cache never holds more than its budget, even for a moment.
        while (self.budget_bytes > 0 and self._entries
               and self.bytes_used + cap + self._new_ckpt_bytes(checkpoints) > self.budget_bytes):
            self._remove(next(iter(self._entries.values())))
            self.n_evicted += 1
        buf = self.pool.acquire(size)
        try:
            n = ctx.state_seq_get_into(buf.data, seq_id, 0)
        except BaseException:
            buf.release()
            raise
        buf.nbytes = n
        e = CacheEntry(tokens=tokens, buffer=buf, nbytes=n, checkpoints=[c.retain() for c in checkpoints],
                       id=next(self._ids), t_stored=time.time())
        self._add(e)
        self.n_stored += 1
        self.t_store_ms += (time.perf_counter() - t0) * 1e3
        return e

    def _new_ckpt_bytes(self, checkpoints: Sequence[Checkpoint]) -> int:
        return sum(c.capacity for c in checkpoints if id(c) not in self._ckpts)

    def _drop_prefixes_of(self, tokens: list[int]) -> None:
        # A cached prompt that is a prefix of the new one is obsolete: the new entry serves every prompt it did.
        for e in self._candidates(tokens):
            if e.n_tokens <= len(tokens) and common_prefix(e.tokens, tokens) == e.n_tokens:
                self._remove(e)

    # ---- restoring --------------------------------------------------------------------------------------

    def restore(self, entry: CacheEntry, ctx: StateContext, seq_id: int, n_keep: int, *,
                can_truncate: bool = True, partial_flags: int = STATE_SEQ_FLAGS_PARTIAL_ONLY) -> RestoreResult:
        """Load `entry` into sequence `seq_id` and cut it to at most `n_keep` tokens (lookup's n).

        On a model that can't truncate, the entry's newest checkpoint at or before n_keep is applied over the
        full state and the attention KV is cut to it. The result's checkpoints are new references for the
        slot (those covering what it keeps). The entry stays cached and becomes most recently used. Raises
        what the engine raises if the state is refused, leaving the sequence empty.
        """
        t0 = time.perf_counter()
        try:
            ctx.state_seq_set(entry.data, seq_id, 0)
            n = self._cut(entry, ctx, seq_id, min(n_keep, entry.n_tokens), can_truncate, partial_flags)
        except BaseException:
            ctx.seq_rm(seq_id, 0, -1)
            raise
        self._entries.move_to_end(entry.id)
        entry.n_hits += 1
        self.n_hits += 1
        self.n_tokens_restored += n
        dt = (time.perf_counter() - t0) * 1e3
        self.t_restore_ms += dt
        return RestoreResult(n_tokens=n, checkpoints=[c.retain() for c in entry.checkpoints if c.n_tokens <= n],
                             t_ms=dt)

    @staticmethod
    def _cut(entry: CacheEntry, ctx: StateContext, seq_id: int, n: int, can_truncate: bool,
             partial_flags: int) -> int:
        if n >= entry.n_tokens:
            return entry.n_tokens
        if can_truncate and ctx.seq_rm(seq_id, n, -1):
            return n
        c = entry.best_checkpoint(n)
        if c is not None:
            ctx.state_seq_set(c.data, seq_id, partial_flags)
            if ctx.seq_rm(seq_id, c.n_tokens, -1):
                return c.n_tokens
        ctx.seq_rm(seq_id, 0, -1)
        return 0

    # ---- eviction -----------------------------------------------------------------------------------------

    def _add(self, e: CacheEntry) -> None:
        self._entries[e.id] = e
        self._index[self._key(e.tokens)].add(e.id)
        self._bytes_states += e.buffer.capacity
        for c in e.checkpoints:
            held = self._ckpts.setdefault(id(c), [c, 0])
            if held[1] == 0:
                self._bytes_ckpts += c.capacity
            held[1] += 1

    def _remove(self, e: CacheEntry) -> None:
        del self._entries[e.id]
        key = self._key(e.tokens)
        ids = self._index.get(key)
        if ids is not None:
            ids.discard(e.id)
            if not ids:
                del self._index[key]
        self._bytes_states -= e.buffer.capacity if e.buffer is not None else 0
        for c in e.checkpoints:
            held = self._ckpts[id(c)]
            held[1] -= 1
            if held[1] == 0:
                del self._ckpts[id(c)]
                self._bytes_ckpts -= c.capacity
        e._drop()

    def _evict(self, limit: int | None) -> None:
        while limit is not None and self._entries and self.bytes_used > limit:
            self._remove(next(iter(self._entries.values())))
            self.n_evicted += 1

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        if self.budget_bytes == 0:
            self.clear()
        else:
            self._evict(self.budget_bytes if self.budget_bytes > 0 else None)

    def clear(self) -> None:
        for e in list(self._entries.values()):
            self._remove(e)

    # ---- reporting --------------------------------------------------------------------------------------

    @property
    def bytes_used(self) -> int:
        return self._bytes_states + self._bytes_ckpts

    @property
    def n_tokens(self) -> int:
        return sum(e.n_tokens for e in self._entries.values())

    def stats(self) -> dict:
        return {"n_entries": len(self._entries), "n_tokens": self.n_tokens, "bytes_used": self.bytes_used,
                "budget_bytes": self.budget_bytes, "n_hits": self.n_hits, "n_misses": self.n_misses,
                "n_tokens_restored": self.n_tokens_restored, "n_stored": self.n_stored,
                "n_skipped": self.n_skipped, "n_evicted": self.n_evicted,
                "t_store_ms": self.t_store_ms, "t_restore_ms": self.t_restore_ms}
