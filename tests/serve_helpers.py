"""What the serve tests share: a package whose tokenizer has a chat template, copies of packages
with a hostile template or normalizer, a running `edgespec serve` (optionally with its long
generations held until the server stops), and waits on events with a deadline."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

import edgespec

# A BOS first, a refusal of unknown roles, block tags on lines of their own (trim_blocks and
# lstrip_blocks decide what whitespace survives) and the generation prompt, as real templates
# have; short markers, as the test pair's context is 128 tokens
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
{{ message['role'][0] }}: {{ message['content'] }}
{% endfor %}
{% if add_generation_prompt %}
a:
{% endif %}"""


def _copy_editing(folder: Path, out: Path, name: str, **fields) -> Path:
    """A copy of ``folder`` whose JSON file ``name`` has ``fields`` set."""
    shutil.copytree(folder, out)
    path = out / name
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return out


def with_chat_template(checkpoint: Path, out: Path) -> Path:
    """A copy of a Hugging Face checkpoint whose tokenizer_config.json has CHAT_TEMPLATE."""
    return _copy_editing(checkpoint, out, "tokenizer_config.json", chat_template=CHAT_TEMPLATE)


def with_manifest(package: Path, out: Path, **fields) -> Path:
    """A copy of an exported package with ``fields`` set in its edgespec.json."""
    return _copy_editing(package, out, "edgespec.json", **fields)


def with_template(package: Path, out: Path, source: str) -> Path:
    """A copy of an exported package whose chat_template.jinja is ``source``."""
    shutil.copytree(package, out)
    (out / "chat_template.jinja").write_text(source)
    return out


def with_normalizer(package: Path, out: Path, normalizer: dict) -> Path:
    """A copy of an exported package whose tokenizer has ``normalizer`` (its vocabulary, and
    so its fingerprint, unchanged)."""
    return _copy_editing(package, out, "tokenizer.json", normalizer=normalizer)


def wait_until(ready: Callable[[], object], what: str, seconds: float = 30,
               every: float = 0.01):
    """Poll ``ready()`` until it is true (and return it); a wait past ``seconds`` fails the
    test, saying what never happened."""
    give_up = time.monotonic() + seconds
    while not (value := ready()):
        assert time.monotonic() < give_up, f"never {what} within {seconds} s"
        threading.Event().wait(every)
    return value


async def until(ready, what: str, seconds: float = 30) -> None:
    """On the event loop: wait for ``ready()`` (polled), failing past ``seconds``."""
    async def poll():
        while not ready():
            await asyncio.sleep(0.005)

    try:
        await asyncio.wait_for(poll(), seconds)
    except asyncio.TimeoutError:
        pytest.fail(f"never {what} within {seconds} s")


# `edgespec serve` whose generations asked with ignore_eos make one piece, then hold until
# they are cancelled (the client leaves, the server stops): a generation that is still running
# when the test acts, however fast the machine
HELD_SERVE = """
import sys, threading
from edgespec.runtime.pipeline import Pipeline
from edgespec.cli import entry

stream = Pipeline.stream


class Held:
    def __init__(self, inner):
        self.inner, self.cancelled = inner, threading.Event()

    def cancel(self):
        self.cancelled.set()
        self.inner.cancel()

    def __iter__(self):
        if not self.cancelled.is_set():  # a generation cancelled before it starts makes none
            yield "x"
        self.cancelled.wait(120)
        list(self.inner)  # cancelled: ends at once, with its result

    @property
    def result(self):
        return self.inner.result


def held(self, *args, **kwargs):
    inner = stream(self, *args, **kwargs)
    return Held(inner) if kwargs.get("ignore_eos") else inner


Pipeline.stream = held
sys.argv[0] = "edgespec"
entry()
"""


class Served:
    """A running `edgespec serve` process, its port, and its stderr as it comes. ``held``:
    its ignore_eos generations hold until cancelled (HELD_SERVE)."""

    def __init__(self, *args: str, env: dict | None = None, host: str = "127.0.0.1",
                 held: bool = False):
        env = {**os.environ, "PYTHONPATH": str(Path(edgespec.__file__).parents[1]),
               **(env or {})}
        command = ["-c", HELD_SERVE] if held else ["-m", "edgespec"]
        self.process = subprocess.Popen(
            [sys.executable, *command, "serve", "--port", "0", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        ready = threading.Event()
        self.port, self.listening = None, False
        loopback = "::1" if ":" in host else "127.0.0.1"

        def read() -> None:  # drained all along: a full pipe would block the server's logging
            for line in self.process.stderr:
                self.lines.append(line)
                found = re.search(r"^serving .* at http://(?:127\.0\.0\.1|\[::\]|0\.0\.0\.0"
                                  r"|\[::1\]):(\d+)/v1", line)
                if found:  # printed once the socket listens: a connection now must succeed
                    self.port = int(found.group(1))
                    self.listening = _connects(loopback, self.port)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(60) or self.port is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines))
        self.url = f"http://{host}:{self.port}"
        self.client = OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health").json()

    def wait_health(self, ready: Callable[[dict], bool], what: str, seconds: float = 30):
        """Poll /health until ``ready(health)``."""
        return wait_until(lambda: ready(self.health()), what, seconds)

    def text_child_running(self) -> bool:
        """Whether the server's tokenizer and template child is running (busy with a
        request), not asleep on its stdin (Linux: /proc)."""
        return child_running(self.process.pid)

    def text_child(self) -> int | None:
        """The pid of the server's tokenizer and template child (Linux: /proc)."""
        return next((pid for pid, _ in _children(self.process.pid)), None)

    def memory_mb(self) -> float:
        """Resident memory of the server and its child, in MB (Linux: /proc)."""
        pids = [self.process.pid, *(pid for pid, _ in _children(self.process.pid))]
        return sum(_rss_kb(pid) for pid in pids) / 1024

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def raw(served: Served, timeout_s: float = 30) -> socket.socket:
    """A plain TCP connection to the server, each read and write bounded by ``timeout_s``."""
    return socket.create_connection(("127.0.0.1", served.port), timeout=timeout_s)


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a read that waits past the
    socket's timeout fails)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def child_running(pid: int) -> bool:
    """Whether a child of ``pid`` is running (busy), not asleep (Linux: /proc)."""
    return any(state == "R" for _, state in _children(pid))


def _children(pid: int) -> list[tuple[int, str]]:
    """The pids and states (R running, S sleeping, ...) of the processes whose parent is
    ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append((int(stat.parent.name), fields[0]))
    return found


def _rss_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(status.split("VmRSS:")[1].split()[0])


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False
