"""Bad input and bad moments: each gets its status and an OpenAI-shaped error, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.fake_runtime import SCRIPT, serve_fake, wait_ready

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


async def error_of(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    err = body["error"]
    assert set(err) >= {"code", "message", "type"} and err["code"] == status
    return err


@pytest.fixture
async def served(aiohttp_client):
    return await serve_fake(aiohttp_client)


async def still_serving(client) -> None:
    r = await client.post("/completion", json={"prompt": "ok", "n_predict": 2})
    assert r.status == 200 and (await r.json())["content"] == SCRIPT[:2]


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions", "/tokenize"])
async def test_malformed_json(served, path):
    client, _ = served
    err = await error_of(await client.post(path, data=b'{"prompt": "x",'), 400)
    assert err["type"] == "invalid_request_error" and "not valid JSON" in err["message"]
    err = await error_of(await client.post(path, data=b'[1, 2]'), 400)
    assert "JSON object" in err["message"]
    await still_serving(client)


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "n_predict": "10"}, "n_predict"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": 3.5}, "prompt"),
    ({"prompt": "x", "max_tokens": -2}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ({"prompt": "x", "n_predict": -5}, "n_predict"),
    ({"n_predict": 1}, "prompt"),
])
async def test_wrong_types_and_ranges_name_the_field(served, body, field):
    client, _ = served
    err = await error_of(await client.post("/completion", json=body), 400)
    assert f"'{field}'" in err["message"]


async def test_huge_but_valid_max_tokens_ends_at_the_script(served):
    client, _ = served
    body = await (await client.post("/completion", json={"prompt": "x", "max_tokens": 2**31 - 1})).json()
    assert body["content"] == SCRIPT


async def test_chat_message_errors(served):
    client, _ = served
    err = await error_of(await client.post("/v1/chat/completions", json={"messages": []}), 400)
    assert "'messages' must not be empty" in err["message"]
    err = await error_of(await client.post("/v1/chat/completions", json={}), 400)
    assert "'messages'" in err["message"]
    err = await error_of(await client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]}), 400)
    assert "content" in err["message"]
    err = await error_of(await client.post("/v1/chat/completions", json={"messages": [{"content": "x"}]}), 400)
    assert "role" in err["message"]
    err = await error_of(await client.post("/v1/chat/completions", json={**CHAT, "n": 2}), 400)
    assert "'n'" in err["message"]
    await still_serving(client)


async def test_unknown_fields_are_ignored(served):
    client, _ = served
    r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "frobnicate": [1, {"a": 2}],
                                                         "user": "u", "metadata": {"x": 1}})
    assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == SCRIPT[:3]


async def test_prompt_longer_than_context(served):
    client, fake = served
    err = await error_of(await client.post("/completion", json={"prompt": "x" * 600}), 400)
    assert err["type"] == "exceed_context_size_error"
    assert err["n_prompt_tokens"] == 601 and err["n_ctx"] == 512
    assert "601" in err["message"] and "512" in err["message"]
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 600}],
                                                         "stream": True})
    err = await error_of(r, 400)  # the error comes before any event, so as JSON even when streaming
    assert err["type"] == "exceed_context_size_error"
    await still_serving(client)


async def test_template_errors_are_400(aiohttp_client):
    tmpl = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}x"
    client, _ = await serve_fake(aiohttp_client, ["--chat-template", tmpl])
    err = await error_of(await client.post("/v1/chat/completions", json={"messages": [
        {"role": "system", "content": "s"}]}), 400)
    assert err["message"] == "must start with user"


async def test_echo_is_refused(served):
    client, _ = served
    await error_of(await client.post("/v1/completions", json={"prompt": "x", "echo": True}), 400)


async def test_api_key(aiohttp_client):
    client, _ = await serve_fake(aiohttp_client, ["--api-key", "k1,k2"])
    err = await error_of(await client.post("/completion", json={"prompt": "x"}), 401)
    assert err == {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}
    await error_of(await client.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    await error_of(await client.get("/nowhere"), 401)  # the key is checked before routing, as upstream
    assert (await client.get("/health")).status == 200  # public
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer k2"})).status == 200
    assert (await client.get("/v1/models", headers={"X-Api-Key": "k1"})).status == 200
    r = await client.post("/completion", json={"prompt": "x", "n_predict": 1},
                          headers={"Authorization": "Bearer k1"})
    assert r.status == 200


async def test_body_too_large(aiohttp_client):
    client, _ = await serve_fake(aiohttp_client, ["--max-body-mib", "1"])
    err = await error_of(await client.post("/completion", data=b'{"prompt": "' + b"a" * (2 << 20) + b'"}'), 413)
    assert "1 MiB" in err["message"]
    await still_serving(client)


async def test_queue_full(aiohttp_client):
    client, fake = await serve_fake(aiohttp_client, queue_limit=0)
    r = await client.post("/v1/chat/completions", json=CHAT)
    err = await error_of(r, 503)
    assert err["type"] == "unavailable_error" and r.headers["Retry-After"] == "1"


async def test_health_503_while_loading(aiohttp_client):
    client, fake = await serve_fake(aiohttp_client, hold_loading=True)
    r = await client.get("/health")
    err = await error_of(r, 503)
    assert err == {"code": 503, "message": "Loading model", "type": "unavailable_error"}
    await error_of(await client.post("/completion", json={"prompt": "x"}), 503)
    fake.release()
    await wait_ready(client)
    assert await (await client.get("/health")).json() == {"status": "ok"}


async def test_load_failure_is_reported(aiohttp_client):
    client, _ = await serve_fake(aiohttp_client, fail_loading="file is not a GGUF")
    for _ in range(100):
        r = await client.get("/health")
        if r.status != 503:
            break
        await asyncio.sleep(0.01)
    err = await error_of(r, 500)
    assert "file is not a GGUF" in err["message"]


async def test_unknown_route_and_method(served):
    client, _ = served
    err = await error_of(await client.get("/v2/everything"), 404)
    assert err == {"code": 404, "message": "File Not Found", "type": "not_found_error"}
    await error_of(await client.get("/completion"), 405)


async def test_engine_error(aiohttp_client):
    client, _ = await serve_fake(aiohttp_client, fail_with="CUDA error: out of memory")
    err = await error_of(await client.post("/completion", json={"prompt": "x", "n_predict": 1}), 500)
    assert err["type"] == "server_error" and "out of memory" in err["message"]
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status == 200
    text = await r.text()
    last = json.loads(text.strip().split("\n\n")[-1][len("data: "):])
    assert last["error"]["code"] == 500 and "[DONE]" not in text


async def test_disconnect_cancels_the_request(aiohttp_client):
    client, fake = await serve_fake(aiohttp_client, delay=0.02, chunk=1)
    for stream in (True, False):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream}) if stream else None
        if stream:
            await resp.content.readline()  # the first event is out: generation is under way
            resp.close()
        else:
            task = asyncio.ensure_future(client.post("/completion", json={"prompt": "x"}))
            await asyncio.sleep(0.1)
            task.cancel()
        for _ in range(100):  # freed within a second
            if len(fake.cancelled) == (1 if stream else 2) and fake.active == 0:
                break
            await asyncio.sleep(0.01)
        assert len(fake.cancelled) == (1 if stream else 2) and fake.active == 0
    await still_serving(client)


async def test_negative_id_slot_and_bad_tokens(served):
    client, _ = served
    err = await error_of(await client.post("/completion", json={"prompt": [1, 99999]}), 400)
    assert "vocabulary" in err["message"]
    err = await error_of(await client.post("/completion", json={"prompt": []}), 400)
    assert "empty" in err["message"]
