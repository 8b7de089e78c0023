"""Loader for the native engine: the cffi cdef plus libllama opened in ABI mode.

This is the only module that creates the `cffi.FFI` object. Nothing is loaded at import time: the first
call to `load()` (made by backend_init() or by the first Model/Vocab/Sampler) reads the cdef text and
dlopens the library, so `import app.engine` works on a machine where the engine is not built yet and a
missing symbol only fails when that function is used (cffi resolves ABI-mode symbols lazily).

Where the library comes from, in order:
1. the directory given to `set_library_dir(path)` (config, tests, a developer's build tree);
2. `app/_lib/`, where `python3 build.py engine` installs it.
The cdef is `<cdef argument>` if given, else `<lib dir>/cdef.h`, else `app/_lib/cdef.h`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

from .errors import EngineError

APP_LIB_DIR = Path(__file__).resolve().parent.parent / "_lib"

if sys.platform == "darwin":
    _LIB_NAMES = ("libllama.dylib",)
    _DEP_NAMES = ("libggml-base.dylib", "libggml-cpu.dylib", "libggml.dylib")
elif sys.platform == "win32":
    _LIB_NAMES = ("llama.dll",)
    _DEP_NAMES = ("ggml-base.dll", "ggml-cpu.dll", "ggml.dll")
else:
    _LIB_NAMES = ("libllama.so",)
    _DEP_NAMES = ("libggml-base.so", "libggml-cpu.so", "libggml.so")


class _Native:
    """Process-wide state of the loaded engine (one libllama per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lib_dir_override: Path | None = None
        self.cdef_override: Path | None = None
        self.ffi = None
        self.lib = None
        self.lib_dir: Path | None = None
        self.keep: list = []  # ctypes handles of preloaded deps: closing them would unload the library


_native = _Native()


def set_library_dir(path: str | os.PathLike, cdef: str | os.PathLike | None = None) -> None:
    """Use the engine libraries in `path` (and optionally the cdef file `cdef`) instead of app/_lib.

    Must be called before the engine is first used; calling it again with the same directory is a
    no-op, with another directory after loading raises EngineError (a process holds one libllama).
    """
    p = Path(path).resolve()
    c = Path(cdef).resolve() if cdef is not None else None
    with _native.lock:
        if _native.lib is not None:
            if _native.lib_dir == p:
                return
            raise EngineError(f"engine already loaded from {_native.lib_dir}; cannot switch to {p}")
        _native.lib_dir_override = p
        _native.cdef_override = c


def _find_library() -> tuple[Path, Path]:
    """Return (library file, cdef file) or raise EngineError saying how to build the engine."""
    dirs = [_native.lib_dir_override] if _native.lib_dir_override else [APP_LIB_DIR]
    for d in dirs:
        for name in _LIB_NAMES:
            lib = d / name
            if lib.is_file():
                for cdef in (_native.cdef_override, d / "cdef.h", APP_LIB_DIR / "cdef.h"):
                    if cdef is not None and cdef.is_file():
                        return lib, cdef
                raise EngineError(f"found {lib} but no cdef.h next to it or in {APP_LIB_DIR}; "
                                  "run `python3 build.py engine` (it generates cdef.h)")
    raise EngineError(f"engine library {_LIB_NAMES[0]} not found in {', '.join(map(str, dirs))}; "
                      "build it with `python3 build.py engine`")


def _preload_deps(lib_dir: Path) -> None:
    """Load ggml's libraries with RTLD_GLOBAL before libllama.

    Why: libllama finds them through its RPATH, but a copied tree may have lost it; and ggml backends that
    are loaded later by dlopen (GGML_BACKEND_DL builds) resolve ggml-base symbols from the global scope.
    Failures are ignored here: the libllama dlopen right after reports the real problem.
    """
    mode = getattr(os, "RTLD_GLOBAL", 0) | getattr(os, "RTLD_NOW", 0)
    # The C++ runtime goes first: Python itself doesn't link it, and nvcc-built libggml-cuda exports weak
    # copies of some libstdc++ template instances; if those enter the global scope first, libllama's iostream
    # calls bind to them and crash (seen on the H200 box inside llama_model_load's print_info).
    try:
        _native.keep.append(ctypes.CDLL("libstdc++.so.6", mode=mode))
    except OSError:
        pass
    for name in _DEP_NAMES:
        dep = lib_dir / name
        if dep.is_file():
            try:
                _native.keep.append(ctypes.CDLL(str(dep), mode=mode))
            except OSError:
                pass


def load():
    """Load the cdef and libllama once; return (ffi, lib). Thread-safe and idempotent."""
    if _native.lib is not None:
        return _native.ffi, _native.lib
    with _native.lock:
        if _native.lib is not None:
            return _native.ffi, _native.lib
        import cffi  # imported here so `import app.engine` stays cheap

        lib_path, cdef_path = _find_library()
        ffi = cffi.FFI()
        try:
            ffi.cdef(cdef_path.read_text())
        except Exception as exc:  # cffi has several parse error types
            raise EngineError(f"cannot parse {cdef_path}: {exc}; regenerate it with `python3 build.py engine`") from exc
        _preload_deps(lib_path.parent)
        try:
            lib = ffi.dlopen(str(lib_path), ffi.RTLD_NOW | ffi.RTLD_GLOBAL)
        except OSError as exc:
            raise EngineError(f"cannot load {lib_path}: {exc}") from exc
        _native.ffi, _native.lib, _native.lib_dir = ffi, lib, lib_path.parent
        return ffi, lib


def library_dir() -> Path:
    """Directory the engine was (or will be) loaded from."""
    if _native.lib_dir is not None:
        return _native.lib_dir
    return _native.lib_dir_override or APP_LIB_DIR


def has(name: str) -> bool:
    """True if the cdef declares `name` and the loaded library exports it (optional upstream features)."""
    _, lib = load()
    try:
        getattr(lib, name)
    except (AttributeError, NotImplementedError):
        return False
    return True
