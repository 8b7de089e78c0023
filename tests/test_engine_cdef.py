"""native/gen_cdef.py: the cdef generated from the real headers parses, carries what the binding needs, and
gives every struct exactly the layout the C compiler gives it (ABI-mode cffi trusts our declarations)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

try:
    from test_engine_support import engine, gen_cdef_module, header_dir  # noqa: F401 - fixtures
except ImportError:  # tests/ imported as a package
    from tests.test_engine_support import engine, gen_cdef_module, header_dir  # noqa: F401

cffi = pytest.importorskip("cffi")


@pytest.fixture(scope="module")
def headers(lib_dir):
    d = header_dir(lib_dir)
    if d is None:
        pytest.skip("no llama.h: run `python3 build.py engine`")
    if shutil.which("cc") is None and shutil.which("gcc") is None and shutil.which("clang") is None:
        pytest.skip("no C compiler")
    return d


@pytest.fixture(scope="module")
def cdef_text(headers, tmp_path_factory):
    out = tmp_path_factory.mktemp("cdef") / "cdef.h"
    gen_cdef_module().generate(headers, out)
    return out.read_text()


def test_cdef_parses_and_has_the_api(cdef_text):
    ffi = cffi.FFI()
    ffi.cdef(cdef_text)
    for fn in ("llama_model_load_from_file", "llama_init_from_model", "llama_decode", "llama_get_logits_ith",
               "llama_memory_seq_rm", "llama_state_seq_get_data_ext", "llama_sampler_chain_init",
               "llama_get_sampled_token_ith", "llama_set_sampler", "llama_batch_ext_init", "llama_process",
               "ggml_backend_dev_get_props", "llama_log_set", "ggml_backend_load_all_from_path"):
        assert re.search(rf"\b{fn}\s*\(", cdef_text), fn
    assert "__attribute__" not in cdef_text and "static_assert" not in cdef_text
    lib = ffi.dlopen(None)  # constants only: no symbol lookups
    assert lib.LLAMA_DEFAULT_SEED == 0xFFFFFFFF and lib.LLAMA_TOKEN_NULL == -1
    assert lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE == 2 and lib.LLAMA_SPLIT_MODE_TENSOR == 3


def test_generation_is_deterministic(headers, cdef_text, tmp_path):
    again = gen_cdef_module().generate(headers, tmp_path / "again.h").read_text()
    assert again == cdef_text


def _struct_names(ffi, cdef_text) -> list[str]:
    names = []
    for name in sorted(set(re.findall(r"\bstruct\s+(\w+)\s*\{", cdef_text))):
        try:
            ffi.sizeof(f"struct {name}")
        except (cffi.CDefError, cffi.FFIError, TypeError):
            continue  # opaque or incomplete in C too
        names.append(name)
    return names


def _c_program(ffi, names) -> str:
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "llama.h"', "int main(void) {"]
    for name in names:
        lines.append(f'printf("{name} %zu\\n", sizeof(struct {name}));')
        for field, _ in ffi.typeof(f"struct {name}").fields:
            lines.append(f'printf("{name}.{field} %zu\\n", offsetof(struct {name}, {field}));')
    lines += ["return 0;", "}"]
    return "\n".join(lines)


def test_struct_layouts_match_the_compiler(headers, cdef_text, tmp_path):
    ffi = cffi.FFI()
    ffi.cdef(cdef_text)
    names = _struct_names(ffi, cdef_text)
    for must in ("llama_model_params", "llama_context_params", "llama_batch", "llama_sampler_seq_config",
                 "llama_model_tensor_buft_override", "ggml_backend_dev_props", "llama_perf_context_data"):
        assert must in names
    src = tmp_path / "layout.c"
    src.write_text(_c_program(ffi, names))
    exe = tmp_path / "layout"
    cc = gen_cdef_module().find_compiler()
    subprocess.run([*cc, "-std=c11", "-I", str(headers), str(src), "-o", str(exe)], check=True)
    expected = dict(line.rsplit(" ", 1) for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                                    check=True).stdout.splitlines())
    mismatches = []
    for name in names:
        if int(expected[name]) != ffi.sizeof(f"struct {name}"):
            mismatches.append(f"sizeof {name}: C {expected[name]} cffi {ffi.sizeof(f'struct {name}')}")
        for field, _ in ffi.typeof(f"struct {name}").fields:
            got = ffi.offsetof(f"struct {name}", field)
            if int(expected[f"{name}.{field}"]) != got:
                mismatches.append(f"{name}.{field}: C {expected[f'{name}.{field}']} cffi {got}")
    assert not mismatches, mismatches


def test_our_own_header_is_included(headers, tmp_path):
    inc = tmp_path / "include"
    shutil.copytree(headers, inc)
    (inc / "rig.h").write_text('#pragma once\n#include "llama.h"\n#define RIG_ABI_VERSION 3\n'
                               "#ifdef __cplusplus\nextern \"C\" {\n#endif\n"
                               "LLAMA_API int32_t rig_hello(struct llama_context * ctx, const char * who);\n"
                               "static inline int rig_helper(int x) { return x + 1; }\n"
                               "#ifdef __cplusplus\n}\n#endif\n")
    text = gen_cdef_module().generate(inc, tmp_path / "cdef.h").read_text()
    assert "rig_hello" in text and "#define RIG_ABI_VERSION 3" in text
    assert "rig_helper" not in text  # inline bodies cannot be bound in ABI mode


def test_missing_symbols_fail_lazily(engine):
    from app.engine import _ffi

    assert _ffi.has("llama_decode")
    assert not _ffi.has("llama_function_that_does_not_exist")
