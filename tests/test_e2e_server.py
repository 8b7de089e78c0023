"""End-to-end: the real server on the real gemma-3-270m model, against real clients and upstream llama-server.

One server of ours and one upstream llama-server from the same build are started per module with the same
flags; greedy requests must give the same content, token for token.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.servers import running_server

SERVER_ARGS = ["-np", "4", "-c", "8192", "-b", "512", "-ub", "512", "-t", "2"]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors: red,",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2? Answer briefly."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}],
]


@pytest.fixture(scope="module")
def model(default_model_path):
    return default_model_path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from app.models.synth import tiny_model

    # f16 weights: the CPU kernels then give the same logits whatever the batch holds, so concurrency can be
    # compared with sequential runs token for token (quantized q4_K/q8 paths are not batch-invariant on CPU).
    return tiny_model(tmp_path_factory.mktemp("tiny"), "llama", qtype="f16")


@pytest.fixture(scope="module")
def tiny_ours(tiny):
    with running_server("ours", tiny, SERVER_ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def tiny_upstream(tiny):
    with running_server("upstream", tiny, SERVER_ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def ours(model):
    with running_server("ours", model, SERVER_ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def upstream(model):
    with running_server("upstream", model, [*SERVER_ARGS, "--jinja"]) as base:
        yield base


def completion(base: str, prompt, n: int = 24, **kw) -> dict:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True, **kw}
    r = httpx.post(f"{base}/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_matches_upstream(ours, upstream):
    for p in PROMPTS:
        a, b = completion(ours, p), completion(upstream, p)
        assert a["tokens"] == b["tokens"], p
        assert a["content"] == b["content"]
        assert a["tokens_evaluated"] == b["tokens_evaluated"]
        assert a["timings"]["predicted_n"] == b["timings"]["predicted_n"]


def test_tiny_synthetic_matches_upstream(tiny_ours, tiny_upstream):
    for p in PROMPTS:
        a, b = completion(tiny_ours, p, 32), completion(tiny_upstream, p, 32)
        assert a["tokens"] == b["tokens"], p


def test_chat_matches_upstream(ours, upstream):
    for messages in CHATS:
        body = {"messages": messages, "max_tokens": 24, "temperature": 0}
        a = httpx.post(f"{ours}/v1/chat/completions", json=body, timeout=120).json()
        b = httpx.post(f"{upstream}/v1/chat/completions", json=body, timeout=120).json()
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"]


def test_openai_client_chat_and_stream(ours):
    client = openai.OpenAI(base_url=f"{ours}/v1", api_key="none")
    msgs = [{"role": "user", "content": "Say hello."}]
    full = client.chat.completions.create(model="x", messages=msgs, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    assert full.usage.completion_tokens > 0 and text
    parts, usage = [], None
    stream = client.chat.completions.create(model="x", messages=msgs, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == text
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_openai_completions_stop_and_logprobs(ours):
    client = openai.OpenAI(base_url=f"{ours}/v1", api_key="none")
    base = client.completions.create(model="x", prompt=PROMPTS[2], max_tokens=24, temperature=0)
    text = base.choices[0].text
    word = text.strip().split()[2]
    cut = client.completions.create(model="x", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[word])
    assert cut.choices[0].text == text[: text.index(word)]
    assert cut.choices[0].finish_reason == "stop"
    # llama-server reports completion logprobs in the chat shape ({"content": [...]}); so do we.
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "logprobs": 3}
    lp = httpx.post(f"{ours}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]["content"]
    assert len(lp) == 4 and all(len(t["top_logprobs"]) == 3 for t in lp)
    assert all(t["logprob"] <= 0.0 and t["top_logprobs"][0]["logprob"] >= t["logprob"] for t in lp)


def test_json_schema_response(ours):
    # Bounded fields: a 270M model left free writes digits until max_tokens; the schema must close the object.
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "adult": {"type": "boolean"}},
              "required": ["name", "adult"], "additionalProperties": False}
    client = openai.OpenAI(base_url=f"{ours}/v1", api_key="none")
    r = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Give a person as JSON."}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "adult"} and isinstance(obj["adult"], bool) and len(obj["name"]) <= 12


def test_concurrent_equals_sequential_and_stream_equals_plain(tiny_ours):
    ours = tiny_ours
    prompts = [f"{p} (variant {i})" for i, p in enumerate(PROMPTS * 2)]
    sequential = [completion(ours, p)["content"] for p in prompts]

    async def one(client, p):
        r = await client.post(f"{ours}/completion", json={"prompt": p, "n_predict": 24, "temperature": 0})
        return r.json()["content"]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[one(c, p) for p in prompts])

    assert asyncio.run(all_at_once()) == sequential
    streamed = []
    with httpx.stream("POST", f"{ours}/completion", timeout=120,
                      json={"prompt": prompts[0], "n_predict": 24, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                streamed.append(json.loads(line[6:]).get("content", ""))
    assert "".join(streamed) == sequential[0]


def test_disconnect_frees_slot(ours):
    body = {"prompt": PROMPTS[1], "n_predict": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{ours}/completion", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    deadline = time.monotonic() + 1.0
    busy = True
    while time.monotonic() < deadline and busy:
        slots = httpx.get(f"{ours}/slots").json()
        busy = any(s.get("is_processing") for s in slots)
        time.sleep(0.05)
    assert not busy, slots


@pytest.mark.parametrize("body,status,needle", [
    ('{"prompt": "hi", "n_predict": ', 400, ""),
    ('{"prompt": 12.5}', 400, "prompt"),
    ('{"messages": []}', 400, "messages"),
    ('{"prompt": "hi", "n_predict": 4, "no_such_field": 1}', 200, ""),
])
def test_bad_input(ours, body, status, needle):
    path = "/v1/chat/completions" if "messages" in body else "/completion"
    r = httpx.post(f"{ours}{path}", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        assert err["code"] == status and needle in err["message"]
    assert httpx.get(f"{ours}/health").status_code == 200


def test_oversized_prompt_names_both_lengths(ours):
    r = httpx.post(f"{ours}/completion", json={"prompt": "word " * 5000, "n_predict": 4}, timeout=60)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "2048" in msg  # the per-slot context: 8192 / 4 slots
