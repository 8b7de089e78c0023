"""Request gates in llama-server's order: CORS preflight, then "still loading", then the API key.

The key comes from `Authorization: Bearer <key>` (or `X-Api-Key`), compared in constant time against every
configured key. /health stays public so load balancers can probe it, as upstream.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from app.server.errors import UNAVAILABLE, ApiError
from app.server.state import STATE

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
CORS_METHODS = "GET, POST, DELETE, OPTIONS"


def _key_ok(given: str, keys: tuple[str, ...]) -> bool:
    g = given.encode()
    # compare with every key (no early exit) so timing does not reveal which one nearly matched
    results = [hmac.compare_digest(g, k.encode()) for k in keys]
    return any(results)


def _presented_key(request: web.Request) -> str:
    value = request.headers.get("Authorization") or request.headers.get("X-Api-Key") or ""
    return value[len("Bearer "):] if value.startswith("Bearer ") else value


@web.middleware
async def gate_middleware(request: web.Request, handler) -> web.StreamResponse:
    if request.method == "OPTIONS":  # browsers send preflights without credentials
        return web.Response(status=200, headers={
            "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
            "Access-Control-Allow-Credentials": "true",
        })
    state = request.app[STATE]
    if state.load_failed is not None:
        raise ApiError(500, f"the model failed to load: {state.load_failed}")
    if not state.runtime.ready or state.template is None:
        raise ApiError(503, "Loading model", UNAVAILABLE, retry_after_s=1)
    keys = state.settings.http.api_keys
    if keys and request.path not in PUBLIC_PATHS and not _key_ok(_presented_key(request), keys):
        raise ApiError(401, "Invalid API Key")
    return await handler(request)


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare hook: every response (streams too) carries llama-server's default CORS answer."""
    origin = request.headers.get("Origin")
    # upstream's default (--cors-origins '*' with credentials) echoes the caller's origin
    response.headers["Access-Control-Allow-Origin"] = origin or "*"
    if origin:
        response.headers["Access-Control-Allow-Credentials"] = "true"
