"""Context checkpoints: save/restore through a fake state context, the per-slot list (limits, thinning,
sharing), the upstream checkpoint policy, and (when the engine is built) bitwise-equal logits after restoring
a checkpoint of a tiny hybrid model."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from app.runtime.bufpool import BufferPool
from app.runtime.checkpoints import (
    STATE_SEQ_FLAGS_PARTIAL_ONLY,
    Checkpoint,
    CheckpointPolicy,
    SlotCheckpoints,
    keep_prefix,
    last_timings,
    needs_checkpoint,
    restore_checkpoint,
    save_checkpoint,
    should_checkpoint,
    usable_prefix,
)

PARTIAL = STATE_SEQ_FLAGS_PARTIAL_ONLY


class FakeStateError(RuntimeError):
    pass


class FakeStateCtx:
    """The state API of app.engine.Context over Python lists, modelling a hybrid memory.

    Each sequence has an attention KV (its tokens, truncatable anywhere) and, when `recurrent`, a running
    state that summarizes the tokens it has seen and can't be rewound (seq_rm into it fails). A full state
    holds both; a partial one (PARTIAL_ONLY) only the running state. `consistent(seq)` says whether the two
    agree, i.e. whether decoding could go on correctly.
    """

    HEAD = struct.Struct("<4sIi")  # kind, n tokens, seq

    def __init__(self, recurrent: bool = True, bytes_per_token: int = 256, partial_size: int = 64 << 10):
        self.recurrent = recurrent
        self.bytes_per_token = bytes_per_token
        self.partial_size = partial_size
        self.kv: dict[int, list[int]] = {}
        self.rs: dict[int, list[int]] = {}  # tokens the running state has consumed
        self.n_get = self.n_set = 0

    # decoding
    def decode(self, seq: int, tokens) -> None:
        self.kv.setdefault(seq, []).extend(tokens)
        self.rs.setdefault(seq, []).extend(tokens)

    def consistent(self, seq: int) -> bool:
        return not self.recurrent or self.kv.get(seq, []) == self.rs.get(seq, [])

    # memory
    def seq_pos_min(self, seq: int) -> int:
        # a hybrid memory reports the larger of its parts' minima: the running state's one position
        if not self.kv.get(seq):
            return -1
        return max(0, len(self.rs.get(seq, [])) - 1) if self.recurrent else 0

    def seq_pos_max(self, seq: int) -> int:
        return len(self.kv.get(seq, [])) - 1

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        p0 = max(p0, 0)
        if p0 == 0 and p1 < 0:
            self.kv[seq], self.rs[seq] = [], []
            return True
        if self.recurrent and len(self.rs.get(seq, [])) > p0:
            return False
        del self.kv.setdefault(seq, [])[p0:]
        return True

    # state
    def _encode(self, seq: int, flags: int) -> bytes:
        rs = self.rs.get(seq, []) if self.recurrent else []
        digest = hashlib.sha256(np.asarray(rs, dtype="<i4").tobytes()).digest()
        body = struct.pack("<I", len(rs)) + np.asarray(rs, dtype="<i4").tobytes() + digest
        body += bytes(max(0, self.partial_size - len(body)))
        if flags & PARTIAL:
            return self.HEAD.pack(b"PART", 0, seq) + body
        kv = self.kv.get(seq, [])
        pad = bytes(self.bytes_per_token * len(kv))
        return self.HEAD.pack(b"FULL", len(kv), seq) + np.asarray(kv, dtype="<i4").tobytes() + pad + body

    def state_seq_size(self, seq: int, flags: int = 0) -> int:
        return len(self._encode(seq, flags))

    def state_seq_get_into(self, buf, seq: int, flags: int = 0) -> int:
        data = self._encode(seq, flags)
        arr = np.asarray(buf)
        if arr.shape[0] < len(data):
            raise FakeStateError("buffer too small")
        arr[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.n_get += 1
        return len(data)

    def state_seq_set(self, buf, seq: int, flags: int = 0) -> int:
        raw = np.asarray(buf, dtype=np.uint8).tobytes()
        kind, n_kv, _ = self.HEAD.unpack_from(raw)
        if kind != (b"PART" if flags & PARTIAL else b"FULL"):
            raise FakeStateError(f"wrong state kind {kind!r}")
        off = self.HEAD.size
        if kind == b"FULL":
            self.kv[seq] = np.frombuffer(raw, dtype="<i4", count=n_kv, offset=off).tolist()
            off += 4 * n_kv + self.bytes_per_token * n_kv
        (n_rs,) = struct.unpack_from("<I", raw, off)
        rs = np.frombuffer(raw, dtype="<i4", count=n_rs, offset=off + 4).tolist()
        if hashlib.sha256(np.asarray(rs, dtype="<i4").tobytes()).digest() != raw[off + 4 + 4 * n_rs:][:32]:
            raise FakeStateError("corrupt state")
        if self.recurrent:
            self.rs[seq] = rs
        self.n_set += 1
        return len(raw)


def prefill(ctx: FakeStateCtx, seq: int, tokens, pool, ckpts: SlotCheckpoints, at=(), id_task=1):
    """Decode `tokens` onto `seq`, checkpointing before the chunks that start at the positions `at`."""
    start = len(ctx.kv.get(seq, []))
    cuts = sorted({p for p in at if start < p < start + len(tokens)} | {start, start + len(tokens)})
    for a, b in zip(cuts, cuts[1:], strict=False):
        if a in at:
            ckpts.add(save_checkpoint(ctx, seq, a, pool, id_task=id_task))
        ctx.decode(seq, tokens[a - start : b - start])


# ---- save / restore ----------------------------------------------------------------------------------------

def test_save_restore_returns_to_the_prefix():
    ctx, pool = FakeStateCtx(), BufferPool(64 << 20)
    prompt = list(range(1000, 1300))
    ckpts = SlotCheckpoints(max_n=8, min_step=0)
    prefill(ctx, 0, prompt, pool, ckpts, at=(100, 200))
    assert [c.n_tokens for c in ckpts.items] == [100, 200]
    c = ckpts.items[1]
    assert (c.pos_min, c.pos_max) == (199, 199) and c.nbytes == ctx.state_seq_size(0, PARTIAL)
    # A new prompt shares 250 tokens: the memory can't be cut there, the checkpoint at 200 serves.
    new = prompt[:250] + [7, 8, 9]
    assert not ctx.seq_rm(0, 250, -1)
    best = ckpts.best_for(250)
    assert best is c
    assert restore_checkpoint(ctx, 0, best) == 200
    assert ctx.kv[0] == prompt[:200] and ctx.consistent(0)
    ckpts.erase_after(200)
    ctx.decode(0, new[200:])
    assert ctx.kv[0] == new and ctx.consistent(0)
    t = last_timings()
    assert t["save"].nbytes == c.nbytes and t["save"].t_total_ms >= t["save"].t_copy_ms >= 0
    assert t["restore"].nbytes == c.nbytes and t["restore"].t_total_ms >= 0


def test_restore_that_cannot_cut_clears_the_sequence():
    ctx, pool = FakeStateCtx(), BufferPool(64 << 20)
    ctx.decode(0, [1, 2, 3, 4])
    ck = save_checkpoint(ctx, 0, 4, pool)
    ck.n_tokens = 2  # a lie the memory can't honour: the running state has seen 4 tokens
    assert restore_checkpoint(ctx, 0, ck) == 0
    assert ctx.kv[0] == [] and ctx.consistent(0)


def test_save_failure_gives_the_buffer_back():
    ctx, pool = FakeStateCtx(), BufferPool(64 << 20)
    ctx.decode(0, [1, 2, 3])
    ctx.state_seq_size = lambda seq, flags=0: 16  # too small for what get_into writes
    with pytest.raises(FakeStateError):
        save_checkpoint(ctx, 0, 3, pool)
    assert pool.stats().n_free == pool.n_buffers == 1


def test_checkpoint_buffers_are_reused_from_the_pool():
    ctx, pool = FakeStateCtx(), BufferPool(64 << 20)
    ckpts = SlotCheckpoints(max_n=2, min_step=0)
    ctx.decode(0, list(range(10)))
    for i in range(6):
        ctx.decode(0, [i])
        ckpts.add(save_checkpoint(ctx, 0, 11 + i, pool))
    # two held, the rest came back and were reused: only 3 buffers were ever made
    assert len(ckpts) == 2 and pool.misses == 3 and pool.hits == 3


def test_keep_prefix_cuts_restores_or_clears():
    pool = BufferPool(64 << 20)
    plain = FakeStateCtx(recurrent=False)
    ck = SlotCheckpoints(max_n=8, min_step=0)
    plain.decode(0, list(range(100)))
    assert not needs_checkpoint(plain, 0, 60)
    assert keep_prefix(plain, 0, 60, ck) == 60 and plain.kv[0] == list(range(60))
    rec = FakeStateCtx(recurrent=True)
    a = list(range(500, 900))
    prefill(rec, 0, a, pool, ck, at=(100, 250))
    assert needs_checkpoint(rec, 0, 399) and not needs_checkpoint(rec, 0, 400) and not needs_checkpoint(rec, 0, 0)
    assert [usable_prefix(rec, 0, n, ck) for n in (0, 99, 100, 260, 400)] == [0, 0, 100, 250, 400]
    assert keep_prefix(rec, 0, 400, ck) == 400 and len(ck) == 2  # nothing to cut
    assert keep_prefix(rec, 0, 260, ck) == 250 and rec.kv[0] == a[:250] and rec.consistent(0)
    assert [c.n_tokens for c in ck.items] == [100, 250] and ck.n_restored == 1
    assert keep_prefix(rec, 0, 120, ck) == 100 and [c.n_tokens for c in ck.items] == [100]
    assert keep_prefix(rec, 0, 50, ck) == 0 and rec.kv[0] == [] and len(ck) == 0
    # SWA-like: the memory dropped cells before position 300 (the window is 64)
    swa = FakeStateCtx(recurrent=False)
    swa.decode(0, list(range(400)))
    swa.seq_pos_min = lambda seq: 300
    assert needs_checkpoint(swa, 0, 350, n_swa=64) and not needs_checkpoint(swa, 0, 380, n_swa=64)


# ---- the slot's list ---------------------------------------------------------------------------------------

def fake_ckpt(pool: BufferPool, n: int, id_task: int = 0) -> Checkpoint:
    buf = pool.acquire(4096)
    return Checkpoint(n_tokens=n, pos_min=0, pos_max=n - 1, buffer=buf, nbytes=4096, id_task=id_task)


def test_limit_drops_the_oldest_and_releases_buffers():
    pool = BufferPool(1 << 30)
    ck = SlotCheckpoints(max_n=3, min_step=0)
    made = [fake_ckpt(pool, n) for n in (10, 20, 30, 40)]
    for c in made:
        ck.add(c)
    assert [c.n_tokens for c in ck.items] == [20, 30, 40]
    assert made[0].buffer is None and pool.stats().n_free == 1
    # same point: replaced, not duplicated
    ck.add(fake_ckpt(pool, 40))
    assert [c.n_tokens for c in ck.items] == [20, 30, 40] and made[3].buffer is None
    assert ck.nbytes == 3 * 4096 and ck.last_n_tokens == 40


def test_full_list_thins_close_checkpoints_of_other_requests_first():
    pool = BufferPool(1 << 30)
    ck = SlotCheckpoints(max_n=4, min_step=100)
    for n in (1000, 1050, 1100):  # an older request's, closely spaced
        ck.add(fake_ckpt(pool, n, id_task=1))
    ck.add(fake_ckpt(pool, 3000, id_task=2))
    # the list is full for the next one: 1050 and 1100 are within min_step of 1000 and go first
    ck.add(fake_ckpt(pool, 3010, id_task=2))
    assert [c.n_tokens for c in ck.items] == [1000, 3000, 3010]


def test_best_for_erase_after_clear():
    pool = BufferPool(1 << 30)
    ck = SlotCheckpoints(max_n=8, min_step=0)
    for n in (10, 50, 90):
        ck.add(fake_ckpt(pool, n))
    assert ck.best_for(9) is None
    assert ck.best_for(10).n_tokens == 10 and ck.best_for(89).n_tokens == 50 and ck.best_for(10**6).n_tokens == 90
    assert ck.erase_after(50) == 1 and [c.n_tokens for c in ck.items] == [10, 50]
    ck.clear()
    assert len(ck) == 0 and pool.stats().n_free == 3


def test_shared_checkpoints_live_until_the_last_holder_lets_go():
    pool = BufferPool(1 << 30)
    a = SlotCheckpoints(max_n=8, min_step=0)
    for n in (10, 20, 30):
        a.add(fake_ckpt(pool, n))
    refs = a.shared(upto=20)  # e.g. a prompt-cache entry
    assert [c.n_tokens for c in refs] == [10, 20] and all(c.refs == 2 for c in refs)
    a.clear()
    assert pool.stats().n_free == 1 and all(c.buffer is not None for c in refs)
    b = SlotCheckpoints(max_n=1, min_step=0)
    b.replace([r.retain() for r in refs])  # another slot adopts them; over its limit the oldest goes
    assert [c.n_tokens for c in b.items] == [20]
    for r in refs:
        r.release()
    assert refs[0].buffer is None and refs[1].buffer is not None
    b.clear()
    assert pool.stats().n_free == 3
    with pytest.raises(ValueError):
        refs[1].release()
    with pytest.raises(ValueError):
        refs[1].retain()


def test_disabled_list_keeps_nothing():
    pool = BufferPool(1 << 30)
    ck = SlotCheckpoints(max_n=0)
    ck.add(fake_ckpt(pool, 5))
    assert len(ck) == 0 and pool.stats().n_free == 1


# ---- policy ------------------------------------------------------------------------------------------------

def test_should_checkpoint_follows_upstream():
    # mid-prompt chunks never (unless `every`), message starts and the prompt's end do
    assert not should_checkpoint(None, 8192, False)
    assert should_checkpoint(None, 8192, True)
    assert should_checkpoint(None, 8192, False, near_end=True)
    # within min_step of the last one: only the last user message or the end
    assert not should_checkpoint(100, 8192, True)
    assert should_checkpoint(100, 8192, True, at_last_user=True)
    assert should_checkpoint(100, 8192, False, near_end=True)
    assert should_checkpoint(8193, 8192, True) and not should_checkpoint(8192, 8192, True)


def simulate(policy: CheckpointPolicy, n_prompt: int, user_starts, n_batch_budget: int):
    """Walk a prefill the way the scheduler would; return (chunk ends, checkpoint points)."""
    done, last, ends, taken = 0, None, [], []
    while done < n_prompt:
        end = policy.chunk_end(done, n_prompt, n_batch_budget, user_starts, last)
        assert done < end <= min(n_prompt, done + n_batch_budget)
        if policy.want(done, end, n_prompt, user_starts, last):
            taken.append(done)
            last = done
        ends.append(end)
        done = end
    return ends, taken


def test_policy_cuts_chunks_at_user_messages_and_the_tail():
    pol = CheckpointPolicy(max_n=32, min_step=1000, n_ubatch=512, n_batch=2048)
    starts = [0, 300, 900, 2500, 5000]
    ends, taken = simulate(pol, 6000, starts, 2048)
    # 300: first checkpoint (none yet); 900 is within min_step of 300: no cut, no checkpoint;
    # 2500: > min_step past 300; 5000: the last user message; 5484 = 6000-4-512 and 5996 = 6000-4: the tail.
    assert taken == [300, 2500, 5000, 5484, 5996]
    assert ends == [300, 2348, 2500, 4548, 5000, 5484, 5996, 6000]


def test_policy_single_message_prompt_and_disabled():
    pol = CheckpointPolicy(max_n=8, min_step=8192, n_ubatch=512, n_batch=2048)
    ends, taken = simulate(pol, 3000, [0], 2048)
    assert taken == [2484, 2996] and ends == [2048, 2484, 2996, 3000]
    ends, taken = simulate(CheckpointPolicy(max_n=0), 3000, [0], 2048)
    assert taken == [] and ends == [2048, 3000]
    # a prompt shorter than the tail offsets: the cut at 4 before the end still happens
    ends, taken = simulate(pol, 100, [], 2048)
    assert ends == [96, 100] and taken == [96]


def test_policy_every_n_tokens():
    pol = CheckpointPolicy(max_n=8, min_step=8192, n_ubatch=512, n_batch=2048, every=1024)
    _, taken = simulate(pol, 5000, [], 1024)
    assert taken == [1024, 2048, 3072, 4096, 4484, 4996]


# ---- the real engine ---------------------------------------------------------------------------------------

try:
    from test_engine_support import engine, model_dir  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.test_engine_support import engine, model_dir  # noqa: F401


@pytest.fixture(scope="module")
def hybrid(engine, model_dir):  # noqa: F811
    try:
        from app.models.synth import tiny_model

        path = tiny_model(model_dir, arch="qwen35", qtype="f16")
    except (ImportError, FileNotFoundError, ValueError) as e:
        pytest.skip(f"tiny hybrid model unavailable: {e}")
    m = engine.Model(path)
    yield m
    m.close()


def _decode(engine, ctx, tokens, pos0, seq=0):
    b = engine.Batch(len(tokens))
    b.add_many(tokens, pos0, seq, logits_last=True)
    ctx.decode(b)
    return ctx.logits_ith(-1).copy()


def test_engine_checkpoint_restore_gives_bitwise_equal_logits(engine, hybrid):  # noqa: F811
    assert hybrid.is_hybrid or hybrid.is_recurrent
    rng = np.random.default_rng(0)
    n_vocab = hybrid.vocab.n_tokens
    prompt = rng.integers(100, n_vocab - 100, 48).tolist()
    other = rng.integers(100, n_vocab - 100, 20).tolist()
    pool = BufferPool(256 << 20)
    with engine.Context(hybrid, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2) as ctx:
        _decode(engine, ctx, prompt[:32], 0)
        slot = SlotCheckpoints(max_n=4, min_step=0)
        slot.add(save_checkpoint(ctx, 0, 32, pool))
        assert slot.items[0].nbytes < ctx.state_seq_size(0, 0)  # partial: the attention KV is not copied
        _decode(engine, ctx, other, 32)  # the slot moves on to another continuation
        assert needs_checkpoint(ctx, 0, 40) and not needs_checkpoint(ctx, 0, 52)
        assert not ctx.seq_rm(0, 40, -1)  # and can't be cut back
        assert keep_prefix(ctx, 0, 40, slot) == 32  # the checkpoint at 32 serves a prefix of 40
        assert ctx.seq_pos_max(0) == 31
        got = _decode(engine, ctx, prompt[32:], 32)
    with engine.Context(hybrid, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2) as fresh:
        _decode(engine, fresh, prompt[:32], 0)
        want = _decode(engine, fresh, prompt[32:], 32)
    assert np.array_equal(got, want)
    slot.clear()


def test_flag_matches_the_engine():
    import app.engine

    assert STATE_SEQ_FLAGS_PARTIAL_ONLY == app.engine.STATE_SEQ_FLAGS_PARTIAL_ONLY
