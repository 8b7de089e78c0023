"""`app serve` end to end on a FakeRuntime: exit codes, the listening line, a real socket, real clients."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import openai
from aiohttp import web

from app.server.main import run_server
from tests.fake_runtime import SCRIPT, FakeRuntime, serve_fake


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_and_bad_flags(capsys):
    assert run_server(["--help"]) == 0
    assert "GPU placement" in capsys.readouterr().out
    assert run_server(["--ctx-sise", "5"]) == 2
    assert "did you mean `--ctx-size`" in capsys.readouterr().err
    assert run_server([]) == 2
    assert "no model" in capsys.readouterr().err


def test_failed_load_exits_1():
    port = free_port()
    rc = run_server(["-m", "x.gguf", "--port", str(port)],
                    runtime_factory=lambda rs: FakeRuntime(rs, fail_loading="not a GGUF file"))
    assert rc == 1


class _SelfProbingRuntime(FakeRuntime):
    """Once loaded, asks its own server for /health and a completion, then stops the server."""

    port: int = 0
    seen: list = []

    async def start(self) -> None:
        await super().start()
        asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        base = f"http://127.0.0.1:{self.port}"
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                async with s.get(f"{base}/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.01)
            async with s.post(f"{base}/completion", json={"prompt": "x", "n_predict": 4}) as r:
                self.seen.append((r.status, (await r.json())["content"]))
        asyncio.get_running_loop().call_soon(_stop)


def _stop() -> None:
    raise web.GracefulExit()


def test_serves_and_announces(capsys):
    port = free_port()
    rt = _SelfProbingRuntime()
    rt.port, rt.seen = port, []

    def factory(rs):
        rt.settings = rs
        return rt

    assert run_server(["-m", "x.gguf", "--port", str(port)], runtime_factory=factory) == 0
    assert f"listening on http://127.0.0.1:{port}" in capsys.readouterr().out
    assert rt.seen == [(200, SCRIPT[:4])] and rt.closed


def test_port_in_use_is_a_clear_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert run_server(["-m", "x.gguf", "--port", str(port)], runtime_factory=FakeRuntime) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


async def test_openai_client(aiohttp_client):
    client, _ = await serve_fake(aiohttp_client, ["--api-key", "sekrit"])
    oai = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="sekrit", max_retries=0)
    chat = await oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=8)
    assert chat.choices[0].message.content == SCRIPT[:8] and chat.usage.completion_tokens == 8
    stream = await oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=8, stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "".join(parts) == SCRIPT[:8] and usage.total_tokens == chat.usage.total_tokens
    comp = await oai.completions.create(model="any", prompt="hi", max_tokens=5, stop=["xyz"])
    assert comp.choices[0].text == SCRIPT[:5] and comp.choices[0].finish_reason == "length"
    models = await oai.models.list()
    assert models.data[0].id == "fake.gguf"
    bad = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="wrong", max_retries=0)
    try:
        await bad.models.list()
        raise AssertionError("a wrong key must be refused")
    except openai.AuthenticationError as e:
        assert e.status_code == 401
    await oai.close()
    await bad.close()
