"""What the serve tests share: a package whose tokenizer has a chat template."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
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


def with_chat_template(checkpoint: Path, out: Path) -> Path:
    """A copy of a Hugging Face checkpoint whose tokenizer_config.json has CHAT_TEMPLATE."""
    shutil.copytree(checkpoint, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return out


def with_template(package: Path, out: Path, source: str) -> Path:
    """A copy of an exported package whose chat_template.jinja is ``source``."""
    shutil.copytree(package, out)
    (out / "chat_template.jinja").write_text(source)
    return out


def with_normalizer(package: Path, out: Path, normalizer: dict) -> Path:
    """A copy of an exported package whose tokenizer has ``normalizer`` (its vocabulary, and
    so its fingerprint, unchanged)."""
    shutil.copytree(package, out)
    path = out / "tokenizer.json"
    raw = json.loads(path.read_text())
    raw["normalizer"] = normalizer
    path.write_text(json.dumps(raw))
    return out


class Served:
    """A running `edgespec serve` process, its port, and its stderr as it comes."""

    def __init__(self, *args: str, env: dict | None = None, host: str = "127.0.0.1"):
        env = {**os.environ, "PYTHONPATH": str(Path(edgespec.__file__).parents[1]),
               **(env or {})}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "edgespec", "serve", "--port", "0", *args],
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

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False
