"""Presets and config files name settings by `app serve` flag names; this turns those names into settings.

A preset or config file says `ubatch-size = 1024` (long flag name without dashes; short names such as `ub`
and `--no-*` negations are accepted too). `app.config.load_settings(..., layers=...)` wants each layer as a
mapping of *destination* (`n_ubatch`) to a *parsed* value, so every value goes through the same converter
the command line uses (`Flag.conv`): a preset cannot hold a value that `-ub` itself would refuse.

The flag table is app.config's; nothing here keeps a second list of flags.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

# _ACCUMULATE: destinations whose values add up (-ot, -ncmoe, --api-key); not re-listed here so it cannot drift
from app.config import _ACCUMULATE, FLAGS, ConfigError, Flag


class PresetError(ConfigError):
    """A preset or config file is wrong (bad TOML, unknown flag, bad value, unknown preset name)."""


@dataclass(frozen=True)
class FlagRef:
    """One flag name as it appears in a file: which Flag, and whether it was the negative form."""

    flag: Flag
    positive: bool

    @property
    def canonical(self) -> str:
        """The long name without dashes (`ubatch-size`), the spelling presets are merged and shown under."""
        longs = [n for n in self.flag.names if n.startswith("--")]
        return (longs[0] if longs else self.flag.names[0]).lstrip("-")


@lru_cache(maxsize=1)
def _by_name() -> dict[str, FlagRef]:
    out: dict[str, FlagRef] = {}
    for f in FLAGS:
        for n in f.names:
            out[n.lstrip("-")] = FlagRef(f, True)
        for n in f.neg:
            out[n.lstrip("-")] = FlagRef(f, False)
    return out


def lookup(key: str) -> FlagRef | None:
    """The flag a file key names (`ubatch-size`, `ub`, `--ubatch-size`, `ubatch_size`), else None."""
    name = key.strip().lstrip("-")
    return _by_name().get(name) or _by_name().get(name.replace("_", "-"))


def known_names() -> list[str]:
    """Every spelling lookup() accepts, without dashes (for error hints and tests)."""
    return sorted(_by_name())


def unknown_key_error(key: str, where: str) -> PresetError:
    close = difflib.get_close_matches(key.lstrip("-"), known_names(), n=1, cutoff=0.6)
    hint = f" (did you mean `{close[0]}`?)" if close else ""
    return PresetError(f"{where}: `{key}` is not a flag of `app serve`{hint}")


def _raw_text(value: Any) -> str:
    """A TOML value as the text the command line would carry: lists become comma lists, bools on/off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(_raw_text(v) for v in value)
    return str(value)


# destinations that choose the layers themselves: a preset or config file naming another one would loop
_NOT_IN_FILES = frozenset({"preset", "config_file"})


def convert(key: str, value: Any, where: str) -> tuple[str, Any]:
    """(destination, parsed value) for one file entry; PresetError naming `where` and the key otherwise."""
    ref = lookup(key)
    if ref is None:
        raise unknown_key_error(key, where)
    f = ref.flag
    if f.dest in _NOT_IN_FILES:
        raise PresetError(f"{where}: `{key}` can only be given on the command line or in the environment")
    if f.conv is None:  # a switch: the file says true/false
        if not isinstance(value, bool):
            raise PresetError(f"{where}: `{key}` is a switch; write true or false, not {value!r}")
        on = value if ref.positive else not value
        return f.dest, (f.const if on else False)
    if not ref.positive:
        raise PresetError(f"{where}: `{key}` is the negative form of a flag that takes a value")
    try:
        return f.dest, f.conv(_raw_text(value))
    except ValueError as e:
        raise PresetError(f"{where}: invalid value for `{key}`: {e}") from None


def to_layer(entries: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A load_settings layer (destination -> parsed value) from flag-named entries, in their order.

    Two entries landing on one accumulating destination (`override-tensor` and `n-cpu-moe`) add up, as on the
    command line; for any other destination the later entry wins.
    """
    out: dict[str, Any] = {}
    for key, value in entries.items():
        dest, parsed = convert(key, value, where)
        if dest in _ACCUMULATE and dest in out:
            out[dest] = list(out[dest]) + list(parsed)
        else:
            out[dest] = parsed
    return out
