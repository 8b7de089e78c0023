"""What `app tune` shows: the plan (also all of `--dry-run`), progress bars, the results table, the outcome."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.devices.types import Inventory
from app.presets import tune as tn
from app.presets.catalog import load_catalog
from app.presets.matching import select_preset
from app.presets.measure import Measurement


def _say(console: Console, text: str, style: str | None = None) -> None:
    # plain text: model paths and library messages may hold brackets that rich would read as markup
    console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


def print_plan(plan: tn.TunePlan, console: Console) -> None:
    _say(console, f"base: {plan.base_reason}")
    size = plan.source.n_bytes / (1 << 30)
    extra = " (to be written first)" if plan.source.needs_writing else ""
    _say(console, f"model: {plan.source.label}, {size:.2f} GiB, {plan.source.path}{extra}")
    t = Table(title="app tune plan", title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("#", justify="right")
    t.add_column("settings")
    t.add_column("measures")
    for i, s in enumerate(plan.trials, 1):
        t.add_row(str(i), " ".join(f"{k}={v}" for k, v in s.items()),
                  f"pp{plan.n_prompt} + tg{plan.n_gen}, 1 warm-up + {plan.reps} timed")
    console.print(t)
    for key, why in plan.skipped:
        _say(console, f"skipped {key}: {why}", style="dim")
    for step, secs in plan.estimate:
        _say(console, f"  ~{secs:6.1f} s  {step}", style="dim")
    _say(console, f"estimated time: ~{plan.est_seconds:.0f} s (rough: assumed speeds, not this machine's)")
    _say(console, f"writes: {plan.out} (preset {plan.name})")


def _results_table(plan: tn.TunePlan, results: list[Measurement], best: Measurement | None) -> Table:
    base_ub = int((plan.base.applicable() if plan.base else {}).get("ubatch-size", 512))
    ref = next((m for m in results if m.ok and m.settings["ubatch-size"] == base_ub), None)
    t = Table(title=f"app tune: {plan.source.label}", title_justify="left", box=box.SIMPLE_HEAD)
    for col, just in (("ubatch", "right"), (f"pp{plan.n_prompt} t/s", "right"), (f"tg{plan.n_gen} t/s", "right"),
                      (f"pp vs ub {base_ub}", "right"), ("", "left")):
        t.add_column(col, justify=just)
    for m in results:
        ub = m.settings["ubatch-size"]
        if not m.ok:
            t.add_row(str(ub), "-", "-", "-", f"failed: {m.error}")
            continue
        ratio = f"{m.pp_tps / ref.pp_tps:.2f}x" if ref and ref.pp_tps else "-"
        mark = "chosen" if m is best else ("base" if ub == base_ub else "")
        t.add_row(str(ub), tn.fmt_rate(m.pp_tps), tn.fmt_rate(m.tg_tps), ratio, mark)
    return t


def _write_model(plan: tn.TunePlan, console: Console) -> None:
    from rich.progress import DownloadColumn, TransferSpeedColumn

    with Progress(TextColumn("writing {task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                  TransferSpeedColumn(), console=console) as bar:
        task = bar.add_task(plan.source.path.name, total=plan.source.n_bytes)
        tn.ensure_model(plan, lambda done, total: bar.update(task, completed=done, total=total))


def _measure(plan: tn.TunePlan, opts: tn.TuneOptions, console: Console) -> list[Measurement]:
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        task = bar.add_task("loading the model", total=len(plan.trials))

        def done(i: int, m: Measurement) -> None:
            nxt = plan.trials[i + 1]["ubatch-size"] if i + 1 < len(plan.trials) else None
            bar.update(task, advance=1, description=f"ubatch {nxt}" if nxt else "done")

        bar.update(task, description=f"ubatch {plan.trials[0]['ubatch-size']}")
        return tn.run_trials(plan, opts, done)


def run(plan: tn.TunePlan, opts: tn.TuneOptions, inventory: Inventory, console: Console) -> int:
    """Measure, show, write; the exit code (0 written, 1 nothing worked or the engine failed)."""
    from app.engine import EngineError

    try:
        if plan.source.needs_writing:
            _write_model(plan, console)
        results = _measure(plan, opts, console)
    except (EngineError, OSError, ValueError) as e:
        _say(console, f"error: {e}")
        return 1
    best = tn.choose(results)
    console.print(_results_table(plan, results, best))
    if best is None:
        _say(console, "error: every setting failed; no preset written")
        return 1
    text, summary = tn.tuned_preset(plan, results, best)
    preset = tn.write_preset(plan, text)
    _say(console, f"wrote {plan.out}: preset {preset.name}, {summary}")
    if plan.out.parent.resolve() == tn.user_dir().resolve():
        chosen, reason = select_preset(inventory, load_catalog())
        _say(console, f"app serve on this machine: {reason}")
    else:
        _say(console, f"not in {tn.user_dir()}: use it with `app serve --preset {plan.out}`")
    return 0
