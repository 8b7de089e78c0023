"""Settings: the one place that resolves every knob from defaults, presets, config files, env and command line.

Precedence, lowest first: built-in defaults (llama-server's, read from common/arg.cpp at the pinned commit) <
`layers` (presets, then a config file; each a mapping of setting name -> value) < environment (the
`LLAMA_ARG_*` names llama-server reads, plus our `RIGSERVE_*` ones) < command line. This module is the only
reader of `os.environ`; everything else receives frozen `Settings`.

Flags use llama-server's spellings (short and long forms, `--no-*` negations, `_` accepted for `-` in long
names as upstream does). A flag we recognise from llama-server but do not implement fails loudly instead of
being ignored, and an unknown flag fails with the closest known name.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

if TYPE_CHECKING:
    from app.runtime.api import SamplingParams


class ConfigError(ValueError):
    """A setting the user gave is wrong; the message says which and why."""


class HelpRequested(Exception):
    """`-h/--help` was given; `.text` is the grouped help to print."""

    def __init__(self, text: str):
        super().__init__("help requested")
        self.text = text


# ---- settings objects ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSettings:
    path: str | None = None
    alias: str = ""  # the name the API reports (llama-server: first alias in sorted order, else the path)
    aliases: tuple[str, ...] = ()
    n_gpu_layers: int = -1  # -1 auto, -2 all, N exact (llama-server's -ngl)
    split_mode: str = "layer"  # none | layer | row | tensor
    tensor_split: tuple[float, ...] = ()
    main_gpu: int = 0
    devices: tuple[str, ...] = ()  # backend device names; ("none",) keeps everything on the CPU
    tensor_buft_overrides: tuple[tuple[str, str], ...] = ()  # (tensor-name regex, buffer type name), in order
    load_mtp: bool = False


@dataclass(frozen=True)
class SpecSettings:
    """Speculative decoding (docs/speculative.md); names and defaults follow llama-server's --spec-* flags."""

    type: str = "none"  # none | draft-simple | draft-mtp | ngram-simple
    draft_model: str | None = None
    draft_n_gpu_layers: int = -1
    draft_devices: tuple[str, ...] = ()  # empty: the target's -dev
    draft_type_k: str = "f16"
    draft_type_v: str = "f16"
    n_max: int = 3  # most tokens drafted per step (a request's speculative.n_max overrides)
    n_min: int = 0  # drafts made before --spec-draft-p-min may cut a draft short
    p_min: float = 0.0  # stop drafting when the draft model's top probability is below this


@dataclass(frozen=True)
class RuntimeSettings:
    model: ModelSettings = field(default_factory=ModelSettings)
    n_ctx: int = 0  # 0: the model's training context
    n_batch: int = 2048
    n_ubatch: int = 512
    n_parallel: int = 4
    n_threads: int = 1
    n_threads_batch: int = 1
    flash_attn: str = "auto"  # on | off | auto
    type_k: str = "f16"
    type_v: str = "f16"
    kv_unified: bool = False
    swa_full: bool = False
    embeddings: bool = False
    cache_prompt: bool = True
    cache_reuse: int = 0
    cache_ram_mib: int = 8192  # host prompt cache budget; -1 = no limit, 0 = off
    ctx_checkpoints: int = 32  # per slot, for models whose memory can't be cut (recurrent, SWA)
    checkpoint_min_step: int = 8192  # tokens between checkpoints within one prompt
    queue_size: int = 256
    sampling: "SamplingParams | None" = None  # per-request defaults; copy before changing (the object is shared)
    n_predict: int = -1
    backend_sampling: bool = True  # sample on the device where the request allows it (issue 10)
    slot_save_path: str | None = None
    spec: SpecSettings = field(default_factory=SpecSettings)


@dataclass(frozen=True)
class HttpSettings:
    host: str = "127.0.0.1"
    hosts: tuple[str, ...] = ("127.0.0.1",)
    port: int = 8080
    api_keys: tuple[str, ...] = ()
    metrics: bool = False
    slots: bool = True
    props: bool = False
    threads_http: int = -1
    timeout: int = 3600
    max_body_bytes: int = 32 << 20
    chat_template: str | None = None  # Jinja source (or "chatml"); --chat-template-file's content wins
    chat_template_file: str | None = None
    jinja: bool = True
    grammar: str | None = None  # default GBNF for requests that bring none
    json_schema: dict | None = None  # default JSON schema for requests that bring none


@dataclass(frozen=True)
class Settings:
    runtime: RuntimeSettings
    http: HttpSettings
    log_level: str = "info"

    @property
    def model(self) -> ModelSettings:
        return self.runtime.model


# ---- value parsing -------------------------------------------------------------------------------------------

LLM_FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # upstream common.h, what -cmoe/-ncmoe match
CPU_BUFT = "CPU"  # name of ggml's host buffer type
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
_TRUTHY = ("on", "enabled", "true", "1")
_FALSEY = ("off", "disabled", "false", "0")


def _int(v: str) -> int:
    try:
        return int(v.strip())
    except ValueError:
        raise ValueError(f"'{v}' is not an integer") from None


def _float(v: str) -> float:
    try:
        return float(v.strip())
    except ValueError:
        raise ValueError(f"'{v}' is not a number") from None


def _bool(v: str) -> bool:
    s = v.strip().lower()
    if s in _TRUTHY:
        return True
    if s in _FALSEY:
        return False
    raise ValueError(f"'{v}' is not a boolean (use on/off, true/false, 1/0)")


def _choice(*choices: str) -> Callable[[str], str]:
    def conv(v: str) -> str:
        if v not in choices:
            raise ValueError(f"'{v}' is not one of {', '.join(choices)}")
        return v

    return conv


def _ngl(v: str) -> int:
    s = v.strip()
    return {"auto": -1, "all": -2}[s] if s in ("auto", "all") else _int(s)


def _flash_attn(v: str) -> str:
    s = v.strip().lower()
    for value, words in (("on", _TRUTHY), ("off", _FALSEY), ("auto", ("auto", "-1"))):
        if s in words:
            return value
    raise ValueError(f"'{v}' is not one of on, off, auto")


def _csv(v: str) -> list[str]:
    # llama-server's CSV rows allow quoted fields (a key with a comma in it)
    rows = list(csv.reader([v], skipinitialspace=True))
    return [x for x in (rows[0] if rows else []) if x]


def _tensor_split(v: str) -> tuple[float, ...]:
    parts = [p for p in v.replace("/", ",").split(",") if p.strip()]
    return tuple(_float(p) for p in parts)


def _override_tensor(v: str) -> list[tuple[str, str]]:
    out = []
    for item in v.split(","):
        pattern, sep, buft = item.partition("=")
        if not sep or not pattern or not buft:
            raise ValueError(f"'{item}' is not <tensor name pattern>=<buffer type>")
        out.append((pattern, buft))
    return out


def _n_cpu_moe(v: str) -> list[tuple[str, str]]:
    n = _int(v)
    if n < 0:
        raise ValueError("must be >= 0")
    return [(rf"blk\.{i}{LLM_FFN_EXPS_REGEX}", CPU_BUFT) for i in range(n)]


def _read_text(v: str) -> str:
    try:
        return Path(v).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read '{v}': {e.strerror}") from None


def _api_key_file(v: str) -> list[str]:
    return [ln.strip() for ln in _read_text(v).splitlines() if ln.strip() and not ln.startswith("#")]


def _json_schema(v: str) -> dict:
    try:
        schema = json.loads(v)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")
    return schema


def _non_negative_int(v: str) -> int:
    n = _int(v)
    if n < 0:
        raise ValueError("must be >= 0")
    return n


def _positive_int(v: str) -> int:
    n = _int(v)
    if n <= 0:
        raise ValueError("must be > 0")
    return n


# ---- the flag table ------------------------------------------------------------------------------------------

G_MODEL, G_CTX, G_GPU, G_SAMPLING, G_HTTP, G_CACHE, G_LOG, G_PRESET = (
    "Model", "Context and batching", "GPU placement", "Sampling defaults (a request's own fields win)",
    "Server and HTTP", "Caching", "Logging", "Presets and config files",
)
G_SPEC = "Speculative decoding"
SPEC_TYPE_NAMES = ("none", "draft-simple", "draft-mtp", "mtp", "ngram-simple")  # mtp: alias of draft-mtp


@dataclass(frozen=True)
class Flag:
    """One setting on the command line: its names, where it lands and how its text becomes a value."""

    names: tuple[str, ...]
    dest: str
    group: str
    help: str
    conv: Callable[[str], Any] | None = None  # None: a switch that sets `const`
    env: str | None = None
    neg: tuple[str, ...] = ()  # names that set the switch False (env LLAMA_ARG_NO_* does too)
    const: Any = True
    metavar: str | None = None


# dests whose values add up (in the order given) instead of replacing each other, as upstream does
_ACCUMULATE = {"tensor_buft_overrides", "api_keys"}

FLAGS: tuple[Flag, ...] = (
    Flag(("-m", "--model"), "model", G_MODEL, "model path (GGUF)", str, "LLAMA_ARG_MODEL", metavar="FNAME"),
    Flag(("-a", "--alias"), "alias", G_MODEL, "model name aliases, comma-separated (reported by the API)", _csv,
         "LLAMA_ARG_ALIAS", metavar="STRING"),
    Flag(("-c", "--ctx-size"), "n_ctx", G_CTX, "size of the context, all slots together (default: 0 = from model)",
         _int, "LLAMA_ARG_CTX_SIZE", metavar="N"),
    Flag(("-n", "--predict", "--n-predict"), "n_predict", G_CTX,
         "default number of tokens to predict (default: -1 = until end of generation or context full)", _int,
         "LLAMA_ARG_N_PREDICT", metavar="N"),
    Flag(("-b", "--batch-size"), "n_batch", G_CTX, "logical maximum batch size (default: 2048)", _positive_int,
         "LLAMA_ARG_BATCH", metavar="N"),
    Flag(("-ub", "--ubatch-size"), "n_ubatch", G_CTX, "physical maximum batch size (default: 512)", _positive_int,
         "LLAMA_ARG_UBATCH", metavar="N"),
    Flag(("-np", "--parallel"), "n_parallel", G_CTX,
         "number of server slots (default: -1 = auto: 4 slots with a unified KV cache)", _int,
         "LLAMA_ARG_N_PARALLEL", metavar="N"),
    Flag(("-t", "--threads"), "n_threads", G_CTX, "CPU threads for generation (default: physical cores)", _int,
         "LLAMA_ARG_THREADS", metavar="N"),
    Flag(("-tb", "--threads-batch"), "n_threads_batch", G_CTX,
         "CPU threads for batch and prompt processing (default: same as --threads)", _int, metavar="N"),
    Flag(("-fa", "--flash-attn"), "flash_attn", G_CTX, "Flash Attention: on, off or auto (default: auto)",
         _flash_attn, "LLAMA_ARG_FLASH_ATTN", metavar="[on|off|auto]"),
    Flag(("-ctk", "--cache-type-k"), "type_k", G_CTX,
         f"KV cache data type for K: {', '.join(KV_CACHE_TYPES)} (default: f16)", _choice(*KV_CACHE_TYPES),
         "LLAMA_ARG_CACHE_TYPE_K", metavar="TYPE"),
    Flag(("-ctv", "--cache-type-v"), "type_v", G_CTX,
         f"KV cache data type for V: {', '.join(KV_CACHE_TYPES)} (default: f16)", _choice(*KV_CACHE_TYPES),
         "LLAMA_ARG_CACHE_TYPE_V", metavar="TYPE"),
    Flag(("-kvu", "--kv-unified"), "kv_unified", G_CTX,
         "one KV buffer shared by all slots (default: on when -np is auto)", None, "LLAMA_ARG_KV_UNIFIED",
         neg=("-no-kvu", "--no-kv-unified")),
    Flag(("--swa-full",), "swa_full", G_CTX, "use a full-size sliding-window-attention cache", None,
         "LLAMA_ARG_SWA_FULL"),
    Flag(("-cb", "--cont-batching"), "cont_batching", G_CTX,
         "continuous batching (always on in rigserve; accepted for compatibility)", None, "LLAMA_ARG_CONT_BATCHING"),
    Flag(("--queue-size",), "queue_size", G_CTX,
         "requests that may wait for a slot before new ones get 503 (default: max(256, 4 x slots))", _positive_int,
         "RIGSERVE_QUEUE_SIZE", metavar="N"),
    Flag(("-ngl", "--gpu-layers", "--n-gpu-layers"), "n_gpu_layers", G_GPU,
         "max. layers in VRAM: a number, 'auto' or 'all' (default: auto)", _ngl, "LLAMA_ARG_N_GPU_LAYERS",
         metavar="N"),
    Flag(("-sm", "--split-mode"), "split_mode", G_GPU, "how to split the model across GPUs: none, layer, row, "
         "tensor (default: layer)", _choice("none", "layer", "row", "tensor"), "LLAMA_ARG_SPLIT_MODE",
         metavar="{none,layer,row,tensor}"),
    Flag(("-ts", "--tensor-split"), "tensor_split", G_GPU, "fraction of the model per GPU, e.g. 3,1",
         _tensor_split, "LLAMA_ARG_TENSOR_SPLIT", metavar="N0,N1,..."),
    Flag(("-mg", "--main-gpu"), "main_gpu", G_GPU, "the GPU for the model (-sm none) or for intermediate "
         "results and KV (-sm row) (default: 0)", _int, "LLAMA_ARG_MAIN_GPU", metavar="INDEX"),
    Flag(("-dev", "--device"), "devices", G_GPU, "comma-separated devices to offload to (none = don't offload)",
         lambda v: tuple(_csv(v)), "LLAMA_ARG_DEVICE", metavar="<dev1,dev2,..>"),
    Flag(("-ot", "--override-tensor"), "tensor_buft_overrides", G_GPU, "override tensor buffer types",
         _override_tensor, "LLAMA_ARG_OVERRIDE_TENSOR", metavar="<pattern>=<buffer type>,..."),
    Flag(("-cmoe", "--cpu-moe"), "tensor_buft_overrides", G_GPU, "keep all MoE expert weights in host memory",
         None, "LLAMA_ARG_CPU_MOE", const=[(LLM_FFN_EXPS_REGEX, CPU_BUFT)]),
    Flag(("-ncmoe", "--n-cpu-moe"), "tensor_buft_overrides", G_GPU,
         "keep the MoE expert weights of the first N layers in host memory", _n_cpu_moe, "LLAMA_ARG_N_CPU_MOE",
         metavar="N"),
    Flag(("--temp", "--temperature"), "temperature", G_SAMPLING, "temperature (default: 0.80)",
         lambda v: max(_float(v), 0.0), "LLAMA_ARG_TEMPERATURE", metavar="N"),
    Flag(("--top-k",), "top_k", G_SAMPLING, "top-k sampling (default: 40, 0 = disabled)", _int, "LLAMA_ARG_TOP_K",
         metavar="N"),
    Flag(("--top-p",), "top_p", G_SAMPLING, "top-p sampling (default: 0.95, 1.0 = disabled)", _float,
         "LLAMA_ARG_TOP_P", metavar="N"),
    Flag(("--min-p",), "min_p", G_SAMPLING, "min-p sampling (default: 0.05, 0.0 = disabled)", _float,
         "LLAMA_ARG_MIN_P", metavar="N"),
    Flag(("--typical", "--typical-p"), "typical_p", G_SAMPLING, "locally typical sampling p (default: 1.00 = "
         "disabled)", _float, metavar="N"),
    Flag(("--repeat-penalty",), "repeat_penalty", G_SAMPLING, "repetition penalty (default: 1.00 = disabled)",
         _float, "LLAMA_ARG_REPEAT_PENALTY", metavar="N"),
    Flag(("--repeat-last-n",), "repeat_last_n", G_SAMPLING, "last n tokens to penalize (default: 64, 0 = "
         "disabled)", _int, metavar="N"),
    Flag(("--presence-penalty",), "presence_penalty", G_SAMPLING, "presence penalty (default: 0.00 = disabled)",
         _float, "LLAMA_ARG_PRESENCE_PENALTY", metavar="N"),
    Flag(("--frequency-penalty",), "frequency_penalty", G_SAMPLING, "frequency penalty (default: 0.00 = "
         "disabled)", _float, "LLAMA_ARG_FREQUENCY_PENALTY", metavar="N"),
    Flag(("-s", "--seed"), "seed", G_SAMPLING, "RNG seed (default: -1 = a random seed per request)", _int,
         metavar="SEED"),
    Flag(("--ignore-eos",), "ignore_eos", G_SAMPLING, "ignore the end-of-generation token", None),
    Flag(("--grammar",), "grammar", G_SAMPLING, "default GBNF grammar", str, metavar="GRAMMAR"),
    Flag(("--grammar-file",), "grammar", G_SAMPLING, "read the default grammar from a file", _read_text,
         metavar="FNAME"),
    Flag(("-j", "--json-schema"), "json_schema", G_SAMPLING, "default JSON schema, e.g. '{\"type\": \"object\"}'",
         _json_schema, metavar="SCHEMA"),
    Flag(("-jf", "--json-schema-file"), "json_schema", G_SAMPLING, "read the default JSON schema from a file",
         lambda v: _json_schema(_read_text(v)), metavar="FILE"),
    Flag(("-bs", "--backend-sampling"), "backend_sampling", G_SAMPLING,
         "sample on the device where a request allows it (default: on in rigserve)", None,
         "LLAMA_ARG_BACKEND_SAMPLING", neg=("--no-backend-sampling",)),
    Flag(("--spec-type",), "spec_type", G_SPEC, "speculative decoding: none, draft-simple (a draft model, -md), "
         "ngram-simple (prompt lookup), draft-mtp/mtp (not supported yet) (default: none, or draft-simple with -md)",
         _choice(*SPEC_TYPE_NAMES), "LLAMA_ARG_SPEC_TYPE", metavar="TYPE"),
    Flag(("--spec-draft-model", "-md", "--model-draft"), "spec_draft_model", G_SPEC,
         "draft model for speculative decoding (same vocabulary as the model)", str, "LLAMA_ARG_SPEC_DRAFT_MODEL",
         metavar="FNAME"),
    Flag(("--spec-draft-ngl", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"), "spec_draft_ngl", G_SPEC,
         "max. draft model layers in VRAM: a number, 'auto' or 'all' (default: auto)", _ngl,
         "LLAMA_ARG_N_GPU_LAYERS_DRAFT", metavar="N"),
    Flag(("--spec-draft-device", "-devd", "--device-draft"), "spec_draft_devices", G_SPEC,
         "comma-separated devices for the draft model (none = don't offload; default: follows --device)",
         lambda v: tuple(_csv(v)), metavar="<dev1,dev2,..>"),
    Flag(("--spec-draft-type-k", "-ctkd", "--cache-type-k-draft"), "spec_draft_type_k", G_SPEC,
         "KV cache data type for K of the draft model (default: f16)", _choice(*KV_CACHE_TYPES),
         "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K", metavar="TYPE"),
    Flag(("--spec-draft-type-v", "-ctvd", "--cache-type-v-draft"), "spec_draft_type_v", G_SPEC,
         "KV cache data type for V of the draft model (default: f16)", _choice(*KV_CACHE_TYPES),
         "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V", metavar="TYPE"),
    Flag(("--spec-draft-n-max",), "spec_n_max", G_SPEC, "most tokens drafted per step (default: 3)",
         _non_negative_int, "LLAMA_ARG_SPEC_DRAFT_N_MAX", metavar="N"),
    Flag(("--spec-draft-n-min",), "spec_n_min", G_SPEC, "drafts made before --spec-draft-p-min may stop drafting "
         "(default: 0)", _non_negative_int, "LLAMA_ARG_SPEC_DRAFT_N_MIN", metavar="N"),
    Flag(("--spec-draft-p-min", "--draft-p-min"), "spec_p_min", G_SPEC, "stop drafting when the draft model's top "
         "probability is below P (default: 0.00)", _float, "LLAMA_ARG_SPEC_DRAFT_P_MIN", metavar="P"),
    Flag(("--host",), "host", G_HTTP, "addresses to listen on, comma-separated, or a UNIX socket path ending in "
         ".sock (default: 127.0.0.1)", _csv, "LLAMA_ARG_HOST", metavar="HOST"),
    Flag(("--port",), "port", G_HTTP, "port to listen on (default: 8080)", _int, "LLAMA_ARG_PORT", metavar="PORT"),
    Flag(("--api-key",), "api_keys", G_HTTP, "API keys, comma-separated (default: none)", _csv, "LLAMA_API_KEY",
         metavar="KEY"),
    Flag(("--api-key-file",), "api_keys", G_HTTP, "file with one API key per line, '#' starts a comment",
         _api_key_file, "LLAMA_ARG_API_KEY_FILE", metavar="FNAME"),
    Flag(("--metrics",), "metrics", G_HTTP, "enable the Prometheus /metrics endpoint", None,
         "LLAMA_ARG_ENDPOINT_METRICS"),
    Flag(("--slots",), "slots", G_HTTP, "expose the /slots endpoint (default: on)", None,
         "LLAMA_ARG_ENDPOINT_SLOTS", neg=("--no-slots",)),
    Flag(("--props",), "props", G_HTTP, "allow changing global properties via POST /props", None,
         "LLAMA_ARG_ENDPOINT_PROPS"),
    Flag(("--embedding", "--embeddings"), "embeddings", G_HTTP, "serve embeddings (/v1/embeddings)", None,
         "LLAMA_ARG_EMBEDDINGS"),
    Flag(("--chat-template",), "chat_template", G_HTTP, "Jinja chat template source, or 'chatml' (default: the "
         "model's)", str, "LLAMA_ARG_CHAT_TEMPLATE", metavar="JINJA_TEMPLATE"),
    Flag(("--chat-template-file",), "chat_template_file", G_HTTP, "read the chat template from a file",
         str, "LLAMA_ARG_CHAT_TEMPLATE_FILE", metavar="FNAME"),
    Flag(("--jinja",), "jinja", G_HTTP, "render chat templates with Jinja (default: on)", None,
         "LLAMA_ARG_JINJA", neg=("--no-jinja",)),
    Flag(("--threads-http",), "threads_http", G_HTTP, "threads for tokenizing and templating large requests "
         "(default: -1 = auto)", _int, "LLAMA_ARG_THREADS_HTTP", metavar="N"),
    Flag(("-to", "--timeout"), "timeout", G_HTTP, "idle connection timeout in seconds (default: 3600)", _int,
         "LLAMA_ARG_TIMEOUT", metavar="N"),
    Flag(("--max-body-mib",), "max_body_mib", G_HTTP, "largest request body in MiB; larger ones get 413 "
         "(default: 32)", _positive_int, "RIGSERVE_MAX_BODY_MIB", metavar="N"),
    Flag(("--cache-prompt",), "cache_prompt", G_CACHE, "reuse a slot's KV for a common prompt prefix (default: "
         "on)", None, "LLAMA_ARG_CACHE_PROMPT", neg=("--no-cache-prompt",)),
    Flag(("--cache-reuse",), "cache_reuse", G_CACHE, "min chunk size to reuse from the cache via KV shifting "
         "(default: 0 = off)", _int, "LLAMA_ARG_CACHE_REUSE", metavar="N"),
    Flag(("-cram", "--cache-ram"), "cache_ram_mib", G_CACHE, "host-RAM prompt cache budget in MiB (default: "
         "8192, -1 = no limit, 0 = off)", _int, "LLAMA_ARG_CACHE_RAM", metavar="N"),
    Flag(("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"), "ctx_checkpoints", G_CACHE, "max checkpoints per "
         "slot for recurrent/SWA models (default: 32)", _int, "LLAMA_ARG_CTX_CHECKPOINTS", metavar="N"),
    Flag(("-cms", "--checkpoint-min-step"), "checkpoint_min_step", G_CACHE, "min tokens between two checkpoints "
         "of one prompt (default: 8192)", _int, "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT", metavar="N"),
    Flag(("--slot-save-path",), "slot_save_path", G_CACHE, "directory for saved slot KV caches", str,
         metavar="PATH"),
    Flag(("--log-level",), "log_level", G_LOG, "debug, info, warning or error (default: info)",
         _choice("debug", "info", "warning", "error"), "RIGSERVE_LOG_LEVEL", metavar="LEVEL"),
    Flag(("-v", "--verbose"), "log_level", G_LOG, "same as --log-level debug", None, const="debug"),
    Flag(("--preset",), "preset", G_PRESET, "tuning preset: a name from `app presets list`, a .toml file, or "
         "'none' (default: the preset matching the detected GPUs)", str, "RIGSERVE_PRESET", metavar="NAME|none"),
    Flag(("--config",), "config_file", G_PRESET, "TOML file of these flags by long name (ctx-size = 8192): "
         "above the preset, below the environment and the command line", str, "RIGSERVE_CONFIG",
         metavar="FILE"),
)

# llama-server flags users commonly pass that rigserve does not implement yet: refused by name, never ignored.
UNSUPPORTED_FLAGS = frozenset("""
--draft --draft-n --draft-max --draft-min --draft-n-min --spec-default
-mm --mmproj -mmu --mmproj-url --mmproj-auto --no-mmproj --mmproj-offload --no-mmproj-offload
--lora --lora-scaled --lora-init-without-apply --control-vector --control-vector-scaled
--rope-scaling --rope-scale --rope-freq-base --rope-freq-scale --yarn-orig-ctx --yarn-ext-factor
--yarn-attn-factor --yarn-beta-slow --yarn-beta-fast -gan --grp-attn-n -gaw --grp-attn-w
-hf -hfr --hf-repo -hff --hf-file -hft --hf-token -mu --model-url -dr --docker-repo --offline
--mlock --no-mmap --mmap -dio --direct-io --numa --rpc --override-kv --check-tensors -fit --fit -fitt --fit-target
-fitc --fit-ctx -kvo --kv-offload -nkvo --no-kv-offload --no-op-offload --op-offload --repack --no-repack --no-host
-ncffn --n-cpu-ffn -nocb --no-cont-batching --context-shift --no-context-shift --keep -dt --defrag-thold
--cache-idle-slots --kv-unified-per-slot
-sps --slot-prompt-similarity --sleep-idle-seconds --pooling --rerank --reranking --embd-normalize
--samplers --sampler-seq --sampling-seq -l --logit-bias --mirostat --mirostat-lr --mirostat-ent
--dry-multiplier --dry-base --dry-allowed-length --dry-penalty-last-n --dry-sequence-breaker
--xtc-probability --xtc-threshold --dynatemp-range --dynatemp-exp --top-nsigma --top-n-sigma
--adaptive-target --adaptive-decay --ssl-key-file --ssl-cert-file --api-prefix --path --reuse-port
--cors-origins --cors-methods --cors-headers --cors-credentials --ui --webui --no-ui --no-webui
--ui-config --webui-config --ui-config-file --webui-config-file --ui-mcp-proxy --tools --agent -ag
--mcp-servers-config --mcp-servers-json --models-dir --models-preset --models-max --models-autoload
--media-path --chat-template-kwargs --reasoning-format -rea --reasoning --reasoning-effort --reasoning-budget
--reasoning-budget-message --reasoning-preserve --skip-chat-parsing --prefill-assistant --no-prefill-assistant
--sse-ping-interval --spm-infill --warmup --no-warmup --tags --log-file --log-disable --log-colors
--log-prefix --log-timestamps --log-jsonl --log-prompts-dir -lv --verbosity --log-verbosity
-C --cpu-mask -Cr --cpu-range --cpu-strict --prio --poll -Cb --cpu-mask-batch -Crb --cpu-range-batch
--cpu-strict-batch --prio-batch --poll-batch -lcs --lookup-cache-static -lcd --lookup-cache-dynamic
""".split())


# ---- argument parsing ----------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print and exit; callers want an exception
        raise ConfigError(message)


class _Ordered(argparse.Action):
    """Records (flag, raw value) in argv order, so later flags win and accumulating flags keep their order."""

    def __call__(self, parser, namespace, values, option_string=None):
        seq = getattr(namespace, "_seq", None)
        if seq is None:
            seq = []
            setattr(namespace, "_seq", seq)
        seq.append((self.dest, option_string, values))


def _build_parser() -> tuple[_Parser, dict[str, tuple[Flag, bool]]]:
    parser = _Parser(prog="app serve", usage="app serve -m MODEL.gguf [flags]", add_help=False,
                     allow_abbrev=False, description="Serve a GGUF model over HTTP with llama-server's API and flags.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    groups: dict[str, argparse._ArgumentGroup] = {}
    by_name: dict[str, tuple[Flag, bool]] = {}
    for i, f in enumerate(FLAGS):
        g = groups.get(f.group) or groups.setdefault(f.group, parser.add_argument_group(f.group))
        env = f" (env: {f.env})" if f.env else ""
        env = (f"; {', '.join(f.neg)} turns it off" if f.neg else "") + env
        key = str(i)  # each flag gets its own argparse dest; the real dest is looked up by index
        if f.conv is None:
            g.add_argument(*f.names, dest=key, nargs=0, action=_Ordered, help=f.help + env)
            if f.neg:
                g.add_argument(*f.neg, dest=key, nargs=0, action=_Ordered, help=argparse.SUPPRESS)
        else:
            g.add_argument(*f.names, dest=key, action=_Ordered, metavar=f.metavar or "VALUE", help=f.help + env)
        for n in f.names:
            by_name[n] = (f, True)
        for n in f.neg:
            by_name[n] = (f, False)
    g = parser.add_argument_group("Help")
    g.add_argument("-h", "--help", dest="_help", nargs=0, action=_Ordered, help="show this help and exit")
    return parser, by_name


def _normalize_argv(argv: Iterable[str]) -> list[str]:
    # llama-server accepts `--ctx_size` for `--ctx-size`; only the name part of `--name=value` is touched
    out = []
    for a in argv:
        if a.startswith("--") and len(a) > 2:
            name, eq, val = a.partition("=")
            a = name.replace("_", "-") + eq + val
        out.append(a)
    return out


def _unknown_flag_error(arg: str, known: Iterable[str]) -> ConfigError:
    name = arg.split("=", 1)[0]
    if name in UNSUPPORTED_FLAGS:
        return ConfigError(f"`{name}` is a llama-server flag rigserve does not support yet")
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    hint = f" (did you mean `{close[0]}`?)" if close else ""
    return ConfigError(f"unknown flag `{name}`{hint}; `app serve --help` lists the flags")


def _convert(conv: Callable[[str], Any], name: str, raw: str, where: str) -> Any:
    try:
        return conv(raw)
    except ValueError as e:
        raise ConfigError(f"invalid value for {where} {name}: {e}") from None


def _apply(values: dict[str, Any], dest: str, value: Any) -> None:
    if dest in _ACCUMULATE:
        values[dest] = list(values.get(dest) or []) + list(value)
    else:
        values[dest] = value


def _apply_env(values: dict[str, Any], environ: Mapping[str, str]) -> None:
    """Environment: between config layers and the command line, read as llama-server reads it."""
    for f in FLAGS:
        if not f.env:
            continue
        neg_env = f.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_") if f.neg else None
        if neg_env and neg_env in environ:
            _apply(values, f.dest, False)
            continue
        if f.env not in environ:
            continue
        raw = environ[f.env]
        if f.conv is not None:
            _apply(values, f.dest, _convert(f.conv, f.env, raw, "environment variable"))
        elif f.neg:  # a switch with a negative form takes a boolean
            _apply(values, f.dest, _convert(_bool, f.env, raw, "environment variable"))
        elif raw.strip().lower() in _TRUTHY:  # a plain switch is set by a truthy value only, like upstream
            _apply(values, f.dest, f.const)


def _check_names(argv: list[str], by_name: dict[str, tuple[Flag, bool]]) -> None:
    """Refuse unknown names before argparse sees them: like llama-server, a flag must match a name exactly
    (argparse alone would read `-md` as `-m d`)."""
    i = 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0] if a.startswith("--") else a
        if name in by_name:
            f = by_name[name][0]
            if f.conv is not None and "=" not in a:
                i += 1  # the next token is this flag's value, whatever it looks like
        elif name not in ("-h", "--help") and a.startswith("-") and len(a) > 1 and not _looks_numeric(a):
            raise _unknown_flag_error(a, by_name)
        i += 1


def _apply_argv(values: dict[str, Any], argv: list[str]) -> None:
    parser, by_name = _build_parser()
    _check_names(argv, by_name)
    ns, extra = parser.parse_known_args(argv)
    if extra:
        raise ConfigError(f"unexpected argument `{extra[0]}` (flags take their value right after the name)")
    for key, name, raw in getattr(ns, "_seq", []):
        if key == "_help":
            raise HelpRequested(format_help())
        f, positive = by_name[name]
        if f.conv is None:
            _apply(values, f.dest, f.const if positive else False)
        else:
            _apply(values, f.dest, _convert(f.conv, name, raw, "flag"))


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def format_help() -> str:
    """The grouped `app serve --help` text."""
    parser, _ = _build_parser()
    return parser.format_help()


# ---- building settings ---------------------------------------------------------------------------------------


def _physical_cores() -> int:
    # upstream's default thread count is the number of physical cores (hyperthreads slow decoding down)
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # psutil missing or unable to tell: fall back to logical CPUs
        n = None
    return max(1, n or os.cpu_count() or 1)


_SAMPLING_DESTS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n",
                   "presence_penalty", "frequency_penalty", "ignore_eos")


def _sampling_defaults(v: Mapping[str, Any]) -> "SamplingParams":
    from app.runtime.api import SamplingParams  # imported here: the runtime package imports this module

    seed = v.get("seed", -1)
    return SamplingParams(**{k: v[k] for k in _SAMPLING_DESTS if k in v},
                          seed=None if seed in (-1, 0xFFFFFFFF) else seed)


def _check_values(v: Mapping[str, Any]) -> None:
    if not 0 <= v.get("port", 8080) <= 65535:
        raise ConfigError(f"invalid value for --port: {v['port']} is not a port number (0-65535)")
    if v.get("n_parallel", -1) == 0:
        raise ConfigError("invalid value for -np/--parallel: 0 (use -1 for auto or a positive count)")
    if v.get("repeat_penalty", 1.0) <= 0:
        raise ConfigError("invalid value for --repeat-penalty: must be greater than 0")
    if v.get("repeat_last_n", 64) < 0:
        raise ConfigError("invalid value for --repeat-last-n: must be >= 0")
    path = v.get("slot_save_path")
    if path is not None and not Path(path).is_dir():
        raise ConfigError(f"invalid value for --slot-save-path: not a directory: {path}")


def _model_settings(v: Mapping[str, Any]) -> ModelSettings:
    path = v.get("model")
    aliases = tuple(dict.fromkeys(a.strip() for a in v.get("alias", ()) if a.strip()))
    # llama-server keeps aliases in a sorted set and names the model after the first one
    alias = sorted(aliases)[0] if aliases else (path or "")
    return ModelSettings(
        path=path, alias=alias, aliases=aliases or ((path,) if path else ()),
        n_gpu_layers=v.get("n_gpu_layers", -1), split_mode=v.get("split_mode", "layer"),
        tensor_split=tuple(v.get("tensor_split", ())), main_gpu=v.get("main_gpu", 0),
        devices=tuple(v.get("devices", ())),
        tensor_buft_overrides=tuple(tuple(x) for x in v.get("tensor_buft_overrides", ())),
        load_mtp=bool(v.get("load_mtp", False)),
    )


def _spec_settings(v: Mapping[str, Any]) -> SpecSettings:
    draft = v.get("spec_draft_model")
    kind = v.get("spec_type")
    if kind is None:  # like upstream, a draft model alone means draft-model speculation
        kind = "draft-simple" if draft else "none"
    kind = "draft-mtp" if kind == "mtp" else kind
    if kind == "draft-simple" and not draft:
        raise ConfigError("--spec-type draft-simple needs a draft model: -md/--model-draft FNAME")
    p_min = v.get("spec_p_min", 0.0)
    if not 0.0 <= p_min <= 1.0:
        raise ConfigError(f"invalid value for --spec-draft-p-min: {p_min} is not a probability (0-1)")
    return SpecSettings(
        type=kind, draft_model=draft, draft_n_gpu_layers=v.get("spec_draft_ngl", -1),
        draft_devices=tuple(v.get("spec_draft_devices", ())), draft_type_k=v.get("spec_draft_type_k", "f16"),
        draft_type_v=v.get("spec_draft_type_v", "f16"), n_max=v.get("spec_n_max", 3),
        n_min=v.get("spec_n_min", 0), p_min=p_min,
    )


def _runtime_settings(v: Mapping[str, Any], model: ModelSettings) -> RuntimeSettings:
    n_parallel = v.get("n_parallel", -1)
    kv_unified = bool(v.get("kv_unified", False))
    if n_parallel < 0:  # llama-server's auto: 4 slots sharing one unified KV buffer
        n_parallel, kv_unified = 4, True
    n_threads = v.get("n_threads", -1)
    n_threads = n_threads if n_threads > 0 else _physical_cores()
    n_threads_batch = v.get("n_threads_batch", -1)
    n_threads_batch = n_threads_batch if n_threads_batch > 0 else n_threads
    n_batch, n_ubatch = v.get("n_batch", 2048), v.get("n_ubatch", 512)
    embeddings = bool(v.get("embeddings", False))
    if embeddings and n_batch > n_ubatch:  # upstream: an embedding must fit one ubatch
        n_batch = n_ubatch
    return RuntimeSettings(
        model=model, n_ctx=v.get("n_ctx", 0), n_batch=n_batch, n_ubatch=n_ubatch, n_parallel=n_parallel,
        n_threads=n_threads, n_threads_batch=n_threads_batch, flash_attn=v.get("flash_attn", "auto"),
        type_k=v.get("type_k", "f16"), type_v=v.get("type_v", "f16"), kv_unified=kv_unified,
        swa_full=bool(v.get("swa_full", False)), embeddings=embeddings,
        cache_prompt=bool(v.get("cache_prompt", True)), cache_reuse=v.get("cache_reuse", 0),
        cache_ram_mib=v.get("cache_ram_mib", 8192), ctx_checkpoints=max(0, v.get("ctx_checkpoints", 32)),
        checkpoint_min_step=_checked_min_step(v.get("checkpoint_min_step", 8192)),
        queue_size=v.get("queue_size") or max(256, 4 * n_parallel), sampling=_sampling_defaults(v),
        n_predict=v.get("n_predict", -1), backend_sampling=bool(v.get("backend_sampling", True)),
        slot_save_path=v.get("slot_save_path"), spec=_spec_settings(v),
    )


def _http_settings(v: Mapping[str, Any]) -> HttpSettings:
    hosts = tuple(h.strip() for h in v.get("host", ["127.0.0.1"]) if h.strip())
    if not hosts:
        raise ConfigError("invalid value for --host: at least one address is needed")
    template_file = v.get("chat_template_file")
    template = v.get("chat_template")
    if template_file is not None:  # the file overrides an inline template
        template = _convert(_read_text, "--chat-template-file", template_file, "flag")
    elif template is not None and template.strip() != "chatml" and "{{" not in template and "{%" not in template:
        raise ConfigError(f"invalid value for --chat-template: '{template}' is neither Jinja source nor 'chatml' "
                          "(llama.cpp's other built-in template names are not supported; pass the template's "
                          "Jinja source or --chat-template-file)")
    return HttpSettings(
        host=hosts[0], hosts=hosts, port=v.get("port", 8080), api_keys=tuple(v.get("api_keys", ())),
        metrics=bool(v.get("metrics", False)), slots=bool(v.get("slots", True)), props=bool(v.get("props", False)),
        threads_http=v.get("threads_http", -1), timeout=v.get("timeout", 3600),
        max_body_bytes=v.get("max_body_mib", 32) << 20, chat_template=template,
        chat_template_file=template_file, jinja=bool(v.get("jinja", True)), grammar=v.get("grammar"),
        json_schema=v.get("json_schema"),
    )


def layer_sources(argv: list[str], environ: Mapping[str, str] = os.environ) -> tuple[str | None, str | None]:
    """(--preset, --config) from the command line, else RIGSERVE_PRESET / RIGSERVE_CONFIG, else None.

    Read before load_settings, because their values decide the `layers` load_settings is given.
    """
    found: dict[str, str | None] = {"preset": environ.get("RIGSERVE_PRESET") or None,
                                    "config_file": environ.get("RIGSERVE_CONFIG") or None}
    _, by_name = _build_parser()
    args = _normalize_argv(argv)
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
        ref = by_name.get(name)
        if ref is not None and ref[0].conv is not None and not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
            i += 1  # the next token is this flag's value, whatever it looks like
        if ref is not None and ref[0].dest in found and value:
            found[ref[0].dest] = value
        i += 1
    return found["preset"], found["config_file"]


def _checked_min_step(n: int) -> int:
    if n < 0:
        raise ConfigError("checkpoint-min-step must be non-negative")
    return n


def load_settings(
    argv: list[str],
    environ: Mapping[str, str] = os.environ,
    *,
    layers: Iterable[Mapping[str, Any]] = (),
    default_model: str | None = None,
) -> Settings:
    """Resolve settings: defaults < `layers` (presets, config file) < environment < command line.

    `layers` map flag destinations (e.g. "n_ctx", "n_gpu_layers", "tensor_buft_overrides") to parsed values.
    Raises ConfigError for a bad value, an unknown or unsupported flag; HelpRequested for -h/--help.
    """
    values: dict[str, Any] = {}
    if default_model:
        values["model"] = default_model
    for layer in layers:
        for k, val in layer.items():
            _apply(values, k, val)
    _apply_env(values, environ)
    _apply_argv(values, _normalize_argv(argv))
    _check_values(values)
    model = _model_settings(values)
    return Settings(
        runtime=_runtime_settings(values, model),
        http=_http_settings(values),
        log_level=values.get("log_level", "info"),
    )
