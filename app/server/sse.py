"""Run one generation for an HTTP request: a JSON body, or server-sent events as the text arrives.

A request whose client goes away is cancelled: handler cancellation (aiohttp's `handler_cancellation`) or a
failed write lands in the `finally`, which calls `handle.cancel()` so the slot frees at the next engine step.
As in llama-server, a stream sends its headers only once the first event is known, so an error that happens
before any text (a prompt that does not fit, a grammar that does not compile) is an ordinary JSON error.
"""

from __future__ import annotations

import logging

from aiohttp import web
from pydantic import BaseModel

from app.runtime.api import Finished, FinishReason, GenerationRequest, TextDelta
from app.server.errors import ApiError
from app.server.formats import Collected, ResponseFormat
from app.server.schemas import StreamError, dump
from app.server.state import ServerState

log = logging.getLogger("app.server")

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # reverse proxies must not buffer a token stream
}
_CLIENT_GONE = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def sse_event(chunk: BaseModel | bytes) -> bytes:
    """One SSE event; bytes are already framed (see formats.Splice)."""
    return chunk if isinstance(chunk, bytes) else b"data: " + dump(chunk) + b"\n\n"


def json_response(body: BaseModel | bytes, status: int = 200) -> web.Response:
    data = body if isinstance(body, bytes) else dump(body)
    return web.Response(body=data, status=status, content_type="application/json")


def _engine_error(fin: Finished) -> ApiError:
    return ApiError(500, fin.error or "the generation failed")


async def generate(request: web.Request, state: ServerState, req: GenerationRequest, fmt: ResponseFormat,
                   stream: bool) -> web.StreamResponse:
    """Submit `req` and answer the request with `fmt`; runtime errors raised by submit() reach the middleware."""
    handle = state.runtime.submit(req)
    finished = False
    try:
        if not stream:
            collected = Collected()
            async for ev in handle:
                if isinstance(ev, TextDelta):
                    collected.add(ev)
                    continue
                finished = True
                if ev.reason is FinishReason.ERROR:
                    raise _engine_error(ev)
                return json_response(fmt.response(collected, ev))
            raise ApiError(500, "the generation ended without a result")
        it = handle.__aiter__()
        first = await it.__anext__()
        if isinstance(first, Finished):
            finished = True
            if first.reason is FinishReason.ERROR:
                raise _engine_error(first)
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        finished = await _pump(resp, it, first, fmt, handle)
        return resp
    finally:
        if not finished:
            handle.cancel()


async def _pump(resp: web.StreamResponse, it, ev, fmt: ResponseFormat, handle) -> bool:
    """Write events until Finished; returns whether the request finished (False: the client went away)."""
    try:
        while True:
            fmt.id_slot = getattr(handle, "id_slot", fmt.id_slot)
            if isinstance(ev, TextDelta):
                await resp.write(b"".join(sse_event(c) for c in fmt.chunks(ev)))
                ev = await it.__anext__()
                continue
            if ev.reason is FinishReason.ERROR:
                # headers are out: the error travels as one event and the stream ends without [DONE]
                await resp.write(sse_event(StreamError.model_construct(error=_engine_error(ev).body())))
            else:
                data = b"".join(sse_event(c) for c in fmt.final_chunks(ev))
                await resp.write(data + (fmt.sse_done or b""))
            await resp.write_eof()
            return True
    except _CLIENT_GONE:
        log.debug("client disconnected mid-stream; cancelling request %s", fmt.req.id)
        return False
