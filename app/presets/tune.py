"""`app tune`: measure the settings that matter on this machine and write a preset for its GPU model.

The plan starts from the preset `app serve` would pick here (the base), sweeps the ubatch size with a short
prompt pass and a few decode steps per value on the user's model (or a synthetic one of the same shape),
keeps every other base value, and writes a user preset matching this machine's GPU names (or `cpu = true`).
Knobs whose flags have not landed yet (split overlap, MoE cache budget, draft length) are listed as skipped
with the reason, and their base values are carried over into the [later] table unchanged.

How the ubatch is chosen: the highest prompt t/s wins, except that a smaller ubatch within TIE_MARGIN of it
is preferred (its compute buffers leave more memory for layers, KV and the MoE cache, and a 3% difference is
within run-to-run noise of a short benchmark). Decode speed is shown, not used: a single-token decode step
does not depend on the ubatch size.
"""

from __future__ import annotations

import datetime as _dt
import glob
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from app.devices.types import Inventory
from app.presets import flags
from app.presets.catalog import Catalog, Preset, load_preset, user_dir
from app.presets.matching import select_preset
from app.presets.measure import Measurement

GPU_UBATCHES = (256, 512, 1024, 2048, 4096)
CPU_UBATCHES = (128, 256, 512)
TIE_MARGIN = 0.03
# Rough speeds for the time estimate only (effective, not peak): a mid-range GPU, a CPU core, a disk cache.
_GPU_FLOPS, _GPU_BW = 1.0e14, 1.0e12
_CPU_FLOPS_PER_CORE, _CPU_BW = 5.0e10, 2.0e10
_LOAD_BW, _SYNTH_BYTES_PER_CORE = 2.0e9, 2.5e8
_BITS_PER_WEIGHT = 4.5  # Q4_0-ish, to turn a file size into a parameter count


@dataclass(frozen=True)
class TuneOptions:
    model: Path | None = None
    synth: str | None = None  # "ARCH:SHAPE[:TYPE]", e.g. "qwen3moe:30b-a3b" or "llama:8b:q4_0"
    ubatches: tuple[int, ...] | None = None  # None: GPU_UBATCHES or CPU_UBATCHES
    n_prompt: int | None = None  # None: max(512, largest ubatch), so every ubatch is exercised
    n_gen: int = 32
    reps: int = 2
    n_gpu_layers: int = 999
    threads: int = 0
    out: Path | None = None
    name: str | None = None
    synth_dir: Path | None = None


@dataclass
class ModelSource:
    path: Path
    n_bytes: int
    label: str
    synth: Any = None  # SynthOptions when the model is (to be) written by app.models.synth
    n_expert: int = 0

    @property
    def needs_writing(self) -> bool:
        return self.synth is not None and not self.path.is_file()


@dataclass
class TunePlan:
    source: ModelSource
    base: Preset | None
    base_reason: str
    gpu_names: tuple[str, ...]
    n_cores: int
    trials: list[dict[str, Any]]
    skipped: list[tuple[str, str]]
    n_prompt: int
    n_gen: int
    reps: int
    out: Path
    name: str
    estimate: list[tuple[str, float]] = field(default_factory=list)

    @property
    def est_seconds(self) -> float:
        return sum(s for _, s in self.estimate)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def _synth_source(spec: str, synth_dir: Path | None) -> ModelSource:
    from app.models import synth
    from app.models.default import default_cache_dir

    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"--synth {spec!r}: write ARCH:SHAPE or ARCH:SHAPE:TYPE (e.g. llama:8b)")
    o = synth.SynthOptions(arch=parts[0], shape=parts[1], qtype=parts[2] if len(parts) == 3 else "q4_0")
    plan = synth.plan_model(o)  # validates arch, shape and type, and sizes the file
    path = (synth_dir or default_cache_dir()) / f"synth-{o.arch}-{o.shape}-{o.qtype}-seed{o.seed}.gguf"
    return ModelSource(path, plan.n_bytes, f"synthetic {o.arch} {o.shape} {o.qtype}", synth=o,
                       n_expert=plan.shape.n_expert)


def _file_source(path: Path) -> ModelSource:
    from app.models.synth_gguf import read_header

    if not path.is_file():
        raise ValueError(f"model file not found: {path}")
    try:
        kv = read_header(path).kv
    except Exception as e:  # not GGUF or truncated: the engine would refuse it too, say so before sweeping
        raise ValueError(f"{path} is not a readable GGUF file ({e})") from None
    arch = str(kv.get("general.architecture", ""))
    n_expert = int(kv.get(f"{arch}.expert_count", 0) or 0)
    return ModelSource(path, path.stat().st_size, f"{path.name} ({arch or 'unknown arch'})", n_expert=n_expert)


def later_knobs(inventory: Inventory, source: ModelSource) -> list[tuple[str, str]]:
    """Knobs tune would sweep once they exist, each with why it is skipped on this run."""
    n_gpu = len(inventory.gpus)
    checks = [
        ("split-overlap", "issue 8", n_gpu >= 2, f"needs 2+ GPUs (this machine has {n_gpu})"),
        ("moe-cache-mib", "issue 6", source.n_expert > 0, "the model has no experts"),
        ("spec-draft-n-max", "issue 4", False, "needs a draft model, which this version of tune does not take"),
    ]
    out = []
    for key, issue, applies, why_not in checks:
        if flags.lookup(key) is None:
            out.append((key, f"`--{key}` is not an `app serve` flag yet ({issue}); base value kept"))
        elif not applies:
            out.append((key, why_not))
        else:  # the flag landed: the sweep for it belongs here next
            out.append((key, "flag exists, but this version of tune does not sweep it yet; base value kept"))
    return out


def build_plan(opts: TuneOptions, inventory: Inventory, catalog: Catalog) -> TunePlan:
    """Everything the run will do, and its estimated time, without touching the engine."""
    if (opts.model is None) == (opts.synth is None):
        raise ValueError("give the model to tune on: -m MODEL.gguf, or --synth ARCH:SHAPE for a synthetic one")
    source = _file_source(opts.model) if opts.model else _synth_source(opts.synth, opts.synth_dir)
    base, reason = select_preset(inventory, catalog)
    names = tuple(dict.fromkeys(g.name for g in inventory.gpus))
    ubatches = tuple(sorted(set(opts.ubatches or (GPU_UBATCHES if names else CPU_UBATCHES))))
    if not ubatches or min(ubatches) < 1:
        raise ValueError("ubatch sizes must be positive")
    n_prompt = opts.n_prompt or max(512, max(ubatches))
    fixed = {k: v for k, v in (base.applicable() if base else {}).items()
             if k in ("flash-attn", "cache-type-k", "cache-type-v")}
    trials = [{"ubatch-size": ub, **fixed} for ub in ubatches]
    name = opts.name or (slug("-".join(names)) if names else "cpu")
    cores = inventory.host.n_cores_physical or 1
    plan = TunePlan(source, base, reason, names, cores, trials, later_knobs(inventory, source), n_prompt,
                    opts.n_gen, max(1, opts.reps), opts.out or user_dir() / f"{name}.toml", name)
    plan.estimate = estimate(plan)
    return plan


def estimate(plan: TunePlan) -> list[tuple[str, float]]:
    """(step, seconds) from rough speeds: a guide for --dry-run, not a promise."""
    n_bytes = plan.source.n_bytes
    n_params = n_bytes * 8 / _BITS_PER_WEIGHT
    if plan.source.n_expert:  # only the routed share of the experts computes per token; assume ~1/8
        n_params /= 8
    gpu = bool(plan.gpu_names)
    flops = _GPU_FLOPS if gpu else _CPU_FLOPS_PER_CORE * plan.n_cores
    bw = _GPU_BW if gpu else _CPU_BW
    steps = []
    if plan.source.needs_writing:
        steps.append(("write the synthetic model", n_bytes / (_SYNTH_BYTES_PER_CORE * plan.n_cores)))
    steps.append(("load the model", 1.0 + n_bytes / _LOAD_BW))
    per_pass = 2 * n_params * plan.n_prompt / flops + plan.n_gen * n_bytes / bw
    per_trial = (0.5 if gpu else 0.1) + (1 + plan.reps) * per_pass  # context set-up, warm-up + timed passes
    steps.append((f"{len(plan.trials)} trials x {1 + plan.reps} passes of pp{plan.n_prompt} + tg{plan.n_gen}",
                  per_trial * len(plan.trials)))
    return steps


def choose(results: list[Measurement]) -> Measurement | None:
    """The smallest ubatch within TIE_MARGIN of the best prompt speed (module doc); None if all failed."""
    ok = [m for m in results if m.ok and m.pp_tps]
    if not ok:
        return None
    best = max(m.pp_tps for m in ok)
    near = [m for m in ok if m.pp_tps >= best * (1 - TIE_MARGIN)]
    return min(near, key=lambda m: m.settings["ubatch-size"])


def ensure_model(plan: TunePlan, progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the synthetic model if the plan needs one (reused when already there)."""
    if plan.source.needs_writing:
        from app.models import synth

        plan.source.path.parent.mkdir(parents=True, exist_ok=True)
        o = plan.source.synth
        synth.write_model(plan.source.path, arch=o.arch, shape=o.shape, qtype=o.qtype, seed=o.seed, progress=progress)
    return plan.source.path


def run_trials(plan: TunePlan, opts: TuneOptions,
               on_result: Callable[[int, Measurement], None] | None = None) -> list[Measurement]:
    """Load the model once and time every trial in order."""
    from app.presets.measure import Bench

    split_mode = str((plan.base.applicable() if plan.base else {}).get("split-mode", "layer"))
    results = []
    with Bench(plan.source.path, n_gpu_layers=opts.n_gpu_layers, split_mode=split_mode,
               threads=opts.threads) as bench:
        for i, settings in enumerate(plan.trials):
            m = bench.run(settings, plan.n_prompt, plan.n_gen, plan.reps)
            results.append(m)
            if on_result:
                on_result(i, m)
    return results


def fmt_rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def tuned_preset(plan: TunePlan, results: list[Measurement], best: Measurement) -> tuple[str, str]:
    """(TOML text, one-line summary) of the preset to write: the base's values with the measured ubatch."""
    from app.presets import writer

    base = plan.base
    base_settings = dict(base.applicable()) if base else {}
    base_notes = base.notes if base else {}
    origin = f"from preset {base.name}" if base else "llama-server default"
    ub = int(best.settings["ubatch-size"])
    rows = ", ".join(f"{m.settings['ubatch-size']}: {fmt_rate(m.pp_tps) if m.ok else 'failed'}" for m in results)
    day = _dt.date.today().isoformat()
    settings = {**base_settings, "ubatch-size": ub, "batch-size": max(ub, int(base_settings.get("batch-size", 2048)))}
    notes = {k: f"{origin}: {base_notes.get('settings.' + k, '')}".rstrip(": ") for k in settings}
    notes["ubatch-size"] = (f"measured by app tune on {day}: best pp{plan.n_prompt} t/s with the smallest ubatch "
                            f"within {TIE_MARGIN:.0%} of the best ({rows})")
    notes["batch-size"] = "at least the ubatch size; " + notes.get("batch-size", "")
    later = dict(base.later) if base else {}
    later_notes = {k: f"{origin}, not swept: {base_notes.get('later.' + k, '')}" for k in later}
    # glob.escape: a name such as "Navi 31 [Radeon RX 7900 XT/7900 XTX]" must match itself, not a bracket class
    match = {"names": [glob.escape(n) for n in plan.gpu_names]} if plan.gpu_names else {"cpu": True}
    match_notes = {"names": "this machine's GPU names as NVML/amdsmi report them"} if plan.gpu_names else {
        "cpu": "this machine has no GPU"}
    tune_record = {
        "date": day, "model": plan.source.label, "n_prompt": plan.n_prompt, "n_gen": plan.n_gen, "reps": plan.reps,
        "results": [{k: v for k, v in (("ubatch", m.settings["ubatch-size"]), ("pp_tps", m.pp_tps),
                                       ("tg_tps", m.tg_tps), ("error", m.error)) if v is not None} for m in results],
        "skipped": [f"{k}: {why}" for k, why in plan.skipped],
    }
    where = "for the GPUs in [match]" if plan.gpu_names else "on machines without a GPU"
    header = [f"Written by `app tune` on {day} for {', '.join(plan.gpu_names) or 'this CPU-only machine'}.",
              f"Base preset: {base.name if base else 'none'}; model: {plan.source.label}.",
              f"`app serve` prefers it to the shipped presets {where}; edit or delete it freely."]
    text = writer.render(header, [
        ("preset", {"name": plan.name, "description": f"tuned by app tune on {day}"}, {}),
        ("match", match, match_notes), ("settings", settings, notes), ("later", later, later_notes),
        ("tune", tune_record, {}),
    ])
    return text, f"ubatch-size {ub}: pp{plan.n_prompt} {fmt_rate(best.pp_tps)} t/s"


def write_preset(plan: TunePlan, text: str) -> Preset:
    """Write the file and read it back with the catalog's own loader, so what was written is what loads."""
    from app.presets import writer

    writer.write_atomic(plan.out, text)
    return load_preset(plan.out, origin="user")
