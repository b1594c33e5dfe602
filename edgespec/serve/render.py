"""Chat templates rendered in a child process, so that a render is bounded in time and memory.

The sandbox (chat.py) caps what one Jinja operation may build, but a template can still loop
for hours (nested ranges), or allocate in C code (a filter's width, a recursive macro), and a
thread cannot be stopped. The child holds the compiled template, lives under an address-space
limit, and answers one conversation per line of JSON; the server kills it when a render passes
its time limit, when the request that waits for it goes away, or when the server stops, and
starts a new one for the next conversation.

    parent -> child   {"source", "special_tokens", "name", "max_chars"}   (once)
    parent -> child   [messages...]                                       (one per render)
    child  -> parent  {"text": ...} or {"error": ...}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import sys
from pathlib import Path

import edgespec
from edgespec.serve.chat import ChatTemplate, ChatTemplateError

RENDER_TIMEOUT_S = 2.0
MEMORY_BYTES = 1 << 30  # address space the child may add to what it holds after start-up


class TemplateProcess:
    """The parent's side: ``render`` one conversation at a time in the child."""

    def __init__(self, template: ChatTemplate, source: str, timeout_s: float = RENDER_TIMEOUT_S):
        self.name, self.max_chars, self.timeout_s = template.name, template.max_chars, timeout_s
        self._hello = json.dumps({"source": source, "special_tokens": template.special_tokens,
                                  "name": template.name, "max_chars": template.max_chars})
        self._process: asyncio.subprocess.Process | None = None
        self._killed: list[asyncio.subprocess.Process] = []  # to reap in close()
        self._lock: asyncio.Lock | None = None

    async def render(self, messages: list[dict]) -> str:
        """The rendered text, or a ChatTemplateError naming the template: its own refusal,
        output past ``max_chars``, more than ``timeout_s`` seconds, or a crash of the child."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            process = await self._started()
            try:
                process.stdin.write(json.dumps(messages).encode() + b"\n")
                await process.stdin.drain()
                line = await asyncio.wait_for(process.stdout.readline(), self.timeout_s)
            except asyncio.TimeoutError:
                self.kill()
                raise ChatTemplateError(
                    f"the chat template {self.name} took more than {self.timeout_s:g} s to "
                    "render the conversation; it was stopped") from None
            except (ConnectionError, ValueError):  # the child died; ValueError: an overlong line
                line = b""
            except BaseException:  # cancelled (client gone, server stopping): stop the render
                self.kill()
                raise
            if not line:
                self.kill()
                raise ChatTemplateError(
                    f"the chat template {self.name} stopped its rendering process (out of "
                    f"memory or crashed) on this conversation")
            reply = json.loads(line)
            if "error" in reply:
                raise ChatTemplateError(reply["error"])
            return reply["text"]

    async def _started(self) -> asyncio.subprocess.Process:
        if self._process is None or self._process.returncode is not None:
            env = {**os.environ,
                   "PYTHONPATH": os.pathsep.join(filter(None, [
                       str(Path(edgespec.__file__).parents[1]), os.environ.get("PYTHONPATH")]))}
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "edgespec.serve.render", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env,
                limit=12 * self.max_chars + 4096)  # a reply line: the text, JSON-escaped
            self._process.stdin.write(self._hello.encode() + b"\n")
        return self._process

    async def start(self) -> None:
        """Start the child ahead of the first conversation."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            await self._started()

    async def close(self) -> None:
        """End the child and wait for it, so that nothing of it outlives the event loop."""
        self.kill()
        for process in self._killed:
            await process.wait()
        self._killed.clear()

    def kill(self) -> None:
        """End the child now (the next render starts another)."""
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            self._killed.append(self._process)
        self._process = None


def _limit_memory() -> None:
    """Let the child grow by MEMORY_BYTES of address space at most: past it, Python raises
    MemoryError, which the render reports, instead of the machine running out."""
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (size + MEMORY_BYTES, size + MEMORY_BYTES))


def main() -> None:
    """The child: compile the template, then render each conversation read from stdin."""
    with contextlib.suppress(OSError, ValueError):  # not Linux: no limit, the timeout stays
        _limit_memory()
    hello = json.loads(sys.stdin.readline())
    try:
        template = ChatTemplate(hello["source"], hello["special_tokens"], hello["name"],
                                hello["max_chars"])
    except ChatTemplateError as e:
        template, compile_error = None, str(e)
    for line in sys.stdin:
        try:
            if template is None:
                raise ChatTemplateError(compile_error)
            reply = {"text": template.render(json.loads(line))}
        except ChatTemplateError as e:
            reply = {"error": str(e)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
