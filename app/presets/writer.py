"""Write a preset as TOML with a comment on every value (what `app tune` produces).

No TOML writer is a dependency, and a preset needs only scalars, lists of scalars and lists of inline
tables, so this small emitter covers it. JSON string escapes are valid TOML basic-string escapes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"TOML has no place for {v}")
        return repr(round(v, 3))
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _key(k: str) -> str:
    bare = k and all(c.isalnum() or c in "-_" for c in k)
    return k if bare else json.dumps(k)


def _comment(text: str) -> str:
    return " ".join(text.split())  # one line: a newline in a note would end the comment


def render(header: Iterable[str], tables: Iterable[tuple[str, Mapping[str, Any], Mapping[str, str]]]) -> str:
    """TOML text: `header` lines as comments, then each (table, values, comments) with `# comment` per value."""
    lines = [f"# {_comment(h)}" if h else "#" for h in header]
    for name, values, notes in tables:
        if not values:
            continue
        lines += ["", f"[{name}]"]
        for k, v in values.items():
            note = notes.get(k, "")
            lines.append(f"{_key(k)} = {toml_value(v)}" + (f"  # {_comment(note)}" if note else ""))
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write beside, then rename: a server starting meanwhile never reads half a preset."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
