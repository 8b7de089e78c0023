"""A small, fast GGUF (v3) reader and writer for the synthetic-model writer.

Why our own: the vocab GGUFs carry a few hundred thousand tokenizer strings, and gguf-py's GGUFReader takes
about ten seconds to index them. We only need to copy those key/value records verbatim into a new file and to
read a model's scalar metadata and tensor table, which a sequential walk over the header does in well under a
second. Tensor data is streamed by the caller after `write_header`.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
VERSION = 3
ALIGNMENT = 32

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_SCALAR = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q",
           F64: "d"}
_SIZE = {t: struct.calcsize("<" + c) for t, c in _SCALAR.items()}
_SMALL_ARRAY = 64  # arrays up to this many items are decoded; longer ones are summarised as ArrayInfo


@dataclass(frozen=True)
class ArrayInfo:
    """A long array we skipped over: its element type and length."""

    type: int
    n: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length
    type: int
    offset: int  # from the start of the data section


@dataclass
class Header:
    kv: dict[str, object]
    tensors: list[TensorInfo]
    data_offset: int


def _pack_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def pack_kv(key: str, value: object, vtype: int, sub_type: int | None = None) -> bytes:
    """One key/value record. `vtype` is a GGUF value type; arrays need `sub_type` (scalar or STR)."""
    out = _pack_str(key) + struct.pack("<I", vtype)
    if vtype == STR:
        return out + _pack_str(str(value))
    if vtype != ARR:
        return out + struct.pack("<" + _SCALAR[vtype], value)
    items = list(value)  # type: ignore[arg-type]
    out += struct.pack("<IQ", sub_type, len(items))
    if sub_type == STR:
        return out + b"".join(_pack_str(s) for s in items)
    return out + struct.pack("<%d%s" % (len(items), _SCALAR[sub_type]), *items)


class _Cursor:
    """Sequential reads over a bytes buffer; `skip_value` walks a value without decoding long arrays."""

    def __init__(self, buf: bytes | memoryview, pos: int = 0):
        self.buf, self.pos = buf, pos

    def take(self, fmt: str):
        vals = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return vals[0] if len(vals) == 1 else vals

    def string(self) -> str:
        n = self.take("Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> object:
        if vtype == STR:
            return self.string()
        if vtype != ARR:
            return self.take(_SCALAR[vtype])
        sub, n = self.take("IQ")
        if n > _SMALL_ARRAY:
            self._skip_array(sub, n)
            return ArrayInfo(sub, n)
        return [self.value(sub) for _ in range(n)]

    def _skip_array(self, sub: int, n: int) -> None:
        if sub == STR:
            buf, pos, unpack = self.buf, self.pos, struct.Struct("<Q").unpack_from
            for _ in range(n):
                pos += 8 + unpack(buf, pos)[0]
            self.pos = pos
        elif sub == ARR:
            for _ in range(n):
                self.value(ARR)
        else:
            self.pos += _SIZE[sub] * n


def _read_prefix(path: Path, need: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(need)


def _walk_header(path: Path, want_raw_prefix: str | None = None):
    """Yield ("kv", key, vtype, value, raw_bytes) records, then ("ti", TensorInfo), then ("end", data_offset)."""
    size = path.stat().st_size
    buf = _read_prefix(path, min(size, 64 << 20))
    if buf[:4] != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cur = _Cursor(buf, 4)
    version, n_tensors, n_kv = cur.take("IQQ")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        vtype = cur.take("I")
        value = cur.value(vtype)
        raw = bytes(buf[start:cur.pos]) if want_raw_prefix is not None and key.startswith(want_raw_prefix) else b""
        yield "kv", key, vtype, value, raw
    alignment = 32
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("I")
        ne = tuple(cur.take("Q") for _ in range(n_dims))
        ttype, offset = cur.take("IQ")
        yield "ti", TensorInfo(name, ne, ttype, offset)
    yield "end", (cur.pos + alignment - 1) // alignment * alignment


def read_header(path: str | Path) -> Header:
    """Scalar metadata, short arrays and the tensor table of a GGUF file (long arrays become ArrayInfo)."""
    kv: dict[str, object] = {}
    tensors: list[TensorInfo] = []
    data_offset = 0
    for rec in _walk_header(Path(path)):
        if rec[0] == "kv":
            kv[rec[1]] = rec[3]
        elif rec[0] == "ti":
            tensors.append(rec[1])
        else:
            data_offset = rec[1]
    align = kv.get("general.alignment", ALIGNMENT)
    data_offset = (data_offset + align - 1) // align * align  # type: ignore[operator]
    return Header(kv, tensors, data_offset)


@functools.lru_cache(maxsize=8)
def tokenizer_records(path: str) -> tuple[tuple[str, bytes], ...]:
    """The raw key/value records of every `tokenizer.*` key in a GGUF file, ready to copy into another."""
    return tuple((rec[1], rec[4]) for rec in _walk_header(Path(path), "tokenizer.") if rec[0] == "kv" and rec[4])


def vocab_size(records: tuple[tuple[str, bytes], ...]) -> int:
    for key, raw in records:
        if key == "tokenizer.ggml.tokens":
            cur = _Cursor(raw)
            cur.string()
            cur.take("I")
            return cur.take("IQ")[1]
    raise ValueError("the vocab GGUF has no tokenizer.ggml.tokens")


def write_header(f: BinaryIO, kv_records: list[bytes],
                 tensors: list[tuple[str, tuple[int, ...], int, int]]) -> list[int]:
    """Write magic, counts, the KV records and the tensor table; pad to the data section.

    `tensors` holds (name, ne, ggml type, n_bytes). Returns each tensor's absolute file offset; the caller
    writes the data there in the same order, padding each to ALIGNMENT.
    """
    out = bytearray(MAGIC + struct.pack("<IQQ", VERSION, len(tensors), len(kv_records)))
    for rec in kv_records:
        out += rec
    rel, offsets = 0, []
    for name, ne, ttype, n_bytes in tensors:
        out += _pack_str(name) + struct.pack("<I", len(ne)) + struct.pack("<%dQ" % len(ne), *ne)
        out += struct.pack("<IQ", ttype, rel)
        offsets.append(rel)
        rel += (n_bytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    out += bytes((-len(out)) % ALIGNMENT)
    f.write(out)
    return [len(out) + o for o in offsets]
