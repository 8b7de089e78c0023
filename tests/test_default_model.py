"""The default model assembled from its PyPI chunk packages: verified, cached, refused when damaged."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from app.models import default
from app.models.default import (
    CHUNKS,
    EXPECTED_SHA256,
    EXPECTED_SIZE,
    MODEL_FILENAME,
    DefaultModelError,
    chunk_paths,
    default_model_path,
)


def _chunks() -> list[Path]:
    # Not a skip: `build.py test` installs the default-model extra, so its absence is a set-up error, and
    # the DefaultModelError raised here names the pip command that fixes it.
    return chunk_paths()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def assembled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _chunks()
    return default_model_path(tmp_path_factory.mktemp("models"))


def test_path_exists_and_sha256_verifies(assembled: Path) -> None:
    assert assembled.name == MODEL_FILENAME
    assert assembled.stat().st_size == EXPECTED_SIZE
    assert _sha256(assembled) == EXPECTED_SHA256
    assert assembled.read_bytes()[:4] == b"GGUF"
    # Only the model and its stamp: no temporary file left behind.
    assert sorted(p.name for p in assembled.parent.iterdir()) == [MODEL_FILENAME, MODEL_FILENAME + ".sha256"]


def test_second_call_is_instant_and_does_not_rewrite(assembled: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = assembled.stat()

    def no_assembly(*args: object, **kwargs: object) -> None:
        raise AssertionError("a verified cached model must not be reassembled")

    monkeypatch.setattr(default, "_assemble", no_assembly)
    monkeypatch.setattr(default, "_hash_file", no_assembly)
    t0 = time.perf_counter()
    again = default_model_path(assembled.parent)
    elapsed = time.perf_counter() - t0
    after = again.stat()
    assert again == assembled
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert elapsed < 0.1


def test_unstamped_right_size_file_is_hashed_once_and_stamped(assembled: Path, tmp_path: Path) -> None:
    copy = tmp_path / MODEL_FILENAME
    try:
        os.link(assembled, copy)  # same bytes without copying 250 MB, when the filesystem allows
    except OSError:
        copy.write_bytes(assembled.read_bytes())
    assert default_model_path(tmp_path) == copy
    assert (tmp_path / (MODEL_FILENAME + ".sha256")).is_file()


def test_same_size_wrong_content_in_cache_is_replaced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _chunks()
    bad = tmp_path / MODEL_FILENAME
    with bad.open("wb") as f:
        f.truncate(EXPECTED_SIZE)  # sparse zeros: right size, wrong hash, no stamp
    path = default_model_path(tmp_path)
    assert _sha256(path) == EXPECTED_SHA256


def _damaged_chunk_set(tmp_path: Path, how: str) -> list[Path]:
    """Symlinks to the real chunks, except part 2, which is a copy with one byte flipped or cut short."""
    real = _chunks()
    out = []
    for i, src in enumerate(real):
        dst = tmp_path / "chunks" / src.name
        dst.parent.mkdir(exist_ok=True)
        if i == 1:
            data = bytearray(src.read_bytes())
            if how == "flip":
                data[len(data) // 2] ^= 0xFF
            else:
                del data[-1000:]
            dst.write_bytes(bytes(data))
        else:
            dst.symlink_to(src)
        out.append(dst)
    return out


def test_corrupted_chunk_is_refused_and_nothing_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    chunks = _damaged_chunk_set(tmp_path, "flip")
    monkeypatch.setattr(default, "chunk_paths", lambda: chunks)
    cache = tmp_path / "cache"
    with pytest.raises(DefaultModelError) as err:
        default_model_path(cache)
    message = str(err.value)
    assert "sha256" in message and EXPECTED_SHA256 in message and "corrupted" in message
    assert "pip install --force-reinstall" in message and CHUNKS[0].distribution in message
    assert list(cache.iterdir()) == []  # the partial file was deleted


def test_truncated_chunk_is_refused_before_reading(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    chunks = _damaged_chunk_set(tmp_path, "truncate")
    monkeypatch.setattr(default, "chunk_paths", lambda: chunks)
    with pytest.raises(DefaultModelError, match=f"{CHUNKS[1].distribution} is damaged"):
        default_model_path(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_missing_package_is_named_with_the_pip_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = default.importlib.util.find_spec
    missing = CHUNKS[2]

    def find_spec(name: str, *args: object):
        return None if name == missing.module else real_find_spec(name, *args)

    monkeypatch.setattr(default.importlib.util, "find_spec", find_spec)
    with pytest.raises(DefaultModelError) as err:
        default_model_path(tmp_path)
    message = str(err.value)
    assert missing.distribution in message
    assert f"-m pip install {missing.distribution}==1.0.0" in message
    assert CHUNKS[0].distribution not in message.split("Install")[0]  # only the missing one is blamed


def test_default_cache_dir_is_under_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(default.Path, "home", classmethod(lambda cls: tmp_path))
    assert default.default_cache_dir() == tmp_path / ".cache" / "rigserve" / "models"


def test_command_prints_only_the_path_on_stdout(assembled: Path) -> None:
    from typer.testing import CliRunner

    from app.models.cli import model_app

    result = CliRunner().invoke(model_app, ["default", "--cache-dir", str(assembled.parent)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{assembled}\n"


def test_command_reports_missing_packages_without_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from app.models.cli import model_app

    monkeypatch.setattr(default.importlib.util, "find_spec", lambda name, *a: None)
    result = CliRunner().invoke(model_app, ["default", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "pip install" in result.stderr and "Traceback" not in result.stderr
