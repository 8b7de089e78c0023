"""Shared fixtures and helpers of the engine tests (tests/test_engine*.py); holds no tests itself.

The engine is the one `python3 build.py engine` installed in app/_lib (conftest's `lib_dir` fixture skips
the tests, naming that command, until it exists). Models are tiny synthetic GGUFs from app.models.synth
(f16 weights, so the CPU repack paths are not involved).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# One thread: CI boxes are small and shared, and ggml's spinning workers slow down badly when oversubscribed.
N_THREADS = 1


def header_dir(lib_dir: Path) -> Path | None:
    """The installed engine headers (llama.h, ggml*.h, gguf.h), or None."""
    inc = lib_dir / "include"
    return inc if (inc / "llama.h").is_file() else None


def gen_cdef_module():
    sys.path.insert(0, str(REPO_ROOT / "native"))
    try:
        import gen_cdef
    finally:
        sys.path.pop(0)
    return gen_cdef


@pytest.fixture(scope="session")
def engine(lib_dir):
    """The app.engine package with its library loaded and backend_init() done."""
    import app.engine as E

    E.backend_init()
    return E


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-models")


def _synth():
    try:
        from app.models import synth
    except ImportError as e:
        pytest.skip(f"app.models.synth is not importable: {e}")
    return synth


@pytest.fixture(scope="session")
def tiny_path(model_dir) -> Path:
    """A tiny random llama, f16 weights, with the 32k SPM vocabulary (it loads in ~50 ms, where a 128k BPE
    vocabulary takes a second; byte-fallback tokens still split multi-byte characters)."""
    try:
        return _synth().tiny_model(model_dir, arch="llama", qtype="f16", vocab="llama-spm")
    except FileNotFoundError as e:  # no vocab files yet
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def bpe_vocab_path() -> Path:
    """The llama-bpe vocabulary GGUF (byte-level BPE, as Llama 3 / Qwen use), for vocab_only loads."""
    try:
        return _synth().vocab_path("llama-bpe")
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def model(engine, tiny_path):
    m = engine.Model(tiny_path)
    yield m
    m.close()


def make_ctx(engine, model, **kw):
    params = dict(n_ctx=512, n_batch=128, n_ubatch=128, n_threads=N_THREADS)
    params.update(kw)
    return engine.Context(model, **params)


def greedy_run(engine, ctx, prompt: list[int], n: int, seq: int = 0) -> tuple[list[int], list]:
    """Decode `prompt` on `seq` then `n` greedy tokens; return (tokens, copies of each step's logits)."""
    batch = engine.Batch(max(len(prompt), 1))
    batch.add_many(prompt, 0, seq)
    ctx.decode(batch)
    toks, logits = [], []
    pos = len(prompt)
    for _ in range(n):
        row = ctx.logits_ith(-1)
        logits.append(row.copy())
        tok = int(row.argmax())
        toks.append(tok)
        batch.clear()
        batch.add(tok, pos, seq, True)
        ctx.decode(batch)
        pos += 1
    return toks, logits
