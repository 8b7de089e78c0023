"""Write GGUF models with random weights of real shapes, loadable by upstream llama.cpp (`app model synth`).

Tensor data is random ggml blocks generated in parallel chunks (each chunk has its own seeded generator, so the
file is the same whatever the thread count) and streamed to disk in order; only a window of chunks is in
memory. Every value is a pure function of (seed, tensor name, chunk), which is what makes `noisy_of` drafts
exact copies of their target's first layers before the noise is added. See docs/synthetic-models.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from app.models import synth_blocks as sb
from app.models import synth_gguf as gg
from app.models.synth_plan import TensorSpec, plan_metadata, plan_tensors
from app.models.synth_shapes import ARCHS, DEFAULT_VOCAB, MTP_ARCHS, Shape, get_shape

SYNTH_KEY = "rigserve.synth."
_CHUNK_BYTES = 8 << 20  # one generator per 8 MiB of output: small enough to spread over threads and stay in cache
_NOISE_TAG = 1
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class SynthOptions:
    """Everything that decides a synthetic model's bytes (plus how to write it)."""

    arch: str = "llama"
    shape: str = "tiny"
    qtype: str = "q4_0"
    seed: int = 0
    layers: int | None = None
    vocab: str | None = None
    route_skew: float = 0.0
    layer_scale: float = 1.0
    noise: float = 0.0
    mtp: bool = False
    noisy_of: str | None = None


def vocab_dir() -> Path:
    """Where the ggml-vocab-*.gguf files are: app/_lib/vocab (installed by build.py), else an unpacked source."""
    installed = Path(__file__).resolve().parents[1] / "_lib" / "vocab"
    if installed.is_dir():
        return installed
    # Before build.py has installed them: the pinned sdist unpacked in the repo's cache or by hand under /tmp/dl.
    # Fixed depths, not "**": the build cache can hold whole source trees.
    repo, models = Path(__file__).resolve().parents[2], "vendor/llama.cpp/models"
    candidates = [*repo.glob(f".cache/*/{models}"), *repo.glob(f".cache/*/*/{models}"),
                  *Path("/tmp/dl").glob(f"llama_cpp_python-*/{models}")]
    for found in sorted(candidates):
        if (found / "ggml-vocab-llama-bpe.gguf").is_file():
            return found
    raise FileNotFoundError("no ggml-vocab-*.gguf files: `python3 build.py engine` installs them into app/_lib/vocab")


def vocab_path(vocab: str) -> Path:
    """A vocab name (`qwen2` -> ggml-vocab-qwen2.gguf) or the path of any GGUF with tokenizer.* keys."""
    as_path = Path(vocab)
    if as_path.suffix == ".gguf" and as_path.is_file():
        return as_path
    found = vocab_dir() / f"ggml-vocab-{vocab}.gguf"
    if not found.is_file():
        names = sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in vocab_dir().glob("ggml-vocab-*.gguf"))
        raise ValueError(f"unknown vocab {vocab!r}; choose one of {', '.join(names)} or give a .gguf path")
    return found


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _rng(seed: int, name: str, chunk: int, tag: int = 0) -> np.random.Generator:
    h = _name_hash(name)
    words = [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, h & 0xFFFFFFFF, h >> 32, chunk, tag]
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence(words)))


def _tensor_std(spec: TensorSpec, o: SynthOptions) -> float:
    return spec.std * (o.layer_scale if spec.layer_scaled else 1.0)


def _fill_chunk(spec: TensorSpec, o: SynthOptions, chunk: int, n_values: int) -> np.ndarray:
    data = sb.fill_blocks(spec.type, n_values, _tensor_std(spec, o), _rng(o.seed, spec.name, chunk))
    if o.noise > 0:
        sb.add_code_noise(spec.type, data, o.noise, _rng(o.seed, spec.name, chunk, _NOISE_TAG))
    return data


def _router(spec: TensorSpec, o: SynthOptions, base: np.ndarray) -> np.ndarray:
    """Scale router rows so a few experts are popular; see docs/synthetic-models.md ("Route skew").

    An expert whose row is longer gets larger |logits| for random hidden states, so it is in the top-k more
    often: popularity follows the row norm without any common direction that would bias the rest of the model.
    Norms (rank+1)^(-S/2) give selection frequencies close to Zipf with exponent S for S <= 1.
    """
    n_expert = spec.ne[1]
    rows = base.reshape(n_expert, spec.ne[0])
    if o.route_skew > 0:
        rank = _rng(o.seed, spec.name, 0, 2).permutation(n_expert)  # hot experts differ from layer to layer
        norms = (rank + 1.0) ** (-o.route_skew / 2)
        rows *= (norms / math.sqrt(float(np.mean(norms ** 2))))[:, None].astype(np.float32)
    return rows.reshape(-1)


def _eh_proj(spec: TensorSpec, o: SynthOptions, base: np.ndarray) -> np.ndarray:
    """MTP input projection: identity on the token-embedding half plus layer-scaled noise.

    The MTP head then predicts roughly what the trunk predicts one token later when layers are weak, so its
    draft acceptance follows --layer-scale like a noisy draft's does.
    """
    n = spec.ne[1]
    w = base.reshape(n, spec.ne[0]) * np.float32(o.layer_scale)
    w[np.arange(n), np.arange(n)] += 1.0
    return w.reshape(-1)


def _fill_small(spec: TensorSpec, o: SynthOptions) -> np.ndarray:
    """The f32/f16 tensors that are generated whole: norms, recurrent parameters, routers, eh_proj."""
    rng, n = _rng(o.seed, spec.name, 0), spec.n_values
    if spec.kind == "ones":
        return np.ones(n, np.float32).view(np.uint8)
    if spec.kind == "ssm_a":  # -exp(A_log) with A in [1, 16]: decays between e^-1 and e^-16 per unit of dt
        return (-rng.uniform(1.0, 16.0, n)).astype(np.float32).view(np.uint8)
    if spec.kind == "ssm_dt":  # bias whose softplus is a dt log-uniform in [1e-3, 1e-1]
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), n))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32).view(np.uint8)
    vals = rng.standard_normal(n, dtype=np.float32) * np.float32(spec.std)
    if o.noise > 0:
        noise = _rng(o.seed, spec.name, 0, _NOISE_TAG).standard_normal(n, dtype=np.float32)
        vals += noise * np.float32(o.noise * spec.std)
    if spec.kind == "router":
        vals = _router(spec, o, vals)
    elif spec.kind == "eh_proj":
        return _eh_proj(spec, o, vals).astype(np.float16).view(np.uint8)
    return vals.view(np.uint8)


def _jobs(specs: list[TensorSpec], o: SynthOptions):
    """(callable, padding after it) per unit of work, in file order; block tensors split into fixed-size chunks."""
    for spec in specs:
        pad = (-spec.n_bytes) % gg.ALIGNMENT
        if spec.kind != "blocks":
            yield (lambda spec=spec: _fill_small(spec, o)), pad
            continue
        per, size = sb.BLOCK[spec.type]
        chunk_values = max(1, _CHUNK_BYTES // size) * per
        starts = range(0, spec.n_values, chunk_values)
        for i, start in enumerate(starts):
            n = min(chunk_values, spec.n_values - start)
            yield (lambda spec=spec, i=i, n=n: _fill_chunk(spec, o, i, n)), (pad if i == len(starts) - 1 else 0)


def _stream(f, specs: list[TensorSpec], o: SynthOptions, threads: int, progress: Progress | None) -> None:
    """Fill chunks on `threads` workers and write them in order, keeping at most 2*threads chunks in memory."""
    total, done = sum(s.n_bytes for s in specs), 0
    jobs, window = _jobs(specs, o), deque()
    with ThreadPoolExecutor(max_workers=threads) as pool:

        def submit() -> None:
            job = next(jobs, None)
            if job is not None:
                window.append((pool.submit(job[0]), job[1]))

        for _ in range(2 * threads):
            submit()
        while window:
            fut, pad = window.popleft()
            submit()
            data = fut.result()
            f.write(memoryview(data))
            if pad:
                f.write(bytes(pad))
            done += data.nbytes
            if progress:
                progress(done, total)


def _resolve_noisy_of(o: SynthOptions) -> SynthOptions:
    """A draft of a synthetic target: its seed, shape, type, vocab and scales, with fewer layers by default."""
    head = gg.read_header(o.noisy_of)
    kv = head.kv
    if SYNTH_KEY + "seed" not in kv:
        raise ValueError(f"{o.noisy_of} was not written by `app model synth`; --noisy-of needs a synthetic target")
    target_layers = int(kv[f"{kv['general.architecture']}.block_count"]) - int(kv.get(SYNTH_KEY + "mtp", False))
    layers = o.layers if o.layers is not None else min(2, target_layers)
    return replace(
        o, arch=str(kv["general.architecture"]), shape=str(kv[SYNTH_KEY + "shape"]), qtype=str(kv[SYNTH_KEY + "type"]),
        seed=int(kv[SYNTH_KEY + "seed"]), vocab=str(kv[SYNTH_KEY + "vocab"]), layers=layers,
        route_skew=float(kv[SYNTH_KEY + "route_skew"]),
        layer_scale=o.layer_scale if o.layer_scale != 1.0 else float(kv[SYNTH_KEY + "layer_scale"]),
    )


def _metadata(o: SynthOptions, arch_records: list[bytes], vocab_file: Path, qtype: int) -> list[bytes]:
    recs = [
        gg.pack_kv("general.architecture", o.arch, gg.STR),
        gg.pack_kv("general.name", f"synth-{o.arch}-{o.shape}-{o.qtype}" + ("-draft" if o.noisy_of else ""), gg.STR),
        gg.pack_kv("general.file_type", sb.FILE_TYPE[qtype], gg.U32),
        gg.pack_kv("general.quantization_version", 2, gg.U32),
    ] + arch_records
    synth = {"shape": (o.shape, gg.STR), "type": (o.qtype, gg.STR), "seed": (o.seed, gg.U64),
             "vocab": (o.vocab, gg.STR), "layer_scale": (o.layer_scale, gg.F32), "route_skew": (o.route_skew, gg.F32),
             "noise": (o.noise, gg.F32), "mtp": (o.mtp, gg.BOOL), "noisy_of": (Path(o.noisy_of or "").name, gg.STR)}
    recs += [gg.pack_kv(SYNTH_KEY + k, v, t) for k, (v, t) in synth.items()]
    return recs + [raw for _, raw in gg.tokenizer_records(str(vocab_file))]


def _validate(o: SynthOptions) -> SynthOptions:
    if o.arch not in ARCHS:
        raise ValueError(f"unknown architecture {o.arch!r}; choose one of {', '.join(ARCHS)}")
    if o.qtype not in sb.QTYPES:
        raise ValueError(f"unknown type {o.qtype!r}; choose one of {', '.join(sb.QTYPES)}")
    if o.mtp and o.arch not in MTP_ARCHS:
        raise ValueError(f"--mtp: upstream loads MTP (nextn) layers only for {', '.join(MTP_ARCHS)}, not {o.arch}")
    if o.layer_scale <= 0 or o.noise < 0 or o.route_skew < 0 or o.seed < 0:
        raise ValueError("--layer-scale must be > 0; --noise, --route-skew and --seed must be >= 0")
    return replace(o, vocab=o.vocab or DEFAULT_VOCAB[o.arch], seed=int(o.seed))


@dataclass
class Plan:
    """A validated model: its options, shape, tensors and metadata records, ready to write."""

    options: SynthOptions
    shape: Shape
    specs: list[TensorSpec]
    records: list[bytes]
    n_vocab: int

    @property
    def n_bytes(self) -> int:
        return sum(s.n_bytes for s in self.specs)


def plan_model(o: SynthOptions) -> Plan:
    """Resolve --noisy-of, check every option and lay out the tensors; raises ValueError on bad options."""
    if o.noisy_of:
        o = _resolve_noisy_of(o)
    o = _validate(o)
    shape = get_shape(o.arch, o.shape, o.layers)
    if o.route_skew and not shape.is_moe:
        raise ValueError(f"--route-skew needs a mixture-of-experts architecture (qwen3moe, qwen35moe), not {o.arch}")
    vocab_file = vocab_path(o.vocab)
    n_vocab = gg.vocab_size(gg.tokenizer_records(str(vocab_file)))
    qtype = sb.QTYPES[o.qtype]
    specs = plan_tensors(o.arch, shape, n_vocab, qtype, o.mtp)
    records = _metadata(o, plan_metadata(o.arch, shape, n_vocab, o.mtp), vocab_file, qtype)
    return Plan(o, shape, specs, records, n_vocab)


def build(path: Path, plan: Plan | SynthOptions, threads: int | None = None, progress: Progress | None = None) -> dict:
    """Write a model to `path` (atomically, through a .part file); returns a summary (bytes, seconds, counts)."""
    if isinstance(plan, SynthOptions):
        plan = plan_model(plan)
    t0 = time.perf_counter()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")  # per process: parallel test workers may race
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb", buffering=0) as f:
            gg.write_header(f, plan.records, [(s.name, s.ne, s.type, s.n_bytes) for s in plan.specs])
            _stream(f, plan.specs, plan.options, threads or os.cpu_count() or 1, progress)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # an interrupted write leaves nothing behind
    qtype = sb.QTYPES[plan.options.qtype]
    fallback = sum(1 for s in plan.specs if s.kind == "blocks" and s.type != qtype)
    return {"path": str(path), "bytes": path.stat().st_size, "seconds": time.perf_counter() - t0,
            "n_tensors": len(plan.specs), "n_layer": plan.shape.n_layer, "n_vocab": plan.n_vocab,
            "fallback_tensors": fallback, "options": asdict(plan.options)}


def write_model(path: str | Path, arch: str = "llama", shape: str = "tiny", qtype: str = "q4_0", seed: int = 0,
                *, force: bool = True, threads: int | None = None, progress: Progress | None = None, **opts) -> Path:
    """Write a synthetic model and return its path. `opts`: the other SynthOptions fields (layers, vocab,
    route_skew, layer_scale, noise, mtp, noisy_of). Raises FileExistsError when the file exists and not force."""
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists (use --force to overwrite)")
    build(path, SynthOptions(arch=arch, shape=shape, qtype=qtype, seed=seed, **opts), threads, progress)
    return path


def tiny_model(tmp_dir: str | Path, arch: str = "llama", **opts) -> Path:
    """A cached tiny model for tests: written once per parameter set into tmp_dir, then reused."""
    params = {"arch": arch, "shape": "tiny", "qtype": "q4_0", "seed": 0, **opts}
    key = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:12]
    path = Path(tmp_dir) / f"synth-{arch}-{key}.gguf"
    if not path.exists():
        write_model(path, **params)
    return path


def read_tensor(path: str | Path, name: str) -> np.ndarray:
    """The float values of one tensor of a GGUF file written by this module (f32, f16 or our blocks)."""
    head = gg.read_header(path)
    info = next((t for t in head.tensors if t.name == name), None)
    if info is None:
        raise KeyError(f"{path} has no tensor {name}")
    size = sb.nbytes(info.type, math.prod(info.ne))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=head.data_offset + info.offset, shape=(size,))
    return sb.decode_blocks(info.type, np.array(raw)).reshape(tuple(reversed(info.ne)))


def route_popularity(path: str | Path, layer: int = 0, n_tokens: int = 8192, seed: int = 1) -> np.ndarray:
    """How often each expert of `layer` is picked, on random unit-RMS hidden states (what RMSNorm feeds it).

    Returns one frequency per expert (they sum to n_expert_used), sorted hottest first.
    """
    kv = gg.read_header(path).kv
    k = int(kv[f"{kv['general.architecture']}.expert_used_count"])
    router = read_tensor(path, f"blk.{layer}.ffn_gate_inp.weight")  # (n_expert, n_embd)
    x = np.random.default_rng(seed).standard_normal((n_tokens, router.shape[1]), dtype=np.float32)
    x /= np.sqrt(np.mean(x * x, axis=1, keepdims=True))
    top = np.argpartition(-(x @ router.T), k - 1, axis=1)[:, :k]
    return np.sort(np.bincount(top.ravel(), minlength=router.shape[0]) / n_tokens)[::-1]


def describe_popularity(freq: np.ndarray) -> str:
    """One line: what share of the routing the hottest experts get."""
    share = freq / freq.sum()
    n10 = max(1, len(freq) // 10)
    return (f"hottest expert picked for {freq[0]:.0%} of tokens ({freq[0] / freq.mean():.1f}x the mean); "
            f"hottest {n10} of {len(freq)} experts take {share[:n10].sum():.0%} of the routing")
