"""Presets: the shipped files parse and name only real flags, matching by NVML/amdsmi device names, the
mixed-rig merge, `--preset NAME|none`, config files, and precedence preset < config file < env < flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import FLAGS, ConfigError, load_settings
from app.devices.types import GpuInfo, HostInfo, Inventory
from app.presets import (
    PresetError, config_file_layer, load_catalog, match_gpu, merge_presets, preset_layer, select_preset,
)
from app.presets.catalog import SHIPPED_DIR, parse_preset

HOST = HostInfo(cpu_model="test", n_cores_physical=2, n_cores_logical=4, memory_total_bytes=64 << 30,
                memory_available_bytes=32 << 30)
SHIPPED = {"nvidia-hopper", "nvidia-rtx-3090", "nvidia-rtx-4090", "nvidia-rtx-5090", "amd-rx-7900-xtx",
           "amd-instinct", "cpu", "generic"}


def gpu(i: int, name: str, arch: str | None = None, vendor: str = "nvidia") -> GpuInfo:
    amd = vendor == "amd" or (arch or "").startswith("gfx")
    return GpuInfo(index=i, vendor="amd" if amd else "nvidia", vendor_index=i, name=name,
                   pci_bus_id=f"0000:{16 + i:02x}:00.0", memory_total_bytes=24 << 30,
                   memory_free_bytes=20 << 30, memory_used_bytes=4 << 30,
                   compute_capability=None if amd else arch, gfx_target=arch if amd else None)


def rig(*gpus: GpuInfo) -> Inventory:
    return Inventory(gpus=tuple(gpus), links=(), host=HOST)


@pytest.fixture
def catalog(tmp_path: Path):
    """Shipped presets only: an empty user folder, so the developer's own ~/.config cannot leak in."""
    return load_catalog(user=tmp_path / "no-user-presets")


# ---- the shipped files ----------------------------------------------------------------------------------------


def test_every_shipped_preset_parses(catalog):
    assert set(catalog.names()) == SHIPPED
    assert sorted(p.stem for p in SHIPPED_DIR.glob("*.toml")) == sorted(SHIPPED)


def test_settings_keys_are_flags_of_app_config(catalog):
    known = {n.lstrip("-") for f in FLAGS for n in f.names + f.neg}
    for p in catalog.presets:
        assert set(p.settings) <= known, p.name
        p.layer()  # every value passes the same converter as the command line


def test_every_value_has_a_comment(catalog):
    for p in catalog.presets:
        for table, values in (("settings", p.settings), ("later", p.later)):
            for key in values:
                assert len(p.notes.get(f"{table}.{key}", "")) > 10, f"{p.name}: {table}.{key} has no comment"


def test_gpu_presets_set_the_core_knobs(catalog):
    for p in catalog.presets:
        if p.match.cpu:
            continue
        core = {"ubatch-size", "batch-size", "flash-attn", "cache-type-k", "cache-type-v", "split-mode"}
        assert core <= set(p.settings), p.name
        assert p.settings["batch-size"] >= p.settings["ubatch-size"], p.name
        assert {"split-overlap", "moe-cache-margin-mib", "spec-draft-n-max"} <= set(p.later), p.name


def test_later_values_apply_only_once_config_knows_the_flag():
    p = parse_preset('[preset]\nname = "x"\n[settings]\nubatch-size = 256\n'
                     '[later]\nctx-size = 4096  # landed\nnot-a-flag-yet = 3  # pending\n', origin="file")
    assert p.pending() == {"not-a-flag-yet": 3}
    assert p.layer() == {"n_ubatch": 256, "n_ctx": 4096}
    assert p.notes["later.ctx-size"] == "landed"


@pytest.mark.parametrize("text, message", [
    ("[settings]\nubatch = 256\n", "did you mean"),
    ("[settings]\nflash-attn = \"maybe\"\n", "invalid value for `flash-attn`"),
    ("[settings]\nkv-unified = 3\n", "is a switch"),
    ("[settings]\nub = 256\nubatch-size = 512\n", "a second time"),
    ("[match]\nname = [\"x\"]\n", "[match] has no key"),
    ("[setting]\nub = 1\n", "unknown table"),
    ("[settings\n", "not valid TOML"),
    ("[later]\nctx-size = \"big\"\n", "invalid value"),
])
def test_bad_preset_files_fail_loudly(text, message):
    with pytest.raises(PresetError, match=message.replace("[", r"\[")):
        parse_preset('[preset]\nname = "bad"\n' + text, origin="file")


# ---- matching -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, arch, expected", [
    ("NVIDIA H200", "9.0", "nvidia-hopper"),
    ("NVIDIA H200 NVL", "9.0", "nvidia-hopper"),
    ("NVIDIA H100 80GB HBM3", "9.0", "nvidia-hopper"),
    ("NVIDIA H100 PCIe", "9.0", "nvidia-hopper"),
    ("NVIDIA GH200 480GB", "9.0", "nvidia-hopper"),
    ("NVIDIA H300 (a future name)", "9.0", "nvidia-hopper"),  # family match by compute capability
    ("NVIDIA H20", "9.0", "generic"),  # cut-down Hopper, excluded on purpose
    ("NVIDIA GeForce RTX 3090", "8.6", "nvidia-rtx-3090"),
    ("NVIDIA GeForce RTX 3090 Ti", "8.6", "nvidia-rtx-3090"),
    ("NVIDIA GeForce RTX 3080", "8.6", "generic"),
    ("NVIDIA GeForce RTX 4090", "8.9", "nvidia-rtx-4090"),
    ("NVIDIA GeForce RTX 4090 D", "8.9", "nvidia-rtx-4090"),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", "8.9", "generic"),
    ("NVIDIA GeForce RTX 5090", "12.0", "nvidia-rtx-5090"),
    ("NVIDIA GeForce RTX 5090 D", "12.0", "nvidia-rtx-5090"),
    ("AMD Radeon RX 7900 XTX", "gfx1100", "amd-rx-7900-xtx"),
    ("Radeon RX 7900 XTX", "gfx1100", "amd-rx-7900-xtx"),
    ("Navi 31 [Radeon RX 7900 XT/7900 XTX]", "gfx1100", "amd-rx-7900-xtx"),
    ("AMD Radeon RX 7900 GRE", "gfx1100", "amd-rx-7900-xtx"),
    ("AMD Instinct MI300X", "gfx942", "amd-instinct"),
    ("AMD Instinct MI300X OAM", "gfx942", "amd-instinct"),
    ("AMD Instinct MI250X/MI250", "gfx90a", "amd-instinct"),
    ("AMD Instinct MI210", "gfx90a", "amd-instinct"),
    ("NVIDIA A100-SXM4-80GB", "8.0", "generic"),
])
def test_match_by_real_device_names(catalog, name, arch, expected):
    p, how = match_gpu(gpu(0, name, arch), catalog)
    assert p is not None and p.name == expected, how


def test_unknown_gpu_falls_back_to_generic_and_says_so(catalog):
    p, reason = select_preset(rig(gpu(0, "NVIDIA A100-SXM4-80GB", "8.0")), catalog)
    assert p.name == "generic"
    assert "no preset matches this GPU" in reason and "A100" in reason


def test_no_gpu_gives_the_cpu_preset(catalog):
    p, reason = select_preset(rig(), catalog)
    assert p.name == "cpu" and "no GPU found" in reason


def test_same_model_on_every_gpu_gives_its_preset_unmerged(catalog):
    p, reason = select_preset(rig(gpu(0, "NVIDIA H200", "9.0"), gpu(1, "NVIDIA H200", "9.0")), catalog)
    assert p.name == "nvidia-hopper" and p.origin == "shipped"
    assert "GPU0 NVIDIA H200" in reason and "GPU1 NVIDIA H200" in reason


def test_mixed_rig_takes_the_most_conservative_value(catalog):
    p, reason = select_preset(rig(gpu(0, "NVIDIA H200", "9.0"), gpu(1, "NVIDIA GeForce RTX 3090", "8.6")), catalog)
    assert p.origin == "merged" and "mixed rig" in reason
    s = p.applicable()
    assert s["ubatch-size"] == 512  # smaller of 2048 and 512
    assert s["flash-attn"] == "on"  # both on
    assert s["cache-type-k"] == "f16" and s["split-mode"] == "layer"
    assert p.later["spec-draft-n-max"] == 4 and p.later["moe-cache-margin-mib"] == 1536  # min / max
    assert p.later["split-overlap"] is False
    assert "smallest" in p.notes["settings.ubatch-size"]


def test_mixed_rig_with_an_amd_card_leaves_flash_attention_to_upstream(catalog):
    p, _ = select_preset(rig(gpu(0, "NVIDIA GeForce RTX 4090", "8.9"), gpu(1, "AMD Radeon RX 7900 XTX", "gfx1100")),
                         catalog)
    assert p.settings["flash-attn"] == "auto" and p.settings["ubatch-size"] == 512


def test_mixed_rig_with_an_unknown_card_merges_with_the_generic_defaults(catalog):
    p, reason = select_preset(rig(gpu(0, "NVIDIA H200", "9.0"), gpu(1, "Some New GPU", "7.5")), catalog)
    assert p.name == "mixed:nvidia-hopper+generic"
    assert p.settings["ubatch-size"] == 512 and p.settings["flash-attn"] == "auto"
    assert p.later["spec-draft-n-max"] == 3


def _preset(name: str, settings: str) -> object:
    return parse_preset(f'[preset]\nname = "{name}"\n[settings]\n{settings}\n', origin="file")


def test_merge_rules_per_kind_of_value():
    a = _preset("a", 'cache-type-k = "q8_0"\ncache-type-v = "q4_0"\nflash-attn = "on"\nsplit-mode = "tensor"\n'
                     'ctx-size = 8192\nparallel = 4\nn-gpu-layers = 40')
    b = _preset("b", 'cache-type-k = "f16"\ncache-type-v = "q8_0"\nflash-attn = "off"\nsplit-mode = "layer"\n'
                     'ctx-size = 8192\nparallel = 8')
    m = merge_presets([a, b])
    assert m.settings["cache-type-k"] == "f16" and m.settings["cache-type-v"] == "q8_0"  # most precise
    assert m.settings["flash-attn"] == "off"  # any off
    assert m.settings["split-mode"] == "layer"  # disagree -> layer
    assert m.settings["ctx-size"] == 8192  # no rule, but all agree
    assert "parallel" not in m.settings and "dropped" in m.notes["settings.parallel"]  # no rule, disagree
    # `gpu-layers` is -ngl's canonical (first long) name
    assert "gpu-layers" not in m.settings and "not set by every preset" in m.notes["settings.gpu-layers"]


def test_user_preset_overrides_the_shipped_one_for_its_gpu(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "my-h200.toml").write_text('[preset]\nname = "my-h200"\n[match]\nnames = ["NVIDIA H200"]\n'
                                       '[settings]\nubatch-size = 768  # measured here\n')
    cat = load_catalog(user=user)
    assert select_preset(rig(gpu(0, "NVIDIA H200", "9.0")), cat)[0].name == "my-h200"
    assert select_preset(rig(gpu(0, "NVIDIA H100 PCIe", "9.0")), cat)[0].name == "nvidia-hopper"


def test_user_preset_with_a_shipped_name_replaces_it(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "cpu.toml").write_text('[preset]\nname = "cpu"\n[match]\ncpu = true\n[settings]\nubatch-size = 64\n')
    cat = load_catalog(user=user)
    p, _ = select_preset(rig(), cat)
    assert (p.name, p.origin, p.settings["ubatch-size"]) == ("cpu", "user", 64)
    assert [s.name for s in cat.shadowed] == ["cpu"]


# ---- the layers -----------------------------------------------------------------------------------------------


def test_preset_none_gives_an_empty_layer(catalog):
    layer, line = preset_layer("none", rig(gpu(0, "NVIDIA H200", "9.0")), catalog=catalog)
    assert layer == {} and "none" in line


def test_preset_by_name_ignores_the_detected_gpus(catalog):
    layer, line = preset_layer("nvidia-rtx-3090", rig(gpu(0, "NVIDIA H200", "9.0")), catalog=catalog)
    assert layer["n_ubatch"] == 512 and layer["flash_attn"] == "on" and "--preset" in line


def test_preset_detected_from_the_inventory(catalog):
    layer, line = preset_layer(None, rig(gpu(0, "NVIDIA H200", "9.0")), catalog=catalog)
    # spec-draft-n-max sits in the preset's [later] table and applies now that config knows the flag.
    assert layer == {"n_ubatch": 2048, "n_batch": 2048, "flash_attn": "on", "type_k": "f16", "type_v": "f16",
                     "split_mode": "layer", "spec_n_max": 8}
    assert line.startswith("preset nvidia-hopper") and "ubatch-size=2048" in line


def test_unknown_preset_name_is_a_config_error(catalog):
    with pytest.raises(ConfigError, match="unknown preset `h9000`.*nvidia-hopper"):
        preset_layer("h9000", rig(), catalog=catalog)


def test_preset_from_a_file_path(tmp_path, catalog):
    path = tmp_path / "mine.toml"
    path.write_text('[preset]\nname = "mine"\n[settings]\nctx-size = 2048\n')
    layer, line = preset_layer(str(path), rig(), catalog=catalog)
    assert layer == {"n_ctx": 2048} and str(path) in line


def test_config_file_layer(tmp_path):
    path = tmp_path / "rig.toml"
    path.write_text('ctx-size = 8192\nflash-attn = true\nkv-unified = false\ntensor-split = [3, 1]\n'
                    'alias = ["a", "b"]\noverride-tensor = "blk\\\\.0\\\\.ffn_up_exps=CPU"\nn-cpu-moe = 1\n')
    layer = config_file_layer(path)
    assert layer["n_ctx"] == 8192 and layer["flash_attn"] == "on" and layer["kv_unified"] is False
    assert layer["tensor_split"] == (3.0, 1.0) and layer["alias"] == ["a", "b"]
    assert len(layer["tensor_buft_overrides"]) == 2  # -ot and -ncmoe add up, as on the command line


@pytest.mark.parametrize("text, message", [
    ("ctx-sise = 1\n", "did you mean `ctx-size`"),
    ("[server]\nport = 1\n", "without tables"),
    ("port = \"high\"\n", "invalid value for `port`"),
])
def test_bad_config_files_fail_loudly(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        config_file_layer(path)


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        config_file_layer(tmp_path / "nope.toml")


# ---- precedence through load_settings -------------------------------------------------------------------------


def test_precedence_preset_config_env_flag(tmp_path, catalog):
    preset, _ = preset_layer("nvidia-hopper", rig(), catalog=catalog)
    cfg = tmp_path / "rig.toml"
    cfg.write_text("ubatch-size = 256\n")
    config = config_file_layer(cfg)

    def ub(argv, env, layers):
        return load_settings(argv, env, layers=layers).runtime.n_ubatch

    assert ub([], {}, []) == 512  # llama-server's default
    assert ub([], {}, [preset]) == 2048  # the preset
    assert ub([], {}, [preset, config]) == 256  # the config file beats the preset
    assert ub([], {"LLAMA_ARG_UBATCH": "128"}, [preset, config]) == 128  # the environment beats both
    assert ub(["-ub", "64"], {"LLAMA_ARG_UBATCH": "128"}, [preset, config]) == 64  # the flag beats all
    none, _ = preset_layer("none", rig(), catalog=catalog)
    assert ub([], {}, [none, config]) == 256


def test_preset_values_not_overridden_survive_the_other_layers(tmp_path, catalog):
    preset, _ = preset_layer("nvidia-hopper", rig(), catalog=catalog)
    s = load_settings(["-c", "4096"], {"LLAMA_ARG_UBATCH": "128"}, layers=[preset])
    assert s.runtime.flash_attn == "on" and s.runtime.n_batch == 2048 and s.runtime.n_ctx == 4096
