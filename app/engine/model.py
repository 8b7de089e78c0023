"""Model: owner of a native llama_model (weights + vocabulary + GGUF metadata), and backend_init().

Thread contract: loading releases the GIL for the whole load (other Python threads keep running; a
`progress` callback runs on the loading thread). Once loaded, a Model and its Vocab are read-only and
may be used from any thread (metadata, tokenization). close() must not race with any other use of the
model or of its contexts: call it from the thread that owns them, after the engine loop has stopped.
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path
from typing import Callable, Iterable, Sequence

from . import _ffi, log
from .devices import buffer_type_by_name, device_by_name
from .errors import EngineError, ModelLoadError

SPLIT_MODES = {"none": 0, "layer": 1, "row": 2, "tensor": 3}
LOAD_MODES = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap_mlock": 3, "direct_io": 4}

_init_lock = threading.Lock()
_initialized = False


def backend_init() -> None:
    """Initialise llama + ggml once per process: log routing, llama_backend_init, dynamic backends.

    Idempotent and thread-safe. Dynamic ggml backends (GGML_BACKEND_DL builds) are loaded from the
    directory libllama came from, not from the Python executable's directory (ggml's default).
    """
    global _initialized
    if _initialized:
        return
    with _init_lock:
        if _initialized:
            return
        ffi, lib = _ffi.load()
        log.route_llama_log()
        lib.llama_backend_init()
        if _ffi.has("ggml_backend_load_all_from_path"):
            lib.ggml_backend_load_all_from_path(str(_ffi.library_dir()).encode())
        _initialized = True


def read_c_string(ffi, fn: Callable[..., int], *args, size: int = 256) -> str | None:
    """Call an upstream `int fn(..., char * buf, size_t size)` that returns the full length (or < 0 when
    absent), growing the buffer once when the value did not fit."""
    for _ in range(2):
        buf = ffi.new("char[]", size)
        n = fn(*args, buf, size)
        if n < 0:
            return None
        if n < size:
            return ffi.string(buf, n).decode("utf-8", "replace")
        size = n + 1
    raise EngineError("string value changed size between two reads")


def _check_gguf_file(path: Path) -> None:
    """Fail early with a clear message for the common mistakes, before upstream gets the file."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a regular file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"not a GGUF file: {path} (starts with {magic!r}, expected b'GGUF')")


class _ModelParams:
    """Builds llama_model_params and keeps every C buffer it points to alive until the load returns."""

    def __init__(self, ffi, lib) -> None:
        self.ffi, self.lib = ffi, lib
        self.p = lib.llama_model_default_params()
        self.keep: list = []
        self.progress_error: BaseException | None = None
        self.progress_aborted = False

    def basic(self, n_gpu_layers: int, split_mode: str, main_gpu: int, load_mtp: bool,
              use_mmap: bool | None, vocab_only: bool, load_mode: str | None, use_extra_bufts: bool) -> None:
        if split_mode not in SPLIT_MODES:
            raise ValueError(f"split_mode must be one of {sorted(SPLIT_MODES)}, not {split_mode!r}")
        p = self.p
        p.n_gpu_layers = int(n_gpu_layers)
        p.split_mode = SPLIT_MODES[split_mode]
        p.main_gpu = int(main_gpu)
        p.vocab_only = bool(vocab_only)
        p.load_mtp = bool(load_mtp)
        p.use_extra_bufts = bool(use_extra_bufts)
        if load_mode is not None:
            if load_mode not in LOAD_MODES:
                raise ValueError(f"load_mode must be one of {sorted(LOAD_MODES)}, not {load_mode!r}")
            p.load_mode = LOAD_MODES[load_mode]
        elif use_mmap is not None:
            p.load_mode = LOAD_MODES["mmap" if use_mmap else "none"]

    def tensor_split(self, split: Sequence[float]) -> None:
        n_max = int(self.lib.llama_max_devices())
        if len(split) > n_max:
            raise ValueError(f"tensor_split has {len(split)} entries; this build supports {n_max} devices")
        arr = self.ffi.new("float[]", n_max)
        for i, v in enumerate(split):
            arr[i] = float(v)
        self.keep.append(arr)
        self.p.tensor_split = arr

    def buft_overrides(self, overrides: Sequence[tuple[str, str]]) -> None:
        n_max = int(self.lib.llama_max_tensor_buft_overrides())
        if len(overrides) > n_max:
            raise ValueError(f"{len(overrides)} tensor_buft_overrides; upstream accepts at most {n_max}")
        arr = self.ffi.new("struct llama_model_tensor_buft_override[]", len(overrides) + 1)  # NULL-terminated
        for i, (pattern, buft_name) in enumerate(overrides):
            s = self.ffi.new("char[]", pattern.encode())
            self.keep.append(s)
            arr[i].pattern = s
            arr[i].buft = buffer_type_by_name(buft_name)
        self.keep.append(arr)
        self.p.tensor_buft_overrides = arr

    def devices(self, devices: Iterable) -> None:
        handles = [device_by_name(d) if isinstance(d, str) else d for d in devices]
        arr = self.ffi.new("ggml_backend_dev_t[]", len(handles) + 1)  # NULL-terminated
        for i, h in enumerate(handles):
            arr[i] = h
        self.keep.append(arr)
        self.p.devices = arr

    def progress(self, fn: Callable[[float], bool | None]) -> None:
        ffi = self.ffi

        @ffi.callback("llama_progress_callback")
        def _cb(value, user_data):  # noqa: ARG001
            try:
                keep_going = fn(float(value))
            except BaseException as exc:  # re-raised by Model after the load returns
                self.progress_error = exc
                keep_going = False
            if keep_going is False:
                self.progress_aborted = True
                return False
            return True

        self.keep.append(_cb)
        self.p.progress_callback = _cb
        self.p.progress_callback_user_data = ffi.NULL


class Model:
    """A loaded GGUF model. Use as a context manager or call close(); see the module doc for threads.

    Raises ModelLoadError with upstream's reason when the file is missing, is not GGUF, is truncated,
    names an unknown architecture, or otherwise fails to load.

    Beyond the llama_model_params fields: `use_mmap` True/False selects load_mode "mmap"/"none" (None
    keeps upstream's "auto"); `load_mode` sets it explicitly; `use_extra_bufts=False` disables the CPU
    weight repacking buffers (AMX, interleaved), like llama-server's --no-repack.
    """

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = -1, split_mode: str = "layer",
                 main_gpu: int = 0, tensor_split: Sequence[float] | None = None,
                 tensor_buft_overrides: Sequence[tuple[str, str]] | None = None,
                 devices: Sequence | None = None, load_mtp: bool = False, use_mmap: bool | None = True,
                 vocab_only: bool = False, progress: Callable[[float], bool | None] | None = None,
                 load_mode: str | None = None, use_extra_bufts: bool = True):
        self._ptr = None
        self.path = Path(path)
        _check_gguf_file(self.path)
        backend_init()
        ffi, lib = _ffi.load()
        self._ffi, self._lib = ffi, lib
        mp = _ModelParams(ffi, lib)
        mp.basic(n_gpu_layers, split_mode, main_gpu, load_mtp, use_mmap, vocab_only, load_mode, use_extra_bufts)
        if tensor_split:
            mp.tensor_split(tensor_split)
        if tensor_buft_overrides:
            mp.buft_overrides(tensor_buft_overrides)
        if devices is not None:
            mp.devices(devices)
        if progress is not None:
            mp.progress(progress)
        mark = log.mark()
        ptr = lib.llama_model_load_from_file(os.fsencode(self.path), mp.p)  # GIL released by cffi
        if ptr == ffi.NULL:
            if mp.progress_error is not None:
                raise ModelLoadError(f"model load of {self.path} aborted: progress callback raised "
                                     f"{mp.progress_error!r}") from mp.progress_error
            if mp.progress_aborted:
                raise ModelLoadError(f"model load of {self.path} aborted by the progress callback")
            reason = log.reason_since(mark, "upstream gave no reason (see the app.engine.llama log)")
            raise ModelLoadError(f"failed to load model {self.path}: {reason}")
        self._ptr = ptr
        self._contexts: weakref.WeakSet = weakref.WeakSet()
        self._dependents: weakref.WeakSet = weakref.WeakSet()  # samplers that hold our vocab pointer
        self.vocab_only = bool(vocab_only)
        from .vocab import Vocab

        self.vocab = Vocab(self, lib.llama_model_get_vocab(ptr))

    # -- lifetime ------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def _handle(self):
        if self._ptr is None:
            raise EngineError("model is closed")
        return self._ptr

    def close(self) -> None:
        """Free the model. Contexts and grammar samplers created from it are closed first (a context
        must never outlive its model). Idempotent."""
        if self._ptr is None:
            return
        for ctx in list(self._contexts):
            ctx.close()
        for dep in list(self._dependents):
            dep.close()
        ptr, self._ptr = self._ptr, None
        self._lib.llama_model_free(ptr)

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # safety net only; close() is the contract
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.desc
        return f"<Model {self.path.name} {state}>"

    # -- metadata ------------------------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        """A scalar GGUF metadata value rendered as a string, or None (arrays are not supported)."""
        return read_c_string(self._ffi, self._lib.llama_model_meta_val_str, self._handle(), key.encode())

    def meta_dict(self) -> dict[str, str]:
        """All scalar metadata as {key: value string}."""
        h, lib, ffi = self._handle(), self._lib, self._ffi
        out = {}
        for i in range(lib.llama_model_meta_count(h)):
            k = read_c_string(ffi, lib.llama_model_meta_key_by_index, h, i)
            if k is not None:
                out[k] = read_c_string(ffi, lib.llama_model_meta_val_str_by_index, h, i, size=1024)
        return out

    def chat_template(self, name: str | None = None) -> str | None:
        """The GGUF chat template (`tokenizer.chat_template[.name]`), or None."""
        ffi = self._ffi
        p = self._lib.llama_model_chat_template(self._handle(), name.encode() if name else ffi.NULL)
        return None if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace")

    @property
    def arch(self) -> str:
        return self.meta("general.architecture") or ""

    @property
    def desc(self) -> str:
        return read_c_string(self._ffi, self._lib.llama_model_desc, self._handle()) or ""

    @property
    def size(self) -> int:
        """Total bytes of all tensors."""
        return int(self._lib.llama_model_size(self._handle()))

    @property
    def n_params(self) -> int:
        return int(self._lib.llama_model_n_params(self._handle()))

    @property
    def n_ctx_train(self) -> int:
        return int(self._lib.llama_model_n_ctx_train(self._handle()))

    @property
    def n_embd(self) -> int:
        return int(self._lib.llama_model_n_embd(self._handle()))

    @property
    def n_embd_out(self) -> int:
        """Width of output embeddings (differs from n_embd for a few architectures)."""
        if _ffi.has("llama_model_n_embd_out"):
            return int(self._lib.llama_model_n_embd_out(self._handle()))
        return self.n_embd

    @property
    def n_layer(self) -> int:
        return int(self._lib.llama_model_n_layer(self._handle()))

    @property
    def n_layer_nextn(self) -> int:
        """Number of MTP (next-n prediction) layers; 0 when the model has none."""
        if _ffi.has("llama_model_n_layer_nextn"):
            return int(self._lib.llama_model_n_layer_nextn(self._handle()))
        return 0

    @property
    def n_head(self) -> int:
        return int(self._lib.llama_model_n_head(self._handle()))

    @property
    def n_head_kv(self) -> int:
        return int(self._lib.llama_model_n_head_kv(self._handle()))

    @property
    def n_swa(self) -> int:
        return int(self._lib.llama_model_n_swa(self._handle()))

    @property
    def is_recurrent(self) -> bool:
        return bool(self._lib.llama_model_is_recurrent(self._handle()))

    @property
    def is_hybrid(self) -> bool:
        return bool(self._lib.llama_model_is_hybrid(self._handle()))

    @property
    def has_encoder(self) -> bool:
        return bool(self._lib.llama_model_has_encoder(self._handle()))

    @property
    def has_decoder(self) -> bool:
        return bool(self._lib.llama_model_has_decoder(self._handle()))
