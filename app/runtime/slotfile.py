"""Slot save files: one sequence's tokens and state on disk, for `POST /slots/{id}?action=save|restore`.

A file is written to a hidden temporary name in the same directory, synced, renamed over the target and the
directory synced, so a crash leaves the old file or the new one, never half of one. It carries what a restore
must check before handing anything to the engine: the model's identity (a state only fits the model and
context shape that made it), the token count, and a checksum over tokens and state. File names are plain
names inside --slot-save-path: anything that could reach outside it is refused (SlotFileError -> HTTP 400).

Format, version 1 (little-endian):
    magic      8 bytes   b"RIGSLOT\\0"
    version    u32       1
    chunk      u32       checksum chunk size (bytes of state per leaf hash)
    id_len     u32       length of the model identity
    model_id   id_len    UTF-8
    n_tokens   u64
    state_len  u64
    tokens     n_tokens * i32
    state      state_len bytes (what llama_state_seq_get_data_ext wrote)
    checksum   32 bytes  sha256 over b"rigslot1" + sha256(tokens) + sha256(state chunk 0) + ...
The checksum is a two-level sha256 so its leaves hash on several cores (hashlib drops the GIL) while the
file is written or read; one core does ~0.5 GB/s, slower than a disk.

Thread contract: functions are reentrant; they block on disk I/O (call them off the event loop).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import struct
import tempfile
import unicodedata
from pathlib import Path
from typing import Sequence

import numpy as np

MAGIC = b"RIGSLOT\0"
VERSION = 1
CHUNK = 8 << 20
_HEAD = struct.Struct("<8sIII")  # magic, version, chunk, id_len
_COUNTS = struct.Struct("<QQ")  # n_tokens, state_len
_DOMAIN = b"rigslot1"
MAX_NAME_BYTES = 255  # the usual file-name limit of Linux file systems
MAX_MODEL_ID = 4096
_FORBIDDEN = set('/\\:*?"<>|') | {"\uff0e", "\u2215", "\u2216", "\ufffd", "\ufeff"}  # and look-alikes


class SlotFileError(ValueError):
    """A bad file name or a save file that can't be restored; the message says what is wrong."""


# ---- names --------------------------------------------------------------------------------------------------

def validate_filename(name: object) -> str:
    """Return `name` if it is a plain file name safe to use inside the save directory, else raise.

    Refused: non-strings, empty, longer than 255 UTF-8 bytes, path separators (also their Unicode
    look-alikes), NUL and other control characters, '..' anywhere, a leading '.' (hidden files, and our own
    temporary files), leading/trailing spaces and trailing dots (Windows strips them), characters Windows
    forbids, lone surrogates. This is upstream's fs_validate_filename, plus the leading-dot rule.
    """
    if not isinstance(name, str):
        raise SlotFileError("filename must be a string")
    if not name:
        raise SlotFileError("filename is empty")
    try:
        n_bytes = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise SlotFileError("filename is not valid UTF-8 (lone surrogate)") from None
    if n_bytes > MAX_NAME_BYTES:
        raise SlotFileError(f"filename is too long ({n_bytes} bytes; at most {MAX_NAME_BYTES})")
    for ch in name:
        if ch in _FORBIDDEN:
            what = repr(ch) if ch.isascii() else f"U+{ord(ch):04X}"
            raise SlotFileError(f"filename may not contain {what}: plain names only, no paths")
        if unicodedata.category(ch) == "Cc":
            raise SlotFileError(f"filename may not contain control character U+{ord(ch):04X}")
    if ".." in name:
        raise SlotFileError("filename may not contain '..'")
    if name.startswith("."):
        raise SlotFileError("filename may not start with '.' (hidden and temporary files are reserved)")
    if name[0] == " " or name[-1] in " .":
        raise SlotFileError("filename may not start with a space or end with a space or '.'")
    return name


def slot_path(save_dir: str | os.PathLike, name: object) -> Path:
    """The path of save file `name` inside `save_dir`, after validate_filename."""
    base = Path(save_dir)
    path = base / validate_filename(name)
    # Belt and braces: the name rules already keep it inside; a symlinked save_dir is the admin's choice.
    if path.parent != base:
        raise SlotFileError("filename must name a file directly inside the slot save path")
    return path


def model_identity(gguf_path: str | os.PathLike, arch: str = "", extra: str = "") -> str:
    """A model identity for save files: sha256 of the GGUF's first MiB, its size, its architecture and
    `extra` (e.g. the context's n_ctx/type_k/type_v, which a state also depends on)."""
    p = Path(gguf_path)
    with open(p, "rb") as f:
        head = f.read(1 << 20)
    digest = hashlib.sha256(head).hexdigest()[:32]
    return f"gguf:{digest}:{p.stat().st_size}:{arch}" + (f":{extra}" if extra else "")


# ---- checksum ---------------------------------------------------------------------------------------------

def _leaf(mv: memoryview) -> bytes:
    return hashlib.sha256(mv).digest()


class _Checksum:
    """The two-level sha256: leaves are hashed in a thread pool as their bytes become available."""

    def __init__(self, pool: concurrent.futures.Executor) -> None:
        self._pool = pool
        self._leaves: list[concurrent.futures.Future] = []

    def add(self, mv: memoryview) -> None:
        self._leaves.append(self._pool.submit(_leaf, mv))

    def add_chunked(self, mv: memoryview, chunk: int) -> None:
        for off in range(0, len(mv), chunk):
            self.add(mv[off : off + chunk])
        if len(mv) == 0:
            self.add(mv)

    def digest(self) -> bytes:
        h = hashlib.sha256(_DOMAIN)
        for f in self._leaves:
            h.update(f.result())
        return h.digest()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 2) - 1)),
                                                 thread_name_prefix="slotfile-hash")


def _bytes_view(state) -> memoryview:
    mv = memoryview(state)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


# ---- writing ----------------------------------------------------------------------------------------------

def write_slot_file(path: str | os.PathLike, model_id: str, tokens: Sequence[int], state) -> int:
    """Write a save file atomically (temp name, fsync, rename, fsync dir); return the file's size in bytes.

    `state` is any contiguous bytes-like object (numpy uint8 array, bytearray, a pooled buffer's view); it
    is written and hashed in place, never copied.
    """
    path = Path(path)
    mid = model_id.encode("utf-8")
    if len(mid) > MAX_MODEL_ID:
        raise SlotFileError(f"model identity is too long ({len(mid)} bytes)")
    toks = np.asarray(tokens, dtype="<i4")
    smv = _bytes_view(state)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f, _executor() as ex:
            ck = _Checksum(ex)
            ck.add(memoryview(toks).cast("B"))
            ck.add_chunked(smv, CHUNK)  # hashing runs while the writes below wait on the disk
            f.write(_HEAD.pack(MAGIC, VERSION, CHUNK, len(mid)) + mid + _COUNTS.pack(len(toks), len(smv)))
            f.write(memoryview(toks).cast("B"))
            for off in range(0, len(smv), CHUNK):
                f.write(smv[off : off + CHUNK])
            f.write(ck.digest())
            f.flush()
            os.fsync(f.fileno())
            n_bytes = f.tell()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return n_bytes


def _fsync_dir(d: Path) -> None:
    # The rename is durable only once the directory entry is; not every platform can open a directory.
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- reading ----------------------------------------------------------------------------------------------

def _read_exact(f, n: int, what: str, file_size: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise SlotFileError(f"save file is truncated: {what} missing ({file_size} bytes on disk)")
    return b


def _read_header(f, path: Path, model_id: str, file_size: int) -> tuple[int, int, int]:
    magic, version, chunk, id_len = _HEAD.unpack(_read_exact(f, _HEAD.size, "header", file_size))
    if magic != MAGIC:
        raise SlotFileError(f"{path.name} is not a rigserve slot save file (bad magic)")
    if version != VERSION:
        raise SlotFileError(f"{path.name} has format version {version}; this server reads version {VERSION}")
    if id_len > MAX_MODEL_ID or chunk <= 0:
        raise SlotFileError(f"{path.name} has a corrupt header")
    saved_id = _read_exact(f, id_len, "model identity", file_size).decode("utf-8", "replace")
    if saved_id != model_id:
        raise SlotFileError(f"{path.name} was saved for another model or context ({saved_id}); "
                            f"this server runs {model_id}")
    n_tokens, state_len = _COUNTS.unpack(_read_exact(f, _COUNTS.size, "token count", file_size))
    expect = f.tell() + 4 * n_tokens + state_len + 32
    if expect != file_size:
        raise SlotFileError(f"{path.name} token count or state length does not match the file size "
                            f"(header says {n_tokens} tokens and {state_len} state bytes: {expect} bytes "
                            f"expected, {file_size} on disk)")
    return chunk, n_tokens, state_len


def read_slot_file(path: str | os.PathLike, model_id: str, *, max_tokens: int | None = None,
                   n_vocab: int | None = None, out=None) -> tuple[list[int], np.ndarray]:
    """Read and verify a save file; return (tokens, state) where state is a uint8 array of the state bytes.

    Checks, each a SlotFileError naming what did not match: magic, version, model identity, the token count
    and state length against the file size, `max_tokens` (the slot's context), token ids < `n_vocab`, and
    the checksum. `out` may be a writable uint8 buffer of at least the state's size (e.g. a pooled buffer's
    `data`) to read into; the returned state is then a view of it.
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise SlotFileError(f"no save file named {path.name}") from None
    except IsADirectoryError:
        raise SlotFileError(f"{path.name} is a directory, not a save file") from None
    with f, _executor() as ex:
        file_size = os.fstat(f.fileno()).st_size
        chunk, n_tokens, state_len = _read_header(f, path, model_id, file_size)
        if max_tokens is not None and n_tokens > max_tokens:
            raise SlotFileError(f"{path.name} holds {n_tokens} tokens; the slot's context has room for "
                                f"{max_tokens}")
        toks = np.frombuffer(_read_exact(f, 4 * n_tokens, "tokens", file_size), dtype="<i4")
        if n_vocab is not None and n_tokens and (int(toks.min()) < 0 or int(toks.max()) >= n_vocab):
            raise SlotFileError(f"{path.name} holds token ids outside this model's vocabulary")
        state = _state_buffer(out, state_len)
        ck = _Checksum(ex)
        ck.add(memoryview(toks).cast("B"))
        _read_state(f, memoryview(state), chunk, ck, file_size)
        stored = _read_exact(f, 32, "checksum", file_size)
        if ck.digest() != stored:
            raise SlotFileError(f"{path.name} is corrupt: checksum mismatch over tokens and state")
    return toks.tolist(), state


def _state_buffer(out, state_len: int) -> np.ndarray:
    if out is None:
        return np.empty(state_len, dtype=np.uint8)
    arr = np.asarray(out)
    if arr.dtype != np.uint8 or arr.ndim != 1 or arr.shape[0] < state_len:
        raise ValueError(f"out must be a 1-D uint8 buffer of at least {state_len} bytes")
    return arr[:state_len]


def _read_state(f, mv: memoryview, chunk: int, ck: _Checksum, file_size: int) -> None:
    # readinto fills the caller's buffer directly; each chunk is hashed while the next one is read.
    for off in range(0, len(mv), chunk):
        part = mv[off : off + chunk]
        got = 0
        while got < len(part):
            n = f.readinto(part[got:])
            if not n:
                raise SlotFileError(f"save file is truncated: state missing ({file_size} bytes on disk)")
            got += n
        ck.add(part)
    if len(mv) == 0:
        ck.add(mv)
