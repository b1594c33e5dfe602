"""A request's prompt or conversation to token ids, within the context window: refused
before tokenizing when no tokenization of its length could fit (runtime/inputs.py's
text_bounds), tokenized or rendered in the child process (text_process.py) otherwise, and
refused from its token count past the window; every wait on the child gives way to the server
stopping."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from edgespec.errors import ChatTemplateError, EdgespecError, TokenizerError
from edgespec.runtime.bounded_text import TooManyTokens
from edgespec.runtime.inputs import check_ids, check_text
from edgespec.serve.errors import ApiError, shutting_down

if TYPE_CHECKING:
    from edgespec.serve.app import Server

log = logging.getLogger("edgespec.serve")

def check_length(server: Server, prompt: str | list[int], param: str) -> None:
    """Refuse, before tokenizing, a text too long for any tokenization of it to fit."""
    if not isinstance(prompt, str):
        return
    size = (len(prompt), "characters", server.max_prompt_chars)
    if size[0] <= size[2]:
        size = (len(prompt.encode("utf-8", "surrogatepass")), "bytes of UTF-8",
                server.max_prompt_bytes)
    if size[0] > size[2]:
        raise ApiError(400, f"the {param} has {size[0]} {size[1]}, more than the {size[2]} "
                       f"that the context window of {server.pipe.manifest.max_positions} "
                       "tokens can hold; shorten it", param, "context_length_exceeded")


async def unless_stopping(server: Server, awaitable: Awaitable):
    """The awaitable's result, or a 503 (the awaitable cancelled) if the server stops first."""
    task = asyncio.ensure_future(awaitable)
    # a server stopping kills the child, so the task may end with the child's fault after the
    # answer is a 503: its exception is taken here, not logged as "never retrieved"
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
    stopping = asyncio.ensure_future(server.stopping.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
    if server.stopping.is_set():
        raise shutting_down()
    try:
        return task.result()
    except TokenizerError as e:
        log.error("the tokenizer failed: %s", e)
        raise ApiError(500, f"the model's tokenizer failed: {e}", None, "tokenizer_error",
                       "server_error") from None


async def chat_ids(server: Server, messages: list[dict], tools: list[dict] | None = None
                   ) -> list[int]:
    """The conversation (messages as templates read them) rendered with the package's chat
    template, ``tools`` offered, and tokenized (in the child process); every fault of the
    template a 400 naming it."""
    try:
        ids = await unless_stopping(server, server.text.render(messages, tools))
    except ChatTemplateError as e:
        raise ApiError(400, str(e), "messages", "chat_template_error") from None
    except TooManyTokens as e:
        raise too_long(server, "messages", e.count, e.partial) from None
    return check_prompt_ids(server, ids, "messages")


async def prompt_ids(server: Server, prompt: str | list[int], param: str) -> list[int]:
    """The prompt's ids as Pipeline.encode makes them: text tokenized (in the child
    process), ids checked to be in the vocabulary; refused if they fill the context."""
    if isinstance(prompt, list):
        return check_prompt_ids(server, prompt, param)
    try:
        check_text(prompt)
    except EdgespecError as e:
        raise ApiError(400, str(e), param) from None
    try:
        ids = await unless_stopping(server, server.text.encode(prompt))
    except TooManyTokens as e:
        raise too_long(server, param, e.count, e.partial) from None
    if not ids:
        raise ApiError(400, f"the {param} is empty; give at least one character", param)
    return check_prompt_ids(server, ids, param)


def check_prompt_ids(server: Server, ids: list[int], param: str) -> list[int]:
    try:
        ids = check_ids(ids, server.pipe.manifest.vocab_size)
    except EdgespecError as e:
        raise ApiError(400, str(e), param) from None
    if len(ids) >= server.pipe.manifest.max_positions:
        raise too_long(server, param, len(ids))
    return ids


def too_long(server: Server, param: str, count: int, partial: bool = False) -> ApiError:
    """OpenAI's refusal of a prompt or conversation that leaves no room to generate
    (``partial``: it has at least ``count`` tokens)."""
    what = "conversation" if param == "messages" else param
    return ApiError(400, f"the {what} has {'at least ' if partial else ''}{count} tokens but "
                    "the context window is "
                    f"{server.pipe.manifest.max_positions}; shorten it", param,
                    "context_length_exceeded")
