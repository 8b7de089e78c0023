"""Route llama.cpp / ggml logging into Python `logging` and remember recent errors for exception messages.

Upstream logs in fragments (a "loading" line followed by "." continuations, then "\\n") and from several
threads, so fragments are reassembled per thread into whole lines before they reach the logger
`app.engine.llama`. Warning and error lines are also kept in a small ring with a sequence number: a
failing native call (model load, context creation, grammar parse, decode) takes a `mark()` before the
call and, on failure, `errors_since(mark)` returns what upstream said *on this thread* during the call,
which goes into the Python exception message.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading

from . import _ffi

LOGGER_NAME = "app.engine.llama"

# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continue the previous message)
_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_CONT = 5
_RING_SIZE = 512


class _LogState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.installed = False
        self.callback = None  # the cffi callback: must stay referenced while C may call it
        self.logger = logging.getLogger(LOGGER_NAME)
        self.pending: dict[int, tuple[int, str]] = {}  # thread id -> (level, partial line)
        self.ring: collections.deque = collections.deque(maxlen=_RING_SIZE)  # (seq, tid, level, line)
        self.seq = 0


_state = _LogState()


def _emit(tid: int, level: int, line: str) -> None:
    line = line.rstrip()
    if not line:
        return
    py_level = _LEVELS.get(level, logging.INFO)
    if py_level >= logging.WARNING:
        with _state.lock:
            _state.seq += 1
            _state.ring.append((_state.seq, tid, py_level, line))
    if _state.logger.isEnabledFor(py_level):
        _state.logger.log(py_level, "%s", line)


def _on_log(level: int, text: bytes) -> None:
    """Reassemble fragments of one thread into lines and emit each complete line."""
    tid = threading.get_ident()
    chunk = text.decode("utf-8", "replace")
    prev_level, prev = _state.pending.pop(tid, (level, ""))
    if level == _CONT:
        level = prev_level
    elif prev:
        _emit(tid, prev_level, prev)  # a new message starts: the unterminated one is complete
        prev = ""
    buf = prev + chunk
    *lines, rest = buf.split("\n")
    for line in lines:
        _emit(tid, level, line)
    if rest:
        _state.pending[tid] = (level, rest)


def _make_callback(ffi):
    @ffi.callback("ggml_log_callback")
    def _cb(level, text, user_data):  # noqa: ARG001 - signature fixed by ggml
        try:
            if text != ffi.NULL:
                _on_log(int(level), ffi.string(text))
        except Exception:  # an exception must never unwind into C
            pass

    return _cb


def route_llama_log(logger: logging.Logger | None = None) -> None:
    """Send llama.cpp and ggml log output to `logger` (default: logging.getLogger("app.engine.llama")).

    Idempotent. Process-wide (upstream's logger state is global): call it from the main thread during
    start-up, not concurrently with engine calls.
    """
    if logger is not None:
        _state.logger = logger
    ffi, lib = _ffi.load()
    with _state.lock:
        if _state.installed:
            return
        _state.callback = _make_callback(ffi)
        _state.installed = True
    lib.llama_log_set(_state.callback, ffi.NULL)
    if _ffi.has("ggml_log_set"):
        lib.ggml_log_set(_state.callback, ffi.NULL)
    atexit.register(_unroute)


def _unroute() -> None:
    """At interpreter exit, give upstream its stderr logger back: C code that logs during late teardown
    must not call into a finalizing interpreter."""
    ffi, lib = _ffi.load()
    lib.llama_log_set(ffi.NULL, ffi.NULL)
    if _ffi.has("ggml_log_set"):
        lib.ggml_log_set(ffi.NULL, ffi.NULL)
    _state.installed = False


def mark() -> int:
    """A position in the error ring; pass it to errors_since() after a native call."""
    return _state.seq


def errors_since(position: int, min_level: int = logging.ERROR, limit: int = 6) -> list[str]:
    """Warning/error lines logged by the *calling thread* after `position` (the newest `limit` of them)."""
    tid = threading.get_ident()
    level, partial = _state.pending.get(tid, (0, ""))
    with _state.lock:
        lines = [ln for seq, t, lv, ln in _state.ring if seq > position and t == tid and lv >= min_level]
    if partial and _LEVELS.get(level, 0) >= min_level:
        lines.append(partial.rstrip())
    return lines[-limit:]


def reason_since(position: int, default: str) -> str:
    """One string for an exception message: upstream's error lines since `position`, else `default`."""
    lines = errors_since(position)
    if not lines:
        lines = errors_since(position, min_level=logging.WARNING)
    return "; ".join(lines) if lines else default
