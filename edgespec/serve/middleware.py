"""What every request passes before a route: its id, the Host check, CORS, the API key, and
the translation of any plain-text refusal into OpenAI's error shape.

A server on loopback is reachable from every page its user opens. Pages cannot send JSON to
another origin without a CORS preflight, which this server answers only for
``allowed_origins``, so the routes take JSON bodies only (app.py answers 415 otherwise); a
DNS-rebinding page reaches the server under its own name, which the Host check refuses. The
checks are Starlette's own middleware, in this order (outermost first):

    RequestId -> Metrics -> HeadLimit -> OpenAIErrors -> TrustedHostMiddleware -> CORSMiddleware
              -> AuthenticationMiddleware (bearer key) -> the routes
"""

from __future__ import annotations

import json
import re
import uuid

from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    AuthenticationError,
    SimpleUser,
)
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgespec.serve.config import ServeConfig

HEAD_BYTES = 16 * 1024  # the largest request line and headers: 431 past it
RETRY_AFTER_S = 1  # what a 429 or a 503 for too many connections asks a client to wait
CLIENT_GONE = 499  # nginx's "client closed request": /metrics counts a client that left so
OPEN_PATHS = ("/health",)  # answered without the API key: liveness probes carry none
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
# Starlette's plain-text refusals, said as OpenAI would say them: (message, code)
_KNOWN_REFUSALS = {
    "Invalid host header": (
        ("the Host header names a host this server does not answer to; reach it by one of "
         "its names (--allowed-hosts)"), "host_not_allowed"),
    "Disallowed CORS origin": (
        "this origin may not call the server (--allowed-origins)", "origin_not_allowed"),
    "Disallowed CORS method": ("this method is not allowed from another origin", None),
    "Disallowed CORS headers": ("these headers are not allowed from another origin", None),
}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def stack(config: ServeConfig) -> list[Middleware]:
    """The middleware for ``config``, outermost first (Metrics is added by the app)."""
    layers = [Middleware(HeadLimit), Middleware(OpenAIErrors),
              Middleware(TrustedHostMiddleware, allowed_hosts=list(config.allowed_hosts),
                         www_redirect=False)]
    if config.allowed_origins:
        layers.append(Middleware(
            CORSMiddleware, allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type",
                                                          "x-request-id"],
            expose_headers=["x-request-id", "retry-after"], max_age=600))
    if config.api_key is not None:
        layers.append(Middleware(AuthenticationMiddleware, backend=BearerKey(config),
                                 on_error=_unauthorized))
    return layers


class RequestId:
    """Echo the client's ``X-Request-Id`` (or give one) on every answer, errors included."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


class HeadLimit:
    """431 for a request whose line and headers pass HEAD_BYTES. uvicorn's h11 refuses such a
    head only while it is incomplete (transport.py answers that 431); one that arrives whole in a
    single read gets here."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + sum(
                len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > HEAD_BYTES:
                response = JSONResponse(error_body(
                    f"the request line and headers are larger than {HEAD_BYTES} bytes",
                    code="request_header_fields_too_large"), status_code=431,
                    headers={"connection": "close"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class OpenAIErrors:
    """Rewrite a plain-text error answer (Starlette's Host and CORS refusals) as OpenAI's
    JSON error, keeping its status and headers other than the body's."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: dict = {}

        async def send_json_errors(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if message["status"] >= 400 and headers.get(
                        b"content-type", b"").startswith(b"text/plain"):
                    held["start"], held["body"] = message, b""
                    return
            elif "start" in held:
                held["body"] += message.get("body", b"")
                if message.get("more_body"):
                    return
                return await self._send_json(held["start"], held["body"], send)
            await send(message)

        await self.app(scope, receive, send_json_errors)

    @staticmethod
    async def _send_json(start: Message, text: bytes, send: Send) -> None:
        status = start["status"]
        message, code = _KNOWN_REFUSALS.get(text.decode("utf-8", "replace"),
                                            (text.decode("utf-8", "replace"), None))
        body = json.dumps(error_body(message, "server_error" if status >= 500
                                     else "invalid_request_error", code=code)).encode()
        kept = [(k, v) for k, v in start.get("headers", [])
                if k.lower() not in (b"content-type", b"content-length")]
        await send({"type": "http.response.start", "status": status,
                    "headers": [*kept, (b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class BearerKey(AuthenticationBackend):
    """``Authorization: Bearer KEY`` as OpenAI's clients send their api_key."""

    def __init__(self, config: ServeConfig):
        self.config = config

    async def authenticate(self, conn: HTTPConnection):
        if conn.url.path in OPEN_PATHS:
            return None
        scheme, _, key = conn.headers.get("authorization", "").partition(" ")
        if not key:
            raise AuthenticationError("this server needs an API key: send the header "
                                      "'Authorization: Bearer KEY' (the openai client's api_key)")
        if scheme.lower() != "bearer" or not self.config.key_matches(key.strip()):
            raise AuthenticationError("the API key is not this server's")
        return AuthCredentials(["authenticated"]), SimpleUser("client")


def _unauthorized(conn: HTTPConnection, error: AuthenticationError) -> JSONResponse:
    return JSONResponse(error_body(str(error), code="invalid_api_key"), status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})
