"""Device (backend) sampling draws from the same distribution as host sampling.

The two paths use different random streams, so tokens are compared as frequencies: over many seeds, each
path's first-token histogram must pass a chi-square goodness-of-fit test (alpha = 0.001) against the exact
distribution computed from the logits (softmax at temperature 1 over the top-k tokens).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.engine import Batch, Context, Model, Sampler, backend_init
from app.runtime.api import SamplingParams
from app.runtime.sampling import build_chain

N_DRAWS = 1200
TOP_K = 8
PARAMS = SamplingParams(temperature=1.0, top_k=TOP_K, top_p=1.0, min_p=0.0)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.001 point of chi-square with df degrees of freedom (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: dict[int, int], probs: dict[int, float], n: int) -> tuple[float, int]:
    stat, df = 0.0, -1
    for tok, p in probs.items():
        expected = p * n
        stat += (counts.get(tok, 0) - expected) ** 2 / expected
        df += 1
    assert sum(counts.get(t, 0) for t in probs) == n, "a token outside the top-k was drawn"
    return stat, df


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from app.models.synth import tiny_model

    backend_init()
    # A weak-layer model keeps the logits spread out, so the top-k tokens all have real probability.
    path = tiny_model(tmp_path_factory.mktemp("fid"), "llama", qtype="f16", layer_scale=0.3)
    with Model(str(path), n_gpu_layers=0) as model:
        greedy = Sampler.chain([Sampler.greedy()])
        with Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=2,
                     backend_samplers={0: greedy}) as ctx, Batch(64) as batch:
            yield model, ctx, batch, greedy


def exact_probs(logits: np.ndarray) -> dict[int, float]:
    top = np.argsort(-logits, kind="stable")[:TOP_K]
    z = logits[top].astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    return {int(t): float(q) for t, q in zip(top, p)}


def test_device_and_host_sampling_match_the_distribution(setup):
    model, ctx, batch, greedy = setup
    prompt = model.vocab.tokenize("the quick brown fox", add_special=True)
    # Host path: one decode without a backend sampler, then many seeded chains over the same logits row.
    ctx.set_backend_sampler(0, None)
    batch.add_many(prompt, 0, 0, logits_last=True)
    ctx.decode(batch)
    i = batch.n_tokens - 1
    probs = exact_probs(ctx.logits_ith(i).copy())
    host: dict[int, int] = {}
    for seed in range(N_DRAWS):
        with build_chain(SamplingParams(**{**PARAMS.__dict__, "seed": seed}), model.vocab, for_device=False) as c:
            tok = c.sample(ctx, i)
        host[tok] = host.get(tok, 0) + 1
    # Device path: the last prompt token is decoded again for every seed, its chain attached to the sequence.
    dev: dict[int, int] = {}
    for seed in range(N_DRAWS):
        chain = build_chain(SamplingParams(**{**PARAMS.__dict__, "seed": seed}), model.vocab, for_device=True)
        assert ctx.set_backend_sampler(0, chain)
        ctx.seq_rm(0, len(prompt) - 1, -1)
        batch.clear()
        batch.add(prompt[-1], len(prompt) - 1, 0, True)
        ctx.decode(batch)
        tok = ctx.sampled_token_ith(0)
        dev[tok] = dev.get(tok, 0) + 1
        ctx.set_backend_sampler(0, None)
        chain.close()
    assert max(probs.values()) < 0.9, "the test needs a spread-out distribution to mean anything"
    for name, counts in (("host", host), ("device", dev)):
        stat, df = chi2_stat(counts, probs, N_DRAWS)
        assert stat < chi2_critical(df), (name, stat, df, counts, probs)
