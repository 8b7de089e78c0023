"""The engine binding: owner objects over libllama (upstream llama.cpp + our patches) through cffi.

This package is the only code that touches cffi. Importing it loads nothing; the library is opened on
first use (backend_init(), or the first Model). See docs/engine.md for the API and thread contracts:
in short, Model/Vocab are usable from any thread; a Context with its Batches and Samplers belongs to one
engine thread; long native calls release the GIL.
"""

from __future__ import annotations

from ._ffi import library_dir, set_library_dir
from .batch import Batch, BatchExt
from .context import Context
from .devices import list_devices
from .errors import ContextError, DecodeError, EngineError, GrammarError, ModelLoadError, StateError
from .log import route_llama_log
from .model import Model, backend_init
from .sampler import Sampler
from .vocab import TokenDecoder, Vocab

STATE_SEQ_FLAGS_NONE = 0
STATE_SEQ_FLAGS_PARTIAL_ONLY = 1  # only partial states (SWA KV cache, recurrent state)
STATE_SEQ_FLAGS_ON_DEVICE = 2  # keep tensor data in device buffers (fast, not host-readable)


def has_feature(name: str) -> bool:
    """True if the loaded engine exports the C function `name` (e.g. "llama_process")."""
    from . import _ffi

    return _ffi.has(name)


__all__ = [
    "Batch", "BatchExt", "Context", "ContextError", "DecodeError", "EngineError", "GrammarError", "Model",
    "ModelLoadError", "Sampler", "StateError", "TokenDecoder", "Vocab", "backend_init", "has_feature",
    "library_dir", "list_devices", "route_llama_log", "set_library_dir",
    "STATE_SEQ_FLAGS_NONE", "STATE_SEQ_FLAGS_PARTIAL_ONLY", "STATE_SEQ_FLAGS_ON_DEVICE",
]
