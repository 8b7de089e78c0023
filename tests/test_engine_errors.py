"""Bad input to the engine raises clear Python exceptions and the process survives; load/free does not leak."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
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
    # the attention scores of a 1M-token ubatch over a 1M-token cache need terabytes: fails fast. (A huge
    # n_ctx alone also fails, but only after upstream spent tens of seconds initialising cache metadata.)
    huge = 2 ** 20
    with pytest.raises(engine.ContextError, match=f"n_ctx={huge}.*not enough memory"):
        engine.Context(model, n_ctx=huge, n_batch=huge, n_ubatch=huge, flash_attn="off", n_threads=1)
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


# Run in a fresh interpreter: in the pytest process other tests' heap churn moves RSS by a few MiB, which
# is the size of the effect we look for. RSS is read after malloc_trim: we look for leaks, not for memory
# malloc keeps cached (glibc arenas).
_RSS_SCRIPT = """
import ctypes, gc, sys, psutil
import app.engine as E
lib_dir, cdef, path = sys.argv[1:4]
E.set_library_dir(lib_dir, cdef=cdef or None)
E.backend_init()
proc = psutil.Process()

def settled():
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return proc.memory_info().rss

def cycle():
    with E.Model(path) as m, E.Context(m, n_ctx=512, n_batch=64, n_ubatch=64, n_threads=1) as ctx:
        b = E.Batch(8)
        b.add_many(m.vocab.tokenize("leak check"), 0, 0)
        ctx.decode(b)

for _ in range(3):  # warm-up: lazily created backend state, allocator pools
    cycle()
start = settled()
for _ in range(20):
    cycle()
print(start, settled())
"""


def test_load_free_20_times_keeps_rss_flat(engine, tiny_path, repo_root):
    from app.engine import _ffi

    cdef = _ffi._native.cdef_override or ""
    proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(engine.library_dir()), str(cdef), str(tiny_path)],
                          capture_output=True, text=True, cwd=repo_root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    start, end = map(int, proc.stdout.split())
    assert end <= start * 1.05, f"RSS grew from {start >> 20} MiB to {end >> 20} MiB over 20 load/free cycles"
