"""PromptCache over a fake state context: store/lookup/restore, prefix rules, LRU within the budget, the
first-tokens index, checkpoint-carrying entries for models that can't truncate; and (engine built) a cached
state restored into another sequence continues bitwise like the original."""

from __future__ import annotations

import numpy as np
import pytest

import app.runtime.prompt_cache as pc
from app.runtime.bufpool import BufferPool, size_class
from app.runtime.checkpoints import SlotCheckpoints, save_checkpoint
from app.runtime.prompt_cache import PromptCache

try:
    from test_checkpoints import FakeStateCtx, FakeStateError, prefill
except ImportError:  # tests/ imported as a package
    from tests.test_checkpoints import FakeStateCtx, FakeStateError, prefill

MiB = 1 << 20


def toks(seed: int, n: int, prefix=()) -> list[int]:
    return list(prefix) + np.random.default_rng(seed).integers(10, 50000, n).tolist()


def fill(ctx: FakeStateCtx, seq: int, tokens) -> None:
    ctx.seq_rm(seq, 0, -1)
    ctx.decode(seq, tokens)


def test_store_lookup_restore_round_trip():
    ctx, pool = FakeStateCtx(recurrent=False), BufferPool(256 * MiB)
    cache = PromptCache(64 * MiB, pool)
    a = toks(1, 300)
    fill(ctx, 0, a)
    e = cache.store(a, ctx, 0)
    assert e is not None and e.n_tokens == 300 and len(cache) == 1
    prompt = a[:250] + toks(2, 40)
    entry, n = cache.lookup(prompt)
    assert entry is e and n == 250
    fill(ctx, 1, toks(3, 500))  # the slot holds something else
    r = cache.restore(entry, ctx, 1, n)
    assert r.n_tokens == 250 and ctx.kv[1] == a[:250] and r.checkpoints == []
    assert len(cache) == 1  # the entry stays for the next conversation that shares it
    s = cache.stats()
    assert (s["n_hits"], s["n_tokens_restored"], s["n_stored"]) == (1, 250, 1)
    assert s["bytes_used"] == size_class(e.nbytes) <= s["budget_bytes"]


def test_lookup_caps_at_prompt_minus_one_and_skips_small_overlaps():
    ctx, pool = FakeStateCtx(recurrent=False), BufferPool(256 * MiB)
    cache = PromptCache(64 * MiB, pool)
    a = toks(1, 400)
    fill(ctx, 0, a)
    cache.store(a, ctx, 0)
    assert cache.lookup(a)[1] == 399  # the whole prompt cached: one token still gets decoded
    assert cache.lookup(a[:200])[1] == 199
    # 40 of 400 shared (< 25%): upstream leaves such an entry alone
    assert cache.lookup(a[:40] + toks(5, 100)) == (None, 0)
    assert cache.lookup(toks(9, 100)) == (None, 0)
    assert cache.lookup(a[:10]) == (None, 0)  # shorter than the index key
    assert cache.n_misses == 3


def test_prefix_rules_on_store():
    ctx, pool = FakeStateCtx(recurrent=False), BufferPool(256 * MiB)
    cache = PromptCache(64 * MiB, pool)
    a = toks(1, 300)
    fill(ctx, 0, a)
    cache.store(a, ctx, 0)
    # a prefix of a cached prompt adds nothing
    fill(ctx, 0, a[:200])
    assert cache.store(a[:200], ctx, 0) is None and cache.n_skipped == 1 and len(cache) == 1
    # a continuation makes the shorter entry obsolete
    b = a + toks(2, 100)
    fill(ctx, 0, b)
    e = cache.store(b, ctx, 0)
    assert cache.entries() == [e]
    assert pool.stats().n_free == 1  # the old entry's buffer went back to the pool
    # too short to cache
    assert cache.store(b[:10], ctx, 0) is None


def test_stays_within_budget_under_distinct_prompts_lru():
    ctx, pool = FakeStateCtx(recurrent=False, bytes_per_token=1024), BufferPool(64 * MiB)
    budget = 4 * MiB
    cache = PromptCache(budget, pool)
    stored = []
    for i in range(60):
        p = toks(100 + i, 200 + 7 * i % 300)
        fill(ctx, 0, p)
        e = cache.store(p, ctx, 0)
        assert e is not None and cache.bytes_used <= budget
        stored.append(p)
        if i >= 30 and i % 3 == 0:  # use refreshes an entry: a regularly used one survives the evictions
            keep = stored[30]
            entry, n = cache.lookup(keep + [1])
            cache.restore(entry, ctx, 1, n)
    assert cache.n_evicted > 0 and len(cache) < 60
    assert cache.lookup(stored[-1] + [1])[0] is not None  # newest kept
    assert cache.lookup(stored[0] + [1])[0] is None  # oldest evicted
    assert cache.lookup(keep + [1])[0] is not None
    assert pool.bytes_total <= max(pool.max_bytes, cache.bytes_used)


def test_state_larger_than_budget_and_disabled_and_unlimited():
    ctx, pool = FakeStateCtx(recurrent=False, bytes_per_token=4096), BufferPool(64 * MiB)
    a = toks(1, 500)
    fill(ctx, 0, a)
    small = PromptCache(1 * MiB, pool)
    assert small.store(a, ctx, 0) is None and small.n_skipped == 1
    off = PromptCache(0, pool)
    assert not off.enabled and off.store(a, ctx, 0) is None and off.lookup(a) == (None, 0)
    unlimited = PromptCache(-1, pool)
    for i in range(5):
        p = toks(i, 500)
        fill(ctx, 0, p)
        assert unlimited.store(p, ctx, 0) is not None
    assert len(unlimited) == 5
    unlimited.set_budget(size_class(ctx.state_seq_size(0)) * 2)
    assert len(unlimited) == 2
    unlimited.set_budget(0)
    assert len(unlimited) == 0 and pool.stats().n_free == pool.n_buffers


def test_index_keeps_lookups_to_matching_first_tokens(monkeypatch):
    ctx, pool = FakeStateCtx(recurrent=False, bytes_per_token=0, partial_size=0), BufferPool(256 * MiB)
    cache = PromptCache(-1, pool)
    system = toks(0, 64)
    for i in range(500):
        p = toks(1000 + i, 64)
        fill(ctx, 0, p)
        cache.store(p, ctx, 0)
    for i in range(3):
        p = toks(2000 + i, 64, prefix=system)
        fill(ctx, 0, p)
        cache.store(p, ctx, 0)
    calls = []
    real = pc.common_prefix
    monkeypatch.setattr(pc, "common_prefix", lambda a, b: calls.append(1) or real(a, b))
    entry, n = cache.lookup(system + toks(3000, 10))
    assert n == 64 and entry.tokens[:64] == system
    assert len(calls) == 3  # only the entries sharing the first INDEX_K tokens were compared


def test_checkpointed_entry_on_a_model_that_cannot_truncate():
    ctx, pool = FakeStateCtx(recurrent=True), BufferPool(256 * MiB)
    cache = PromptCache(64 * MiB, pool)
    slot = SlotCheckpoints(max_n=8, min_step=0)
    a = toks(1, 400)
    prefill(ctx, 0, a, pool, slot, at=(100, 300))
    e = cache.store(a, ctx, 0, slot.items)
    assert [c.n_tokens for c in e.checkpoints] == [100, 300] and all(c.refs == 2 for c in e.checkpoints)
    assert cache.bytes_used == size_class(e.nbytes) + slot.nbytes
    slot.clear()  # the slot moves on; the entry keeps its checkpoints alive
    assert all(c.buffer is not None for c in e.checkpoints)
    prompt = a[:350] + toks(2, 20)
    entry, n = cache.lookup(prompt, can_truncate=False)
    assert entry is e and n == 300  # rounded down to the checkpoint
    assert cache.lookup(prompt)[1] == 350
    fill(ctx, 1, toks(3, 50))
    r = cache.restore(entry, ctx, 1, n, can_truncate=False)
    assert r.n_tokens == 300 and ctx.kv[1] == a[:300] and ctx.consistent(1)
    assert [c.n_tokens for c in r.checkpoints] == [100, 300]
    slot.replace(r.checkpoints)
    ctx.decode(1, prompt[300:])
    assert ctx.consistent(1)
    # no checkpoint at or before the shared prefix: nothing usable
    assert cache.lookup(a[:90] + [5], can_truncate=False)[1] == 0
    # the whole entry is usable without any cut
    longer = a + toks(4, 10)
    assert cache.lookup(longer, can_truncate=False)[1] == 400
    cache.clear()
    slot.clear()
    assert pool.stats().n_free == pool.n_buffers


def test_restore_failure_leaves_the_sequence_empty():
    ctx, pool = FakeStateCtx(recurrent=False), BufferPool(256 * MiB)
    cache = PromptCache(64 * MiB, pool)
    a = toks(1, 100)
    fill(ctx, 0, a)
    e = cache.store(a, ctx, 0)
    e.buffer.data[:4] = 0  # corrupt the kind tag
    ctx.decode(1, [1, 2, 3])
    with pytest.raises(FakeStateError):
        cache.restore(e, ctx, 1, 99)
    assert ctx.kv[1] == [] and cache.n_hits == 0


def test_store_failure_returns_the_buffer():
    ctx, pool = FakeStateCtx(recurrent=False), BufferPool(256 * MiB)
    cache = PromptCache(64 * MiB, pool)
    a = toks(1, 100)
    fill(ctx, 0, a)
    ctx.state_seq_size = lambda seq, flags=0: 8
    with pytest.raises(FakeStateError):
        cache.store(a, ctx, 0)
    assert len(cache) == 0 and pool.stats().n_free == pool.n_buffers == 1


def test_checkpoint_shared_with_an_entry_counts_once():
    ctx, pool = FakeStateCtx(recurrent=True), BufferPool(256 * MiB)
    cache = PromptCache(64 * MiB, pool)
    slot = SlotCheckpoints(max_n=8, min_step=0)
    a = toks(1, 200)
    ctx.decode(0, a[:100])
    slot.add(save_checkpoint(ctx, 0, 100, pool))
    ctx.decode(0, a[100:])
    e1 = cache.store(a, ctx, 0, slot.items)
    b = a[:100] + toks(2, 150)
    ctx.seq_rm(0, 0, -1)
    ctx.decode(0, b)
    e2 = cache.store(b, ctx, 0, slot.items)
    assert e1.checkpoints[0] is e2.checkpoints[0]
    assert cache.bytes_used == size_class(e1.nbytes) + size_class(e2.nbytes) + slot.nbytes


# ---- the real engine ---------------------------------------------------------------------------------------

try:
    from test_checkpoints import hybrid  # noqa: F401
    from test_engine_support import engine, model, model_dir, tiny_path  # noqa: F401
except ImportError:
    from tests.test_checkpoints import hybrid  # noqa: F401
    from tests.test_engine_support import engine, model, model_dir, tiny_path  # noqa: F401


def _decode(engine, ctx, tokens, pos0, seq):  # noqa: F811
    b = engine.Batch(len(tokens))
    b.add_many(tokens, pos0, seq, logits_last=True)
    ctx.decode(b)
    return ctx.logits_ith(-1).copy()


def test_engine_cached_state_continues_bitwise(engine, model):  # noqa: F811
    rng = np.random.default_rng(1)
    prompt = rng.integers(100, model.vocab.n_tokens - 100, 80).tolist()
    pool = BufferPool(256 * MiB)
    cache = PromptCache(64 * MiB, pool)
    with engine.Context(model, n_ctx=512, n_batch=128, n_ubatch=128, n_threads=2, n_seq_max=2) as ctx:
        b = engine.Batch(128)
        b.add_many(prompt[:64], 0, 0, logits_last=True)
        ctx.decode(b)
        cache.store(prompt[:64], ctx, 0)
        ctx.seq_rm(0, 0, -1)
        entry, n = cache.lookup(prompt)
        assert n == 64
        assert cache.restore(entry, ctx, 1, n).n_tokens == 64
        b.clear()
        b.add_many(prompt[64:], 64, 1, logits_last=True)
        ctx.decode(b)
        got = ctx.logits_ith(-1).copy()
        b.clear()
        b.add_many(prompt[:64], 0, 0, logits_last=False)
        ctx.decode(b)
        b.clear()
        b.add_many(prompt[64:], 64, 0, logits_last=True)
        ctx.decode(b)
        want = ctx.logits_ith(-1).copy()
    assert np.array_equal(got, want)


def test_engine_hybrid_entry_restored_through_its_checkpoint(engine, hybrid):  # noqa: F811
    rng = np.random.default_rng(2)
    n_vocab = hybrid.vocab.n_tokens
    a = rng.integers(100, n_vocab - 100, 96).tolist()
    prompt = a[:70] + rng.integers(100, n_vocab - 100, 10).tolist()
    pool = BufferPool(256 * MiB)
    cache = PromptCache(64 * MiB, pool)
    slot = SlotCheckpoints(max_n=4, min_step=0)
    kw = dict(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2, n_seq_max=2)
    with engine.Context(hybrid, **kw) as ctx:
        _decode(engine, ctx, a[:64], 0, 0)
        slot.add(save_checkpoint(ctx, 0, 64, pool))
        _decode(engine, ctx, a[64:], 64, 0)
        cache.store(a, ctx, 0, slot.items)
        slot.clear()
        entry, n = cache.lookup(prompt, can_truncate=False)
        assert n == 64 and cache.lookup(prompt, can_truncate=True)[1] == 70
        r = cache.restore(entry, ctx, 1, n, can_truncate=False)
        assert r.n_tokens == 64 and ctx.seq_pos_max(1) == 63 and [c.n_tokens for c in r.checkpoints] == [64]
        got = _decode(engine, ctx, prompt[64:], 64, 1)
        slot.replace(r.checkpoints)
    with engine.Context(hybrid, **kw) as fresh:
        _decode(engine, fresh, prompt[:64], 0, 0)
        want = _decode(engine, fresh, prompt[64:], 64, 0)
    assert np.array_equal(got, want)
    slot.clear()
    cache.clear()
    assert pool.stats().n_free == pool.n_buffers
