"""Slot save files: file-name rules, atomic writes, and every refusal on read (corrupt, truncated, foreign
model, wrong version, too many tokens, tokens outside the vocabulary) with a message naming the mismatch."""

from __future__ import annotations

import os

import numpy as np
import pytest

import app.runtime.slotfile as sf
from app.runtime.bufpool import BufferPool
from app.runtime.slotfile import (
    SlotFileError,
    model_identity,
    read_slot_file,
    slot_path,
    validate_filename,
    write_slot_file,
)

MODEL = "gguf:0123abcd:1234:llama"


@pytest.mark.parametrize("name", ["slot0.bin", "a", "my save 1", "naïve-日本.state", "x.y.z", "a" * 255,
                                  "name-with-dash_and_underscore"])
def test_plain_names_pass(name):
    assert validate_filename(name) == name


@pytest.mark.parametrize("name,why", [
    ("", "empty"), ("../etc/passwd", "may not contain '/'"), ("..", "'..'"), ("a..b", "'..'"),
    (".", "start with '.'"), (".hidden", "start with '.'"), ("...", "'..'"),
    ("dir/file", "'/'"), ("dir\\file", "'\\\\\\\\'"), ("/abs", "'/'"), ("nul\x00byte", "U\\+0000"),
    ("tab\tname", "U\\+0009"), ("del\x7f", "U\\+007F"), ("c1\x85", "U\\+0085"), ("a" * 256, "too long"),
    ("é" * 128, "too long"), ("trailing.", "end with"), (" lead", "start with a space"), ("trail ", "end with"),
    ("a:b", "':'"), ("a*b", "'\\*'"), ("a?b", "'\\?'"), ("a|b", "'\\|'"), ('a"b', "'\"'"), ("a<b", "'<'"),
    ("full\uff0ewidth", "U\\+FF0E"), ("div\u2215slash", "U\\+2215"), ("surr\ud800", "UTF-8"),
    ("bom\ufeff", "U\\+FEFF"), ("repl\ufffd", "U\\+FFFD"),
])
def test_bad_names_are_refused_with_a_reason(name, why):
    with pytest.raises(SlotFileError, match=why):
        validate_filename(name)


def test_non_string_name_and_slot_path(tmp_path):
    with pytest.raises(SlotFileError, match="string"):
        validate_filename(None)
    assert slot_path(tmp_path, "s1") == tmp_path / "s1"
    with pytest.raises(SlotFileError):
        slot_path(tmp_path, "../s1")


def state_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("n_tokens,n_state", [(0, 0), (1, 10), (300, 100_000), (5, 0)])
def test_round_trip(tmp_path, n_tokens, n_state):
    tokens = list(range(7, 7 + n_tokens))
    state = state_bytes(n_state)
    path = tmp_path / "s"
    n = write_slot_file(path, MODEL, tokens, state)
    assert n == path.stat().st_size
    got_tokens, got_state = read_slot_file(path, MODEL)
    assert got_tokens == tokens and np.array_equal(got_state, state)
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temporary left


def test_many_checksum_chunks_and_reading_into_a_pooled_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(sf, "CHUNK", 4096)  # written into the header: the reader follows the file
    state = state_bytes(100_003)
    path = tmp_path / "s"
    write_slot_file(path, MODEL, [1, 2, 3], bytearray(state.tobytes()))
    monkeypatch.setattr(sf, "CHUNK", 1 << 20)
    pool = BufferPool(16 << 20)
    buf = pool.acquire(len(state))
    tokens, got = read_slot_file(path, MODEL, out=buf.data)
    assert tokens == [1, 2, 3] and np.array_equal(got, state)
    assert np.shares_memory(got, buf.data)
    with pytest.raises(ValueError, match="at least"):
        read_slot_file(path, MODEL, out=np.empty(10, dtype=np.uint8))


def test_overwrite_is_atomic_and_a_failed_write_changes_nothing(tmp_path, monkeypatch):
    path = tmp_path / "s"
    write_slot_file(path, MODEL, [1], state_bytes(1000, 1))
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(sf.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_slot_file(path, MODEL, [2], state_bytes(1000, 2))
    monkeypatch.undo()
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["s"]
    write_slot_file(path, MODEL, [3], state_bytes(1000, 3))
    assert read_slot_file(path, MODEL)[0] == [3]


def saved(tmp_path, tokens=(5, 6, 7), n_state=5000):
    path = tmp_path / "s"
    write_slot_file(path, MODEL, list(tokens), state_bytes(n_state))
    return path


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_state_or_tokens_fail_the_checksum(tmp_path):
    path = saved(tmp_path)
    flip(path, path.stat().st_size - 100)  # inside the state
    with pytest.raises(SlotFileError, match="checksum"):
        read_slot_file(path, MODEL)
    path = saved(tmp_path)
    flip(path, path.stat().st_size - 32 - 5000 - 4)  # inside the tokens
    with pytest.raises(SlotFileError, match="checksum"):
        read_slot_file(path, MODEL)
    path = saved(tmp_path)
    flip(path, path.stat().st_size - 1)  # the checksum itself
    with pytest.raises(SlotFileError, match="checksum"):
        read_slot_file(path, MODEL)


@pytest.mark.parametrize("keep", [0, 5, 20, 40, 5000, -1])
def test_truncated_files_are_refused(tmp_path, keep):
    path = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(SlotFileError, match="truncated|does not match the file size|not a rigserve"):
        read_slot_file(path, MODEL)


def test_header_mismatches_name_what_differs(tmp_path):
    path = saved(tmp_path)
    with pytest.raises(SlotFileError, match="another model.*gguf:0123abcd.*this server runs gguf:other"):
        read_slot_file(path, "gguf:other")
    with pytest.raises(SlotFileError, match="has room for 2"):
        read_slot_file(path, MODEL, max_tokens=2)
    with pytest.raises(SlotFileError, match="vocabulary"):
        read_slot_file(path, MODEL, n_vocab=7)
    assert read_slot_file(path, MODEL, max_tokens=3, n_vocab=8)[0] == [5, 6, 7]
    flip(path, 0)
    with pytest.raises(SlotFileError, match="bad magic"):
        read_slot_file(path, MODEL)
    path = saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[8:12] = (2).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(SlotFileError, match="version 2"):
        read_slot_file(path, MODEL)
    # a token count that doesn't agree with the file's size
    path = saved(tmp_path)
    data = bytearray(path.read_bytes())
    off = 20 + len(MODEL)
    data[off : off + 8] = (4).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(SlotFileError, match="header says 4 tokens"):
        read_slot_file(path, MODEL)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(SlotFileError, match="no save file named nope"):
        read_slot_file(tmp_path / "nope", MODEL)
    (tmp_path / "d").mkdir()
    with pytest.raises(SlotFileError, match="directory"):
        read_slot_file(tmp_path / "d", MODEL)


def test_model_identity(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + bytes(3 << 20))
    a = model_identity(p, "llama")
    assert a.startswith("gguf:") and a.endswith(f":{3 * (1 << 20) + 4}:llama")
    assert model_identity(p, "llama", "n_ctx=4096") == a + ":n_ctx=4096"
    with open(p, "r+b") as f:
        f.seek(100)
        f.write(b"x")
    assert model_identity(p, "llama") != a
    os.truncate(p, 2 << 20)
    assert model_identity(p, "llama") != a
