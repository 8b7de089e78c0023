"""BufferPool: size classes, reuse of released buffers, the byte bound and its LRU trimming, stats."""

from __future__ import annotations

import time

import numpy as np
import pytest

from app.runtime.bufpool import PAGE, BufferPool, size_class

MiB = 1 << 20


def test_size_class_bounds_waste():
    for n in [0, 1, 4095, 4096, 4097, 65536]:
        c = size_class(n)
        assert c >= max(n, PAGE) and c % PAGE == 0 and c - max(n, 1) < PAGE
    rng = np.random.default_rng(0)
    for n in [65537, 1 << 20, (1 << 20) + 1, 112 * MiB, 3 * 10**9, *rng.integers(65537, 1 << 34, 500)]:
        n = int(n)
        c = size_class(n)
        assert n <= c < n * 1.125 and c % PAGE == 0
    # Sizes that differ by a little share a class, so a slowly growing state reuses its buffer.
    assert size_class(100 * MiB) == size_class(100 * MiB + 12345)
    with pytest.raises(ValueError):
        size_class(-1)


def test_acquire_release_reuses_the_same_buffer():
    pool = BufferPool(64 * MiB)
    a = pool.acquire(3 * MiB)
    assert a.nbytes == 3 * MiB and a.capacity == size_class(3 * MiB) and len(a.view) == 3 * MiB
    a.view[:] = 7  # writable, resident
    data = a.data
    a.release()
    b = pool.acquire(3 * MiB - 100)  # same class
    assert b.data is data and b.nbytes == 3 * MiB - 100
    c = pool.acquire(5 * MiB)  # another class: a new buffer
    assert c.data is not data
    s = pool.stats()
    assert (s.hits, s.misses, s.n_buffers, s.n_free) == (1, 2, 2, 0)
    assert s.bytes_total == size_class(3 * MiB) + size_class(5 * MiB) and s.bytes_free == 0
    b.release()
    assert pool.bytes_free == size_class(3 * MiB) and pool.stats().n_free == 1


def test_bound_drops_least_recently_released_free_buffers():
    cap = size_class(4 * MiB)
    pool = BufferPool(3 * cap)
    bufs = [pool.acquire(4 * MiB) for _ in range(3)]
    for b in bufs:
        b.release()
    assert pool.n_buffers == 3 and pool.bytes_free == 3 * cap
    # A new class needs room: the least recently released free buffer goes first.
    big = pool.acquire(6 * MiB)
    assert pool.bytes_total <= 3 * cap + size_class(6 * MiB)
    assert pool.bytes_total <= pool.max_bytes or pool.bytes_free == 0
    assert bufs[0].pool is None and len(bufs[0].data) == 0  # dropped: memory let go
    assert bufs[2].pool is pool
    big.release()
    assert pool.bytes_total <= pool.max_bytes


def test_in_use_buffers_may_exceed_the_bound_and_are_dropped_on_release():
    pool = BufferPool(2 * MiB)
    a = pool.acquire(4 * MiB)  # over the bound: still served
    b = pool.acquire(4 * MiB)
    assert pool.bytes_total == 2 * size_class(4 * MiB)
    a.release()
    b.release()
    assert pool.n_buffers == 0 and pool.bytes_total == 0 and pool.stats().n_dropped == 2


def test_zero_bound_is_no_pool():
    pool = BufferPool(0)
    a = pool.acquire(MiB)
    a.release()
    b = pool.acquire(MiB)
    assert pool.hits == 0 and pool.misses == 2 and b.data is not a.data
    b.release()
    assert pool.n_buffers == 0


def test_release_errors_and_trim():
    pool, other = BufferPool(16 * MiB), BufferPool(16 * MiB)
    a = pool.acquire(MiB)
    with pytest.raises(ValueError, match="does not belong"):
        other.release(a)
    a.release()
    with pytest.raises(ValueError, match="twice"):
        pool.release(a)
    assert pool.clear() == size_class(MiB) and pool.n_buffers == 0
    b = pool.acquire(2 * MiB)
    b.release()
    pool.set_max_bytes(0)
    assert pool.n_buffers == 0
    with pytest.raises(ValueError):
        BufferPool(-1)


def test_pooled_buffer_is_faster_than_a_fresh_one():
    # The point of the pool (numbers in docs/prompt-cache.md): a fresh buffer pays page faults and zeroing.
    n = 32 * MiB
    pool = BufferPool(4 * n)
    t0 = time.perf_counter()
    a = pool.acquire(n)
    t_fresh = time.perf_counter() - t0
    a.release()
    t0 = time.perf_counter()
    b = pool.acquire(n)
    t_pooled = time.perf_counter() - t0
    assert b.data is a.data and t_pooled < t_fresh
