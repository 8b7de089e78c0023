"""Prompt cache and checkpoints through the real runtime: reuse must not change a single greedy token."""

from __future__ import annotations

import asyncio

import pytest

from app.config import load_settings
from app.runtime.api import Finished, GenerationRequest, SamplingParams
from app.runtime.service import Runtime


def settings(model, *extra):
    return load_settings(["-m", str(model), "-np", "1", "-c", "2048", "-b", "256", "-ub", "256", "-t", "2",
                          *extra]).runtime


async def generate(rt: Runtime, prompt: list[int], n: int = 12, cache: bool = True) -> tuple[list[int], Finished]:
    h = rt.submit(GenerationRequest(prompt=prompt, sampling=SamplingParams(temperature=0), n_predict=n,
                                    cache_prompt=cache))
    toks: list[int] = []
    fin = None
    async for ev in h:
        if isinstance(ev, Finished):
            fin = ev
        else:
            toks += ev.tokens
    return toks, fin


def prompts(n_vocab: int) -> tuple[list[int], list[int]]:
    a = [1] + [(7 * i + 3) % (n_vocab - 10) + 5 for i in range(300)]
    b = [1] + [(11 * i + 5) % (n_vocab - 10) + 5 for i in range(200)]
    return a, b


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_cached_prefix_gives_identical_tokens(tmp_path_factory, arch):
    from app.models.synth import tiny_model

    model = tiny_model(tmp_path_factory.mktemp("mem"), arch, qtype="f16")

    async def run(extra):
        rt = Runtime(settings(model, *extra))
        await rt.start()
        try:
            a, b = prompts(rt.info.n_vocab)
            first, _ = await generate(rt, a)
            await generate(rt, b)  # the single slot moves on: `a`'s state goes to the prompt cache
            again, fin = await generate(rt, a + first[:4])  # shares all of `a`: restored, not prefilled
            return first, again, fin, rt.stats()
        finally:
            await rt.close()

    # -cms 64: hybrid models checkpoint every 64 prompt tokens, so the restore has one to land on.
    first, again, fin, _ = asyncio.run(run(["-cms", "64"]))
    assert fin.timings.n_cached > 0, "the prompt cache was not used"
    first_nc, again_nc, fin_nc, _ = asyncio.run(run(["--cache-ram", "0", "--no-cache-prompt"]))
    assert fin_nc.timings.n_cached == 0
    assert first == first_nc
    assert again == again_nc
