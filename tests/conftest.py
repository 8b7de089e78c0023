"""Fixtures the whole suite shares: where the built engine and upstream tools are, the default model, a cache.

Each fixture skips (with the command that fixes it) when what it points at has not been built yet, so a
partial checkout still runs the tests that can run. Append new shared fixtures here; keep them small.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
LIB_DIR = REPO_ROOT / "app" / "_lib"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def lib_dir() -> Path:
    """app/_lib, where `python3 build.py engine` installs libllama, headers, tools and vocab files."""
    if not (LIB_DIR / "build-info.json").is_file():
        pytest.skip("app/_lib is not built: run `python3 build.py engine`")
    return LIB_DIR


@pytest.fixture(scope="session")
def upstream_bin(lib_dir: Path) -> Callable[[str], Path]:
    """upstream_bin("llama-server") -> app/_lib/bin/llama-server; skips when that tool was not built."""

    def find(name: str) -> Path:
        path = lib_dir / "bin" / name
        if not path.is_file():
            pytest.skip(f"{name} is not built: run `python3 build.py engine --with-upstream-tools`")
        return path

    return find


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The verified gemma-3-270m Q4_K_M GGUF (assembled on first use). Skips only when app.models.default
    is not importable; a damaged or missing model package is an error (`build.py test` installs it)."""
    try:
        from app.models.default import default_model_path as locate
    except ImportError as e:
        pytest.skip(f"app.models.default is not importable: {e}")
    return locate()


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty rigserve cache dir, also exported as RIGSERVE_CACHE_DIR for subprocesses of the test."""
    cache = tmp_path / "rigserve-cache"
    cache.mkdir()
    monkeypatch.setenv("RIGSERVE_CACHE_DIR", str(cache))
    return cache
