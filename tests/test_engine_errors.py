"""Bad input to the engine raises clear Python exceptions and the process survives; load/free does not leak."""

from __future__ import annotations

import gc

import numpy as np
import psutil
import pytest

try:
    from test_engine_support import engine, make_ctx, model, model_dir, tiny_path  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.test_engine_support import engine, make_ctx, model, model_dir, tiny_path  # noqa: F401


def _still_works(engine, path) -> None:
    """The process survived: a model loads and decodes normally."""
    with engine.Model(path) as m, make_ctx(engine, m) as ctx:
        b = engine.Batch(8)
        b.add_many(m.vocab.tokenize("ok"), 0, 0)
        ctx.decode(b)
        assert np.isfinite(ctx.logits_ith(-1)).all()


def test_missing_file(engine, tmp_path, tiny_path):
    with pytest.raises(engine.ModelLoadError, match="model file not found: .*nope.gguf"):
        engine.Model(tmp_path / "nope.gguf")
    with pytest.raises(engine.ModelLoadError, match="not a regular file"):
        engine.Model(tmp_path)
    _still_works(engine, tiny_path)


def test_not_a_gguf_file(engine, tmp_path, tiny_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is a text file, not a model\n")
    with pytest.raises(engine.ModelLoadError, match="not a GGUF file.*b'this'"):
        engine.Model(p)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(engine.ModelLoadError, match="not a GGUF file"):
        engine.Model(empty)
    _still_works(engine, tiny_path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 64])
def test_truncated_gguf(engine, tmp_path, tiny_path, keep):
    data = tiny_path.read_bytes()
    n = int(len(data) * keep) if keep < 1 else keep
    p = tmp_path / "truncated.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(engine.ModelLoadError) as ei:
        engine.Model(p)
    msg = str(ei.value)
    assert str(p) in msg and "failed to load model" in msg
    assert any(w in msg for w in ("bounds", "corrupt", "incomplete", "failed to read", "gguf")), msg
    _still_works(engine, tiny_path)


def test_unknown_architecture(engine, tmp_path, tiny_path):
    import gguf

    p = tmp_path / "nosucharch.gguf"
    w = gguf.GGUFWriter(str(p), "nosucharch")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(engine.ModelLoadError, match="unknown model architecture: 'nosucharch'"):
        engine.Model(p)
    _still_works(engine, tiny_path)


def test_impossible_context_size(engine, model, tiny_path):
    with pytest.raises(engine.ContextError, match="n_ctx=4000000000.*not enough memory"):
        engine.Context(model, n_ctx=4_000_000_000, n_threads=1)
    with pytest.raises(engine.ContextError, match="out of range"):
        engine.Context(model, n_ctx=2 ** 32)
    with pytest.raises(engine.ContextError, match="n_seq_max=100000 exceeds"):
        engine.Context(model, n_seq_max=100_000)
    with pytest.raises(ValueError, match="flash_attn"):
        engine.Context(model, flash_attn="sometimes")
    with pytest.raises(ValueError, match="unknown ggml type"):
        engine.Context(model, type_k="q9_9")
    _still_works(engine, tiny_path)


def test_vocab_only_model(engine, tiny_path):
    with engine.Model(tiny_path, vocab_only=True) as m:
        assert m.vocab.tokenize("hi", add_special=False)
        with pytest.raises(engine.ContextError, match="vocab_only"):
            engine.Context(m)


def test_progress_callback_abort_and_exception(engine, tiny_path):
    seen = []
    with engine.Model(tiny_path, progress=lambda f: seen.append(f)):
        pass
    assert seen and seen[-1] == pytest.approx(1.0)
    with pytest.raises(engine.ModelLoadError, match="aborted by the progress callback"):
        engine.Model(tiny_path, progress=lambda f: False)

    def boom(_):
        raise KeyError("stop")

    with pytest.raises(engine.ModelLoadError, match="KeyError") as ei:
        engine.Model(tiny_path, progress=boom)
    assert isinstance(ei.value.__cause__, KeyError)


def test_bad_model_options(engine, tiny_path):
    with pytest.raises(ValueError, match="split_mode"):
        engine.Model(tiny_path, split_mode="diagonal")
    with pytest.raises(engine.EngineError, match="unknown buffer type 'NOPE'.*CPU"):
        engine.Model(tiny_path, tensor_buft_overrides=[("ffn_.*", "NOPE")])
    with pytest.raises(engine.EngineError, match="unknown device"):
        engine.Model(tiny_path, devices=["GPU42"])
    with engine.Model(tiny_path, tensor_buft_overrides=[(r"blk\..*\.ffn_.*", "CPU")], devices=["CPU"],
                      tensor_split=[1.0], use_mmap=False) as m:
        assert m.n_layer > 0


def test_load_free_20_times_keeps_rss_flat(engine, tiny_path):
    proc = psutil.Process()

    def cycle():
        with engine.Model(tiny_path) as m, make_ctx(engine, m) as ctx:
            b = engine.Batch(8)
            b.add_many(m.vocab.tokenize("leak check"), 0, 0)
            ctx.decode(b)

    for _ in range(3):  # warm-up: allocator pools, lazily created backend state
        cycle()
    gc.collect()
    start = proc.memory_info().rss
    for _ in range(20):
        cycle()
    gc.collect()
    end = proc.memory_info().rss
    assert end <= start * 1.05, f"RSS grew from {start >> 20} MiB to {end >> 20} MiB over 20 load/free cycles"
