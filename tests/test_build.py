"""build.py without compiling: the cache key rule, patch and download checks, export trimming, set-up argv.

One test runs the real `build.py engine` against an installed app/_lib and checks that it is a fast no-op.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_PY = REPO_ROOT / "build.py"


def _load_build_module():
    spec = importlib.util.spec_from_file_location("rigserve_build", BUILD_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


build = _load_build_module()

PATCH_GOOD = """\
--- a/hello.txt
+++ b/hello.txt
@@ -1,2 +1,2 @@
-hello
+hi
 world
"""
PATCH_CONFLICT = """\
--- a/hello.txt
+++ b/hello.txt
@@ -1,2 +1,2 @@
-something that is not there
+bye
 world
"""


@pytest.fixture
def opts(tmp_path: Path):
    """Options over a private copy of native/ (an empty patch series), with a fixed compiler id."""
    native = tmp_path / "native"
    (native / "patches").mkdir(parents=True)
    (native / "include").mkdir()
    shutil.copy(REPO_ROOT / "native" / "upstream.toml", native / "upstream.toml")
    return build.EngineOptions(patches_dir=native / "patches", include_dir=native / "include",
                               upstream_toml=native / "upstream.toml", compiler_id="test-cc 1.0")


def test_key_is_stable(opts):
    key = build.engine_key(opts)
    assert len(key) == 64
    assert build.engine_key(dataclasses.replace(opts)) == key
    (opts.patches_dir / "README.md").write_text("not a patch\n")
    assert build.engine_key(opts) == key


def test_key_changes_with_patch_bytes_and_back(opts):
    patch = opts.patches_dir / "0001-topic.patch"
    patch.write_text(PATCH_GOOD)
    key = build.engine_key(opts)
    patch.write_text(PATCH_GOOD.replace("+hi", "+hey"))
    changed = build.engine_key(opts)
    assert changed != key
    patch.write_text(PATCH_GOOD)
    assert build.engine_key(opts) == key


def test_key_changes_when_patch_added_or_renamed(opts):
    (opts.patches_dir / "0001-topic.patch").write_text(PATCH_GOOD)
    key = build.engine_key(opts)
    (opts.patches_dir / "0002-more.patch").write_text(PATCH_GOOD)
    added = build.engine_key(opts)
    assert added != key
    (opts.patches_dir / "0002-more.patch").rename(opts.patches_dir / "0003-more.patch")
    assert build.engine_key(opts) not in (key, added)


def test_key_changes_with_our_headers(opts):
    key = build.engine_key(opts)
    (opts.include_dir / "rig.h").write_text("int rig_x(void);\n")
    assert build.engine_key(opts) != key


@pytest.mark.parametrize("change", [
    {"tools": True},
    {"backend": "cuda"},
    {"backend": "cuda", "cuda_arch": "90"},
    {"backend": "hip", "hip_arch": "gfx942"},
    {"defines": ("GGML_NATIVE=OFF",)},
    {"amx": True},
    {"compiler_id": "test-cc 2.0"},
])
def test_key_changes_with_options(opts, change):
    if change.get("amx") and not build._no_amx_flags():
        pytest.skip("AMX flags only apply to x86 compilers that know AMX")
    assert build.engine_key(dataclasses.replace(opts, **change)) != build.engine_key(opts)


def test_cuda_arch_is_part_of_the_key(opts):
    cuda = dataclasses.replace(opts, backend="cuda")
    assert build.engine_key(dataclasses.replace(cuda, cuda_arch="89")) != \
        build.engine_key(dataclasses.replace(cuda, cuda_arch="90"))


def test_tools_build_satisfies_a_request_without_tools(opts):
    with_tools = build.engine_key(opts.with_tools())
    assert with_tools in build.acceptable_keys(opts)
    assert build.acceptable_keys(opts.with_tools()) == [with_tools]
    info = {"layout": build.LAYOUT_VERSION, "cache_key": with_tools, "tools": list(build.TOOLS),
            "source_id": build.source_id(opts)}
    assert build.installed_satisfies(info, opts)
    plain = dict(info, cache_key=build.engine_key(opts), tools=[])
    assert not build.installed_satisfies(plain, opts.with_tools())
    assert not build.installed_satisfies(plain, opts.with_tools(), any_backend=True)
    assert build.installed_satisfies(dict(info, cache_key="cuda-build"), opts.with_tools(), any_backend=True)


def test_print_key_matches_engine_key():
    res = subprocess.run([sys.executable, str(BUILD_PY), "engine", "--print-key"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == build.engine_key(build.EngineOptions())


def test_toml_fallback_parser_agrees_with_tomllib():
    tomllib = pytest.importorskip("tomllib")
    text = (REPO_ROOT / "native" / "upstream.toml").read_text()
    assert build._parse_simple_toml(text) == tomllib.loads(text)


def test_sha256_mismatch_is_refused(tmp_path: Path):
    fake = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    fake.write_bytes(b"not the pinned sdist")
    expected = build.read_upstream()["source"]["sha256"]
    with pytest.raises(build.BuildError) as info:
        build.verify_sha256(fake, expected)
    message = str(info.value)
    assert info.value.stage == "download"
    assert "sha256 mismatch" in message and expected in message and build.sha256_file(fake) in message


def _add(tf: tarfile.TarFile, name: str, data: bytes = b"x") -> None:
    member = tarfile.TarInfo(name)
    member.size = len(data)
    tf.addfile(member, io.BytesIO(data))


def test_extract_takes_only_the_subfolder(tmp_path: Path):
    tarball = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(tarball, "w:gz") as tf:
        _add(tf, "pkg-1.0/setup.py")
        _add(tf, "pkg-1.0/vendor/llama.cpp/CMakeLists.txt", b"project(x)\n")
        _add(tf, "pkg-1.0/vendor/llama.cpp/.git", b"gitdir: ../../.git/modules/vendor/llama.cpp\n")
        _add(tf, "pkg-1.0/vendor/llama.cpp/src/llama.cpp")
        _add(tf, "pkg-1.0/vendor/llama.cpp/../../escape.txt")
        _add(tf, "pkg-1.0/vendor/other/file")
    dest = tmp_path / "tree"
    assert build.extract_subfolder(tarball, "vendor/llama.cpp", dest) == 2
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert files == ["CMakeLists.txt", "src/llama.cpp"]
    assert not (tmp_path / "escape.txt").exists()
    with pytest.raises(build.BuildError, match="not found"):
        build.extract_subfolder(tarball, "vendor/missing", tmp_path / "tree2")


def _tools():
    return [t for t in ("git", "patch") if shutil.which(t)]


@pytest.mark.parametrize("tool", _tools())
def test_patch_conflict_names_the_patch(tmp_path: Path, tool: str):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "hello.txt").write_text("hello\nworld\n")
    good, bad = tmp_path / "0001-good.patch", tmp_path / "0002-bad.patch"
    good.write_text(PATCH_GOOD)
    bad.write_text(PATCH_CONFLICT)
    with pytest.raises(build.BuildError) as info:
        build.apply_patches(tree, [good, bad], tmp_path / "patch.log", tool=tool)
    assert info.value.stage == "patch"
    assert "0002-bad.patch" in str(info.value) and "0001-good" not in str(info.value)
    assert info.value.log == tmp_path / "patch.log"
    assert (tree / "hello.txt").read_text() == "hi\nworld\n"  # the good one applied, the bad one left nothing


@pytest.mark.skipif(not shutil.which("git"), reason="git not installed")
def test_git_apply_inside_another_repository(tmp_path: Path):
    """A cache dir inside a git work tree (e.g. RIGSERVE_CACHE_DIR=./.cache) must still patch the tree."""
    outer = tmp_path / "outer"
    outer.mkdir()
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    tree = outer / "cache" / "src" / "abc"
    tree.mkdir(parents=True)
    (tree / "hello.txt").write_text("hello\nworld\n")
    patch = tmp_path / "0001-good.patch"
    patch.write_text(PATCH_GOOD)
    build.apply_patches(tree, [patch], tmp_path / "patch.log", tool="git")
    assert (tree / "hello.txt").read_text() == "hi\nworld\n"


@pytest.mark.parametrize("rel, action", [
    ("src/llama.cpp", "keep"),
    ("include/llama.h", "keep"),
    ("docs/build.md", "drop"),
    ("tests/test-backend-ops.cpp", "drop"),
    ("models/ggml-vocab-llama-bpe.gguf", "gzip"),
    ("models/ggml-vocab-llama-bpe.gguf.inp", "drop"),
    ("models/templates/x.jinja", "drop"),
    ("ggml/src/ggml-cuda/ggml-cuda.cu", "keep"),
    ("ggml/src/ggml-cpu/ggml-cpu.c", "keep"),
    ("ggml/src/ggml-vulkan/ggml-vulkan.cpp", "drop"),
    ("ggml/src/ggml.c", "keep"),
    ("tools/ui/CMakeLists.txt", "keep"),
    ("tools/ui/src/app.ts", "drop"),
    ("tools/server/server.cpp", "keep"),
    ("tools/server/tests/unit/test_basic.py", "drop"),
    ("scripts/ui-assets.cmake", "keep"),
    ("scripts/sync-ggml.sh", "drop"),
    ("convert_hf_to_gguf.py", "drop"),
    ("_build/cpu-1234/CMakeCache.txt", "drop"),
    (".git", "drop"),
])
def test_export_trim_rules(rel: str, action: str):
    assert build.export_action(rel) == action


def test_serve_argv_defaults_and_overrides(tmp_path: Path):
    py = Path("/venv/bin/python")
    argv = build.serve_argv(py, ["-m", "model.gguf", "-c", "4096"], tmp_path)
    assert argv == [str(py), "-m", "app", "serve", "--host", "127.0.0.1", "--port", "8080",
                    "-m", "model.gguf", "-c", "4096"]
    argv = build.serve_argv(py, ["--model=m.gguf", "--port=9000", "--host", "0.0.0.0"], tmp_path)
    assert argv == [str(py), "-m", "app", "serve", "--model=m.gguf", "--port=9000", "--host", "0.0.0.0"]


def test_installed_build_info(lib_dir: Path):
    info = json.loads((lib_dir / "build-info.json").read_text())
    for field in ("upstream", "sdist", "patch_series_sha256", "backend", "cmake_flags", "cache_key",
                  "built_at", "tools"):
        assert field in info, field
    assert (lib_dir / "libllama.so").exists() and (lib_dir / "include" / "llama.h").is_file()
    assert any((lib_dir / "vocab").glob("ggml-vocab-*.gguf"))
    for tool in info["tools"]:
        assert (lib_dir / "bin" / tool).is_file()


def test_second_engine_command_is_a_fast_noop(lib_dir: Path):
    check = subprocess.run([sys.executable, str(BUILD_PY), "engine", "--check"],
                           capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        pytest.skip("app/_lib was built from other patches or options: run `python3 build.py engine`")
    before = (lib_dir / "build-info.json").stat().st_mtime_ns
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(BUILD_PY), "engine"], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    assert "up to date" in res.stdout
    assert "configure" not in res.stdout and "compile" not in res.stdout
    assert elapsed < 10, f"no-op took {elapsed:.1f}s"
    assert (lib_dir / "build-info.json").stat().st_mtime_ns == before


def test_exported_tree_keeps_its_source_id_until_edited(opts, tmp_path: Path):
    tree = tmp_path / "export"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "llama.cpp").write_text("int x;\n")
    (tree / build.SOURCE_MANIFEST).write_text(json.dumps(
        {"source_id": build.pristine_source_id(opts), "tree_digest": build.tree_digest(tree)}))
    exported = dataclasses.replace(opts, source=tree)
    build._exported_source_id.cache_clear()
    assert build.engine_key(exported) == build.engine_key(opts)
    (tree / build.BUILD_SUBDIR / "cpu").mkdir(parents=True)  # a build dir inside the tree does not count
    (tree / build.BUILD_SUBDIR / "cpu" / "CMakeCache.txt").write_text("x\n")
    build._exported_source_id.cache_clear()
    assert build.engine_key(exported) == build.engine_key(opts)
    (tree / "src" / "llama.cpp").write_text("int y;\n")
    build._exported_source_id.cache_clear()
    assert build.source_id(exported).startswith("modified-")
    assert build.engine_key(exported) != build.engine_key(opts)
