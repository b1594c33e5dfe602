"""OpenAI's response objects for one generation: a whole ``text_completion`` or
``chat.completion``, or its server-sent events (chunks, the usage chunk, ``[DONE]``), and the
watch that cancels a generation whose client went away."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from edgespec.runtime.pipeline import GenerationResult
from edgespec.runtime.tools import ToolFormat
from edgespec.serve.errors import ApiError, bug, client_gone, generation_error
from edgespec.serve.metrics import Metrics
from edgespec.serve.schemas import Settings
from edgespec.serve.worker import TIME_LIMIT, Job

log = logging.getLogger("edgespec.serve")

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length",
                  "context_limit": "length", TIME_LIMIT: "length"}


async def respond(request: Request, body: Settings, job: Job, reply: Reply) -> Response:
    """The started job's answer: a stream of events, or the whole object once it ends."""
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(reply.events(job, include_usage, request),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    watcher = asyncio.create_task(cancel_on_disconnect(request, job))
    try:
        result = await job.result()
    except Exception as e:
        if watcher.done() and not watcher.cancelled():  # the client left: it cancelled the job
            raise client_gone() from None
        raise generation_error(e) from None
    finally:
        watcher.cancel()
    return JSONResponse(reply.whole(result))


async def cancel_on_disconnect(request: Request, job: Job) -> None:
    """Cancel the job if the client goes away while it waits for its answer (a client that
    only closed its side of the connection once its request was sent still waits: transport.py
    keeps such a connection open for the answer)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


class Reply:
    """OpenAI's response objects for one request: a whole one, or stream chunks."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int, metrics: Metrics,
                 tool_format: ToolFormat | None = None):
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.metrics = metrics
        self.tool_format = tool_format  # the request gave tools: calls are parsed out
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.kind = "chat.completion" if chat else "text_completion"
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def _object(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _usage(self, result: GenerationResult) -> dict:
        # the user's prompt as tokenized (with token healing the generation backed off its
        # last token, which the first completion token regrows: not counted twice)
        completion = result.stats.new_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def whole(self, result: GenerationResult) -> dict:
        finish = FINISH_REASONS.get(result.stats.finish_reason, "stop")
        if self.chat:
            message = {"role": "assistant", "content": result.text}
            if self.tool_format is not None:
                content, calls = self.tool_format.parse(result.text)
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": [call.as_openai() for call in calls]}
                    finish = "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish}
        return self._object(self.kind, [choice], usage=self._usage(result),
                            edgespec=result.stats.as_dict())

    def _chunk(self, text: str | None, finish: str | None = None, **extra) -> str:
        if self.chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return event(self._object(self.chunk_kind, [choice], **extra))

    async def events(self, job: Job, include_usage: bool, request: Request) -> AsyncIterator[str]:
        """Server-sent events: text pieces as decoded, a last chunk with the finish reason and
        edgespec's stats, the usage chunk if asked for, then ``[DONE]``; a failure is an error
        event before ``[DONE]``. A client that goes away cancels the generation, even while
        its rounds write nothing."""
        watcher = asyncio.create_task(cancel_on_disconnect(request, job))
        first = True
        try:
            if self.chat:
                yield event(self._object(self.chunk_kind, [{
                    "index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]))
            held = _HeldText(self.tool_format)
            async for item in job:
                if isinstance(item, str):
                    if first:
                        self.metrics.first_token.observe(time.perf_counter() - self.start)
                        first = False
                    if piece := held.add(item):
                        yield self._chunk(piece)
                    continue
                finish = FINISH_REASONS.get(item.stats.finish_reason, "stop")
                rest, calls = held.finish()
                if rest:
                    yield self._chunk(rest)
                if calls:  # each call whole, in OpenAI's delta shape (index, id, name, args)
                    finish = "tool_calls"
                    yield event(self._object(self.chunk_kind, [{
                        "index": 0, "delta": {"tool_calls": [
                            {"index": i, **call.as_openai()} for i, call in enumerate(calls)]},
                        "logprobs": None, "finish_reason": None}]))
                yield self._chunk(None, finish, edgespec=item.stats.as_dict())
                if include_usage:
                    yield event(self._object(self.chunk_kind, [], usage=self._usage(item)))
        except Exception as e:
            error = generation_error(e)
            if not isinstance(error, ApiError):  # a fault in edgespec mid-stream
                log.error("internal error while streaming", exc_info=e)
                error = bug(e)
            yield event(error.response_body())
        finally:
            watcher.cancel()
            job.cancel()  # the client went away: the generation ends at its next round
        yield "data: [DONE]\n\n"


class _HeldText:
    """A stream's text with tools given: pieces go out as they come while they cannot be part
    of a call; from where a call may start (hermes: a ``<tool_call>``, or a tail that may
    become one; llama3: an answer opening with ``{``) the text is held, and at the end parsed
    into the content not yet sent and the calls."""

    def __init__(self, tool_format: ToolFormat | None):
        self.format, self.text, self.sent = tool_format, "", 0

    def add(self, piece: str) -> str:
        self.text += piece
        if self.format is None:
            self.sent = len(self.text)
            return piece
        if self.format.name == "llama3":
            if self.text.lstrip()[:1] in ("", "{", "<"):
                return ""  # may be a call: held
            safe = len(self.text)
        else:
            opener = "<tool_call>"
            found = self.text.find(opener)
            safe = found if found >= 0 else next(
                (len(self.text) - n for n in range(len(opener) - 1, 0, -1)
                 if self.text.endswith(opener[:n])), len(self.text))
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list]:
        """(the text not sent yet that is content, the calls)."""
        if self.format is None:
            return self.text[self.sent:], []
        content, calls = self.format.parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        content = content or ""
        return content[self.sent:] if len(content) > self.sent else "", calls


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
