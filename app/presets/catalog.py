"""The preset catalog: TOML files in configs/presets/ (shipped) and ~/.config/rigserve/presets/ (user).

A preset file has these tables (docs/presets.md has the full format):

    [preset]    name, description
    [match]     names (glob patterns on NVML/amdsmi device names), exclude, arch (compute capability or gfx
                target, a weaker family match), cpu = true (the no-GPU preset), fallback = true (unknown GPUs)
    [settings]  `app serve` flags by long name (`ubatch-size = 1024`), checked against app.config's table
    [later]     knobs whose flags have not landed in app.config yet: kept, shown, applied only once config
                knows the flag, so nothing unknown is ever applied silently
    [tune]      what `app tune` measured (informational, never applied)

Every value's comment (on its line, or the comment lines right above it) is kept so `app presets show`
can print why the value is what it is.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from app.presets import flags
from app.presets.flags import PresetError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser from PyPI (pyproject: tomli; python_version < '3.11')
    import tomli as tomllib

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "configs" / "presets"
_TABLES = ("preset", "match", "settings", "later", "tune")
_MATCH_KEYS = {"names": list, "exclude": list, "arch": list, "cpu": bool, "fallback": bool}


def user_dir() -> Path:
    """Where `app tune` writes and `app serve` looks for the user's presets."""
    return Path.home() / ".config" / "rigserve" / "presets"


@dataclass(frozen=True)
class Match:
    """Which machines a preset is for."""

    names: tuple[str, ...] = ()  # case-insensitive globs on the full device name
    exclude: tuple[str, ...] = ()  # names that look alike but are other silicon (laptop parts)
    arch: tuple[str, ...] = ()  # "9.0", "gfx942": same silicon family when no name pattern matched
    cpu: bool = False  # the preset for a machine with no GPU
    fallback: bool = False  # the preset for a GPU no other preset matches


@dataclass(frozen=True)
class Preset:
    """One preset: settings keyed by canonical flag name (`ubatch-size`), with the file's comments."""

    name: str
    description: str = ""
    origin: str = "shipped"  # shipped | user | file | merged
    path: Path | None = None
    match: Match = field(default_factory=Match)
    settings: Mapping[str, Any] = field(default_factory=dict)
    later: Mapping[str, Any] = field(default_factory=dict)
    notes: Mapping[str, str] = field(default_factory=dict)  # "settings.ubatch-size" -> the value's comment
    tune: Mapping[str, Any] = field(default_factory=dict)

    def applicable(self) -> dict[str, Any]:
        """Settings plus the [later] knobs whose flags app.config knows by now, settings first."""
        out = dict(self.settings)
        for key, value in self.later.items():
            ref = flags.lookup(key)
            if ref is not None:
                out.setdefault(ref.canonical, value)
        return out

    def pending(self) -> dict[str, Any]:
        """[later] knobs that app.config does not know yet (shown, never applied)."""
        return {k: v for k, v in self.later.items() if flags.lookup(k) is None}

    def layer(self) -> dict[str, Any]:
        """This preset as a load_settings layer (destination -> parsed value)."""
        return flags.to_layer(self.applicable(), f"preset {self.name}")


# ---- reading files ---------------------------------------------------------------------------------------------


def _comment_start(line: str) -> int:
    """Index of the `#` that starts a comment on this line (outside any string), or -1."""
    quote = ""
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c == "#":
            return i
        i += 1
    return -1


def value_comments(text: str) -> dict[str, str]:
    """Map "table.key" to its comment: the text after `#` on the key's line, else the comment lines right
    above it. A line-level scan is enough for preset files (one key per line, no multi-line values)."""
    out: dict[str, str] = {}
    table, above = "", []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            above = []
            continue
        if line.startswith("#"):
            above.append(line.lstrip("#").strip())
            continue
        if line.startswith("["):
            table, above = line.strip("[] "), []
            continue
        cut = _comment_start(line)
        key = line.split("=", 1)[0].strip().strip("\"'")
        note = line[cut + 1:].strip() if cut >= 0 else ""
        out[f"{table}.{key}"] = note or " ".join(above)
        above = []
    return out


def _table(data: Mapping[str, Any], name: str, where: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise PresetError(f"{where}: [{name}] must be a table")
    return dict(value)


def _parse_match(raw: Mapping[str, Any], where: str) -> Match:
    for key, value in raw.items():
        kind = _MATCH_KEYS.get(key)
        if kind is None:
            raise PresetError(f"{where}: [match] has no key `{key}` (known: {', '.join(_MATCH_KEYS)})")
        if not isinstance(value, kind) or (kind is list and not all(isinstance(v, str) for v in value)):
            raise PresetError(f"{where}: [match] {key} must be {'a list of strings' if kind is list else 'true/false'}")
    return Match(names=tuple(raw.get("names", ())), exclude=tuple(raw.get("exclude", ())),
                 arch=tuple(str(a) for a in raw.get("arch", ())), cpu=bool(raw.get("cpu", False)),
                 fallback=bool(raw.get("fallback", False)))


def _parse_settings(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Canonical keys, each value checked by the flag's own converter (so a bad value fails at load)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        ref = flags.lookup(key)
        if ref is None:
            raise flags.unknown_key_error(key, f"{where} [settings]")
        flags.convert(key, value, f"{where} [settings]")
        name = ref.canonical
        if name in out:
            raise PresetError(f"{where} [settings]: `{key}` sets `{name}` a second time")
        # a negative spelling (`no-kv-unified = true`) is stored as the positive flag's value
        out[name] = value if ref.positive or not isinstance(value, bool) else not value
    return out


def _parse_later(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        ref = flags.lookup(key)
        if ref is not None:  # landed since the file was written: it must now be a valid value too
            flags.convert(key, value, f"{where} [later]")
        out[ref.canonical if ref else key.lstrip("-")] = value
    return out


def parse_preset(text: str, *, origin: str, path: Path | None = None, default_name: str = "") -> Preset:
    """A Preset from TOML text; PresetError naming the file and key for anything wrong."""
    where = str(path) if path else f"preset {default_name or '(text)'}"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"{where}: not valid TOML: {e}") from None
    extra = [k for k in data if k not in _TABLES]
    if extra:
        raise PresetError(f"{where}: unknown table or key `{extra[0]}` (tables: {', '.join(_TABLES)})")
    head = _table(data, "preset", where)
    name = str(head.get("name") or default_name)
    if not name:
        raise PresetError(f"{where}: [preset] needs a name")
    return Preset(
        name=name, description=str(head.get("description", "")), origin=origin, path=path,
        match=_parse_match(_table(data, "match", where), where),
        settings=_parse_settings(_table(data, "settings", where), where),
        later=_parse_later(_table(data, "later", where), where),
        notes=value_comments(text), tune=_table(data, "tune", where),
    )


def load_preset(path: Path, origin: str = "file") -> Preset:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise PresetError(f"cannot read preset {path}: {e.strerror or e}") from None
    return parse_preset(text, origin=origin, path=Path(path), default_name=Path(path).stem)


# ---- the catalog -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Catalog:
    """Shipped and user presets. A user preset with a shipped preset's name replaces it; in matching, user
    presets are tried first (matching.py), so a tuned preset wins over the shipped one for its GPU."""

    presets: tuple[Preset, ...]
    shadowed: tuple[Preset, ...] = ()  # shipped presets a user preset of the same name replaced

    def get(self, name: str) -> Preset | None:
        return next((p for p in self.presets if p.name == name), None)

    def names(self) -> list[str]:
        return [p.name for p in self.presets]


def _read_dir(folder: Path | None, origin: str) -> list[Preset]:
    if folder is None or not folder.is_dir():
        return []
    return [load_preset(p, origin) for p in sorted(folder.glob("*.toml"))]


def load_catalog(shipped: Path | None = SHIPPED_DIR, user: Path | None = None) -> Catalog:
    """Every preset; `user` defaults to user_dir(), None-or-missing folders are simply empty."""
    user_presets = _read_dir(user if user is not None else user_dir(), "user")
    user_names = {p.name for p in user_presets}
    shipped_presets = _read_dir(shipped, "shipped")
    kept = [p for p in shipped_presets if p.name not in user_names]
    shadowed = [p for p in shipped_presets if p.name in user_names]
    return Catalog(presets=tuple(user_presets + kept), shadowed=tuple(shadowed))
