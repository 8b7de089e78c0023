"""The synthetic-model writer: metadata, symmetric blocks, drafts, determinism and loading with upstream."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import numpy as np
import pytest

from app.models import synth
from app.models import synth_blocks as sb
from app.models import synth_gguf as gg
from app.models.synth import read_tensor, route_popularity, tiny_model, write_model

REPO = Path(__file__).resolve().parents[1]
VARIANTS = [("llama", False), ("qwen3", False), ("qwen3moe", False), ("qwen35", False), ("qwen35", True),
            ("qwen35moe", False), ("qwen35moe", True)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("synth")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch,mtp", VARIANTS)
def test_tiny_writes_with_the_metadata_upstream_reads(cache, arch, mtp):
    path = tiny_model(cache, arch, mtp=mtp)
    head = gg.read_header(path)
    kv = head.kv
    plan = synth.plan_model(synth.SynthOptions(arch=arch, mtp=mtp))
    assert kv["general.architecture"] == arch
    assert kv[f"{arch}.block_count"] == plan.shape.n_layer + int(mtp)
    assert kv.get(f"{arch}.nextn_predict_layers", 0) == int(mtp)
    assert [t.name for t in head.tensors] == [s.name for s in plan.specs]
    assert {t.type for t in head.tensors} <= {sb.F32, sb.F16, sb.Q4_0}
    n_vocab = kv["tokenizer.ggml.tokens"].n
    assert head.tensors[0].ne == (kv[f"{arch}.embedding_length"], n_vocab) == (plan.shape.n_embd, n_vocab)
    assert path.stat().st_size < 32 << 20  # "a few MB": the vocab matrices dominate


def test_gguf_package_reads_what_we_write(cache):
    gguf = pytest.importorskip("gguf")
    # the small llama-spm vocab keeps gguf-py's reader to a couple of seconds
    path = tiny_model(cache, "qwen35moe", mtp=True, vocab="llama-spm", qtype="q8_0")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "qwen35moe"
    assert reader.fields["qwen35moe.block_count"].contents() == 5
    ours = gg.read_header(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert keys == list(ours.kv)
    for key in keys:
        theirs, mine = reader.fields[key].contents(), ours.kv[key]
        if isinstance(mine, gg.ArrayInfo):
            assert len(theirs) == mine.n, key
        elif isinstance(mine, float):
            assert theirs == pytest.approx(mine), key
        else:
            assert theirs == mine, key
    assert len(reader.tensors) == len(ours.tensors)
    for theirs, mine in zip(reader.tensors, ours.tensors):
        assert theirs.name == mine.name and tuple(int(n) for n in theirs.shape) == mine.ne
        assert int(theirs.tensor_type) == mine.type
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    values = gguf.quants.dequantize(embd.data, embd.tensor_type)
    np.testing.assert_array_equal(values, read_tensor(path, "token_embd.weight"))


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_k", "f16"])
def test_blocks_decode_symmetric_with_the_requested_std(qtype):
    gguf = pytest.importorskip("gguf")
    t = sb.QTYPES[qtype]
    data = sb.fill_blocks(t, 256 * 2048, 0.02, np.random.Generator(np.random.SFC64(7)))
    values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t)).reshape(-1)
    np.testing.assert_array_equal(values, sb.decode_blocks(t, data))
    assert abs(values.mean()) < 0.005 * values.std()
    assert values.std() == pytest.approx(0.02, rel=0.01)
    assert np.abs(values).max() <= 0.02 * 4  # uniform codes: no outliers


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_written_tensors_are_zero_mean(cache, qtype):
    path = tiny_model(cache, "qwen3", qtype=qtype)
    for name in ("token_embd.weight", "output.weight", "blk.0.ffn_down.weight"):
        values = read_tensor(path, name)
        assert abs(values.mean()) < 0.01 * values.std(), name
        # no common direction: the mean row is as small as the average of independent rows would be
        mean_row = values.mean(axis=0)
        assert np.linalg.norm(mean_row) < 3 * values.std() * np.sqrt(values.shape[1] / values.shape[0])


def test_noisy_draft_keeps_width_and_vocab_and_drops_layers(cache, tmp_path):
    target = tiny_model(cache, "llama", layers=6, layer_scale=0.05)
    exact = write_model(tmp_path / "exact.gguf", noisy_of=str(target))
    noisy = write_model(tmp_path / "noisy.gguf", noisy_of=str(target), noise=0.1)
    t_kv, d_kv = gg.read_header(target).kv, gg.read_header(noisy).kv
    for key in ("llama.embedding_length", "llama.vocab_size", "llama.feed_forward_length", "rigserve.synth.seed"):
        assert d_kv[key] == t_kv[key]
    assert (t_kv["llama.block_count"], d_kv["llama.block_count"]) == (6, 2)
    assert d_kv["rigserve.synth.layer_scale"] == pytest.approx(0.05)
    for name in ("token_embd.weight", "blk.1.attn_q.weight", "output.weight"):
        base = read_tensor(target, name)
        np.testing.assert_array_equal(read_tensor(exact, name), base)
        corr = np.corrcoef(base.ravel(), read_tensor(noisy, name).ravel())[0, 1]
        assert 0.97 < corr < 0.999, name


def test_same_seed_same_bytes_whatever_the_thread_count(tmp_path):
    a = write_model(tmp_path / "a.gguf", arch="qwen35moe", seed=3, threads=1, route_skew=1.0)
    b = write_model(tmp_path / "b.gguf", arch="qwen35moe", seed=3, threads=3, route_skew=1.0)
    c = write_model(tmp_path / "c.gguf", arch="qwen35moe", seed=4, threads=3, route_skew=1.0)
    assert _sha(a) == _sha(b) != _sha(c)


def test_route_skew_makes_a_few_experts_popular(cache):
    flat = route_popularity(tiny_model(cache, "qwen3moe"))
    skewed = route_popularity(tiny_model(cache, "qwen3moe", route_skew=2.0))
    k = 4  # tiny: 16 experts, 4 used
    assert flat.sum() == pytest.approx(k) and skewed.sum() == pytest.approx(k)
    assert flat[0] < 0.35 and skewed[0] > 0.42  # the mean is 0.25; the most a symmetric router allows is 0.5
    assert skewed[:2].sum() > flat[:2].sum() + 0.2


@pytest.mark.parametrize("opts,message", [
    (dict(arch="gpt9"), "unknown architecture"),
    (dict(shape="9b"), "unknown shape"),
    (dict(qtype="q3_k"), "unknown type"),
    (dict(mtp=True), "MTP"),
    (dict(route_skew=1.0), "mixture-of-experts"),
    (dict(arch="qwen35", layers=1), "at least 2 layers"),
    (dict(vocab="klingon"), "unknown vocab"),
    (dict(seed=-1), "must be >= 0"),
])
def test_bad_options_say_what_is_wrong(opts, message):
    with pytest.raises(ValueError, match=message):
        synth.plan_model(synth.SynthOptions(**opts))


def test_noisy_of_needs_a_synthetic_target(tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(Path(synth.vocab_path("llama-spm")).read_bytes())
    with pytest.raises(ValueError, match="not written by"):
        synth.plan_model(synth.SynthOptions(noisy_of=str(other)))


def test_cli_writes_and_refuses_to_overwrite(tmp_path):
    from typer.testing import CliRunner

    from app.models.cli import model_app

    out = tmp_path / "m.gguf"
    runner = CliRunner()
    first = runner.invoke(model_app, ["synth", "--arch", "qwen3", "--type", "q8_0", "-o", str(out)])
    assert first.exit_code == 0, first.output
    assert gg.read_header(out).kv["rigserve.synth.type"] == "q8_0"
    again = runner.invoke(model_app, ["synth", "--arch", "qwen3", "-o", str(out)])
    assert again.exit_code == 1 and "exists" in again.output


def _llama_completion() -> Path | None:
    tool = REPO / "app" / "_lib" / "bin" / "llama-completion"
    return tool if tool.is_file() else None


# every architecture once, and MTP on the MoE hybrid (the dense hybrid's nextn block is the same code path)
UPSTREAM_VARIANTS = [v for v in VARIANTS if v != ("qwen35", True)]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def upstream_runs(cache) -> dict:
    """Greedy completions of every variant by upstream llama-completion, run side by side (one thread each)."""
    tool = _llama_completion()
    if tool is None:
        pytest.skip("upstream llama-completion is not built (python3 build.py engine --with-upstream-tools)")
    procs = {}
    for arch, mtp in UPSTREAM_VARIANTS:
        path = tiny_model(cache, arch, mtp=mtp)
        # -nr: no weight repacking; some virtual machines advertise AMX but fault on its tile instructions
        cmd = [str(tool), "-m", str(path), "-p", PROMPT, "-n", "16", "--temp", "0", "-no-cnv", "-c", "256",
               "-t", "1", "-nr", "--no-warmup"]
        procs[arch, mtp] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            encoding="utf-8", errors="replace")
    runs = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        runs[key] = (proc.returncode, out, err)
    return runs


@pytest.mark.parametrize("arch,mtp", UPSTREAM_VARIANTS)
def test_upstream_loads_and_generates_varied_text(upstream_runs, arch, mtp):
    returncode, out, err = upstream_runs[arch, mtp]
    assert returncode == 0 and PROMPT in out, err[-2000:]
    generated = out.split(PROMPT, 1)[-1]
    assert len(set(generated.split())) > 1 or len(set(generated)) > 4, repr(generated)
