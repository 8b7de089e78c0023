"""Tuning presets per GPU model: the catalog in configs/presets/ (and the user's), matching to the detected
GPUs, the preset and config-file settings layers, and `app tune`, which measures and writes a preset.

A leaf helper beside devices/ and models/: it imports app.config (for the flag table), app.devices and, in
the tune command only, app.engine and app.models; nothing imports it but the CLI and the server start-up.
"""

from app.presets.catalog import Catalog, Match, Preset, load_catalog, load_preset, user_dir
from app.presets.flags import PresetError
from app.presets.layers import config_file_layer, preset_layer
from app.presets.matching import match_gpu, merge_presets, select_preset

__all__ = [
    "Catalog", "Match", "Preset", "PresetError", "config_file_layer", "load_catalog", "load_preset",
    "match_gpu", "merge_presets", "preset_layer", "select_preset", "user_dir",
]
