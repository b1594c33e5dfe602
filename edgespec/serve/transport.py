"""The HTTP/1.1 connection: uvicorn's h11 protocol with what it lacks added, each refusal in
OpenAI's error shape.

- a client has ``read_timeout_s`` to send a request's headers (an idle socket, or headers
  dribbled a byte at a time, are answered 408 and closed), and as long to take in what it is
  sent once the socket's buffers are full (a client that stops reading is disconnected, so
  an answer it never reads is not held in memory); the app bounds the body's time (app.py);
- a head past the size limit is answered 431 rather than 400;
- a request with both Content-Length and Transfer-Encoding is refused (400) and its
  connection closed (RFC 9112 6.3: a proxy in front may have framed it the other way);
- a client that half-closes its side once its request is sent still gets its answer, then
  the connection closes; one that closed the whole connection is told apart by the reset its
  socket answers to an interim 100 Continue, and dropped (its generation cancelled);
- past ``limit_concurrency`` connections or requests, uvicorn's plain-text 503 becomes a JSON
  503 with Retry-After.

uvicorn has no public hook for any of this, so ``Protocol`` subclasses its private
``uvicorn.protocols.http.h11_impl.H11Protocol`` and relies on exactly these of its names,
which tests/test_serve_transport.py checks on the installed uvicorn and h11 (pyproject.toml
pins both to the versions it passed on):

- ``H11Protocol(config, server_state, app_state, _loop=None)``, its asyncio.Protocol methods
  (``connection_made``, ``data_received``, ``eof_received``, ``connection_lost``,
  ``pause_writing``, ``resume_writing``) and ``send_400_response(msg)``, which its
  ``handle_events`` calls on an ``h11.RemoteProtocolError``;
- its attributes ``conn`` (the ``h11.Connection``, whose ``next_event`` it calls through the
  attribute, so an instance attribute wraps it), ``limit_concurrency`` (None turns its own
  check off), ``app`` (what each request's cycle runs), ``connections`` and ``tasks`` (the
  server's sets), ``cycle``, ``transport`` and ``loop``;
- the cycle's (``RequestResponseCycle``) ``response_started``, ``response_complete``,
  ``keep_alive`` and ``waiting_for_100_continue``;
- h11's ``Connection.their_state``, ``their_http_version`` and ``send``, the states ``IDLE``
  and ``DONE``, ``Request``, ``InformationalResponse`` and
  ``RemoteProtocolError.error_status_hint``.
"""

from __future__ import annotations

import json
import logging
import socket
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from edgespec.serve.middleware import HEAD_BYTES, RETRY_AFTER_S, error_body

PROBE_S = 0.5  # how often a half-closed connection is checked for a client that left
AMBIGUOUS_FRAMING = ("a request may not carry both Content-Length and Transfer-Encoding "
                     "(RFC 9112 6.3)")
log = logging.getLogger("edgespec.serve")


def protocol(read_timeout_s: float) -> type[Protocol]:
    """The protocol class uvicorn's ``Config(http=...)`` takes (it makes one per connection
    and passes no options), with its read timeout."""
    return type("Protocol", (Protocol,), {"read_timeout_s": read_timeout_s})


class Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines for each request's head and each stalled write,
    unambiguous framing, half-closed clients answered, and JSON refusals (see the module)."""

    read_timeout_s: float  # set by protocol()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timer = self._write_timer = self._probe_timer = None
        self._refusal: int | str = 400  # what send_400_response answers: a status or a reason
        self.conn.next_event = self._checked(self.conn.next_event)
        # uvicorn's own connection limit answers plain text: checked in _limited instead
        self._limit, self.limit_concurrency = self.limit_concurrency, None
        self.app = self._limited(self.app)

    # -- each request's framing, and the refusals uvicorn answers with a plain 400

    def _checked(self, next_event):
        """h11's next_event, remembering a head too large (h11 knows 431 from 400; uvicorn
        forgets) and refusing a request framed twice."""

        def next_event_checked():
            try:
                event = next_event()
            except h11.RemoteProtocolError as e:
                self._refusal = e.error_status_hint
                raise
            if isinstance(event, h11.Request) and _framed_twice(event.headers):
                self._refusal = AMBIGUOUS_FRAMING
                raise h11.RemoteProtocolError(AMBIGUOUS_FRAMING)
            return event

        return next_event_checked

    def send_400_response(self, msg: str) -> None:
        if self._refusal == 431:
            self._refuse(431, f"the request line and headers are larger than {HEAD_BYTES} "
                              "bytes", "request_header_fields_too_large")
        elif self._refusal == AMBIGUOUS_FRAMING:
            self._refuse(400, AMBIGUOUS_FRAMING, "invalid_http")
        else:
            self._refuse(400, "the request is not valid HTTP/1.1", "invalid_http")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` in OpenAI's error shape outside any request, and close."""
        body = json.dumps(error_body(message, code=code)).encode()
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
                "content-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self.transport.close()

    # -- the connection limit, answered in JSON

    def _limited(self, app):
        async def limited(scope, receive, send):
            # this request's own task is among self.tasks already, unlike in uvicorn's check
            if self._limit is not None and (len(self.connections) >= self._limit
                                            or len(self.tasks) > self._limit):
                log.warning("past --limit-concurrency (%d): answered 503", self._limit)
                return await _too_many(self._limit, send)
            return await app(scope, receive, send)

        return limited

    # -- the head's deadline: read_timeout_s from a connection's start, or a head's first byte

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._await_head()  # part of a head: the clock runs from its first byte
        else:
            self._head_arrived()

    def connection_lost(self, exc) -> None:
        self._head_arrived()
        for timer in (self._write_timer, self._probe_timer):
            if timer is not None:
                timer.cancel()
        self._write_timer = self._probe_timer = None
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.read_timeout_s, self._head_too_slow)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered; pipelined bytes wait for it
        self._refuse(408, f"the request's headers did not arrive within "
                          f"{self.read_timeout_s:g} s", "request_timeout")

    # -- a stalled write's deadline: a client that reads nothing is dropped

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.read_timeout_s, self._write_too_slow)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_too_slow(self) -> None:
        """The client has read nothing for read_timeout_s with the buffers full: drop it
        (its request sees a disconnect, and a generation for it is cancelled)."""
        self._write_timer = None
        log.warning("a client read nothing for %g s; disconnecting it", self.read_timeout_s)
        self.transport.abort()

    # -- a half-closed client still answered; one that left, dropped

    def eof_received(self):
        """The client closed its side. If its HTTP/1.1 request is all here and its answer not
        begun, answer it, then close (True keeps the transport open for writing); otherwise
        close now, as uvicorn does (a stream's client has left)."""
        cycle = self.cycle
        if (cycle is None or cycle.response_started or self.conn.their_state is not h11.DONE
                or self.conn.their_http_version != b"1.1"):
            return None
        cycle.keep_alive = False
        self._probe(cycle)
        return True

    def _probe(self, cycle) -> None:
        """Tell a client that only half-closed from one that left: write an interim ``100
        Continue`` (HTTP/1.1 clients skip 1xx answers), to which a closed socket answers with
        a reset, and look for that reset every PROBE_S until the answer starts; a client that
        left is then dropped (its generation is cancelled)."""
        self.transport.write(self.conn.send(h11.InformationalResponse(
            status_code=100, headers=[], reason=b"Continue")))
        cycle.waiting_for_100_continue = False
        self._probe_timer = self.loop.call_later(PROBE_S, self._reset_seen, cycle)

    def _reset_seen(self, cycle) -> None:
        self._probe_timer = None
        if cycle.response_started or self.transport.is_closing():
            return
        if _was_reset(self.transport):
            self.transport.abort()
        else:
            self._probe_timer = self.loop.call_later(PROBE_S, self._reset_seen, cycle)


def _was_reset(transport) -> bool:
    """Whether the peer reset the connection (it had left, and got bytes). Its socket's
    pending error says so (a read would not: after the client's FIN it only reads the end)."""
    sock = transport.get_extra_info("socket")
    return sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0


def _framed_twice(headers) -> bool:
    names = {name.lower() for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


async def _too_many(limit: int, send) -> None:
    """The JSON 503 for a connection or request past the limit, asking for a retry."""
    body = json.dumps(error_body(
        f"the server holds {limit} connections or requests at most (its --limit-concurrency); "
        "retry later", "server_error", code="too_many_connections")).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
