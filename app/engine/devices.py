"""Backend devices as the engine sees them (ggml backend registry), and name -> handle lookups.

`list_devices()` reports what ggml enumerated after backend_init(): the engine's device order, which
`app/devices/` maps onto NVML/amdsmi devices through `device_id` (the PCI bus id, when the backend knows
it). The lookup helpers turn the names users write (`CUDA0`, `CPU`, `CUDA_Host`) into the handles that
llama_model_params wants for `devices` and `tensor_buft_overrides`.

Thread contract: read-only queries, safe from any thread after backend_init(); memory figures are a
snapshot taken by the backend at call time.
"""

from __future__ import annotations

from . import _ffi
from .errors import EngineError

# enum ggml_backend_dev_type, in header order
_DEV_TYPES = ("cpu", "gpu", "igpu", "accel", "meta")


def _str(ffi, p) -> str | None:
    return None if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace")


def _iter_devices():
    ffi, lib = _ffi.load()
    for i in range(lib.ggml_backend_dev_count()):
        yield lib.ggml_backend_dev_get(i)


def list_devices() -> list[dict]:
    """All backend devices: name, description, type ("cpu"|"gpu"|"igpu"|"accel"|"meta"), memory_free,
    memory_total (bytes) and device_id (PCI bus id or None)."""
    from .model import backend_init

    backend_init()
    ffi, lib = _ffi.load()
    out = []
    for dev in _iter_devices():
        props = ffi.new("struct ggml_backend_dev_props *")
        lib.ggml_backend_dev_get_props(dev, props)
        t = int(props.type)
        out.append({
            "name": _str(ffi, props.name),
            "description": _str(ffi, props.description),
            "type": _DEV_TYPES[t] if 0 <= t < len(_DEV_TYPES) else str(t),
            "memory_free": int(props.memory_free),
            "memory_total": int(props.memory_total),
            "device_id": _str(ffi, props.device_id),
        })
    return out


def device_by_name(name: str):
    """The ggml_backend_dev_t called `name` (case-insensitive), or EngineError listing the known ones."""
    ffi, lib = _ffi.load()
    names = []
    for dev in _iter_devices():
        dev_name = _str(ffi, lib.ggml_backend_dev_name(dev)) or ""
        if dev_name.lower() == name.lower():
            return dev
        names.append(dev_name)
    raise EngineError(f"unknown device {name!r}; available: {', '.join(names) or 'none'}")


def buffer_type_by_name(name: str):
    """The ggml_backend_buffer_type_t called `name`: a device's buffer type ("CPU", "CUDA0") or its host
    buffer type ("CUDA_Host"); a device name is accepted for its main buffer type."""
    ffi, lib = _ffi.load()
    known = []
    for dev in _iter_devices():
        dev_name = _str(ffi, lib.ggml_backend_dev_name(dev)) or ""
        candidates = [lib.ggml_backend_dev_buffer_type(dev), lib.ggml_backend_dev_host_buffer_type(dev)]
        for buft in candidates:
            if buft == ffi.NULL:
                continue
            buft_name = _str(ffi, lib.ggml_backend_buft_name(buft)) or ""
            if buft_name.lower() == name.lower():
                return buft
            known.append(buft_name)
        if dev_name.lower() == name.lower() and candidates[0] != ffi.NULL:
            return candidates[0]
    raise EngineError(f"unknown buffer type {name!r}; available: {', '.join(dict.fromkeys(known)) or 'none'}")
