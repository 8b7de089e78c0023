"""Prompt reuse through the real server: multi-turn chat, slot files across a restart, the RAM budget."""

from __future__ import annotations

import httpx
import pytest

from tests.servers import running_server

ARGS = ["-np", "1", "-c", "4096", "-b", "256", "-ub", "256", "-t", "2", "-cms", "64"]
TURN1 = [{"role": "system", "content": "You are a helpful assistant. " * 12},
         {"role": "user", "content": "Tell me about the sea and the sky and the wind."}]


def chat(base: str, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module", params=["llama", "qwen35"])
def model(request, tmp_path_factory):
    from app.models.synth import tiny_model

    return tiny_model(tmp_path_factory.mktemp("cache"), request.param, qtype="f16")


def test_second_turn_reprocesses_only_new_tokens(model):
    with running_server("ours", model, ARGS) as base:
        first = chat(base, TURN1)
        turn2 = TURN1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And the mountains?"}]
        warm = chat(base, turn2)
    with running_server("ours", model, [*ARGS, "--no-cache-prompt", "--cache-ram", "0"]) as base:
        cold = chat(base, turn2)
    n_prompt = warm["usage"]["prompt_tokens"]
    n_cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert n_cached >= first["usage"]["prompt_tokens"] // 2, (n_cached, n_prompt)
    assert warm["timings"]["prompt_n"] == n_prompt - n_cached
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


def test_slot_file_survives_a_restart(tmp_path, model):
    args = [*ARGS, "--slot-save-path", str(tmp_path)]
    req = {"n_predict": 8, "temperature": 0, "id_slot": 0, "return_tokens": True}
    with running_server("ours", model, args) as base:
        prompt = httpx.post(f"{base}/tokenize", json={"content": "the wind and the sea " * 12}).json()["tokens"]
        first = httpx.post(f"{base}/completion", json={**req, "prompt": prompt}, timeout=120).json()
        assert httpx.post(f"{base}/slots/0?action=save", json={"filename": "a.bin"}).status_code == 200
        # The next turn extends what the slot holds (a recurrent state can only go forward from its end).
        follow = prompt + first["tokens"] + prompt[1:9]
        uninterrupted = httpx.post(f"{base}/completion", json={**req, "prompt": follow}, timeout=120).json()
    with running_server("ours", model, args) as base:
        r = httpx.post(f"{base}/slots/0?action=restore", json={"filename": "a.bin"})
        assert r.status_code == 200, r.text
        again = httpx.post(f"{base}/completion", json={**req, "prompt": follow}, timeout=120).json()
    assert again["tokens"] == uninterrupted["tokens"]
    assert again["timings"]["cache_n"] >= len(prompt)


def test_cache_stays_within_its_budget(model):
    with running_server("ours", model, [*ARGS, "--cache-ram", "1", "--metrics"]) as base:
        for i in range(12):
            prompt = f"prompt number {i} " + "filler words here " * (20 + i)
            assert httpx.post(f"{base}/completion", json={"prompt": prompt, "n_predict": 2}, timeout=60).status_code == 200
        text = httpx.get(f"{base}/metrics").text
    used = next(float(line.split()[1]) for line in text.splitlines() if line.startswith("llamacpp:prompt_cache_bytes "))
    assert 0 < used <= 1 << 20
