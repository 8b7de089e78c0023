"""Generate the cffi cdef for libllama from the real installed headers (standard library only).

`build.py engine` installs the engine's public headers flat into `app/_lib/include/` and then calls
`generate(include_dir, out)`, which writes `app/_lib/cdef.h`; `app/engine/_ffi.py` feeds that text to
`cffi.FFI.cdef()` and opens `libllama.so` in ABI mode.

Why generate instead of hand-writing declarations: struct layouts (llama_model_params,
llama_context_params, llama_batch, ...) change between upstream commits, and ABI-mode cffi computes field
offsets from the declarations we give it. A stale hand-written struct silently corrupts memory; a cdef
derived from the very headers the library was compiled against cannot drift.

How:
1. Preprocess `llama.h` (which pulls in ggml.h, ggml-backend.h, ggml-cpu.h, ggml-opt.h, gguf.h) plus our
   own `rig.h` when present, with the system C compiler: `cc -E -P -nostdinc` against a folder of empty
   fake standard headers (cffi already knows int32_t, size_t, bool, FILE, ...), with `__GNUC__` undefined
   so the visibility/deprecation/format attribute macros expand to nothing.
2. Scrub what pycparser cannot read: leftover `__attribute__((...))`, `__declspec(...)`, `restrict`,
   `_Noreturn`, `extern`; drop static asserts and any function *definition* (inline bodies).
3. Append integer `#define` constants (LLAMA_DEFAULT_SEED, LLAMA_TOKEN_NULL, LLAMA_STATE_SEQ_FLAGS_*,
   GGML_MAX_DIMS, ...) taken from `cc -E -dM`, since cffi understands `#define NAME <int>`.
4. If cffi is importable in the running interpreter, parse the result once so a bad cdef fails the build
   instead of the first `import app.engine`.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Headers that are entry points for the cdef; rig.h is ours and optional.
ENTRY_HEADERS = ("llama.h", "rig.h")

# Standard headers the engine headers include; they become empty files because cffi predefines the types.
FAKE_STD_HEADERS = ("stdbool.h", "stddef.h", "stdint.h", "stdio.h", "stdarg.h", "stdlib.h", "string.h",
                    "assert.h", "limits.h", "inttypes.h")

# Only constants with these prefixes are exported; compiler-internal macros are not ours to bind.
MACRO_PREFIXES = ("LLAMA_", "GGML_", "GGUF_", "RIG_")

_INT_LITERAL = re.compile(r"^\(?\s*(-?\s*(?:0[xX][0-9a-fA-F]+|\d+))[uUlL]*\s*\)?$")


def find_compiler() -> list[str]:
    """Return the argv prefix of a C preprocessor; build.py already requires a C/C++ compiler."""
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise RuntimeError("gen_cdef: no C compiler (cc, gcc or clang) found on PATH to preprocess headers")


def _preprocess(include_dir: Path, extra_flags: list[str]) -> str:
    """Run the preprocessor over a wrapper that includes the entry headers."""
    with tempfile.TemporaryDirectory(prefix="gen_cdef_") as tmp:
        tmpdir = Path(tmp)
        fake = tmpdir / "fakestd"
        fake.mkdir()
        for name in FAKE_STD_HEADERS:
            (fake / name).write_text("/* empty: cffi predefines the standard types */\n")
        wrapper = tmpdir / "wrapper.c"
        lines = [f'#include "{h}"' for h in ENTRY_HEADERS if (include_dir / h).is_file()]
        if not lines:
            raise RuntimeError(f"gen_cdef: {include_dir} has no llama.h")
        wrapper.write_text("\n".join(lines) + "\n")
        cmd = find_compiler() + [
            "-E", "-nostdinc", "-I", str(fake), "-I", str(include_dir),
            # No __GNUC__: DEPRECATED(), GGML_DEPRECATED() and GGML_ATTRIBUTE_FORMAT() expand to nothing.
            "-U__GNUC__", "-U__clang__", "-U__cplusplus",
            *extra_flags, str(wrapper),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"gen_cdef: preprocessing failed ({' '.join(cmd)}):\n{proc.stderr}")
        return proc.stdout


def _strip_balanced(text: str, keyword: str) -> str:
    """Remove every `keyword(...)` with balanced parentheses (attributes, declspecs, static asserts)."""
    out = []
    i = 0
    pattern = re.compile(r"\b" + re.escape(keyword) + r"\s*\(")
    while True:
        m = pattern.search(text, i)
        if not m:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            j += 1
        i = j


def _split_top_level(text: str) -> list[str]:
    """Split C text into top-level declarations, keeping struct/enum bodies with their declaration.

    A declaration ends at ';' outside any braces/parentheses. A '{' that directly follows a ')' at top
    level opens a function body: the whole definition is returned as one chunk ending at its '}' so the
    caller can drop it (cffi cannot bind inline functions in ABI mode anyway).
    """
    chunks, start, depth_brace, depth_paren = [], 0, 0, 0
    in_func = False
    i = 0
    while i < len(text):
        c = text[i]
        if c == "(":
            depth_paren += 1
        elif c == ")":
            depth_paren -= 1
        elif c == "{":
            if depth_brace == 0 and depth_paren == 0 and text[start:i].rstrip().endswith(")"):
                in_func = True
            depth_brace += 1
        elif c == "}":
            depth_brace -= 1
            if depth_brace == 0 and in_func:
                chunks.append(text[start:i + 1])
                start, in_func = i + 1, False
        elif c == ";" and depth_brace == 0 and depth_paren == 0:
            chunks.append(text[start:i + 1])
            start = i + 1
        i += 1
    if text[start:].strip():
        chunks.append(text[start:])
    return chunks


_C_SIZES = {
    "char": "c_char", "short": "c_short", "int": "c_int", "long": "c_long", "float": "c_float",
    "double": "c_double", "size_t": "c_size_t", "int8_t": "c_int8", "uint8_t": "c_uint8",
    "int16_t": "c_int16", "uint16_t": "c_uint16", "int32_t": "c_int32", "uint32_t": "c_uint32",
    "int64_t": "c_int64", "uint64_t": "c_uint64", "void*": "c_void_p",
}


def _fold_array_dims(text: str) -> str:
    """Fold constant array dimensions such as `[64 / sizeof(int32_t)]`, which cffi cannot evaluate.

    Sizes come from ctypes, i.e. from this platform's C ABI, the same one the library was built for.
    """
    import ctypes

    def sizeof(m: re.Match) -> str:
        name = re.sub(r"\s+", "", m.group(1))
        if name.endswith("*"):
            name = "void*"
        if name not in _C_SIZES:
            raise RuntimeError(f"gen_cdef: cannot fold sizeof({m.group(1)}) in an array dimension")
        return str(ctypes.sizeof(getattr(ctypes, _C_SIZES[name])))

    def fold(m: re.Match) -> str:
        expr = m.group(1)
        if re.fullmatch(r"\s*\d*\s*", expr):
            return m.group(0)
        expr = re.sub(r"sizeof\s*\(\s*([\w\s\*]+?)\s*\)", sizeof, expr)
        if not re.fullmatch(r"[\d\s()+\-*/%<>]+", expr):
            return m.group(0)  # leave it for cffi to judge (it may be a declared enum constant)
        return "[" + str(eval(expr.replace("/", "//"), {"__builtins__": {}})) + "]"

    return re.sub(r"\[([^\[\]]*)\]", fold, text)


def _clean(preprocessed: str) -> str:
    """Turn preprocessor output into declarations pycparser (inside cffi) accepts."""
    text = "\n".join(ln for ln in preprocessed.splitlines() if not ln.lstrip().startswith("#"))
    for kw in ("__attribute__", "__declspec", "_Static_assert", "static_assert", "__asm__", "__asm"):
        text = _strip_balanced(text, kw)
    text = re.sub(r"\b(__restrict__|__restrict|restrict|_Noreturn|__extension__|__inline__|__inline)\b",
                  "", text)
    decls, seen = [], set()
    for chunk in _split_top_level(text):
        body = chunk.strip()
        if not body or body == ";":
            continue  # what a removed static_assert(...) leaves behind
        if body.endswith("}"):
            continue  # a function definition (inline body): not bindable in ABI mode
        if re.match(r"^(static|inline)\b", body):
            continue  # static data or static inline helpers live only in the caller's translation unit
        body = re.sub(r"^extern\s+(?!\")", "", body)
        body = re.sub(r"[ \t]+", " ", body)
        body = re.sub(r"\n\s*\n+", "\n", body)
        key = " ".join(body.split())
        if key in seen:
            continue  # C11 allows repeating an identical typedef; cffi does not
        seen.add(key)
        decls.append(body)
    return _fold_array_dims("\n".join(decls) + "\n")


def _int_macros(include_dir: Path) -> dict[str, int]:
    """Integer-valued LLAMA_/GGML_/GGUF_/RIG_ macros, resolving simple aliases (A defined as B)."""
    raw: dict[str, str] = {}
    for line in _preprocess(include_dir, ["-dM"]).splitlines():
        m = re.match(r"#define\s+([A-Za-z_]\w*)\s+(.+?)\s*$", line)
        if m and m.group(1).startswith(MACRO_PREFIXES):
            raw[m.group(1)] = m.group(2)
    values: dict[str, int] = {}
    for name in sorted(raw):
        val, seen = raw[name], {name}
        while val in raw and val not in seen:  # alias chain, e.g. LLAMA_SESSION_MAGIC -> ..._GGSN
            seen.add(val)
            val = raw[val]
        m = _INT_LITERAL.match(val)
        if m:
            values[name] = int(m.group(1).replace(" ", ""), 0)
    return values


def _existing_names(cdef: str) -> set[str]:
    """Identifiers declared in the cdef (so a macro never shadows an enum constant of the same name)."""
    return set(re.findall(r"\b[A-Za-z_]\w*\b", cdef))


def generate(include_dir: Path, out: Path) -> Path:
    """Write the cffi cdef for the headers in `include_dir` to `out`; return `out`.

    Raises RuntimeError with the compiler's stderr or cffi's parse error when the headers cannot be
    turned into a valid cdef.
    """
    include_dir, out = Path(include_dir), Path(out)
    decls = _clean(_preprocess(include_dir, ["-P"]))
    declared = _existing_names(decls)
    macros = _int_macros(include_dir)
    digest = hashlib.sha256()
    for h in sorted(include_dir.glob("*.h")):
        digest.update(h.name.encode() + b"\0" + h.read_bytes())
    parts = [
        "/* Generated by native/gen_cdef.py from the engine headers; do not edit.",
        f"   headers sha256: {digest.hexdigest()} */",
        decls,
        "/* integer constants from #define */",
    ]
    parts += [f"#define {k} {v}" for k, v in sorted(macros.items()) if k not in declared]
    text = "\n".join(parts) + "\n"
    _validate(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)  # atomic: a concurrent importer never sees half a cdef
    return out


def _validate(text: str) -> None:
    """Parse with cffi when it is importable (build.py may run under a bare system python3)."""
    try:
        import cffi  # noqa: PLC0415 - optional dependency at build time
    except ImportError:
        return
    try:
        cffi.FFI().cdef(text)
    except Exception as exc:  # cffi raises several error types (CDefError, ParseError, ...)
        raise RuntimeError(f"gen_cdef: generated cdef does not parse with cffi: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("include_dir", type=Path, help="folder with llama.h, ggml*.h, gguf.h (and rig.h)")
    ap.add_argument("out", type=Path, help="where to write the cdef (e.g. app/_lib/cdef.h)")
    args = ap.parse_args(argv)
    path = generate(args.include_dir, args.out)
    print(f"gen_cdef: wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
