"""Tokenizing and chat templates in a child process, bounded in time and memory: the child,
its line protocol, and BoundedText, the library's side of it.

The library and the command line (``Pipeline.encode`` and ``encode_chat``, so ``edgespec
generate`` and ``edgespec chat``) wait on the child through BoundedText, with a deadline,
which Ctrl-C also ends; the server talks to the same child on its event loop
(serve/text_process.py's TextProcess, with this module's ``CHILD``, ``reply_bytes``,
``read_reply`` and ``fault``).

Both come with the package, so both may be hostile, and neither can be stopped in-process: a
tokenizer's normalizer runs in Rust holding the GIL (the event loop, the signal handlers and
every other thread wait for it; a backtracking regex takes minutes), a template can loop for
hours or allocate in C code. The child holds the package's tokenizer and compiled template,
lives under an address-space limit, and answers one request per line of JSON; its parent
kills it only for a fault: when a request passes its time limit, when the request that waits
for it goes away, when its reply is not what it should be, or when the parent stops, and
starts a new one for the next request.

Every reply is bounded at its source, so that a valid request never overflows the line the
parent reads: the child answers at most ``max_ids`` ids (the context window), and only the
count of a text or a conversation that tokenizes to more; the parent sends at most
``max_ids`` ids to decode, whose text is at most ``max_chars`` characters (the longest token
times the context window).

    parent -> child   {"package", "template", "name", "max_chars", "max_ids",
                       "special_tokens"}   (once; package None: render to text, no tokenizer)
    parent -> child   {"encode": text} | {"render": messages, "tools": tools} | {"decode": ids}
    child  -> parent  {"ids": [...]} | {"count": n} (more than max_ids) | {"text": ...}
                      | {"error": ..., "kind": "template"|"native"}
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import edgespec
from edgespec.errors import (
    ChatTemplateError,
    EdgespecError,
    GenerationError,
    TokenizerError,
    shown,
)
from edgespec.runtime.chat import render_chat
from edgespec.runtime.chat_template import ChatTemplate
from edgespec.runtime.inputs import encode_text

LIBRARY_TIMEOUT_S = 10.0  # a render or tokenizing in the library; the server's are its options
MEMORY_BYTES = 1 << 30  # address space the child may add to what it holds after start-up
PART_IDS = 4  # characters per id of a long text's first part, counted before the whole


class TooManyTokens(EdgespecError):
    """A text or a conversation tokenizes to more ids than the context window holds: to
    ``count`` of them, or (``partial``) at least as many (counted on a part of it)."""

    def __init__(self, count: int, limit: int, partial: bool = False):
        super().__init__(f"{'at least ' if partial else ''}{count} tokens, more than the "
                         f"context window of {limit}")
        self.count, self.limit, self.partial = count, limit, partial


class BoundedText:
    """The same child for the library and the command line: a blocking request at a time,
    waited on until ``timeout_s``; past it, or on Ctrl-C meanwhile (the wait is a select, which
    a signal interrupts), the child is killed and the next request starts another. The child
    holds the package's tokenizer and template (``source``, None without one)."""

    def __init__(self, package: Path | None, source: str | None, name: str | None,
                 timeout_s: float, max_chars: int, max_ids: int,
                 special_tokens: dict | None = None):
        self.name, self.timeout_s = name, timeout_s
        self.max_chars, self.max_ids = max_chars, max_ids
        self._hello = json.dumps({"package": package and str(package), "template": source,
                                  "name": name, "max_chars": max_chars, "max_ids": max_ids,
                                  "special_tokens": special_tokens})
        self._process: subprocess.Popen | None = None
        self._buffer = b""
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """As TextProcess.encode."""
        return self._ask({"encode": text}, "tokenizer")

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """As TextProcess.render."""
        return self._ask({"render": messages, "tools": tools}, "template")

    def render_text(self, messages: list[dict]) -> str:
        """The conversation as text, without a package (``package`` None: a checkpoint's
        template, with its tokenizer's ``special_tokens``, which the caller tokenizes)."""
        return self._ask({"render": messages}, "template")

    def _ask(self, request: dict, what: str):
        with self._lock:  # one request at a time in the child, whichever thread asks
            return self._ask_child(request, what)

    def _ask_child(self, request: dict, what: str):
        deadline = time.monotonic() + self.timeout_s
        try:
            process = self._started()
            process.stdin.write(json.dumps(request).encode() + b"\n")
            process.stdin.flush()
            line = self._line(process, deadline)
        except TimeoutError:
            self.close()
            raise fault(self.name, what, f"took more than {self.timeout_s:g} s; it was "
                                          "stopped") from None
        except OSError:  # the child died (a broken pipe)
            line = b""
        except BaseException:  # Ctrl-C: the work stops with the child
            self.close()
            raise
        if not line:
            self.close()
            raise fault(self.name, what, "stopped its process (out of memory, or crashed), or "
                                          "answered past its bounds")
        return read_reply(line, self.max_ids)

    def _line(self, process: subprocess.Popen, deadline: float) -> bytes:
        """The child's next line, b"" if it ends first or writes past its bounds."""
        limit, fd = reply_bytes(self.max_chars, self.max_ids), process.stdout.fileno()
        if os.name == "nt":  # no select on pipes: a reader thread, waited on until the deadline
            return _line_in_thread(process, deadline, limit)
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk or len(self._buffer) + len(chunk) > limit:
                    return b""
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._process = _spawner().submit(
                subprocess.Popen, CHILD, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env=child_env(),
                start_new_session=True).result()  # Ctrl-C reaches us, not the child
            self._buffer = b""
            self._process.stdin.write(self._hello.encode() + b"\n")
            weakref.finalize(self, _end, self._process)
        return self._process

    def close(self) -> None:
        """End the child now and wait for it (the next request starts another)."""
        if self._process is not None:
            process, self._process = self._process, None
            _end(process)


@functools.cache
def _spawner() -> ThreadPoolExecutor:
    """The thread that starts every BoundedText child: Linux kills a child when the *thread*
    that started it ends (PR_SET_PDEATHSIG, _die_with_parent), so not a caller's thread,
    which may end while the pipeline lives on, but one that lives as long as the process."""
    return ThreadPoolExecutor(1, thread_name_prefix="edgespec-text-child")


def _line_in_thread(process: subprocess.Popen, deadline: float, limit: int) -> bytes:
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline(limit)),
                              daemon=True)
    reader.start()
    reader.join(max(0.0, deadline - time.monotonic()))
    if reader.is_alive():
        raise TimeoutError
    line = lines[0]
    return line.rstrip(b"\n") if line.endswith(b"\n") else b""


def _end(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    for pipe in (process.stdin, process.stdout):
        with contextlib.suppress(OSError):
            pipe.close()
    process.wait()


CHILD = (sys.executable, "-m", "edgespec.runtime.bounded_text")  # the child's command


def child_env() -> dict:
    """The environment the child starts in: this edgespec first on its path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path(edgespec.__file__).parents[1]), os.environ.get("PYTHONPATH")]))}


def reply_bytes(max_chars: int, max_ids: int) -> int:
    """The longest reply line: max_chars of text, each character at most 12 bytes of JSON (a
    surrogate pair escaped), or max_ids ids, each at most 11 bytes with ", "."""
    return max(12 * max_chars, 11 * max_ids) + 4096


def read_reply(line: bytes, max_ids: int):
    """A reply line as its ids or text, or the error it says."""
    reply = json.loads(line)
    if "error" in reply:
        error = ChatTemplateError if reply["kind"] == "template" else TokenizerError
        raise error(reply["error"])
    if "count" in reply:
        raise TooManyTokens(reply["count"], max_ids, reply.get("partial", False))
    return reply["ids"] if "ids" in reply else reply["text"]


def fault(name: str | None, what: str, how: str) -> EdgespecError:
    """The error for a child that failed ``what`` ("template" or "tokenizer") ``how``."""
    if what == "template":
        return ChatTemplateError(f"the chat template {name} (or the tokenizer on its text) {how}")
    return TokenizerError(f"the tokenizer {how}")


def _limit_memory() -> None:
    """Linux: let the child grow by MEMORY_BYTES of address space at most: past it, Python
    raises MemoryError and Rust aborts the child, instead of the machine running out.
    (Elsewhere the time limit alone bounds it: no /proc, and RLIMIT_AS is not enforced on
    macOS.)"""
    import resource  # POSIX only

    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (size + MEMORY_BYTES, size + MEMORY_BYTES))


class _Child:
    """The child's side: the package's tokenizer and template."""

    def __init__(self, hello: dict):
        from tokenizers import Tokenizer

        from edgespec.manifest import Manifest

        self.max_ids = hello["max_ids"]
        self.tokenizer, special_tokens = None, hello.get("special_tokens") or {}
        if hello["package"] is not None:  # else: templates alone, rendered to text
            package = Path(hello["package"])
            self.manifest = Manifest.read(package)  # loaded and checked by the parent already
            self.tokenizer = Tokenizer.from_file(str(package / self.manifest.tokenizer))
            special_tokens = self.manifest.special_tokens
        self.template, self.compile_error = None, None
        if hello["template"] is not None:
            try:
                self.template = ChatTemplate(hello["template"], special_tokens,
                                             hello["name"], hello["max_chars"])
            except ChatTemplateError as e:
                self.compile_error = str(e)

    def answer(self, request: dict) -> dict:
        if "render" in request:
            try:
                if self.template is None:
                    raise ChatTemplateError(self.compile_error or "the package has no template")
                text = render_chat(self.template, request["render"], request.get("tools"))
            except (ChatTemplateError, GenerationError) as e:
                return {"error": str(e), "kind": "template"}
            if self.tokenizer is None:
                return {"text": text}
            return self._bounded(text, rendered=True)
        if "encode" in request:
            return self._bounded(request["encode"], rendered=False)
        return {"text": self.tokenizer.decode(request["decode"], skip_special_tokens=False)}

    def _bounded(self, text: str, rendered: bool) -> dict:
        """The text's ids, or only their count past max_ids (a reply of bounded length). A
        long text is first counted on a part of it, cut before a space where pre-tokenizers
        split (the part's tokens are then the whole's first ones), growing from PART_IDS
        characters per id: one that is past the window already costs no more to refuse."""
        size = PART_IDS * self.max_ids
        while size < len(text):
            cut = max(text.rfind(space, 0, size) for space in " \n\t")
            if cut > 0 and (count := len(self._tokenize(text[:cut], rendered))) > self.max_ids:
                return {"count": count, "partial": True}
            size *= 2
        ids = self._tokenize(text, rendered)
        return {"ids": ids} if len(ids) <= self.max_ids else {"count": len(ids)}

    def _tokenize(self, text: str, rendered: bool) -> list[int]:
        """The one encoding rule (runtime/inputs.py's encode_text): BOS first for plain text,
        none for a rendered template, which writes its own."""
        return encode_text(self.tokenizer, self.manifest, text, rendered)


def _die_with_parent() -> None:
    """Linux: the kernel kills the child when its parent (the server, the library's spawning
    thread) dies, even by SIGKILL, so that a render stuck in a loop is not left behind
    (elsewhere it ends at its next read of stdin)."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the call
        sys.exit(0)


def main() -> None:
    """The child: load the package's tokenizer and template, then answer each line."""
    if sys.platform.startswith("linux"):  # elsewhere: the timeouts and the parent's kill
        for setup in (_limit_memory, _die_with_parent):
            with contextlib.suppress(OSError, ValueError):  # a hard limit lower already
                setup()
    child = _Child(json.loads(sys.stdin.readline()))
    for line in sys.stdin:
        try:
            reply = child.answer(json.loads(line))
        except BaseException as e:  # a Rust panic is a BaseException; MemoryError too
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            reply = {"error": f"the tokenizer failed ({type(e).__name__}: {shown(str(e), 200)})",
                     "kind": "native"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
