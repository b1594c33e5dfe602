"""The contract serve/transport.py keeps with uvicorn and h11: each private name its docstring
lists, checked on the installed versions, so that an upgrade that renames or drops one fails
here, by name, rather than as a server that quietly loses a guard (a 408, a 431, a JSON 503).
The behaviour itself is tested through real sockets in test_serve_bounds.py and
test_serve_hostile.py."""

from __future__ import annotations

import asyncio
import inspect
import re
from importlib.metadata import version
from pathlib import Path

import h11
import pytest
import uvicorn
from packaging.requirements import Requirement
from uvicorn.protocols.http import h11_impl
from uvicorn.server import ServerState

from edgespec.serve import transport

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"
PROTOCOL_METHODS = ("connection_made", "data_received", "eof_received", "connection_lost",
                    "pause_writing", "resume_writing", "send_400_response")
CYCLE_ATTRIBUTES = ("response_started", "response_complete", "keep_alive",
                    "waiting_for_100_continue")


@pytest.mark.parametrize("package", ["uvicorn", "h11"])
def test_the_installed_versions_are_in_the_pinned_range(package):
    """The serve extra pins both below the first release the contract was not checked on."""
    serve = re.search(r"^serve = \[(.*?)\]", PYPROJECT.read_text(), re.M | re.S).group(1)
    pins = [Requirement(r) for r in re.findall(r'"([^"]+)"', serve)]
    pin = next(r for r in pins if r.name == package)
    assert any(s.operator == "<" for s in pin.specifier), f"{package} has no upper bound"
    assert version(package) in pin.specifier, (package, version(package), str(pin.specifier))


def test_h11_protocol_takes_what_the_subclass_passes_and_overrides():
    parameters = list(inspect.signature(h11_impl.H11Protocol.__init__).parameters)
    assert parameters[:4] == ["self", "config", "server_state", "app_state"]
    for name in PROTOCOL_METHODS:
        assert callable(getattr(h11_impl.H11Protocol, name, None)), name
    assert list(inspect.signature(h11_impl.H11Protocol.send_400_response).parameters) == [
        "self", "msg"]


def test_h11_protocol_calls_what_the_subclass_wraps():
    """handle_events reads the next event through ``self.conn.next_event`` (an instance
    attribute wraps it), answers a RemoteProtocolError with send_400_response, checks
    ``self.limit_concurrency`` (None: no check) and runs ``self.app``."""
    source = inspect.getsource(h11_impl.H11Protocol.handle_events)
    for used in ("self.conn.next_event()", "h11.RemoteProtocolError", "self.send_400_response(",
                 "self.limit_concurrency is not None", "self.app"):
        assert used in source, used


def test_h11_protocol_instance_has_the_attributes_the_subclass_reads():
    async def app(scope, receive, send):
        pass

    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(app, limit_concurrency=3, lifespan="off")
        state = ServerState()
        protocol = h11_impl.H11Protocol(config=config, server_state=state, app_state={},
                                        _loop=loop)
        assert isinstance(protocol.conn, h11.Connection)
        assert protocol.limit_concurrency == 3
        assert protocol.connections is state.connections and protocol.tasks is state.tasks
        assert protocol.loop is loop and protocol.app is not None
        assert protocol.cycle is None and hasattr(protocol, "transport")
        ours = transport.protocol(2.0)(config=config, server_state=state, app_state={},
                                       _loop=loop)
        assert ours.limit_concurrency is None and ours._limit == 3  # the check is ours now
        assert ours.read_timeout_s == 2.0
    finally:
        loop.close()


def test_the_request_cycle_has_the_attributes_the_subclass_reads_and_sets():
    source = inspect.getsource(h11_impl.RequestResponseCycle.__init__)
    for name in CYCLE_ATTRIBUTES:
        assert f"self.{name} =" in source, name


def test_h11_has_the_names_the_subclass_uses():
    connection = h11.Connection(h11.SERVER)
    assert connection.their_state is h11.IDLE and h11.DONE is not h11.IDLE
    assert hasattr(connection, "their_http_version") and callable(connection.send)
    assert h11.RemoteProtocolError("too large", 431).error_status_hint == 431
    h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
    assert inspect.isclass(h11.Request)


def test_uvicorn_config_and_server_take_what_server_py_passes():
    """server.py's uvicorn.Config options and the uvicorn.Server methods its subclass
    overrides (startup, shutdown, handle_exit) and attributes it reads."""
    options = inspect.signature(uvicorn.Config.__init__).parameters
    for name in ("http", "timeout_graceful_shutdown", "timeout_keep_alive",
                 "limit_concurrency", "h11_max_incomplete_event_size", "lifespan"):
        assert name in options, name
    for name, parameters in (("startup", ["self", "sockets"]), ("shutdown", ["self", "sockets"]),
                             ("handle_exit", ["self", "sig", "frame"])):
        assert list(inspect.signature(getattr(uvicorn.Server, name)).parameters) == parameters
    server = uvicorn.Server(uvicorn.Config(lambda *a: None))
    assert server.started is False and server.should_exit is False
