"""Generation endpoints: /completion (llama.cpp native), /v1/completions, /v1/chat/completions, embeddings.

Each handler validates the body into its wire model, converts it to a runtime request (convert.py), and lets
sse.generate() answer with the endpoint's response format (formats.py).
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel

from app.runtime.api import EmbeddingRequest
from app.server import convert
from app.server.errors import NOT_SUPPORTED, ApiError
from app.server.formats import ChatFormat, NativeFormat, OAICompletionFormat
from app.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingData,
    EmbeddingRequestWire,
    EmbeddingResponse,
    EmbeddingUsage,
    NativeEmbedding,
    OAICompletionRequest,
    dump_list,
)
from app.server.sse import generate, json_response
from app.server.state import ServerState, get_state

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: web.Request, model: type[M]) -> M:
    """The body as `model`: 413 past the size limit, 400 for bad JSON or fields (a pydantic error)."""
    body = await request.read()
    return model.model_validate_json(body)


async def completion(request: web.Request) -> web.StreamResponse:
    """POST /completion and /completions: llama.cpp's native completion."""
    state = get_state(request)
    req = await parse_body(request, CompletionRequest)
    gen = await convert.completion_request(req, state)
    stream = bool(req.stream)
    fmt = NativeFormat(state, gen, stream=stream, post_sampling=bool(req.post_sampling_probs),
                       response_fields=req.response_fields)
    return await generate(request, state, gen, fmt, stream)


async def oai_completion(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    state = get_state(request)
    req = await parse_body(request, OAICompletionRequest)
    gen = await convert.completion_request(req, state)
    stream = bool(req.stream)
    fmt = OAICompletionFormat(state, gen, stream=stream, post_sampling=bool(req.post_sampling_probs))
    return await generate(request, state, gen, fmt, stream)


async def chat_completion(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /chat/completions."""
    state = get_state(request)
    req = await parse_body(request, ChatCompletionRequest)
    gen, top = await convert.chat_request(req, state)
    stream = bool(req.stream)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    fmt = ChatFormat(state, gen, stream=stream, n_top=top, post_sampling=bool(req.post_sampling_probs),
                     include_usage=include_usage)
    return await generate(request, state, gen, fmt, stream)


# ---- embeddings -----------------------------------------------------------------------------------------------


def _embedding_inputs(state: ServerState, raw: object) -> list[list[int]]:
    """Every shape llama-server takes: text, texts, token ids, lists of token ids."""
    rt = state.runtime
    if isinstance(raw, str):
        items: list = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw):
        items = [raw]
    else:
        items = list(raw or [])
    if not items:
        raise ApiError(400, "'input' must not be empty")
    out = [rt.tokenize(x, True, True) if isinstance(x, str) else list(x) for x in items]
    if any(not t for t in out):
        raise ApiError(400, "input content cannot be empty")
    return out


async def _embed_all(state: ServerState, prompts: list[list[int]]) -> list[list[float]]:
    rt = state.runtime
    tasks = [asyncio.ensure_future(rt.embed(EmbeddingRequest(prompt=p))) for p in prompts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:  # one failed or the client left: the others are not wanted either
            t.cancel()
        raise


async def _embeddings(request: web.Request, oai: bool) -> web.Response:
    state = get_state(request)
    if not state.settings.runtime.embeddings:
        raise ApiError(501, "embeddings are off on this server: start it with --embedding", NOT_SUPPORTED)
    req = await parse_body(request, EmbeddingRequestWire)
    if req.input is not None:
        raw = req.input
    elif req.content is not None:
        raw, oai = req.content, False  # "content" is llama.cpp's native form and gets the native answer
    else:
        raise ApiError(400, "'input' or 'content' must be provided")
    fmt = req.encoding_format or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, "'encoding_format' must be \"float\" or \"base64\"")
    prompts = _embedding_inputs(state, raw)
    vectors = await _embed_all(state, prompts)
    if not oai:
        return json_response(dump_list([NativeEmbedding.model_construct(index=i, embedding=[v])
                                        for i, v in enumerate(vectors)]))
    data = [EmbeddingData.model_construct(
        embedding=base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if fmt == "base64" else v,
        index=i, object="embedding", encoding_format="base64" if fmt == "base64" else None)
        for i, v in enumerate(vectors)]
    n = sum(len(p) for p in prompts)
    return json_response(EmbeddingResponse.model_construct(
        model=req.model or state.model_name, object="list",
        usage=EmbeddingUsage.model_construct(prompt_tokens=n, total_tokens=n), data=data))


async def oai_embeddings(request: web.Request) -> web.Response:
    """POST /v1/embeddings."""
    return await _embeddings(request, oai=True)


async def native_embeddings(request: web.Request) -> web.Response:
    """POST /embedding and /embeddings (llama.cpp's shape)."""
    return await _embeddings(request, oai=False)
