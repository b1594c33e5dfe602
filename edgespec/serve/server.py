"""Listening: the socket bound before the models load, and uvicorn running the app on it.

uvicorn drops idle keep-alive connections and bounds how large a request head may grow; what
it lacks (deadlines for a request's head and a stalled write, unambiguous framing, half-closed
clients, JSON refusals) is transport.py's protocol.

Stopping (SIGTERM, Ctrl-C) cancels the generations first, so that each answer under way ends
with a 503 ``shutting_down`` (a stream: an error event and ``[DONE]``), then lets uvicorn
close the connections; whatever still runs after EXIT_S (a tokenizer in a native library
cannot be interrupted) does not hold the process: it exits all the same.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Callable

import uvicorn
from starlette.applications import Starlette

from edgespec.errors import EdgespecError
from edgespec.serve.config import ServeConfig
from edgespec.serve.middleware import HEAD_BYTES
from edgespec.serve.transport import protocol

EXIT_S = 4.5  # after the first signal, the process exits by then whatever still runs
log = logging.getLogger("edgespec.serve")


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: any free port), or an EdgespecError that
    says why not in one line. Bound here rather than by uvicorn, whose failure is a log line
    and a SystemExit, and before the models load, so a port in use is reported at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise EdgespecError(f"cannot listen on {host!r}: {getattr(e, 'strerror', None) or e}; "
                            "pass an address such as 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart past TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise EdgespecError(f"cannot listen on {host}:{port}: {e.strerror or e}; "
                            "choose another --port or --host") from None
    return sock


def url(host: str, port: int) -> str:
    """How a client writes the address: an IPv6 host in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(app: Starlette, sock: socket.socket, config: ServeConfig,
        listening: Callable[[], None] = lambda: None) -> None:
    """Serve until SIGTERM or Ctrl-C, calling ``listening`` once the socket accepts
    connections. uvicorn raises the signal again once it has stopped, so the caller's own
    handlers still set the exit code."""
    uvicorn_config = uvicorn.Config(
        app, log_level="info", lifespan="on", http=protocol(config.read_timeout_s),
        timeout_graceful_shutdown=config.shutdown_s, timeout_keep_alive=config.keep_alive_s,
        limit_concurrency=config.limit_concurrency, h11_max_incomplete_event_size=HEAD_BYTES)
    _Server(uvicorn_config, app.state.server.stop, listening).run(sockets=[sock])


class _Server(uvicorn.Server):
    """uvicorn's server that says when it listens, cancels the generations before closing the
    connections, and exits within EXIT_S of a signal whatever still runs."""

    def __init__(self, config: uvicorn.Config, stop: Callable[[], None],
                 listening: Callable[[], None]):
        super().__init__(config)
        self._stop, self._listening = stop, listening
        self._deadline: threading.Thread | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            self._listening()

    async def shutdown(self, sockets=None) -> None:
        self._stop()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        if self._deadline is None:
            self._deadline = threading.Thread(target=_exit_after, args=(EXIT_S, sig),
                                              name="edgespec-exit", daemon=True)
            self._deadline.start()


def _exit_after(seconds: float, sig: int) -> None:
    """The last resort of a stop: exit with the signal's status (143, 130) after ``seconds``."""
    threading.Event().wait(seconds)
    log.warning("still busy %g s after the signal (a tokenizer or template in native code); "
                "exiting now", seconds)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(128 + sig)
