"""The OpenAI-compatible HTTP API over one loaded Pipeline, as an ASGI app (Starlette).

    GET  /health               liveness and the queue's counts (no API key needed)
    GET  /metrics              the server's counters in Prometheus's text format
    GET  /v1/models            the one model served
    POST /v1/completions       text completion, plain or streamed (server-sent events)
    POST /v1/chat/completions  chat through the package's chat template
    POST /tokenize             the token ids of a prompt or a conversation
    POST /detokenize           the text of token ids

Errors use OpenAI's shape, with the status saying whose fault it was (errors.py); replies,
whole or streamed, are shaped in responses.py. What every request passes first is in
middleware.py.

A request takes its place in the queue (worker.py) as soon as its body is read, before its
prompt is tokenized or its template rendered, and both run in a child process
(runtime/bounded_text.py, waited on by text_process.py) that is killed past a time limit;
whatever waits for it gives up with a 503 when the server starts to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from functools import partial

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgespec.config import Constraint, resolve_sampling
from edgespec.errors import EdgespecError
from edgespec.runtime.inputs import check_ids, text_bounds
from edgespec.runtime.pipeline import Pipeline
from edgespec.runtime import tools
from edgespec.runtime.chat_template import ChatTemplate
from edgespec.runtime.prefix_cache import PrefixCache
from edgespec.serve import middleware, prompts
from edgespec.serve.config import ServeConfig
from edgespec.serve.errors import HANDLERS, ApiError, parse, shown, shutting_down
from edgespec.serve.metrics import Metrics, RequestMetrics
from edgespec.serve.responses import Reply, respond
from edgespec.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Settings,
    TokenizeRequest,
)
from edgespec.serve.text_process import TextProcess
from edgespec.serve.worker import Busy, Closing, Job, Worker

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
log = logging.getLogger("edgespec.serve")


@dataclass
class Server:
    """What the routes share: the pair, its name, its template, the worker and the options."""

    pipe: Pipeline
    model: str
    config: ServeConfig
    worker: Worker
    template: ChatTemplate | None
    template_source: str | None  # its text: the tool format is read from it
    text: TextProcess  # tokenizing and chat templates, in a child process
    metrics: Metrics
    max_prompt_chars: int  # no text longer, in characters or in UTF-8 bytes, can fit the
    max_prompt_bytes: int  # context window (text_bounds)
    created: int = field(default_factory=lambda: int(time.time()))
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self) -> None:
        """Begin to stop (on the event loop): refuse new work, cancel every generation and
        render or tokenizing; answers under way then finish with 503 ``shutting_down`` (a
        stream: an error event and ``[DONE]``)."""
        self.stopping.set()
        self.worker.stop()
        self.text.kill()


def build_app(pipe: Pipeline, config: ServeConfig | None = None) -> Starlette:
    """The ASGI app serving ``pipe`` with ``config``'s options (ServeConfig's defaults: the
    model named after the package folder, 8 requests waiting at most, loopback hosts only)."""
    config = config or ServeConfig()
    max_chars, max_bytes = text_bounds(pipe.tokenizer, pipe.manifest.max_positions)
    template = ChatTemplate.of_package(pipe.path, pipe.manifest, max_chars)
    source = None if template is None else (
        pipe.path / pipe.manifest.chat_template).read_text(encoding="utf-8")
    text = TextProcess(pipe.path, template, source, config.template_timeout_s,
                       config.tokenize_timeout_s, max_chars, pipe.manifest.max_positions)
    paths = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
             "/tokenize", "/detokenize"}
    metrics = Metrics(paths)
    worker = Worker(config.queue, on_result=metrics.record)
    metrics.watch_queue(worker.counts)
    # the server's kept caches: one store in the one pipeline its worker runs generations on,
    # each taken by one generation at a time (runtime/prefix_cache.py)
    pipe.prefix_cache = PrefixCache(config.cache_slots, None if config.cache_mb is None
                                    else config.cache_mb << 20)
    metrics.watch_cache(pipe.prefix_cache)
    server = Server(pipe, config.model or pipe.path.resolve().name, config, worker, template,
                    source, text, metrics, max_chars, max_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await text.start()
        yield
        server.stop()  # no-op when the server (server.py) began to stop already
        await text.close()
        await asyncio.to_thread(worker.close, 2.0)  # a running round ends first

    routes = [
        Route("/health", partial(health, server), methods=["GET"]),
        Route("/metrics", metrics.endpoint, methods=["GET"]),
        Route("/v1/models", partial(list_models, server), methods=["GET"]),
        Route("/v1/models/{model:path}", partial(get_model, server), methods=["GET"]),
        Route("/v1/completions", partial(completions, server), methods=["POST"]),
        Route("/v1/chat/completions", partial(chat_completions, server), methods=["POST"]),
        Route("/tokenize", partial(tokenize, server), methods=["POST"]),
        Route("/detokenize", partial(detokenize, server), methods=["POST"]),
    ]
    stack = [Middleware(middleware.RequestId), Middleware(RequestMetrics, metrics=metrics),
             *middleware.stack(config)]
    app = Starlette(routes=routes, exception_handlers=HANDLERS, lifespan=lifespan,
                    middleware=stack)
    app.state.server = server
    return app


async def health(server: Server, request: Request) -> JSONResponse:
    return JSONResponse({"status": "stopping" if server.stopping.is_set() else "ok",
                         "model": server.model, **server.worker.counts(),
                         "queue": server.worker.capacity - 1})


def _model_card(server: Server) -> dict:
    return {"id": server.model, "object": "model", "created": server.created,
            "owned_by": "edgespec", "max_model_len": server.pipe.manifest.max_positions}


async def list_models(server: Server, request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(server)]})


async def get_model(server: Server, request: Request) -> JSONResponse:
    _check_model(server, request.path_params["model"])
    return JSONResponse(_model_card(server))


async def completions(server: Server, request: Request) -> Response:
    body = parse(CompletionRequest, await _read_body(request, server))
    _check_settings(server, body)
    prompt = body.single_prompt()
    max_tokens = _max_tokens(server, body.max_tokens, "max_tokens") or COMPLETION_MAX_TOKENS
    prompts.check_length(server, prompt, "prompt")
    async with _admitted(server) as job:
        ids = await prompts.prompt_ids(server, prompt, "prompt")
        # text goes to the pipeline as text, which token healing needs (ids are never healed)
        _start(server, job, body, prompt, ids, max_tokens)
    return await _respond(server, request, body, job, chat=False)


async def chat_completions(server: Server, request: Request) -> Response:
    body = parse(ChatCompletionRequest, await _read_body(request, server))
    _check_settings(server, body)
    _check_template(server)
    asked = (_max_tokens(server, body.max_completion_tokens, "max_completion_tokens")
             or _max_tokens(server, body.max_tokens, "max_tokens"))
    calling = _tool_calling(server, body)  # None without tools
    messages = [m.as_template_input() for m in body.messages]
    try:
        messages = tools.template_messages(messages)
    except tools.ToolError as e:
        raise ApiError(400, str(e), "messages") from None
    async with _admitted(server) as job:
        ids = await prompts.chat_ids(server, messages, body.tools if calling else None)
        # default: the rest of the context window, where OpenAI's models stop too, within the
        # server's cap, so that one chat cannot hold the generation for the whole context
        rest = server.pipe.manifest.max_positions - len(ids)
        _start(server, job, body, ids, ids, asked or min(server.config.max_tokens, rest),
               constraint=calling[1] if calling else None)
    return await _respond(server, request, body, job, chat=True,
                          tool_format=calling[0] if calling else None)


def _tool_calling(server: Server, body: ChatCompletionRequest
                  ) -> tuple[tools.ToolFormat, Constraint] | None:
    """The template's tool format and the grammar of the request's tool_choice over its
    tools (runtime/tools.py); a 400 for tools the request or the template cannot have."""
    form = tools.tool_format(server.template_source)
    if form is None:  # calls in the history need the format too
        for i, message in enumerate(body.messages):
            if message.tool_calls or message.role == "tool":
                field = "tool_calls" if message.tool_calls else "role"
                raise ApiError(400, f"the chat template of {server.model} has no tool format, "
                               "so it cannot render tool calls or their results; send them "
                               "as text", f"messages[{i}].{field}", "unsupported_parameter")
    if not body.tools:
        return None
    if form is None:
        raise ApiError(400, f"the chat template of {server.model} has no tool format (it "
                       "writes no <tool_call> blocks or Llama 3 JSON calls), so it cannot be "
                       "given tools; describe them in a message instead", "tools",
                       "unsupported_parameter")
    try:
        offered = tools.read_tools(body.tools)
        mode, callable_ = tools.chosen(offered, body.tool_choice)
    except tools.ToolError as e:
        raise ApiError(400, str(e), "tools" if "tool_choice" not in str(e) else "tool_choice"
                       ) from None
    return form, form.constraint(mode, callable_, body.parallel_tool_calls)


async def tokenize(server: Server, request: Request) -> JSONResponse:
    body = parse(TokenizeRequest, await _read_body(request, server))
    _check_model(server, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give either prompt (as /v1/completions takes it) or messages (as "
                       "/v1/chat/completions does), not both", "prompt")
    async with _admitted(server):
        if body.messages is not None:
            _check_template(server)
            ids = await prompts.chat_ids(server, [m.as_template_input() for m in body.messages])
        else:
            prompts.check_length(server, body.prompt, "prompt")
            ids = await prompts.prompt_ids(server, body.prompt, "prompt")
    return JSONResponse({"tokens": ids, "count": len(ids),
                         "max_model_len": server.pipe.manifest.max_positions})


async def detokenize(server: Server, request: Request) -> JSONResponse:
    body = parse(DetokenizeRequest, await _read_body(request, server))
    _check_model(server, body.model)
    limit = server.pipe.manifest.max_positions  # bounds the answer: 1 MB of ids is no 9 MB
    if len(body.tokens) > limit:
        raise ApiError(400, f"tokens has {len(body.tokens)} ids, more than the context window "
                       f"of {limit}; detokenize at most {limit} at a time", "tokens",
                       "context_length_exceeded")
    try:
        ids = check_ids(body.tokens, server.pipe.manifest.vocab_size)
    except EdgespecError as e:
        raise ApiError(400, str(e), "tokens") from None
    async with _admitted(server):
        text = await prompts.unless_stopping(server, server.text.decode(ids))
    return JSONResponse({"prompt": text})


async def _read_body(request: Request, server: Server) -> bytes:
    """The request body: JSON only (415 otherwise: a web page can send other types to any
    origin without asking), refused with 413 past ``max_body`` bytes before it is all read,
    and with 408 if it takes longer than ``read_timeout_s``."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"the body must be JSON, sent with Content-Type: application/json "
                       f"(got {kind or 'none'})", None, "unsupported_media_type")
    limit = server.config.max_body
    too_large = ApiError(413, f"the request body is larger than {limit} bytes", None,
                         "request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large

    async def read() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        return bytes(body)

    timeout = server.config.read_timeout_s
    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s", None,
                       "request_timeout") from None
    except ClientDisconnect:  # gone before its request was read: nobody to answer
        raise ApiError(400, "the client disconnected while sending the request") from None


def _check_model(server: Server, model: str) -> None:
    if model != server.model:
        raise ApiError(404, f"the model {shown(model)} does not exist; this server has "
                       f"{server.model!r} (GET /v1/models)", "model", "model_not_found")


def _check_settings(server: Server, body: Settings) -> None:
    _check_model(server, body.model)
    refused = body.unsupported()
    if refused:
        raise ApiError(400, refused[1], refused[0], "unsupported_parameter")


def _check_template(server: Server) -> None:
    if server.template is None:
        raise ApiError(400, f"the model {server.model} has no chat template (its package was "
                       "exported from a tokenizer without one, or before edgespec carried "
                       "them); use /v1/completions, or re-export from a checkpoint whose "
                       "tokenizer_config.json has a chat_template",
                       "messages", "chat_template_missing")


def _max_tokens(server: Server, asked: int | None, param: str) -> int | None:
    cap = server.config.max_tokens
    if asked is not None and asked > cap:
        raise ApiError(400, f"{param} is {asked} but this server gives at most {cap} tokens "
                       "per request (its --max-tokens)", param)
    return asked


@contextlib.asynccontextmanager
async def _admitted(server: Server) -> AsyncIterator[Job]:
    """A place in the queue, from before the prompt is tokenized until the generation ends
    (or, if none starts, the end of this block); 429 when all are taken."""
    try:
        job = server.worker.admit(server.config.request_timeout_s)
    except Busy:
        raise ApiError(429, f"the server is busy: {server.worker.capacity} requests are "
                       "running or waiting; retry later", None, "queue_full", "server_error",
                       {"Retry-After": str(middleware.RETRY_AFTER_S)}) from None
    except Closing:
        raise shutting_down() from None
    try:
        yield job
    finally:
        if job.stream is None:
            server.worker.release(job)


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty")  # what a request may set of config.SamplingConfig


def _sampling(server: Server, body: Settings) -> dict:
    """The request's sampling settings; those it omits from the package's generation
    defaults, else greedy: the same rule as the library's and the CLI's
    (config.resolve_sampling), so one request gives one answer on every surface."""
    given = {name: getattr(body, name) for name in _SAMPLING}
    return asdict(resolve_sampling(given, server.pipe.manifest.generation))


def _start(server: Server, job: Job, body: Settings, prompt: str | list[int],
           prompt_ids: list[int], max_tokens: int, constraint: Constraint | None = None
           ) -> None:
    """Hand the admitted job its generation. ``prompt``: what the pipeline gets (text, which
    it may heal, or ids), already tokenized as ``prompt_ids``."""
    if server.stopping.is_set():
        raise shutting_down()
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        stream = server.pipe.stream(
            prompt, prompt_ids=prompt_ids, max_new_tokens=max_tokens,
            **_sampling(server, body), **body.drafting(), schedule=body.schedule,
            seed=body.seed, stop=stop, ignore_eos=body.ignore_eos,
            token_healing=body.token_healing,
            constraint=constraint or body.constraint())
    except EdgespecError as e:  # the schema checked each setting: what is left is the mix
        raise ApiError(400, str(e)) from None
    job.prompt_tokens = len(prompt_ids)
    server.worker.start(job, stream)


async def _respond(server: Server, request: Request, body: Settings, job: Job,
                   chat: bool, tool_format: tools.ToolFormat | None = None) -> Response:
    reply = Reply(server.model, chat, job.prompt_tokens, server.metrics, tool_format)
    return await respond(request, body, job, reply)
