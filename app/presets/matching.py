"""Choose the preset for the GPUs found: one GPU model -> its preset; a mixed rig -> the most conservative merge.

Per GPU, the candidates are ranked: a device-name pattern beats an arch (family) match; among equals a user
preset beats a shipped one (so `app tune`'s output wins for its GPU), then the more specific pattern (more
literal characters), then the name. A GPU nothing matches gets the `fallback = true` preset (generic
defaults), and the reason says so. No GPU at all gives the `cpu = true` preset.

A rig whose GPUs chose different presets gets one merged preset. The rule per kind of value, because the
settings must work on the weakest card and a merged value is never something no single preset chose:
- sizes that cost memory or time per step (`ubatch-size`, `batch-size`, `spec-draft-n-max`): the smallest;
- memory left free (`moe-cache-margin-mib`): the largest;
- `flash-attn`: `on` only if every preset says on, `off` if any says off, else `auto`;
- KV cache types: the most precise type any preset asks for (f32 > f16 > bf16 > q8_0 > ... > q4_0), so a
  card whose preset wants f16 never gets a quantized cache because a bigger card tolerated one;
- `split-mode`: kept when all agree, else `layer` (the split every backend pair supports);
- on/off features (`split-overlap`): on only if all are on;
- anything else: kept when all agree, else dropped so llama-server's default applies.
A key some presets lack is dropped too (the default is what those GPUs would have run with).
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Iterable

from app.devices.types import GpuInfo, Inventory
from app.presets.catalog import Catalog, Preset, load_catalog

# KV cache types from most to least precise (bits per value, then format age as the tie-break)
KV_PRECISION = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0")


def _flash(values: list[Any]) -> Any:
    norm = [{True: "on", False: "off"}.get(v, str(v).lower()) for v in values]
    if all(v == "on" for v in norm):
        return "on"
    return "off" if "off" in norm else "auto"


def _kv(values: list[Any]) -> Any:
    rank = {t: i for i, t in enumerate(KV_PRECISION)}
    return min(values, key=lambda v: rank.get(str(v), len(rank)))


def _split(values: list[Any]) -> Any:
    return values[0] if len(set(map(str, values))) == 1 else "layer"


MERGE_RULES: dict[str, tuple[str, Callable[[list[Any]], Any]]] = {
    "ubatch-size": ("smallest", min),
    "batch-size": ("smallest", min),
    "spec-draft-n-max": ("smallest", min),
    "moe-cache-margin-mib": ("largest", max),
    "flash-attn": ("on only if all on", _flash),
    "cache-type-k": ("most precise", _kv),
    "cache-type-v": ("most precise", _kv),
    "split-mode": ("agreed, else layer", _split),
    "split-overlap": ("on only if all on", all),
}


def _specificity(pattern: str) -> int:
    return sum(1 for c in pattern if c not in "*?[]")


def _excluded(p: Preset, low_name: str) -> bool:
    return any(fnmatch.fnmatchcase(low_name, x.lower()) for x in p.match.exclude)


def match_gpu(gpu: GpuInfo, catalog: Catalog) -> tuple[Preset | None, str]:
    """(preset, how it matched) for one GPU; the fallback preset, or None, when nothing matches."""
    low = gpu.name.strip().lower()
    ranked = []
    for p in catalog.presets:
        if _excluded(p, low):  # look-alike names of other silicon (laptop parts) match neither way
            continue
        pat = next((x for x in p.match.names if fnmatch.fnmatchcase(low, x.lower())), None)
        if pat is not None:
            ranked.append(((2, p.origin == "user", _specificity(pat)), p.name, p, f"name pattern '{pat}'"))
        elif gpu.arch and gpu.arch in p.match.arch:
            ranked.append(((1, p.origin == "user", 0), p.name, p, f"arch {gpu.arch} (family match)"))
    if ranked:
        ranked.sort(key=lambda r: (tuple(-int(x) for x in r[0]), r[1]))
        _, _, p, how = ranked[0]
        return p, how
    fallback = next((p for p in catalog.presets if p.match.fallback), None)
    return fallback, "no preset matches this GPU: generic defaults"


def _merge_table(tables: list[dict[str, Any]], names: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    out: dict[str, Any] = {}
    notes: dict[str, str] = {}
    keys = list(dict.fromkeys(k for t in tables for k in t))
    for key in keys:
        values = [t.get(key) for t in tables]
        listing = ", ".join(f"{n}: {v}" for n, v in zip(names, values))
        if any(v is None for v in values):
            notes[key] = f"dropped: not set by every preset ({listing})"
            continue
        rule, fn = MERGE_RULES.get(key, ("agreed, else default", None))
        if fn is None:
            if len({repr(v) for v in values}) == 1:
                out[key] = values[0]
                notes[key] = f"all presets agree ({listing})"
            else:
                notes[key] = f"dropped: presets disagree and no rule says which is safe ({listing})"
            continue
        out[key] = fn(values)
        notes[key] = f"{rule} of {listing}"
    return out, notes


def merge_presets(presets: Iterable[Preset]) -> Preset:
    """One preset holding, per value, the most conservative choice of `presets` (module doc)."""
    ps = list(presets)
    names = [p.name for p in ps]
    settings, s_notes = _merge_table([dict(p.settings) for p in ps], names)
    later, l_notes = _merge_table([dict(p.later) for p in ps], names)
    notes = {f"settings.{k}": v for k, v in s_notes.items()} | {f"later.{k}": v for k, v in l_notes.items()}
    return Preset(name="mixed:" + "+".join(names), description="merged for a mixed rig: " + ", ".join(names),
                  origin="merged", settings=settings, later=later, notes=notes)


def _where(p: Preset) -> str:
    return f"{p.origin} {p.path}" if p.path else p.origin


def select_preset(inventory: Inventory, catalog: Catalog | None = None) -> tuple[Preset | None, str]:
    """The preset for this machine and one line saying why (for the server log)."""
    catalog = catalog if catalog is not None else load_catalog()
    if not inventory.gpus:
        cpu = next((p for p in catalog.presets if p.match.cpu), None)
        if cpu is None:
            return None, f"no GPU found ({inventory.no_gpu_reason()}) and no cpu preset: llama-server defaults"
        return cpu, f"preset {cpu.name}: no GPU found ({inventory.no_gpu_reason()}) ({_where(cpu)})"
    chosen: list[tuple[GpuInfo, Preset | None, str]] = [(g, *match_gpu(g, catalog)) for g in inventory.gpus]
    per_gpu = "; ".join(f"GPU{g.index} {g.name} -> {p.name if p else 'none'} ({how})" for g, p, how in chosen)
    if any(p is None for _, p, _ in chosen):
        return None, f"no preset: {per_gpu}; no fallback preset, llama-server defaults"
    distinct = list({p.name: p for _, p, _ in chosen}.values())
    if len(distinct) == 1:
        p = distinct[0]
        return p, f"preset {p.name}: {per_gpu} ({_where(p)})"
    merged = merge_presets(distinct)
    return merged, f"preset {merged.name} (mixed rig, most conservative value of each): {per_gpu}"
