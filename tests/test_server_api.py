"""The HTTP layer on a FakeRuntime: every route's shape, streaming equals non-streaming, usage, probabilities."""

from __future__ import annotations

import json

import pytest

from tests.fake_runtime import BOS, SCRIPT, serve_fake


def sse_events(text: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded ([DONE] kept as the string)."""
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.fixture
async def client(aiohttp_client):
    c, _ = await serve_fake(aiohttp_client, ["--metrics", "--embedding"])
    return c


@pytest.fixture
async def served(aiohttp_client):
    return await serve_fake(aiohttp_client, ["--metrics"])


# ---- /completion (llama.cpp native) -------------------------------------------------------------------------


async def test_completion_fields(client):
    r = await client.post("/completion", json={"prompt": "hi", "n_predict": 10, "return_tokens": True})
    assert r.status == 200
    body = await r.json()
    assert body["content"] == SCRIPT[:10]
    assert body["tokens"] == list(SCRIPT[:10].encode())
    assert body["stop"] is True and body["stop_type"] == "limit" and body["stopping_word"] == ""
    assert body["tokens_predicted"] == 10 and body["tokens_evaluated"] == 3  # BOS + "hi"
    assert body["truncated"] is False and body["model"] == "fake.gguf" and "id_slot" in body
    t = body["timings"]
    for key in ("prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                "predicted_ms", "predicted_per_token_ms", "predicted_per_second", "cache_n"):
        assert key in t
    assert t["predicted_n"] == 10 and t["predicted_per_second"] == pytest.approx(1000.0)
    assert body["generation_settings"]["n_predict"] == 10
    assert body["prompt"] == "<s>hi"


async def test_completion_eos_and_stop_word(client):
    body = await (await client.post("/completion", json={"prompt": "hi"})).json()
    assert body["content"] == SCRIPT and body["stop_type"] == "eos"
    body = await (await client.post("/completion", json={"prompt": "hi", "stop": ["runtime", "xyz"]})).json()
    assert body["content"] == SCRIPT[:SCRIPT.index("runtime")]
    assert body["stop_type"] == "word" and body["stopping_word"] == "runtime"
    body = await (await client.post("/completion", json={"prompt": "hi", "stop": "fake"})).json()
    assert body["stopping_word"] == "fake"


async def test_completion_stream_equals_non_stream(client):
    req = {"prompt": "hi", "n_predict": 25, "stop": ["the"]}
    whole = await (await client.post("/completion", json=req)).json()
    r = await client.post("/completion", json={**req, "stream": True})
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await r.text())
    assert "[DONE]" not in events  # the native stream has no [DONE], as upstream
    *chunks, last = events
    assert all(c["stop"] is False for c in chunks) and last["stop"] is True
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert last["content"] == "" and last["timings"]["predicted_n"] == whole["timings"]["predicted_n"]
    assert chunks[-1]["tokens_predicted"] == len(whole["content"])


async def test_completion_prompt_forms(served):
    client, fake = served
    await client.post("/completion", json={"prompt": [1, 2, 3], "n_predict": 1})
    assert fake.submitted[-1].prompt == [1, 2, 3]
    await client.post("/completion", json={"prompt": ["ab", 5, "c"], "n_predict": 1})
    assert fake.submitted[-1].prompt == [BOS, 97, 98, 5, 99]  # BOS only before the leading text
    await client.post("/completion", json={"prompt": ["single"], "n_predict": 1})
    assert fake.submitted[-1].prompt == [BOS, *b"single"]
    r = await client.post("/completion", json={"prompt": ["a", "b"]})
    assert r.status == 400 and "several prompts" in (await r.json())["error"]["message"]


async def test_completion_probabilities(client):
    body = await (await client.post("/completion", json={"prompt": "hi", "n_predict": 3, "n_probs": 2})).json()
    probs = body["completion_probabilities"]
    assert len(probs) == 3
    assert set(probs[0]) == {"id", "token", "bytes", "logprob", "top_logprobs"}
    assert probs[0]["id"] == ord("H") and probs[0]["token"] == "H" and probs[0]["bytes"] == [72]
    assert len(probs[0]["top_logprobs"]) == 2
    body = await (await client.post("/completion", json={"prompt": "hi", "n_predict": 2, "n_probs": 1,
                                                         "post_sampling_probs": True})).json()
    p = body["completion_probabilities"][0]
    assert "prob" in p and "top_probs" in p and 0 < p["prob"] <= 1


async def test_completion_sampling_fields_reach_the_runtime(served):
    client, fake = served
    req = {"prompt": "hi", "temperature": 0.0, "top_k": 3, "top_p": 2.0, "min_p": 0.2, "typical_p": 0.9,
           "repeat_penalty": 1.2, "repeat_last_n": 16, "presence_penalty": 0.5, "frequency_penalty": 0.25,
           "seed": 7, "logit_bias": [[72, -1.5], ["e", False]], "ignore_eos": True, "grammar": "root ::= \"a\"",
           "cache_prompt": False, "id_slot": 1, "n_indent": 2, "max_tokens": 4, "mirostat": 2,
           "some_unknown_field": {"ignored": True}}
    r = await client.post("/completion", json=req)
    assert r.status == 200
    g = fake.submitted[-1]
    sp = g.sampling
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.typical_p) == (0.0, 3, 1.0, 0.2, 0.9)  # top_p clamped
    assert (sp.repeat_penalty, sp.repeat_last_n, sp.presence_penalty, sp.frequency_penalty) == (1.2, 16, 0.5, 0.25)
    assert sp.seed == 7 and sp.ignore_eos and sp.grammar == 'root ::= "a"'
    assert sp.logit_bias == {72: -1.5, ord("e"): float("-inf")}
    assert (g.n_predict, g.cache_prompt, g.id_slot, g.n_indent) == (4, False, 1, 2)


async def test_n_predict_precedence_and_server_default(aiohttp_client):
    client, fake = await serve_fake(aiohttp_client, ["-n", "7"])
    await client.post("/completion", json={"prompt": "x", "n_predict": 3, "max_tokens": 5})
    assert fake.submitted[-1].n_predict == 3
    await client.post("/completion", json={"prompt": "x", "max_completion_tokens": 4, "max_tokens": 5})
    assert fake.submitted[-1].n_predict == 4
    await client.post("/completion", json={"prompt": "x", "max_tokens": -1})
    assert fake.submitted[-1].n_predict == 7
    await client.post("/completion", json={"prompt": "x"})
    assert fake.submitted[-1].n_predict == 7


async def test_response_fields(client):
    r = await client.post("/completion", json={"prompt": "hi", "n_predict": 2,
                                               "response_fields": ["content", "generation_settings/n_predict"]})
    assert await r.json() == {"content": SCRIPT[:2], "generation_settings/n_predict": 2}


# ---- /v1/completions ----------------------------------------------------------------------------------------


async def test_oai_completion(client):
    r = await client.post("/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 5, "logprobs": 2})
    body = await r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake.gguf"  # llama-server answers with its own model name
    choice = body["choices"][0]
    assert choice["text"] == SCRIPT[:5] and choice["finish_reason"] == "length" and choice["index"] == 0
    assert len(choice["logprobs"]["content"]) == 5
    assert body["usage"] == {"completion_tokens": 5, "prompt_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    body = await (await client.post("/v1/completions", json={"prompt": "hi"})).json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["logprobs"] is None


async def test_oai_completion_stream(client):
    req = {"prompt": "hi", "max_tokens": 20}
    whole = await (await client.post("/v1/completions", json=req)).json()
    events = sse_events(await (await client.post("/v1/completions", json={**req, "stream": True})).text())
    assert events[-1] == "[DONE]"
    *chunks, final = events[:-1]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert final["choices"][0]["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 20
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == whole["choices"][0]["text"]
    assert len({c["id"] for c in events[:-1]}) == 1


# ---- /v1/chat/completions ------------------------------------------------------------------------------------


CHAT = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}


async def test_chat(served):
    client, fake = served
    r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12})
    body = await r.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": SCRIPT[:12]}
    assert choice["finish_reason"] == "length" and "logprobs" not in choice
    prompt = fake.submitted[-1].prompt
    assert prompt[0] == BOS and prompt.count(BOS) == 1  # the template's BOS text is not doubled
    text = bytes(t for t in prompt[1:]).decode()
    assert text == "<start_of_turn>system\nbe brief<end_of_turn>\n<start_of_turn>user\nhi<end_of_turn>\n" \
                   "<start_of_turn>model\n"
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == 12
    assert "timings" in body


async def test_chat_stream_equals_non_stream_with_usage(client):
    req = {**CHAT, "max_tokens": 60, "stop": ["same"]}
    whole = await (await client.post("/v1/chat/completions", json=req)).json()
    r = await client.post("/v1/chat/completions", json={**req, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    events = sse_events(await r.text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop"
    assert finish[0]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    no_usage = sse_events(await (await client.post("/v1/chat/completions", json={**req, "stream": True})).text())
    assert all("usage" not in c for c in no_usage[:-1])


async def test_chat_logprobs(client):
    req = {**CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 3}
    body = await (await client.post("/v1/chat/completions", json=req)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and len(content[0]["top_logprobs"]) == 3
    body = await (await client.post("/v1/chat/completions", json={**req, "top_logprobs": 0})).json()
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    events = sse_events(await (await client.post("/v1/chat/completions", json={**req, "stream": True})).text())
    streamed = [p for c in events[:-1] if c["choices"] for p in (c["choices"][0].get("logprobs") or {}).get(
        "content", [])]
    assert len(streamed) == 4
    r = await client.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 2})
    assert r.status == 400


async def test_chat_structured_outputs(served):
    client, fake = served
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert (await client.post("/v1/chat/completions", json={**CHAT, "response_format": rf})).status == 200
    assert fake.submitted[-1].sampling.json_schema == schema
    await client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "json_object"}})
    assert fake.submitted[-1].sampling.json_schema == {"type": "object"}
    await client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}})
    assert fake.submitted[-1].sampling.json_schema is None
    r = await client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "yaml"}})
    assert r.status == 400 and "yaml" in (await r.json())["error"]["message"]
    r = await client.post("/v1/chat/completions", json={**CHAT, "grammar": "root ::= x", "json_schema": schema})
    assert r.status == 400


async def test_chat_content_parts_and_tools(served):
    client, fake = served
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert (await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})).status == 200
    assert b"<start_of_turn>user\nab<end_of_turn>" in bytes(t for t in fake.submitted[-1].prompt if t < 256)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "42"}]
    r = await client.post("/v1/chat/completions", json={"messages": msgs, "tools": tools, "max_tokens": 1})
    assert r.status == 200
    r = await client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:..."}}]}]})
    assert r.status == 400 and "multimodal" in (await r.json())["error"]["message"]


async def test_chat_alias_route(client):
    r = await client.post("/chat/completions", json={**CHAT, "max_tokens": 2})
    assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == SCRIPT[:2]


# ---- embeddings ----------------------------------------------------------------------------------------------


async def test_embeddings(client):
    body = await (await client.post("/v1/embeddings", json={"input": ["ab", "cde"], "model": "m"})).json()
    assert body["object"] == "list" and body["model"] == "m"
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "embedding"
    assert len(body["data"][0]["embedding"]) == 3
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    body = await (await client.post("/v1/embeddings", json={"input": "ab", "encoding_format": "base64"})).json()
    assert isinstance(body["data"][0]["embedding"], str) and body["data"][0]["encoding_format"] == "base64"
    native = await (await client.post("/embedding", json={"content": "ab"})).json()
    assert isinstance(native, list) and len(native[0]["embedding"][0]) == 3
    r = await client.post("/v1/embeddings", json={"input": []})
    assert r.status == 400


async def test_embeddings_off_is_501(served):
    client, _ = served
    r = await client.post("/v1/embeddings", json={"input": "x"})
    assert r.status == 501 and (await r.json())["error"]["type"] == "not_supported_error"


# ---- utility endpoints ----------------------------------------------------------------------------------------


async def test_tokenize_detokenize(client):
    body = await (await client.post("/tokenize", json={"content": "hi"})).json()
    assert body == {"tokens": [104, 105]}  # add_special defaults to false
    body = await (await client.post("/tokenize", json={"content": "hi", "add_special": True})).json()
    assert body["tokens"][0] == BOS
    body = await (await client.post("/tokenize", json={"content": "é", "with_pieces": True})).json()
    assert body["tokens"] == [{"id": 195, "piece": [195]}, {"id": 169, "piece": [169]}]  # half a character each
    body = await (await client.post("/tokenize", json={"content": "a", "with_pieces": True})).json()
    assert body["tokens"] == [{"id": 97, "piece": "a"}]
    assert await (await client.post("/tokenize", json={})).json() == {"tokens": []}
    assert await (await client.post("/detokenize", json={"tokens": [104, 105]})).json() == {"content": "hi"}
    r = await client.post("/detokenize", json={"tokens": [99999]})
    assert r.status == 400


async def test_apply_template(client):
    body = await (await client.post("/apply-template", json=CHAT)).json()
    assert body["prompt"].endswith("<start_of_turn>model\n") and not body["prompt"].startswith("<s>")


async def test_health_models_props_slots(client):
    assert await (await client.get("/health")).json() == {"status": "ok"}
    assert (await client.get("/v1/health")).status == 200
    for path in ("/v1/models", "/models"):
        body = await (await client.get(path)).json()
        assert body["object"] == "list" and body["data"][0]["id"] == "fake.gguf"
        assert body["data"][0]["meta"]["n_ctx"] == 512 and body["models"][0]["name"] == "fake.gguf"
    props = await (await client.get("/props")).json()
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 512
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert props["bos_token"] == "<s>" and props["endpoint_metrics"] is True and "chat_template" in props
    assert (await client.post("/props", json={})).status == 501
    slots = await (await client.get("/slots")).json()
    assert [s["id"] for s in slots] == [0, 1] and slots[0]["is_processing"] is False


async def test_slots_off(aiohttp_client):
    client, _ = await serve_fake(aiohttp_client, ["--no-slots"])
    assert (await client.get("/slots")).status == 501


async def test_metrics(client):
    await client.post("/completion", json={"prompt": "hi", "n_predict": 2})
    r = await client.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = await r.text()
    assert "# TYPE llamacpp:prompt_tokens_total counter" in text
    assert "llamacpp:prompt_tokens_total 10.0" in text
    for name in ("tokens_predicted_total", "prompt_tokens_seconds", "predicted_tokens_seconds",
                 "requests_processing", "requests_deferred", "n_decode_total"):
        assert f"llamacpp:{name} " in text


async def test_metrics_off(aiohttp_client):
    client, _ = await serve_fake(aiohttp_client)
    r = await client.get("/metrics")
    assert r.status == 501 and "--metrics" in (await r.json())["error"]["message"]


async def test_cors(client):
    r = await client.options("/v1/chat/completions", headers={"Origin": "http://x.test",
                                                                "Access-Control-Request-Method": "POST"})
    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "http://x.test"
    r = await client.get("/health")
    assert r.headers["Access-Control-Allow-Origin"] == "*"


async def test_stream_text_with_json_specials(aiohttp_client):
    script = 'Ünïcødé "quoted" \\ back\nnew line\u2028 tab\t </script> \x01'
    client, _ = await serve_fake(aiohttp_client, script=script, chunk=1000)
    for path, body, text_of in (
        ("/v1/chat/completions", CHAT, lambda c: c["choices"][0]["delta"].get("content") if c["choices"] else ""),
        ("/v1/completions", {"prompt": "x"}, lambda c: c["choices"][0]["text"]),
    ):
        events = sse_events(await (await client.post(path, json={**body, "stream": True})).text())
        assert "".join(text_of(c) or "" for c in events[:-1]) == script
