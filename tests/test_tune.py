"""`app tune`: the plan and `--dry-run`, the choice rule, the written preset, and a short real tune on the CPU
with a tiny synthetic model whose preset `app serve`'s settings layer then loads. Also `app presets`."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import app.devices
from app.config import load_settings
from app.devices.types import GpuInfo, HostInfo, Inventory
from app.presets import load_catalog, load_preset, match_gpu, preset_layer, select_preset
from app.presets import tune as tn
from app.presets.catalog import parse_preset
from app.presets.cli import presets_app, tune_command
from app.presets.measure import Measurement

HOST = HostInfo(cpu_model="test", n_cores_physical=2, n_cores_logical=2, memory_total_bytes=16 << 30,
                memory_available_bytes=8 << 30)
NO_GPU = Inventory(gpus=(), links=(), host=HOST)


def _gpu(i: int, name: str) -> GpuInfo:
    return GpuInfo(index=i, vendor="nvidia", vendor_index=i, name=name, pci_bus_id=f"0000:{16 + i:02x}:00.0",
                   memory_total_bytes=141 << 30, memory_free_bytes=140 << 30, memory_used_bytes=1 << 30,
                   compute_capability="9.0")


TWO_H200 = Inventory(gpus=(_gpu(0, "NVIDIA H200"), _gpu(1, "NVIDIA H200")), links=(), host=HOST)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HOME, so ~/.config/rigserve/presets is the test's own."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _cli(monkeypatch: pytest.MonkeyPatch, inventory: Inventory) -> typer.Typer:
    # the commands as app/cli.py mounts them, with device discovery replaced by a fixed inventory
    monkeypatch.setattr(app.devices, "discover", lambda: inventory)
    cli = typer.Typer()
    cli.add_typer(presets_app, name="presets")
    cli.command("tune")(tune_command)
    return cli


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from app.models.synth import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tune-models"))


# ---- plan and dry run -----------------------------------------------------------------------------------------


def test_dry_run_prints_the_plan_and_writes_nothing(home, monkeypatch, tiny_gguf):
    res = CliRunner().invoke(_cli(monkeypatch, NO_GPU), ["tune", "-m", str(tiny_gguf), "--dry-run"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "app tune plan" in out and "ubatch-size=128" in out and "ubatch-size=512" in out
    assert "estimated time" in out and "preset cpu: no GPU found" in out
    assert "skipped split-overlap" in out and "skipped spec-draft-n-max" in out
    assert not (home / ".config").exists()


def test_dry_run_with_a_synthetic_model_plans_to_write_it(home, monkeypatch, tmp_path):
    res = CliRunner().invoke(_cli(monkeypatch, TWO_H200), ["tune", "--synth", "qwen3moe:30b-a3b", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "synthetic qwen3moe 30b-a3b q4_0" in res.output and "to be written first" in res.output
    assert "write the synthetic model" in res.output and "ubatch-size=4096" in res.output
    assert "nvidia-h200.toml" in res.output


def test_tune_needs_a_model(home, monkeypatch):
    res = CliRunner().invoke(_cli(monkeypatch, NO_GPU), ["tune", "--dry-run"])
    assert res.exit_code == 2 and "-m MODEL.gguf" in res.output


def test_gpu_plan_starts_from_the_matching_preset(tmp_path, tiny_gguf):
    cat = load_catalog(user=tmp_path / "none")
    plan = tn.build_plan(tn.TuneOptions(model=tiny_gguf, out=tmp_path / "o.toml"), TWO_H200, cat)
    assert plan.base.name == "nvidia-hopper" and plan.gpu_names == ("NVIDIA H200",) and plan.name == "nvidia-h200"
    assert [t["ubatch-size"] for t in plan.trials] == list(tn.GPU_UBATCHES)
    assert plan.trials[0]["flash-attn"] == "on"  # the base preset's fixed values go with every trial
    assert plan.n_prompt == max(tn.GPU_UBATCHES)  # a prompt long enough to fill the largest ubatch
    skipped = dict(plan.skipped)
    assert "not an `app serve` flag yet" in skipped["split-overlap"]
    assert plan.est_seconds > 0


def test_later_knobs_explain_why_not_swept(tiny_gguf):
    src = tn.ModelSource(tiny_gguf, 1, "tiny")
    notes = dict(tn.later_knobs(NO_GPU, src))
    assert set(notes) == {"split-overlap", "moe-cache-mib", "spec-draft-n-max"}


# ---- choosing and writing -------------------------------------------------------------------------------------


def _m(ub: int, pp: float | None, err: str | None = None) -> Measurement:
    return Measurement({"ubatch-size": ub}, pp_tps=pp, tg_tps=None if pp is None else 10.0, error=err)


def test_choose_prefers_the_smaller_ubatch_within_the_margin():
    assert tn.choose([_m(256, 900), _m(512, 1000), _m(1024, 1020)]).settings["ubatch-size"] == 512
    assert tn.choose([_m(256, 500), _m(512, 900), _m(1024, 1000)]).settings["ubatch-size"] == 1024
    assert tn.choose([_m(256, 900), _m(4096, None, "out of memory")]).settings["ubatch-size"] == 256
    assert tn.choose([_m(256, None, "failed")]) is None


def test_written_preset_matches_its_own_gpu_name_even_with_brackets(tmp_path, tiny_gguf):
    name = "Navi 31 [Radeon RX 7900 XT/7900 XTX]"
    inv = Inventory(gpus=(GpuInfo(0, "amd", 0, name, "0000:03:00.0", 24 << 30, 20 << 30, 4 << 30,
                                  gfx_target="gfx1100"),), links=(), host=HOST)
    cat = load_catalog(user=tmp_path / "none")
    plan = tn.build_plan(tn.TuneOptions(model=tiny_gguf, ubatches=(256, 512), out=tmp_path / "x.toml"), inv, cat)
    text, summary = tn.tuned_preset(plan, [_m(256, 100.0), _m(512, 150.0)], _m(512, 150.0))
    p = parse_preset(text, origin="user")
    assert p.settings["ubatch-size"] == 512 and p.settings["flash-attn"] == "auto"  # from the 7900 XTX preset
    assert p.later == cat.get("amd-rx-7900-xtx").later
    assert "measured by app tune" in p.notes["settings.ubatch-size"]
    assert all(p.notes.get(f"settings.{k}") for k in p.settings)
    assert p.tune["results"][1] == {"ubatch": 512, "pp_tps": 150.0, "tg_tps": 10.0}
    assert match_gpu(inv.gpus[0], type(cat)(presets=(p, *cat.presets)))[0] is p
    assert "ubatch-size 512" in summary


# ---- a real tune ----------------------------------------------------------------------------------------------


def test_short_real_tune_on_cpu_writes_a_preset_that_serve_loads(home, monkeypatch, tiny_gguf, lib_dir):
    res = CliRunner().invoke(_cli(monkeypatch, NO_GPU), [
        "tune", "-m", str(tiny_gguf), "--ubatch", "16,32", "--prompt", "32", "--gen", "4", "--reps", "1"])
    assert res.exit_code == 0, res.output
    assert "chosen" in res.output and "wrote" in res.output and "app serve on this machine: preset cpu" in res.output
    path = home / ".config" / "rigserve" / "presets" / "cpu.toml"
    written = load_preset(path, origin="user")
    ub = written.settings["ubatch-size"]
    assert ub in (16, 32) and written.match.cpu and len(written.tune["results"]) == 2
    # what `app serve` does at start-up: the detected machine's preset, as a layer below env and flags
    chosen, reason = select_preset(NO_GPU, load_catalog())
    assert chosen.origin == "user" and chosen.path == path
    layer, line = preset_layer(None, NO_GPU)
    settings = load_settings(["-m", str(tiny_gguf)], {}, layers=[layer])
    assert settings.runtime.n_ubatch == ub and f"ubatch-size={ub}" in line


# ---- app presets ----------------------------------------------------------------------------------------------


def test_presets_list_marks_this_machine(home, monkeypatch):
    res = CliRunner().invoke(_cli(monkeypatch, TWO_H200), ["presets", "list"])
    assert res.exit_code == 0, res.output
    assert "nvidia-hopper" in res.output and "this machine: preset nvidia-hopper" in res.output


def test_presets_show_gives_values_status_and_reasons(home, monkeypatch):
    res = CliRunner().invoke(_cli(monkeypatch, NO_GPU), ["presets", "show", "nvidia-hopper"])
    assert res.exit_code == 0, res.output
    assert "ubatch-size" in res.output and "applied" in res.output and "pending" in res.output
    res = CliRunner().invoke(_cli(monkeypatch, NO_GPU), ["presets", "show", "nope"])
    assert res.exit_code == 2 and "unknown preset" in res.output
