"""``edgespec serve``: parse, build the ServeConfig, bind, load, run the server."""

from __future__ import annotations

from pathlib import Path

import click

from edgespec.cli.base import main, needs_serve_extra, resolve_package, runtime, user_errors
from edgespec.config import PROVIDERS
from edgespec.serve.config import ServeConfig

_SERVE = ServeConfig()  # the server's defaults (edgespec/serve/config.py, no heavy imports)


@main.command()
@click.argument("package", required=False, type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 or :: opens the server to the network "
                   "(then set --api-key).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="0 picks a free port.")
@click.option("--model-name", help="The model's id in the API  [default: the package folder's "
                                   "name, e.g. demo]")
@click.option("--api-key", envvar="EDGESPEC_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' (the openai client's api_key) on "
                   "every request but GET /health. Printable ASCII; spaces around it are "
                   "dropped.")
@click.option("--allowed-hosts", multiple=True, metavar="HOST[,HOST...]",
              help="Host header values to answer besides the loopback names and --host "
                   "(the names clients use to reach a server on the network); '*': any.")
@click.option("--allowed-origins", multiple=True, metavar="ORIGIN[,ORIGIN...]",
              help="Web origins (e.g. http://localhost:3000) whose pages may call the server "
                   "(CORS); none by default.")
@click.option("--queue", default=_SERVE.queue, show_default=True, type=click.IntRange(0),
              help="Requests that may wait while one generates; more are answered 429.")
@click.option("--max-tokens", default=_SERVE.max_tokens, show_default=True,
              type=click.IntRange(1),
              help="Most tokens one request may ask for (and a chat's default).")
@click.option("--request-timeout", default=_SERVE.request_timeout_s, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="Seconds one generation may run; it then ends as at max_tokens.")
@click.option("--max-body", default=_SERVE.max_body, show_default=True, type=click.IntRange(1),
              help="Largest request body in bytes; larger ones are answered 413.")
@click.option("--read-timeout", default=_SERVE.read_timeout_s, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="Seconds a client has to send a request's headers, again its body, and to "
                   "read more of an answer that fills the socket's buffers.")
@click.option("--keep-alive", default=_SERVE.keep_alive_s, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="Seconds an idle connection stays open.")
@click.option("--limit-concurrency", default=_SERVE.limit_concurrency, show_default=True,
              type=click.IntRange(1),
              help="Connections at once; more are answered 503 with Retry-After.")
@click.option("--provider", default="auto", show_default=True, type=click.Choice(PROVIDERS))
@click.option("--draft-provider", type=click.Choice(PROVIDERS),
              help="Where the draft runs, if not where the target does.")
@user_errors
def serve(package: Path | None, host: str, port: int, model_name: str | None,
          api_key: str | None, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...],
          queue: int, max_tokens: int, request_timeout: float, max_body: int,
          read_timeout: float, keep_alive: float, limit_concurrency: int, provider: str,
          draft_provider: str | None) -> None:
    """Serve PACKAGE (default: the demo pair) over an OpenAI-compatible HTTP API
    (needs edgespec[serve])."""
    serving = needs_serve_extra()
    from edgespec.serve.config import hosts_for, is_loopback

    config = ServeConfig(
        model=model_name, queue=queue, max_body=max_body, max_tokens=max_tokens,
        request_timeout_s=request_timeout, read_timeout_s=read_timeout,
        keep_alive_s=keep_alive, limit_concurrency=limit_concurrency,
        allowed_hosts=hosts_for(host, _listed(allowed_hosts)),
        allowed_origins=_listed(allowed_origins),
        api_key=None if api_key is None else api_key.strip())
    sock = serving.server.bind(host, port)  # first: a port in use is reported at once
    try:
        pipe = runtime().load(resolve_package(package), provider=provider,
                               draft_provider=draft_provider)
        app = serving.build_app(pipe, config)
    except BaseException:
        sock.close()
        raise
    if api_key is None and not is_loopback(host):
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach "
                   "this machine can use the model", err=True)

    def listening() -> None:  # the socket accepts connections: now the address is true
        address = serving.server.url(host, sock.getsockname()[1])
        click.echo(f"serving {app.state.server.model} at {address}/v1 (one generation at a "
                   f"time, {queue} waiting at most); Ctrl-C stops", err=True)

    serving.server.run(app, sock, config, listening)


def _listed(values: tuple[str, ...]) -> tuple[str, ...]:
    """Repeated and comma-separated option values as one tuple."""
    return tuple(v.strip() for value in values for v in value.split(",") if v.strip())

