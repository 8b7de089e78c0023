"""The binding on other model kinds: a hybrid recurrent model (qwen35) with MTP layers, and embeddings."""

from __future__ import annotations

import numpy as np
import pytest

try:
    from test_engine_support import engine, make_ctx, model, model_dir, tiny_path  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.test_engine_support import engine, make_ctx, model, model_dir, tiny_path  # noqa: F401


@pytest.fixture(scope="module")
def hybrid(engine, model_dir):
    try:
        from app.models.synth import tiny_model

        path = tiny_model(model_dir, arch="qwen35", qtype="f16", mtp=True, vocab="llama-spm")
    except (ImportError, FileNotFoundError, ValueError, TypeError) as e:
        pytest.skip(f"cannot write a tiny qwen35 with MTP: {e}")
    m = engine.Model(path, load_mtp=True)
    yield m
    m.close()


def test_hybrid_model_facts(hybrid):
    assert hybrid.arch == "qwen35"
    assert hybrid.is_hybrid and not hybrid.is_recurrent
    assert hybrid.n_layer_nextn >= 1


def test_hybrid_state_restore_is_bitwise(engine, hybrid):
    prompt = hybrid.vocab.tokenize("Hello world and more")
    with make_ctx(engine, hybrid) as ctx:
        b = engine.Batch(16)
        b.add_many(prompt, 0, 0)
        ctx.decode(b)
        state = ctx.state_seq_get(0)
        b.clear()
        b.add(5, len(prompt), 0, True)
        ctx.decode(b)
        reference = ctx.logits_ith(0).copy()
        ctx.memory_clear()
        ctx.state_seq_set(state, 0)
        ctx.decode(b)
        assert np.array_equal(ctx.logits_ith(0), reference)


def test_hybrid_rollback_inside_the_last_batch(engine, hybrid):
    """Recurrent state cannot be cut at any position: with n_rs_seq=N, seq_rm may drop up to N trailing
    tokens of the last batch decoded for the sequence (speculative verify -> reject), nothing more."""
    prompt = hybrid.vocab.tokenize("Hello world and more")
    n = len(prompt)
    with make_ctx(engine, hybrid) as ctx:
        b = engine.Batch(16)
        b.add_many(prompt, 0, 0)
        ctx.decode(b)
        b.clear()
        assert not ctx.seq_rm(0, n - 2, -1)  # no snapshots without n_rs_seq
    with make_ctx(engine, hybrid, n_rs_seq=4) as ctx:
        b.clear()
        b.add_many(prompt, 0, 0)
        ctx.decode(b)
        b.clear()
        for k, tok in enumerate([5, 6, 7]):  # one accepted token and two drafts, verified in one batch
            b.add(tok, n + k, 0, True)
        ctx.decode(b)
        verified = ctx.logits().copy()
        assert ctx.seq_rm(0, n + 1, -1)  # reject both drafts
        assert ctx.seq_pos_max(0) == n
        b.clear()
        b.add(6, n + 1, 0, True)
        ctx.decode(b)
        # one token at a time and three in a ubatch take different recurrent kernels (~1e-4 apart); the
        # wrong state, e.g. a rollback past the last batch, is off by whole units
        assert np.abs(ctx.logits_ith(0) - verified[1]).max() < 1e-2


def test_mtp_context_pairs_with_its_target(engine, hybrid):
    main = make_ctx(engine, hybrid)
    mtp = make_ctx(engine, hybrid, ctx_type="mtp", ctx_other=main)
    assert mtp.n_ctx == main.n_ctx
    main.close()
    assert mtp.closed  # a context created with ctx_other closes before the context it points to
    with pytest.raises(ValueError, match="ctx_type"):
        make_ctx(engine, hybrid, ctx_type="eagle")


def test_embeddings_views(engine, model):
    prompt = model.vocab.tokenize("embed this text")
    with make_ctx(engine, model, embeddings=True, pooling="mean") as ctx:
        b = engine.Batch(16)
        for i, t in enumerate(prompt):
            b.add(t, i, 0, True)
        ctx.decode(b)
        pooled = ctx.embeddings_seq(0).copy()  # a view dies with its context
        assert pooled.shape == (model.n_embd_out,) and np.isfinite(pooled).all()
    with make_ctx(engine, model, embeddings=True, pooling="none") as ctx:
        ctx.decode(b)
        rows = np.stack([ctx.embeddings_ith(i).copy() for i in range(len(prompt))])
        assert rows.shape == (len(prompt), model.n_embd_out)
        assert np.allclose(rows.mean(axis=0), pooled, atol=1e-4)
        assert ctx.embeddings_seq(0) is None  # no pooling: use embeddings_ith
