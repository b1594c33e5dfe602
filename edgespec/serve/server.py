"""Listening: the socket bound before the models load, and uvicorn running the app on it."""

from __future__ import annotations

import socket

import uvicorn
from starlette.applications import Starlette

from edgespec.errors import EdgespecError

SHUTDOWN_S = 3.0  # on SIGTERM / Ctrl-C: how long running requests may go on before cancelling


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


def run(app: Starlette, sock: socket.socket, shutdown_s: float = SHUTDOWN_S) -> None:
    """Serve until SIGTERM or Ctrl-C: stop accepting, give running requests ``shutdown_s``
    seconds, cancel the rest at their next round, then return. uvicorn raises the signal again
    once it has stopped, so the caller's own handlers still set the exit code."""
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=shutdown_s,
                            lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
