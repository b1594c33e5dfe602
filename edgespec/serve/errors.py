"""Faults said in OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``:
the ApiError a handler raises, a request body's schema fault named by its field, what a failed
generation answers, and the app's handlers for Starlette's 404 / 405 and for a bug.

The status says whose fault it was: 400 bad request, 401 no or a wrong API key, 404 unknown
model or path, 408 a body that did not arrive in time, 413 body too large, 415 a body that is
not JSON, 429 queue full (with Retry-After), 499 the client went away (only counted in
/metrics: nobody reads it), 500 a fault in edgespec, its package or a native library, 503 the
server is stopping.
"""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from edgespec.errors import EdgespecError, ManifestError
from edgespec.serve.middleware import CLIENT_GONE, error_body
from edgespec.serve.worker import Cancelled, NativeFault

log = logging.getLogger("edgespec.serve")

# What a field that takes one of several types must be, said once instead of per type tried
UNION_FIELDS = {
    "prompt": "a string, a list of token ids, or a list holding one of either",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "logprobs": "a boolean or an integer",
}
SHOWN_CHARS = 40  # how much of a client's value an error message quotes


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers

    def response_body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.response_body(), status_code=self.status, headers=self.headers)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is stopping; retry on another instance or later", None,
                    "shutting_down", "server_error")


def client_gone() -> ApiError:
    """The answer to a request whose client left before it (nobody reads it; /metrics counts
    it as the client's, 499 as nginx names it, not as the server's 5xx)."""
    return ApiError(CLIENT_GONE, "the client closed the connection before its answer", None,
                    "client_closed_request")


def shown(value) -> str:
    """A client's value as an error message quotes it: JSON, at most SHOWN_CHARS characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def parse(schema: type[BaseModel], body: bytes):
    """The body checked against the schema; the first fault is a 400 naming its field."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        if error["type"] == "json_invalid":
            raise ApiError(400, f"the body is not valid JSON: {error['msg']}") from None
        loc = [str(part) for part in error["loc"]]
        param = _param(loc)
        if not param:
            raise ApiError(400, f"the body must be a JSON object: {error['msg']}") from None
        if error["type"] == "missing":
            raise ApiError(400, f"{param} is required", param) from None
        if error["type"] == "value_error":  # one of the schema's own rules: say it
            raise ApiError(400, f"{param}: {error['ctx']['error']}", param) from None
        union = next((i for i, part in enumerate(loc) if part in UNION_FIELDS), None)
        if union is not None:  # one error per type tried: name the field, not the types
            param = _param(loc[: union + 1])
            raise ApiError(400, f"{param} must be {UNION_FIELDS[loc[union]]}", param) from None
        raise ApiError(400, f"{param}: {error['msg']}, got {shown(error.get('input'))}",
                       param) from None


def _param(loc: list[str]) -> str:
    """A field's place as OpenAI writes it: messages[0].role."""
    return "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in loc).lstrip(".")


def generation_error(error: Exception) -> Exception:
    """What a generation that failed answers: the server stopping 503, a fault of the
    package or a native library 500, a request the pipeline refused 400; anything else is a
    bug, left to the 500 handler."""
    if isinstance(error, Cancelled):
        return shutting_down()
    if isinstance(error, NativeFault):
        log.error("a native library failed: %s", error)
        return ApiError(500, f"the tokenizer or the model failed inside a native library "
                        f"({error})", None, "native_error", "server_error")
    if isinstance(error, ManifestError):
        log.error("the package failed during a generation: %s", error)
        return ApiError(500, f"the model's package failed: {error}", None, "package_error",
                        "server_error")
    if isinstance(error, EdgespecError):
        return ApiError(400, str(error))
    return error


def bug(error: BaseException) -> ApiError:
    """A fault in edgespec: a 500 that says so (the log has the trace)."""
    return ApiError(500, f"internal error ({type(error).__name__}); this is a bug in edgespec",
                    kind="server_error")


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's 404 / 405 in OpenAI's shape."""
    message = {404: f"no such path: {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}
    return ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                    code="not_found" if exc.status_code == 404 else None,
                    headers=getattr(exc, "headers", None)).response()


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A fault in edgespec: 500 in OpenAI's shape; the server goes on."""
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return bug(exc).response()


HANDLERS = {ApiError: lambda request, e: e.response(), HTTPException: http_error,
            Exception: internal_error}
