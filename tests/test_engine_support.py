"""Shared fixtures and helpers of the engine tests (tests/test_engine*.py); holds no tests itself.

The engine comes from app/_lib (`python3 build.py engine`). Before that exists, a developer build tree is
used when present: libraries in DEV_LIB_DIR, with a cdef generated on the fly by native/gen_cdef.py from
the pinned source headers. Otherwise every engine test is skipped with the command that fixes it.
Models are tiny synthetic GGUFs from app.models.synth (f16, so no CPU repack path is involved).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
APP_LIB = REPO_ROOT / "app" / "_lib"
DEV_LIB_DIR = Path("/tmp/eng-build/bin")
PINNED_SOURCES = sorted(Path("/tmp/dl").glob("llama_cpp_python-*/vendor/llama.cpp"))
N_THREADS = 2


def header_dir(tmp: Path) -> Path | None:
    """A flat folder with llama.h and the ggml headers: app/_lib/include or a copy of the pinned source's."""
    if (APP_LIB / "include" / "llama.h").is_file():
        return APP_LIB / "include"
    for src in PINNED_SOURCES:
        if (src / "include" / "llama.h").is_file():
            flat = tmp / "include"
            flat.mkdir(parents=True, exist_ok=True)
            for h in [src / "include" / "llama.h", *(src / "ggml" / "include").glob("*.h")]:
                (flat / h.name).write_bytes(h.read_bytes())
            return flat
    return None


def gen_cdef_module():
    sys.path.insert(0, str(REPO_ROOT / "native"))
    try:
        import gen_cdef
    finally:
        sys.path.pop(0)
    return gen_cdef


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    """The app.engine package with its library loaded and backend_init() done."""
    import app.engine as E

    if not ((APP_LIB / "libllama.so").is_file() and (APP_LIB / "cdef.h").is_file()):
        tmp = tmp_path_factory.mktemp("engine-cdef")
        headers = header_dir(tmp)
        if not (DEV_LIB_DIR / "libllama.so").is_file() or headers is None:
            pytest.skip("engine not built: run `python3 build.py engine`")
        cdef = gen_cdef_module().generate(headers, tmp / "cdef.h")
        E.set_library_dir(DEV_LIB_DIR, cdef=cdef)
    E.backend_init()
    return E


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-models")


@pytest.fixture(scope="session")
def tiny_path(model_dir) -> Path:
    """A tiny random llama (llama-bpe vocabulary, f16 weights)."""
    try:
        from app.models.synth import tiny_model
    except ImportError as e:
        pytest.skip(f"app.models.synth is not importable: {e}")
    try:
        return tiny_model(model_dir, arch="llama", qtype="f16")
    except FileNotFoundError as e:  # no vocab files yet
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
