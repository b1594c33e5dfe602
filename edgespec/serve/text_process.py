"""The server's side of the tokenizing and chat-template child (runtime/bounded_text.py):
the same child, talked to on the event loop.

A request's text waits on the child with ``asyncio.wait_for``; the server kills the child only
for a fault (a request past its time limit, a request that goes away while it waits, a reply
that is not what it should be, the server stopping), and starts a new one for the next
request. The child, its line protocol and its bounds are runtime/bounded_text.py's, shared
with the library's BoundedText.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.runtime.bounded_text import (
    CHILD,
    child_env,
    fault,
    read_reply,
    reply_bytes,
)
from edgespec.runtime.chat_template import ChatTemplate


class TextProcess:
    """The server's side: one request at a time in the child, each with a time limit."""

    def __init__(self, package: Path, template: ChatTemplate | None, source: str | None,
                 template_timeout_s: float, tokenize_timeout_s: float, max_chars: int,
                 max_ids: int):
        self.template = template
        self.template_timeout_s, self.tokenize_timeout_s = template_timeout_s, tokenize_timeout_s
        self.max_chars, self.max_ids = max_chars, max_ids
        self._hello = json.dumps({"package": str(package), "template": source,
                                  "name": template.name if template else None,
                                  "max_chars": max_chars, "max_ids": max_ids})
        self._process: asyncio.subprocess.Process | None = None
        self._reaping: set[asyncio.Task] = set()  # killed children not yet waited for
        self._lock: asyncio.Lock | None = None

    async def encode(self, text: str) -> list[int]:
        """The ids of a prompt, as ``Pipeline.encode`` makes them (BOS where the tokenizer
        adds one); TooManyTokens past ``max_ids``; a TokenizerError if the tokenizer fails or
        passes its limits."""
        return await self._ask({"encode": text}, self.tokenize_timeout_s, "tokenizer")

    async def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The ids of a conversation rendered with the chat template, tokenized without
        special tokens (the template writes them); TooManyTokens past ``max_ids``; a
        ChatTemplateError naming the template."""
        return await self._ask({"render": messages, "tools": tools}, self.template_timeout_s,
                               "template")

    async def decode(self, ids: list[int]) -> str:
        """The text of at most ``max_ids`` ids (a ValueError for more: the caller refuses
        them)."""
        if len(ids) > self.max_ids:
            raise ValueError(f"decode takes at most {self.max_ids} ids, got {len(ids)}")
        return await self._ask({"decode": ids}, self.tokenize_timeout_s, "tokenizer")

    async def _ask(self, request: dict, timeout_s: float, what: str):
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            process = await self._started()
            try:
                process.stdin.write(json.dumps(request).encode() + b"\n")
                await process.stdin.drain()
                line = await asyncio.wait_for(process.stdout.readline(), timeout_s)
            except asyncio.TimeoutError:
                self.kill()
                raise self._fault(what, f"took more than {timeout_s:g} s; it was stopped") \
                    from None
            except (ConnectionError, ValueError):  # the child died; ValueError: too long a line
                line = b""
            except BaseException:  # cancelled (client gone, server stopping): stop the work
                self.kill()
                raise
            if not line:
                self.kill()
                raise self._fault(what, "stopped its process (out of memory, or crashed), or "
                                        "answered past its bounds")
        return read_reply(line, self.max_ids)

    def _fault(self, what: str, how: str) -> EdgespecError:
        return fault(self.template.name if self.template else None, what, how)

    async def _started(self) -> asyncio.subprocess.Process:
        if self._process is None or self._process.returncode is not None:
            self._process = await asyncio.create_subprocess_exec(
                *CHILD, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL, env=child_env(),
                start_new_session=True,  # Ctrl-C reaches the server, which ends the child
                limit=reply_bytes(self.max_chars, self.max_ids))
            self._process.stdin.write(self._hello.encode() + b"\n")
        return self._process

    async def start(self) -> None:
        """Start the child ahead of the first request."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            await self._started()

    async def close(self) -> None:
        """End the child and wait for it, so that nothing of it outlives the event loop."""
        self.kill()
        await asyncio.gather(*self._reaping)

    def kill(self) -> None:
        """End the child now (the next request starts another); it is waited for in the
        background, and then nothing of it is kept."""
        if self._process is None:
            return
        process, self._process = self._process, None
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        reaping = asyncio.get_running_loop().create_task(process.wait())
        self._reaping.add(reaping)
        reaping.add_done_callback(self._reaping.discard)
