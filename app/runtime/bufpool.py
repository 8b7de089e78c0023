"""A pool of host buffers whose pages are already resident, for sequence states (checkpoints, prompt cache).

Why: a fresh multi-MiB numpy array is only address space; the kernel faults in and zeroes each page on first
write, so the first state copy into it pays for that (~44 ms per 112 MiB measured upstream-side, see
docs/prompt-cache.md for our numbers). Checkpoints of one slot have nearly the same size every time, so a
buffer released by an erased checkpoint is the right one for the next.

Size classes: requests up to 64 KiB round up to whole 4 KiB pages; larger ones to one of 8 steps per power
of two (1.000, 1.125, ... 1.875 x 2^k), so a buffer wastes less than 12.5% and a slowly growing state (SWA
window, longer prompt) still lands in the class of the buffer it released. A released buffer is reused only
for a request of the same class.

Bound: `max_bytes` caps the bytes the pool keeps (in use + free). Buffers in use are never taken back, so a
request is always served even when it overshoots the bound; free buffers beyond the bound are dropped, least
recently released first, and a buffer released while the pool is over the bound is dropped at once.
`max_bytes=0` keeps nothing: every acquire is a fresh buffer (the "no pool" baseline for measurements).

Thread contract: not thread-safe. One engine thread owns a pool (and the context whose states it holds).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

PAGE = 4096
_SMALL = 64 * 1024
_STEPS_PER_OCTAVE = 8  # waste < 1/8 = 12.5%


def size_class(nbytes: int) -> int:
    """The capacity a buffer of `nbytes` gets: whole pages up to 64 KiB, else 8 steps per power of two."""
    if nbytes < 0:
        raise ValueError(f"buffer size must be >= 0, got {nbytes}")
    if nbytes <= _SMALL:
        return max(PAGE, -(-nbytes // PAGE) * PAGE)
    step = (1 << (nbytes.bit_length() - 1)) // _STEPS_PER_OCTAVE  # >= 8 KiB here, so a multiple of PAGE
    return -(-nbytes // step) * step


def prefault(arr: np.ndarray) -> None:
    """Touch every page of `arr` once so the kernel maps it now rather than inside a later state copy."""
    arr[::PAGE] = 0


class PooledBuffer:
    """A uint8 buffer of `capacity` bytes lent by a BufferPool; `nbytes` is the part in use.

    `view` (a numpy slice, no copy) is what goes to the engine; cffi's from_buffer accepts it. Give it back
    with `release()` (or `pool.release(buf)`); using it afterwards is a bug the pool cannot detect.
    """

    __slots__ = ("data", "nbytes", "pool", "in_use", "_lru_tick")

    def __init__(self, data: np.ndarray, nbytes: int, pool: "BufferPool | None") -> None:
        self.data = data
        self.nbytes = nbytes
        self.pool = pool
        self.in_use = True
        self._lru_tick = 0

    @property
    def capacity(self) -> int:
        return int(self.data.shape[0])

    @property
    def view(self) -> np.ndarray:
        return self.data[: self.nbytes]

    def release(self) -> None:
        if self.pool is not None:
            self.pool.release(self)
        else:
            self.in_use = False

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"<PooledBuffer {self.nbytes}/{self.capacity} bytes{'' if self.in_use else ' free'}>"


@dataclass
class PoolStats:
    n_buffers: int
    n_free: int
    bytes_total: int
    bytes_free: int
    max_bytes: int
    hits: int
    misses: int
    n_dropped: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class BufferPool:
    """Size-classed free lists of resident buffers, bounded by `max_bytes` (see the module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        # class capacity -> free buffers, most recently released last (reuse the warmest first)
        self._free: dict[int, list[PooledBuffer]] = collections.defaultdict(list)
        self._n_buffers = 0
        self._n_free = 0
        self._bytes_total = 0
        self._bytes_free = 0
        self._tick = 0
        self.hits = 0
        self.misses = 0
        self.n_dropped = 0

    # ---- lending ----------------------------------------------------------------------------------------

    def acquire(self, nbytes: int) -> PooledBuffer:
        """A buffer with at least `nbytes` resident bytes (`buf.nbytes == nbytes`); its content is undefined."""
        cap = size_class(nbytes)
        free = self._free.get(cap)
        if free:
            buf = free.pop()
            self._n_free -= 1
            self._bytes_free -= cap
            buf.nbytes = nbytes
            buf.in_use = True
            self.hits += 1
            return buf
        self.misses += 1
        data = np.empty(cap, dtype=np.uint8)
        prefault(data)
        buf = PooledBuffer(data, nbytes, self)
        self._n_buffers += 1
        self._bytes_total += cap
        # A new buffer may push the pool over its bound: make room from the free lists.
        self._trim(self.max_bytes)
        return buf

    def release(self, buf: PooledBuffer) -> None:
        """Give a buffer back; it is kept for reuse unless that would exceed max_bytes."""
        if buf.pool is not self:
            raise ValueError("buffer does not belong to this pool")
        if not buf.in_use:
            raise ValueError("buffer released twice")
        buf.in_use = False
        cap = buf.capacity
        if self._bytes_total > self.max_bytes:
            self._drop(buf)
            return
        self._tick += 1
        buf._lru_tick = self._tick
        self._free[cap].append(buf)
        self._n_free += 1
        self._bytes_free += cap

    # ---- bounding ---------------------------------------------------------------------------------------

    def trim(self, max_bytes: int | None = None) -> int:
        """Drop free buffers, least recently released first, until the pool holds at most `max_bytes`
        (default: its bound). Returns the bytes dropped."""
        return self._trim(self.max_bytes if max_bytes is None else max_bytes)

    def clear(self) -> int:
        """Drop every free buffer (buffers in use stay valid and are dropped when released)."""
        return self._trim(0)

    def set_max_bytes(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._trim(self.max_bytes)

    def _trim(self, limit: int) -> int:
        if self._bytes_total <= limit or not self._n_free:
            return 0
        # Few classes and few buffers per class: a sort per trim is cheaper than keeping a global LRU.
        victims = sorted((b for lst in self._free.values() for b in lst), key=lambda b: b._lru_tick)
        dropped = 0
        for buf in victims:
            if self._bytes_total <= limit:
                break
            lst = self._free[buf.capacity]
            lst.remove(buf)
            if not lst:
                del self._free[buf.capacity]
            self._n_free -= 1
            self._bytes_free -= buf.capacity
            dropped += buf.capacity
            self._drop(buf)
        return dropped

    def _drop(self, buf: PooledBuffer) -> None:
        self._n_buffers -= 1
        self._bytes_total -= buf.capacity
        self.n_dropped += 1
        buf.pool = None  # a late release() of a dropped buffer is then a no-op, not a corruption
        buf.data = np.empty(0, dtype=np.uint8)  # let the memory go now, even if someone keeps the object

    # ---- reporting --------------------------------------------------------------------------------------

    @property
    def n_buffers(self) -> int:
        return self._n_buffers

    @property
    def bytes_total(self) -> int:
        return self._bytes_total

    @property
    def bytes_free(self) -> int:
        return self._bytes_free

    def stats(self) -> PoolStats:
        return PoolStats(n_buffers=self._n_buffers, n_free=self._n_free, bytes_total=self._bytes_total,
                         bytes_free=self._bytes_free, max_bytes=self.max_bytes, hits=self.hits,
                         misses=self.misses, n_dropped=self.n_dropped)

    def __repr__(self) -> str:
        return (f"<BufferPool {self._n_buffers} buffers, {self._bytes_total >> 20} MiB "
                f"({self._bytes_free >> 20} MiB free) of {self.max_bytes >> 20} MiB>")


def measure(nbytes: int = 112 << 20, reps: int = 15) -> dict[str, float]:
    """Median milliseconds to get a fresh buffer vs a pooled one of `nbytes`, alone and followed by a copy of
    `nbytes` into it (what a state save does). `python -c "from app.runtime.bufpool import measure;
    print(measure())"` gives the numbers quoted in docs/prompt-cache.md."""
    import statistics
    import time

    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    pool = BufferPool(2 * size_class(nbytes))
    pool.acquire(nbytes).release()

    def fresh(copy: bool) -> None:
        buf = np.empty(size_class(nbytes), dtype=np.uint8)
        prefault(buf)
        if copy:
            np.copyto(buf[:nbytes], src)

    def pooled(copy: bool) -> None:
        buf = pool.acquire(nbytes)
        if copy:
            np.copyto(buf.view, src)
        buf.release()

    out = {}
    for name, fn, copy in [("fresh_ms", fresh, False), ("pooled_ms", pooled, False),
                           ("fresh_copy_ms", fresh, True), ("pooled_copy_ms", pooled, True)]:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(copy)
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(times)
    return out
