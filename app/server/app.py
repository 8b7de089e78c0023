"""The aiohttp application: its state, its one route table, its middlewares and the runtime's lifetime.

The runtime is owned by a cleanup context: the model loads in a background task, so the server answers
(503 "Loading model") from the moment it listens, and closes when the app shuts down (the pattern of aiohttp's
background_tasks example).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from app.config import HttpSettings, Settings
from app.server import handlers as gen
from app.server import handlers_info as info
from app.server.auth import add_cors_headers, gate_middleware
from app.server.errors import error_middleware
from app.server.state import STATE, ServerState
from app.server.templates import ChatTemplate

log = logging.getLogger("app.server")

ROUTES = [
    web.get("/health", info.health),  # public: no API key needed
    web.get("/v1/health", info.health),
    web.get("/metrics", info.metrics_endpoint),
    web.get("/props", info.props),
    web.post("/props", info.set_props),
    web.get("/models", info.models),
    web.get("/v1/models", info.models),
    web.post("/completion", gen.completion),  # llama.cpp native
    web.post("/completions", gen.completion),  # llama.cpp native too, as upstream
    web.post("/v1/completions", gen.oai_completion),
    web.post("/chat/completions", gen.chat_completion),
    web.post("/v1/chat/completions", gen.chat_completion),
    web.post("/embedding", gen.native_embeddings),
    web.post("/embeddings", gen.native_embeddings),
    web.post("/v1/embeddings", gen.oai_embeddings),
    web.post("/tokenize", info.tokenize),
    web.post("/detokenize", info.detokenize),
    web.post("/apply-template", info.apply_template),
    web.get("/slots", info.slots),
    web.post("/slots/{id_slot}", info.slot_action),
]


def build_template(http: HttpSettings, model_info: Any) -> ChatTemplate:
    """The chat template in force: --chat-template(-file), else the GGUF's, else ChatML."""
    source = http.chat_template or model_info.chat_template
    return ChatTemplate(source, bos_token=model_info.bos_text, eos_token=model_info.eos_text,
                        add_bos=model_info.add_bos)


async def _load(app: web.Application, on_failure: Callable[[str], None] | None) -> None:
    state = app[STATE]
    rt = state.runtime
    t0 = time.perf_counter()
    try:
        await rt.start()
        state.template = build_template(state.settings.http, rt.info)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # any load failure: report it once, clearly, and let the owner decide
        state.load_failed = getattr(rt, "load_error", None) or str(e) or type(e).__name__
        log.error("failed to load the model: %s", state.load_failed)
        if on_failure is not None:
            on_failure(state.load_failed)
        return
    log.info("model loaded in %.1f s: %s (%d slots, %d tokens of context each)", time.perf_counter() - t0,
             state.model_name, rt.info.n_slots, rt.info.n_ctx_slot)


def _lifecycle(on_failure: Callable[[str], None] | None):
    async def runtime_ctx(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        task = asyncio.create_task(_load(app, on_failure), name="model-load")
        yield
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        await state.runtime.close()
        state.executor.shutdown(wait=False, cancel_futures=True)

    return runtime_ctx


def create_app(
    settings: Settings,
    runtime_factory: Callable[[Any], Any] | None = None,
    *,
    on_load_failure: Callable[[str], None] | None = None,
) -> web.Application:
    """The server app; `runtime_factory(settings.runtime)` builds the runtime (tests pass a fake)."""
    if runtime_factory is None:
        from app.runtime.service import Runtime  # the real engine only when serving for real

        runtime_factory = Runtime
    http = settings.http
    n_workers = http.threads_http if http.threads_http > 0 else min(8, os.cpu_count() or 1)
    state = ServerState(
        settings=settings,
        runtime=runtime_factory(settings.runtime),
        executor=ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="http"),
    )
    # error_middleware is the outermost, so the gate's own 401/503 come out in the OpenAI shape too
    app = web.Application(client_max_size=http.max_body_bytes, middlewares=[error_middleware, gate_middleware])
    app[STATE] = state
    app.add_routes(ROUTES)
    app.on_response_prepare.append(add_cors_headers)
    app.cleanup_ctx.append(_lifecycle(on_load_failure))
    return app
