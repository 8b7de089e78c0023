"""Speculative decoding: drafts never change what is generated, and they do get accepted.

Tiny synthetic llama models in f16 (the CPU kernels then give the same logits whatever else the batch holds, so
runs with and without drafts can be compared token for token). The target has a small layer scale, so its next
token depends mostly on the current one: a prompt that contains the model's own continuation makes n-gram
drafts hit, and a 1-layer draft written with `noisy_of` agrees with it most of the time.
"""

from __future__ import annotations

import asyncio

import pytest

from app.config import ConfigError, load_settings
from app.runtime.api import GenerationRequest, SamplingParams, TextDelta
from app.runtime.service import Runtime
from app.runtime.speculative import lookup

N_GEN = 32
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def prompts(models):
    return asyncio.run(_prompts(models[0]))


@pytest.fixture(scope="module")
def baseline(models, prompts):
    """Greedy outputs without speculation, per sampling path."""
    return {flag: asyncio.run(_run_all(models[0], prompts, flag))[0]
            for flag in ("--backend-sampling", "--no-backend-sampling")}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from app.models.synth import tiny_model

    d = tmp_path_factory.mktemp("spec")
    target = tiny_model(d, "llama", qtype="f16", layer_scale=0.1)
    draft = tiny_model(d, "llama", qtype="f16", noisy_of=str(target), layers=1)
    other_vocab = tiny_model(d, "qwen3", qtype="f16")
    return target, draft, other_vocab


async def _runtime(target, *flags: str) -> Runtime:
    s = load_settings(["-m", str(target), "-c", "4096", "-np", "4", "-t", "1", "--preset", "none", *flags], {})
    rt = Runtime(s.runtime)
    await rt.start()
    return rt


async def _generate(rt: Runtime, prompt: list[int], n: int = N_GEN, sampling: SamplingParams = GREEDY):
    h = rt.submit(GenerationRequest(prompt=prompt, n_predict=n, sampling=sampling, return_tokens=True,
                                    cache_prompt=False))
    tokens, fin = [], None
    async for ev in h:
        if isinstance(ev, TextDelta):
            tokens += ev.tokens
        else:
            fin = ev
    assert fin.error is None, fin.error
    return tokens, fin


async def _prompts(target) -> list[list[int]]:
    """Prompts that contain the target's own greedy continuation, then the start again: a model that copies
    (or n-gram lookup) predicts the rest from the context."""
    rt = await _runtime(target)
    try:
        out = []
        for text in ("The cat sat on the mat", "Once upon a time", "def main():", "1, 2, 3,"):
            p = rt.tokenize(text)
            cont, _ = await _generate(rt, p, 40)
            out.append(p + cont + p[1:])
        return out
    finally:
        await rt.close()


async def _run_all(target, prompts, *flags, concurrent=False, sampling=GREEDY):
    rt = await _runtime(target, *flags)
    try:
        if concurrent:
            res = await asyncio.gather(*(_generate(rt, p, sampling=sampling) for p in prompts))
        else:
            res = [await _generate(rt, p, sampling=sampling) for p in prompts]
        return [t for t, _ in res], [f for _, f in res], rt.stats()
    finally:
        await rt.close()


@pytest.mark.parametrize("spec", ["ngram", "draft"])
@pytest.mark.parametrize("sampling_flag", ["--backend-sampling", "--no-backend-sampling"])
async def test_greedy_output_identical(models, prompts, baseline, spec, sampling_flag):
    target, draft, _ = models
    want = baseline[sampling_flag]
    flags = ["--spec-type", "ngram-simple", "--spec-draft-n-max", "8"] if spec == "ngram" else ["-md", str(draft)]
    got, fins, stats = await _run_all(target, prompts, sampling_flag, *flags)
    assert got == want
    assert stats["spec_decode_num_accepted_tokens_total"] > 0
    assert stats["spec_decode_num_draft_tokens_total"] >= stats["spec_decode_num_accepted_tokens_total"]
    assert sum(f.timings.n_draft_accepted for f in fins) == stats["spec_decode_num_accepted_tokens_total"]
    assert all(f.timings.n_predicted == N_GEN for f in fins)


async def test_four_concurrent_slots_match_sequential(models, prompts, baseline):
    target, draft, _ = models
    want = baseline["--backend-sampling"]
    flags = ["-md", str(draft), "--spec-draft-n-max", "5"]
    got, _, stats = await _run_all(target, prompts, *flags, concurrent=True)
    assert got == want
    assert stats["spec_decode_num_accepted_tokens_total"] > 0


@pytest.mark.parametrize("sampling_flag", ["--backend-sampling", "--no-backend-sampling"])
async def test_seeded_sampling_finishes_and_matches(models, prompts, sampling_flag):
    target, draft, _ = models
    prompts = prompts[:2]
    seeded = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, seed=1234)
    want, _, _ = await _run_all(target, prompts, sampling_flag, sampling=seeded)
    got, fins, _ = await _run_all(target, prompts, sampling_flag, "-md", str(draft), sampling=seeded)
    assert all(f.timings.n_predicted == N_GEN for f in fins)
    # Every token is sampled with the request's own chain in order, so even seeded sampling is reproduced.
    assert got == want


async def test_budget_caps_drafts(models, prompts):
    target, draft, _ = models
    prompt = prompts[0]
    rt = await _runtime(target, "-md", str(draft), "--spec-draft-n-max", "8")
    try:
        for n in (1, 2, 5):
            tokens, fin = await _generate(rt, prompt, n)
            assert len(tokens) == n == fin.timings.n_predicted
            assert fin.timings.n_draft <= max(0, n - 1)
    finally:
        await rt.close()


async def test_per_request_n_max_zero_turns_speculation_off(models, prompts):
    target, draft, _ = models
    prompt = prompts[0]
    rt = await _runtime(target, "-md", str(draft))
    try:
        h = rt.submit(GenerationRequest(prompt=prompt, n_predict=16, sampling=GREEDY, spec_n_max=0))
        fin = [ev async for ev in h][-1]
        assert fin.timings.n_draft == 0
    finally:
        await rt.close()


async def test_draft_with_other_vocab_is_refused(models):
    target, _, other = models
    with pytest.raises(Exception, match="vocabulary|tokenizer"):
        await _runtime(target, "-md", str(other))


async def test_mtp_is_refused_at_startup(models):
    target, _, _ = models
    with pytest.raises(Exception, match="not supported yet"):
        await _runtime(target, "--spec-type", "mtp")


def test_flags():
    s = load_settings(["-m", "x", "--spec-type", "ngram-simple", "--spec-draft-n-max", "8"], {}).runtime.spec
    assert (s.type, s.n_max, s.n_min, s.p_min) == ("ngram-simple", 8, 0, 0.0)
    s = load_settings(["-m", "x", "-md", "d.gguf", "-ngld", "all", "-ctkd", "q8_0", "--draft-p-min", "0.6"],
                      {"LLAMA_ARG_SPEC_DRAFT_N_MIN": "2"}).runtime.spec
    assert (s.type, s.draft_model, s.draft_n_gpu_layers, s.draft_type_k, s.n_min, s.p_min) == (
        "draft-simple", "d.gguf", -2, "q8_0", 2, 0.6)
    assert load_settings(["-m", "x", "--spec-type", "mtp"], {}).runtime.spec.type == "draft-mtp"
    assert load_settings(["-m", "x"], {}).runtime.spec.type == "none"
    with pytest.raises(ConfigError, match="needs a draft model"):
        load_settings(["-m", "x", "--spec-type", "draft-simple"], {})
    with pytest.raises(ConfigError):
        load_settings(["-m", "x", "--spec-type", "eagle"], {})


def test_ngram_lookup():
    ctx = [1, 2, 3, 4, 5, 9, 2, 3]
    assert lookup(ctx, 4, 3) == [5, 9, 2]  # "2 3 4" seen before: what followed it
    assert lookup(ctx, 7, 3) == []  # 7 never seen
    assert lookup([5, 1, 6, 1, 7], 1, 2) == [7, 1]  # the most recent 1-gram match wins (the last token counts)
    assert lookup([3, 1, 2, 0, 1, 2], 9, 4, n_hi=3, n_lo=2) == []
    # ids whose bytes could match across token boundaries must not: only whole tokens count
    assert lookup([0x01000000, 0x00000002, 7], 0x00000100, 2) == []


async def test_penalties_on_device_with_drafts(models, prompts):
    """Upstream's penalties stage refuses several outputs per sequence: the chain's rest runs on the host."""
    target, draft, _ = models
    sp = SamplingParams(temperature=0.7, repeat_penalty=1.1, seed=7)
    want, _, _ = await _run_all(target, prompts[:2], "--backend-sampling", sampling=sp)
    got, _, stats = await _run_all(target, prompts[:2], "--backend-sampling", "-md", str(draft), sampling=sp)
    assert got == want
    assert stats["spec_decode_num_accepted_tokens_total"] > 0
