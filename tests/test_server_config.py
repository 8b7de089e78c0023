"""app/config.py: llama-server flag names and defaults, env precedence, clear errors for bad or unknown flags."""

from __future__ import annotations

import json

import pytest

from app.config import (
    CPU_BUFT,
    LLM_FFN_EXPS_REGEX,
    ConfigError,
    HelpRequested,
    format_help,
    load_settings,
)


def load(*argv: str, env: dict | None = None, **kw):
    return load_settings(["-m", "m.gguf", *argv], env or {}, **kw)


def test_defaults_match_llama_server():
    s = load()
    rt, http, ms = s.runtime, s.http, s.model
    assert (rt.n_ctx, rt.n_batch, rt.n_ubatch, rt.n_predict) == (0, 2048, 512, -1)
    assert (rt.n_parallel, rt.kv_unified) == (4, True)  # -np auto: 4 slots, unified KV
    assert (rt.flash_attn, rt.type_k, rt.type_v, rt.cache_prompt, rt.cache_reuse) == ("auto", "f16", "f16", True, 0)
    assert (http.host, http.port, http.timeout, http.slots, http.metrics, http.props, http.jinja) == (
        "127.0.0.1", 8080, 3600, True, False, False, True)
    assert (ms.n_gpu_layers, ms.split_mode, ms.main_gpu, ms.tensor_buft_overrides) == (-1, "layer", 0, ())
    sp = rt.sampling
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.repeat_penalty, sp.repeat_last_n, sp.seed) == (
        0.8, 40, 0.95, 0.05, 1.0, 64, None)
    assert rt.n_threads >= 1 and rt.n_threads_batch == rt.n_threads
    assert rt.queue_size == 256
    assert ms.alias == "m.gguf"  # no alias: the model is named after its path, as upstream


def test_short_and_long_forms():
    s = load("-c", "4096", "-np", "8", "-b", "1024", "-ub", "256", "-t", "3", "-tb", "5", "-ngl", "99",
             "-sm", "row", "-ts", "3,1", "-mg", "1", "-fa", "on", "-ctk", "q8_0", "-ctv", "q4_0", "-kvu",
             "--swa-full", "--host", "0.0.0.0", "--port", "9000", "-a", "mymodel", "-n", "128", "-s", "42",
             "--temp", "0.1", "--top-k", "5", "--top-p", "0.5", "--min-p", "0.1", "--repeat-penalty", "1.1",
             "--repeat-last-n", "32", "-to", "60", "--threads-http", "4", "--metrics", "--props", "--embedding",
             "--cache-reuse", "256", "--no-cache-prompt", "--no-slots", "--queue-size", "10")
    rt, http, ms = s.runtime, s.http, s.model
    assert (rt.n_ctx, rt.n_parallel, rt.kv_unified, rt.n_ubatch, rt.n_threads, rt.n_threads_batch) == (
        4096, 8, True, 256, 3, 5)
    assert rt.n_batch == 256  # with --embedding, n_batch is cut to n_ubatch as upstream does
    assert (ms.n_gpu_layers, ms.split_mode, ms.tensor_split, ms.main_gpu) == (99, "row", (3.0, 1.0), 1)
    assert (rt.flash_attn, rt.type_k, rt.type_v, rt.swa_full, rt.embeddings) == ("on", "q8_0", "q4_0", True, True)
    assert (http.host, http.port, http.timeout, http.threads_http, http.metrics, http.props, http.slots) == (
        "0.0.0.0", 9000, 60, 4, True, True, False)
    assert (ms.alias, rt.n_predict, rt.sampling.seed, rt.cache_reuse, rt.cache_prompt, rt.queue_size) == (
        "mymodel", 128, 42, 256, False, 10)
    sp = rt.sampling
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.repeat_penalty, sp.repeat_last_n) == (
        0.1, 5, 0.5, 0.1, 1.1, 32)


def test_long_aliases_and_underscores():
    s = load("--ctx_size", "2048", "--n-gpu-layers", "all", "--gpu-layers=auto", "--flash-attn", "off")
    assert s.runtime.n_ctx == 2048
    assert s.model.n_gpu_layers == -1  # the later flag wins
    assert s.runtime.flash_attn == "off"
    assert load("-ngl", "all").model.n_gpu_layers == -2


def test_env_precedence():
    env = {"LLAMA_ARG_CTX_SIZE": "1000", "LLAMA_ARG_PORT": "7000", "LLAMA_ARG_N_GPU_LAYERS": "12",
           "LLAMA_ARG_FLASH_ATTN": "enabled", "LLAMA_API_KEY": "k1,k2", "LLAMA_ARG_ENDPOINT_METRICS": "1",
           "LLAMA_ARG_MODEL": "env.gguf"}
    s = load_settings(["-c", "2000"], env)
    assert s.runtime.n_ctx == 2000  # command line beats env
    assert (s.http.port, s.model.n_gpu_layers, s.runtime.flash_attn) == (7000, 12, "on")
    assert s.http.api_keys == ("k1", "k2") and s.http.metrics and s.model.path == "env.gguf"
    # layers (presets, config file) sit below env
    s = load_settings([], env, layers=[{"n_ctx": 5, "n_batch": 64}])
    assert (s.runtime.n_ctx, s.runtime.n_batch) == (1000, 64)


def test_env_booleans_like_upstream():
    assert load(env={"LLAMA_ARG_NO_ENDPOINT_SLOTS": "1"}).http.slots is False
    assert load(env={"LLAMA_ARG_ENDPOINT_SLOTS": "off"}).http.slots is False
    assert load(env={"LLAMA_ARG_JINJA": "false"}).http.jinja is False
    assert load(env={"LLAMA_ARG_ENDPOINT_METRICS": "0"}).http.metrics is False  # a switch needs a truthy value
    assert load("--slots", env={"LLAMA_ARG_NO_ENDPOINT_SLOTS": "1"}).http.slots is True
    with pytest.raises(ConfigError, match="LLAMA_ARG_KV_UNIFIED"):
        load(env={"LLAMA_ARG_KV_UNIFIED": "maybe"})


def test_unknown_flag_suggests_the_closest():
    with pytest.raises(ConfigError) as e:
        load("--ctx-sise", "10")
    assert "`--ctx-sise`" in str(e.value) and "`--ctx-size`" in str(e.value)
    with pytest.raises(ConfigError, match="unknown flag `--frobnicate`"):
        load("--frobnicate")


@pytest.mark.parametrize("flag", ["--draft-max", "--mmproj", "--lora", "--rope-scaling", "--no-mmap"])
def test_unsupported_llama_server_flag(flag):
    with pytest.raises(ConfigError) as e:
        load(flag, "x")
    assert str(e.value) == f"`{flag}` is a llama-server flag rigserve does not support yet"


@pytest.mark.parametrize("argv, fragment", [
    (["-c", "abc"], "-c: 'abc' is not an integer"),
    (["-fa", "maybe"], "on, off, auto"),
    (["-ctk", "q3_k"], "f16"),
    (["-sm", "diagonal"], "none, layer, row, tensor"),
    (["--port", "70000"], "port"),
    (["-np", "0"], "-np"),
    (["-ot", "noequals"], "<tensor name pattern>=<buffer type>"),
    (["-j", "{not json"], "not valid JSON"),
    (["--slot-save-path", "/definitely/not/here"], "not a directory"),
    (["-c"], "expected one argument"),
    (["stray"], "unexpected argument `stray`"),
    (["--chat-template", "llama3"], "neither Jinja source nor 'chatml'"),
])
def test_bad_values_name_the_flag(argv, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        load(*argv)
    assert fragment in str(e.value)


def test_cpu_moe_patterns_match_upstream():
    s = load("-ncmoe", "3")
    assert s.model.tensor_buft_overrides == tuple(
        (rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU") for i in range(3))
    assert load("-cmoe").model.tensor_buft_overrides == ((r"\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU"),)
    assert LLM_FFN_EXPS_REGEX == r"\.ffn_(up|down|gate|gate_up)_(ch|)exps" and CPU_BUFT == "CPU"
    with pytest.raises(ConfigError):
        load("-ncmoe", "-1")


def test_override_tensor_order_is_kept():
    s = load("-ot", "blk\\.0\\.=CUDA0,attn=CPU", "-ncmoe", "1", "-ot", "x=CUDA1")
    assert s.model.tensor_buft_overrides == (
        ("blk\\.0\\.", "CUDA0"), ("attn", "CPU"), (rf"blk\.0{LLM_FFN_EXPS_REGEX}", "CPU"), ("x", "CUDA1"))


def test_files_and_keys(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nsecret1\n\nsecret2\n")
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{{ messages[0]['content'] }}")
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "a"')
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "string"}))
    s = load("--api-key", "k0", "--api-key-file", str(keys), "--chat-template", "{{ inline }}",
             "--chat-template-file", str(tmpl), "--grammar-file", str(grammar), "-jf", str(schema))
    assert s.http.api_keys == ("k0", "secret1", "secret2")
    assert s.http.chat_template == "{{ messages[0]['content'] }}"  # the file wins over the inline template
    assert s.http.grammar == 'root ::= "a"' and s.http.json_schema == {"type": "string"}
    with pytest.raises(ConfigError, match="cannot read"):
        load("--api-key-file", str(tmp_path / "missing"))


def test_aliases_name_the_model_like_upstream():
    s = load("-a", "zeta, alpha")
    assert s.model.aliases == ("zeta", "alpha")
    assert s.model.alias == "alpha"  # llama-server keeps aliases in a sorted set and uses the first


def test_help_is_grouped():
    with pytest.raises(HelpRequested) as e:
        load("--help")
    text = e.value.text
    for group in ("Model", "Context and batching", "GPU placement", "Sampling defaults", "Server and HTTP",
                  "Caching"):
        assert group in text
    assert "LLAMA_ARG_CTX_SIZE" in text and text == format_help()


def test_no_model_is_allowed_here():
    assert load_settings([], {}).model.path is None
    assert load_settings([], {}, default_model="d.gguf").model.path == "d.gguf"


def test_seed_minus_one_is_random():
    assert load("-s", "-1").runtime.sampling.seed is None
    assert load("-s", "4294967295").runtime.sampling.seed is None
