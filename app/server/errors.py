"""Errors in the OpenAI shape `{"error": {"code", "message", "type"}}`, with llama-server's type names.

Handlers raise `ApiError` (or let a runtime error, a pydantic ValidationError or an aiohttp HTTP error escape);
`error_middleware` turns each into a JSON response with its status. A user's mistake never becomes a traceback.
"""

from __future__ import annotations

import logging

from aiohttp import web
from pydantic import ValidationError

from app.runtime.api import PromptTooLong, RuntimeError_
from app.server.schemas import ErrorBody, ErrorResponse, dump
from app.server.state import STATE

log = logging.getLogger("app.server")

# llama-server's error types by status
INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER = "server_error"
PERMISSION = "permission_error"
NOT_SUPPORTED = "not_supported_error"
UNAVAILABLE = "unavailable_error"
EXCEED_CONTEXT = "exceed_context_size_error"

_TYPE_BY_STATUS = {400: INVALID_REQUEST, 401: AUTHENTICATION, 403: PERMISSION, 404: NOT_FOUND, 500: SERVER,
                   501: NOT_SUPPORTED, 503: UNAVAILABLE}


class ApiError(Exception):
    """An error a handler reports to the client."""

    def __init__(self, status: int, message: str, type_: str | None = None, *, retry_after_s: int | None = None,
                 n_prompt_tokens: int | None = None, n_ctx: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or _TYPE_BY_STATUS.get(status, INVALID_REQUEST if status < 500 else SERVER)
        self.retry_after_s = retry_after_s
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx

    def body(self) -> ErrorBody:
        return ErrorBody.model_construct(code=self.status, message=self.message, type=self.type,
                                         n_prompt_tokens=self.n_prompt_tokens, n_ctx=self.n_ctx)

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return web.Response(status=self.status, body=dump(ErrorResponse.model_construct(error=self.body())),
                            content_type="application/json", headers=headers)


def from_runtime(e: RuntimeError_) -> ApiError:
    """The HTTP face of an error the runtime raised (its class carries the status)."""
    if isinstance(e, PromptTooLong):
        return ApiError(400, str(e), EXCEED_CONTEXT, n_prompt_tokens=e.n_prompt, n_ctx=e.n_ctx)
    return ApiError(e.status, str(e), retry_after_s=getattr(e, "retry_after_s", None))


def from_validation(e: ValidationError) -> ApiError:
    """A readable 400 naming the offending fields, from pydantic's report."""
    msgs: list[str] = []
    for err in e.errors(include_url=False):
        if err["type"] == "json_invalid":
            return ApiError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
        if err["type"] == "model_type" and not err["loc"]:
            return ApiError(400, "the request body must be a JSON object")
        # drop pydantic's union-branch labels (e.g. "str", "list[int]") so the path reads like the JSON
        loc = ".".join(str(p) for p in err["loc"] if isinstance(p, int) or not _is_type_label(str(p)))
        msg = f"'{loc}': {err['msg']}" if loc else err["msg"]
        if msg not in msgs:
            msgs.append(msg)
    more = f" (and {len(msgs) - 3} more)" if len(msgs) > 3 else ""
    return ApiError(400, "invalid request: " + "; ".join(msgs[:3]) + more)


def _is_type_label(p: str) -> bool:
    return p in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in p or p.startswith(
        ("function-", "union[", "tagged-union[")) or p[:1].isupper()


def not_found() -> ApiError:
    return ApiError(404, "File Not Found", NOT_FOUND)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except RuntimeError_ as e:
        return from_runtime(e).response()
    except ValidationError as e:
        return from_validation(e).response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _from_http(request, e).response()
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
        raise  # the client is gone; there is nobody to answer
    except Exception as e:  # a bug on our side: log it, answer 500 without internals
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, f"internal server error: {type(e).__name__}", SERVER).response()


def _from_http(request: web.Request, e: web.HTTPException) -> ApiError:
    if e.status == 404:
        return not_found()
    if e.status == 405:
        return ApiError(405, f"method {request.method} is not allowed on {request.path}", INVALID_REQUEST)
    if e.status == 413:
        limit = request.app[STATE].settings.http.max_body_bytes
        return ApiError(413, f"the request body is larger than the server accepts ({limit >> 20} MiB, see "
                             "--max-body-mib)", INVALID_REQUEST)
    return ApiError(e.status, e.reason or "HTTP error")
