"""``edgespec serve``: parse, build the ServeConfig, bind, load, run the server."""

from __future__ import annotations

from pathlib import Path

import click

from edgespec.cli.base import loader, main, needs_serve_extra, resolve_package, user_errors
from edgespec.config import PROVIDERS
from edgespec.serve.config import (
    DOWNSCALE_DELAY_S,
    DRAIN_S,
    REPLICA_CPUS,
    TARGET_ONGOING,
    UPSCALE_DELAY_S,
    ServeConfig,
)

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
@click.option("--cache-slots", default=_SERVE.cache_slots, show_default=True,
              type=click.IntRange(0),
              help="Generations whose KV caches are kept, for a request to start from the "
                   "longest token prefix it shares with one (a chat's next turn prefills only "
                   "its new message); 0 keeps none.")
@click.option("--cache-mb", default=_SERVE.cache_mb, show_default=True, type=click.IntRange(0),
              help="The most memory (MiB) the kept caches may hold; the least recently used "
                   "go first.")
@click.option("--provider", default="auto", show_default=True, type=click.Choice(PROVIDERS))
@click.option("--draft-provider", type=click.Choice(PROVIDERS),
              help="Where the draft runs, if not where the target does.")
@click.option("--replicas", type=click.IntRange(1),
              help="Run the server on Ray Serve with this many replicas, each loading PACKAGE "
                   "once, behind Ray's HTTP proxy on --host/--port (needs edgespec[ray]). "
                   "Without it or --ray-address: one process.")
@click.option("--ray-address", metavar="ADDR",
              help="Deploy on the Ray cluster at ADDR ('auto': the one `ray start` made "
                   "here); PACKAGE's path must be readable on every node. Without it, "
                   "--replicas starts a local Ray and stops it on exit.")
@click.option("--replica-cpus", default=REPLICA_CPUS, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="CPUs Ray reserves for each replica; its sessions use as many threads.")
@click.option("--autoscale", metavar="MIN:MAX",
              help="Instead of --replicas: Ray Serve's autoscaler keeps MIN to MAX replicas "
                   f"(MIN at start), aiming at {TARGET_ONGOING:g} ongoing request per replica, "
                   "since each generates one at a time and queues the rest (up to --queue): it "
                   "adds one when requests wait on every replica, removes one when they stay "
                   "below.")
@click.option("--upscale-delay", default=UPSCALE_DELAY_S, show_default=True,
              type=click.FloatRange(0), help="With --autoscale: seconds of waiting requests "
                                             "before a replica is added.")
@click.option("--downscale-delay", default=DOWNSCALE_DELAY_S, show_default=True,
              type=click.FloatRange(0), help="With --autoscale: seconds of fewer requests "
                                             "before a replica is removed.")
@click.option("--drain-timeout", default=DRAIN_S, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="On Ray: seconds a replica being stopped (Ctrl-C, SIGTERM, a redeploy, "
                   "scaling down) keeps answering the requests it holds, streams included; "
                   "it takes no new ones, and is killed past it.")
@user_errors
def serve(package: Path | None, host: str, port: int, model_name: str | None,
          api_key: str | None, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...],
          queue: int, max_tokens: int, request_timeout: float, max_body: int,
          read_timeout: float, keep_alive: float, limit_concurrency: int, cache_slots: int,
          cache_mb: int, provider: str,
          draft_provider: str | None, replicas: int | None, ray_address: str | None,
          replica_cpus: float, autoscale: str | None, upscale_delay: float,
          downscale_delay: float, drain_timeout: float) -> None:
    """Serve PACKAGE (default: the demo pair) over an OpenAI-compatible HTTP API
    (needs edgespec[serve])."""
    serving = needs_serve_extra()
    from edgespec.serve.config import hosts_for

    config = ServeConfig(
        model=model_name, queue=queue, max_body=max_body, max_tokens=max_tokens,
        request_timeout_s=request_timeout, read_timeout_s=read_timeout,
        keep_alive_s=keep_alive, limit_concurrency=limit_concurrency,
        cache_slots=cache_slots, cache_mb=cache_mb,
        allowed_hosts=hosts_for(host, _listed(allowed_hosts)),
        allowed_origins=_listed(allowed_origins),
        api_key=None if api_key is None else api_key.strip())
    if replicas is not None and autoscale is not None:
        raise click.UsageError("give --replicas N or --autoscale MIN:MAX, not both")
    if autoscale is None and _given("upscale_delay", "downscale_delay"):
        raise click.UsageError("--upscale-delay and --downscale-delay need --autoscale MIN:MAX")
    if replicas is not None or ray_address is not None or autoscale is not None:
        _warn_if_open(host, api_key)
        return _serve_on_ray(resolve_package(package), host, port, config, provider,
                             draft_provider, _ray_options(
                                 replicas, ray_address, replica_cpus, autoscale,
                                 upscale_delay, downscale_delay, drain_timeout))
    sock = serving.server.bind(host, port)  # first: a port in use is reported at once
    try:
        pipe = loader()(resolve_package(package), provider=provider,
                               draft_provider=draft_provider)
        app = serving.build_app(pipe, config)
    except BaseException:
        sock.close()
        raise
    _warn_if_open(host, api_key)

    def listening() -> None:  # the socket accepts connections: now the address is true
        address = serving.server.url(host, sock.getsockname()[1])
        click.echo(f"serving {app.state.server.model} at {address}/v1 (one generation at a "
                   f"time, {queue} waiting at most); Ctrl-C stops", err=True)

    serving.server.run(app, sock, config, listening)


def _warn_if_open(host: str, api_key: str | None) -> None:
    from edgespec.serve.config import is_loopback

    if api_key is None and not is_loopback(host):
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach "
                   "this machine can use the model", err=True)


def _ray_deploy():
    try:
        from edgespec.serve import ray_deploy
    except ImportError as e:
        raise click.ClickException(f"--replicas, --autoscale and --ray-address need the ray "
                                   f"extra ({e.name} is missing): pip install "
                                   "\"edgespec[ray]\"") from None
    return ray_deploy


def _ray_options(replicas: int | None, address: str | None, replica_cpus: float,
                 autoscale: str | None, upscale_delay: float, downscale_delay: float,
                 drain_timeout: float):
    ray_deploy = _ray_deploy()
    scaling = None if autoscale is None else ray_deploy.Autoscale.parse(
        autoscale, upscale_delay_s=upscale_delay, downscale_delay_s=downscale_delay)
    return ray_deploy.RayOptions(replicas or 1, address, replica_cpus, scaling, drain_timeout)


def _serve_on_ray(package: Path, host: str, port: int, config: ServeConfig, provider: str,
                  draft_provider: str | None, options) -> None:
    """The same app as Ray Serve replicas (serve/ray_deploy.py) until Ctrl-C or SIGTERM, which
    drain them (--drain-timeout)."""
    ray_deploy = _ray_deploy()
    from edgespec.serve.server import bind, url

    address = options.address
    if address is None:  # a local Ray: a port in use is reported at once, not by Ray's
        with bind(host, port) as sock:  # proxy later; 0: a free port, chosen here
            port = sock.getsockname()[1]
    # on a cluster, Serve's proxies may hold the port already (then they keep their own)
    scale = options.autoscale
    replicas = (f"{scale.min_replicas} to {scale.max_replicas}" if scale
                else str(options.replicas))
    with ray_deploy.Cluster(options, host, port, config) as cluster:
        click.echo(f"deploying {replicas} replica(s) of {package} on Ray "
                   f"({address or 'a local instance'})", err=True)
        cluster.run(ray_deploy.application(package, config, options, provider, draft_provider))
        click.echo(f"serving {config.model or package.resolve().name} at {url(host, port)}/v1 "
                   f"({replicas} replica(s) on Ray Serve, {config.queue} waiting at most in "
                   "each); Ctrl-C stops", err=True)
        try:
            ray_deploy.wait_forever()
        finally:
            click.echo(f"stopping: the replicas finish what they hold (up to "
                       f"{options.drain_s:g} s)", err=True)


def _given(*names: str) -> bool:
    """Whether any of the options ``names`` was given (not left at its default)."""
    from click.core import ParameterSource

    context = click.get_current_context()
    return any(context.get_parameter_source(name) is not ParameterSource.DEFAULT
               for name in names)


def _listed(values: tuple[str, ...]) -> tuple[str, ...]:
    """Repeated and comma-separated option values as one tuple."""
    return tuple(v.strip() for value in values for v in value.split(",") if v.strip())

