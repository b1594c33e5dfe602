"""The OpenAI-compatible HTTP API over one loaded Pipeline, as an ASGI app (Starlette).

    GET  /health               liveness and the queue's counts
    GET  /v1/models            the one model served
    POST /v1/completions       text completion, plain or streamed (server-sent events)
    POST /v1/chat/completions  chat through the package's chat template

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the
status saying whose fault it was: 400 bad request, 404 unknown model or path, 413 body too
large, 429 queue full (with Retry-After), 500 a fault in edgespec.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgespec.errors import EdgespecError
from edgespec.runtime.pipeline import GenerationResult, Pipeline
from edgespec.serve.chat import ChatTemplate, ChatTemplateError
from edgespec.serve.schemas import ChatCompletionRequest, CompletionRequest, Settings
from edgespec.serve.worker import Busy, Cancelled, Job, Worker

log = logging.getLogger("edgespec.serve")

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY = 1 << 20  # bytes; a prompt of a whole context window is far smaller
RETRY_AFTER_S = 1
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length",
                  "context_limit": "length"}
# What a field that takes one of several types must be, said once instead of per type tried
UNION_FIELDS = {
    "prompt": "a string, a list of token ids, or a list holding one of either",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "logprobs": "a boolean or an integer",
}


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers

    def response_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.response_body(), status_code=self.status, headers=self.headers)


@dataclass
class Server:
    """What the routes share: the pair, its name, its template and its worker."""

    pipe: Pipeline
    model: str
    worker: Worker
    template: ChatTemplate | None
    max_body: int
    created: int


def build_app(pipe: Pipeline, model: str | None = None, queue: int = 8,
              max_body: int = MAX_BODY) -> Starlette:
    """The ASGI app serving ``pipe`` under the name ``model`` (default: the package folder's
    name), with ``queue`` requests allowed to wait for the one running generation."""
    if queue < 0:
        raise EdgespecError(f"the queue must hold 0 or more requests, got {queue}")
    server = Server(pipe, model or pipe.path.resolve().name, Worker(queue),
                    ChatTemplate.of_package(pipe.path, pipe.manifest), max_body,
                    int(time.time()))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(server.worker.close)  # running generations end at their round

    routes = [
        Route("/health", partial(health, server), methods=["GET"]),
        Route("/v1/models", partial(list_models, server), methods=["GET"]),
        Route("/v1/models/{model:path}", partial(get_model, server), methods=["GET"]),
        Route("/v1/completions", partial(completions, server), methods=["POST"]),
        Route("/v1/chat/completions", partial(chat_completions, server), methods=["POST"]),
    ]
    handlers = {ApiError: lambda r, e: e.response(), HTTPException: _http_error,
                Exception: _internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.server = server
    return app


async def health(server: Server, request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok", "model": server.model, **server.worker.counts(),
                         "queue": server.worker.capacity - 1})


def _model_card(server: Server) -> dict:
    return {"id": server.model, "object": "model", "created": server.created,
            "owned_by": "edgespec"}


async def list_models(server: Server, request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(server)]})


async def get_model(server: Server, request: Request) -> JSONResponse:
    _check_model(server, request.path_params["model"])
    return JSONResponse(_model_card(server))


async def completions(server: Server, request: Request) -> Response:
    body = _parse(CompletionRequest, await _read_body(request, server.max_body))
    _check_settings(server, body)
    prompt = body.single_prompt()
    # tokenizing a long prompt takes a while: off the event loop, which streams other requests
    prompt_ids = await asyncio.to_thread(_encode, server, prompt, "prompt")
    max_tokens = body.max_tokens or COMPLETION_MAX_TOKENS
    # text goes to the pipeline as text, which token healing needs (ids are never healed)
    return await _respond(server, request, body, prompt_ids, max_tokens, chat=False,
                          prompt=prompt)


async def chat_completions(server: Server, request: Request) -> Response:
    body = _parse(ChatCompletionRequest, await _read_body(request, server.max_body))
    _check_settings(server, body)
    if server.template is None:
        raise ApiError(400, f"the model {server.model} has no chat template (its package was "
                       "exported from a tokenizer without one, or before edgespec carried "
                       "them); use /v1/completions, or re-export from a checkpoint whose "
                       "tokenizer_config.json has a chat_template",
                       "messages", "chat_template_missing")
    prompt_ids = await asyncio.to_thread(_encode_chat, server, body)
    # default: the rest of the context window, where OpenAI's models stop too
    max_tokens = (body.max_completion_tokens or body.max_tokens
                  or server.pipe.manifest.max_positions - len(prompt_ids))
    return await _respond(server, request, body, prompt_ids, max_tokens, chat=True)


def _encode_chat(server: Server, body: ChatCompletionRequest) -> list[int]:
    """The conversation rendered with the package's chat template, then its ids."""
    try:
        text = server.template.render([m.as_template_input() for m in body.messages])
    except ChatTemplateError as e:
        raise ApiError(400, str(e), "messages") from None
    # the rendered text holds the template's special tokens (BOS too): none are added
    return _encode(server, server.pipe.tokenizer.encode(text, add_special_tokens=False).ids,
                   "messages")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes, before it is all read."""
    too_large = ApiError(413, f"the request body is larger than {limit} bytes", None,
                         "request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # gone before its request was read: nobody to answer
        raise ApiError(400, "the client disconnected while sending the request") from None
    return bytes(body)


def _parse(schema: type[BaseModel], body: bytes):
    """The body checked against the schema; the first fault is a 400 naming its field."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        if error["type"] == "json_invalid":
            raise ApiError(400, f"the body is not valid JSON: {error['msg']}") from None
        loc = [str(part) for part in error["loc"]]
        union = next((i for i, part in enumerate(loc) if part in UNION_FIELDS), None)
        if union is not None:  # one error per type tried: name the field, not the types
            param = _param(loc[: union + 1])
            raise ApiError(400, f"{param} must be {UNION_FIELDS[loc[union]]}", param) from None
        param = _param(loc)
        if not param:
            raise ApiError(400, f"the body must be a JSON object: {error['msg']}") from None
        if error["type"] == "missing":
            raise ApiError(400, f"{param} is required", param) from None
        shown = json.dumps(error.get("input"))
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise ApiError(400, f"{param}: {error['msg']}, got {shown}", param) from None


def _param(loc: list[str]) -> str:
    """A field's place as OpenAI writes it: messages[0].role."""
    return "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in loc).lstrip(".")


def _check_model(server: Server, model: str) -> None:
    if model != server.model:
        raise ApiError(404, f"the model {model!r} does not exist; this server has "
                       f"{server.model!r} (GET /v1/models)", "model", "model_not_found")


def _check_settings(server: Server, body: Settings) -> None:
    _check_model(server, body.model)
    refused = body.unsupported()
    if refused:
        raise ApiError(400, refused[1], refused[0], "unsupported_parameter")


def _encode(server: Server, prompt: str | list[int], param: str) -> list[int]:
    """The prompt's ids, refused if they are not text or ids, or fill the context window."""
    try:
        ids = server.pipe.encode(prompt)
    except EdgespecError as e:
        raise ApiError(400, str(e), param) from None
    limit = server.pipe.manifest.max_positions
    if len(ids) >= limit:
        what = "conversation" if param == "messages" else param
        raise ApiError(400, f"the {what} has {len(ids)} tokens but the context window is "
                       f"{limit}; shorten it", param, "context_length_exceeded")
    return ids


# OpenAI's sampling defaults, for a package whose target brought none (vLLM does the same)
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0}


def _sampling(server: Server, body: Settings) -> dict:
    """The request's sampling settings; those it omits from the package's generation
    defaults, else OpenAI's."""
    given = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k")
             if getattr(body, name) is not None}
    return {**OPENAI_SAMPLING, **server.pipe.manifest.generation, **given}


def _submit(server: Server, body: Settings, prompt: str | list[int], max_tokens: int) -> Job:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        stream = server.pipe.stream(
            prompt, max_new_tokens=max_tokens, **_sampling(server, body),
            gamma=body.gamma, schedule=body.schedule,
            use_draft=body.use_draft, drafter=body.drafter, seed=body.seed, stop=stop,
            ignore_eos=body.ignore_eos, token_healing=body.token_healing)
    except EdgespecError as e:  # ConfigError names the setting first: "top_k must be ..."
        field = str(e).split(" ", 1)[0]
        raise ApiError(400, str(e), "max_tokens" if field == "max_new_tokens" else
                       field if field in Settings.model_fields else None) from None
    try:
        return server.worker.submit(stream)
    except Busy:
        raise ApiError(429, f"the server is busy: one generation is running and "
                       f"{server.worker.capacity - 1} are waiting; retry later", None,
                       "queue_full", "server_busy",
                       {"Retry-After": str(RETRY_AFTER_S)}) from None


async def _respond(server: Server, request: Request, body: Settings, prompt_ids: list[int],
                   max_tokens: int, chat: bool, prompt: str | list[int] | None = None) -> Response:
    """``prompt``: what the pipeline gets (text or ids), ``prompt_ids`` if not given."""
    job = _submit(server, body, prompt_ids if prompt is None else prompt, max_tokens)
    reply = _Reply(server.model, chat, len(prompt_ids))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(reply.events(job, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
    try:
        result = await job.result()
    except Cancelled as e:
        raise ApiError(503, str(e), None, "shutting_down", "server_error") from None
    except EdgespecError as e:
        raise ApiError(400, str(e)) from None
    finally:
        watcher.cancel()
    return JSONResponse(reply.whole(result))


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """Cancel the job if the client goes away while it waits for a whole answer."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


class _Reply:
    """OpenAI's response objects for one request: a whole one, or stream chunks."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int):
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _usage(self, result: GenerationResult) -> dict:
        # the prompt as decoded: with token healing one token shorter, its last token regrown
        # by the first completion token, so the total is the context the request used
        prompt = result.stats.prompt_tokens or self.prompt_tokens
        completion = result.stats.new_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def whole(self, result: GenerationResult) -> dict:
        finish = FINISH_REASONS.get(result.stats.finish_reason, "stop")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish}
        return self._object("chat.completion" if self.chat else "text_completion", [choice],
                            usage=self._usage(result), edgespec=result.stats.as_dict())

    def _chunk(self, text: str | None, finish: str | None = None, **extra) -> str:
        if self.chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return _event(self._object(kind, [choice], **extra))

    async def events(self, job: Job, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: text pieces as decoded, a last chunk with the finish reason and
        edgespec's stats, the usage chunk if asked for, then ``[DONE]``."""
        try:
            if self.chat:
                yield _event(self._object("chat.completion.chunk", [{
                    "index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]))
            async for item in job:
                if isinstance(item, str):
                    yield self._chunk(item)
                    continue
                finish = FINISH_REASONS.get(item.stats.finish_reason, "stop")
                yield self._chunk(None, finish, edgespec=item.stats.as_dict())
                if include_usage:
                    yield _event(self._object(
                        "chat.completion.chunk" if self.chat else "text_completion", [],
                        usage=self._usage(item)))
        except Cancelled as e:
            yield _event(ApiError(503, str(e), None, "shutting_down", "server_error")
                         .response_body())
        except EdgespecError as e:
            yield _event(ApiError(400, str(e)).response_body())
        except Exception as e:  # a fault in edgespec mid-stream: said as a 500 would say it
            log.exception("internal error while streaming", exc_info=e)
            yield _event(ApiError(500, f"internal error ({type(e).__name__}); this is a bug in "
                                       "edgespec", kind="server_error").response_body())
        finally:
            job.cancel()  # the client went away: the generation ends at its next round
        yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's 404 / 405 in OpenAI's shape."""
    message = {404: f"no such path: {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}
    return ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                    code="not_found" if exc.status_code == 404 else None,
                    headers=getattr(exc, "headers", None)).response()


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A fault in edgespec: 500 in OpenAI's shape; the server goes on (the log has the trace)."""
    log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(500, f"internal error ({type(exc).__name__}); this is a bug in edgespec",
                    kind="server_error").response()
