"""The two settings layers below the environment: the preset, then a `--config FILE`.

`app serve` resolves settings as defaults < preset < config file < environment < command line; this module
builds the first two as `load_settings(..., layers=[preset, config_file])` wants them (destination ->
parsed value). Which preset and which file come from `--preset` / `--config` (or their RIGSERVE_*
variables), which app.config reads, since it is the only reader of the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.devices.types import Inventory
from app.presets import flags
from app.presets.catalog import Catalog, load_catalog, load_preset, tomllib
from app.presets.flags import PresetError
from app.presets.matching import select_preset

NO_PRESET = "none"


def _summary(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items()) or "(no values)"


def preset_layer(argv_preset: str | None, inventory: Inventory | None = None, *,
                 catalog: Catalog | None = None) -> tuple[dict[str, Any], str]:
    """(layer, log line) for `--preset NAME|PATH|none`, or for the detected GPUs when argv_preset is None.

    `inventory` is discovered when needed and not given. An unknown name raises PresetError (a ConfigError,
    so `app serve` exits 2 with the message); `none` gives an empty layer.
    """
    if argv_preset is not None and argv_preset.strip().lower() == NO_PRESET:
        return {}, "preset: none (--preset none): llama-server defaults below config file, env and flags"
    if argv_preset is not None and argv_preset.endswith(".toml"):  # a file (a missing one is an error)
        p = load_preset(Path(argv_preset), origin="file")
        return p.layer(), f"preset {p.name} from {argv_preset} (--preset): {_summary(p.applicable())}"
    catalog = catalog if catalog is not None else load_catalog()
    if argv_preset is not None:
        p = catalog.get(argv_preset)
        if p is None:
            raise PresetError(f"unknown preset `{argv_preset}`; known: {', '.join(catalog.names()) or 'none'} "
                              "(or a .toml path, or `none`)")
        return p.layer(), f"preset {p.name} (--preset, {p.origin}): {_summary(p.applicable())}"
    if inventory is None:
        from app.devices import discover

        inventory = discover()
    p, reason = select_preset(inventory, catalog)
    if p is None:
        return {}, reason
    return p.layer(), f"{reason}: {_summary(p.applicable())}"


def config_file_layer(path: str | Path) -> dict[str, Any]:
    """A `--config FILE` layer: a TOML file of `app serve` flags by name (`ctx-size = 8192`), top level.

    Unlike a preset, a config file is what the user asked for, so every key must be a flag that exists now
    (no [later] table); an unknown key fails with the closest known name.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PresetError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"config file {path}: not valid TOML: {e}") from None
    tables = [k for k, v in data.items() if isinstance(v, dict)]
    if tables:
        raise PresetError(f"config file {path}: [{tables[0]}]: write flags at the top level, without tables")
    return flags.to_layer(data, f"config file {path}")
