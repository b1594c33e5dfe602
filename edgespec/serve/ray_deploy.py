"""``edgespec serve --replicas N [--ray-address ADDR]``: the same app on Ray Serve.

Each replica is a Ray actor that loads the package once (``edgespec.load``, its sessions'
threads capped at the replica's ``num_cpus``) and serves ``build_app``'s Starlette app, routes,
schemas, queue, guards, API key and /metrics unchanged, behind Ray's HTTP proxy on the given
host and port. The proxy picks a replica per request; each answer says which one served it in
the ``X-Edgespec-Replica`` header (the replica's id and pid). /health and /metrics therefore
count one replica's requests, whichever answered (the router prefers an idle one).

The package is not shipped with the deployment: every node loads it from the same path, so it
must be readable there (a shared filesystem, or the same folder copied to each node), and
edgespec installed in each node's Python.

What guards where. Ray's proxy, not transport.py's protocol, reads the HTTP; the checks inside
the app still run in each replica (Host, CORS, API key, JSON only, body size and time, head
size, the queue's 429, the generation's time limit, OpenAI's error shape). transport.py's
protocol guards do not: the deadline on a request's headers, the disconnection of a client
that stops reading, the refusal of a request framed twice, the probe of half-closed clients,
and its JSON 503 past --limit-concurrency. In their place the proxy's uvicorn keeps idle
connections ``keep_alive_s``, and a replica takes ``1 + queue`` requests at once
(``max_ongoing_requests``, so the app's own 429 still answers a full queue) while the proxy
holds up to ``limit_concurrency`` more waiting for a replica, then answers 503 itself.

What the proxy answers itself (that 503, a request whose replica died before answering) is
put in OpenAI's error shape by ``proxy_middlewares``, which Ray's proxy takes from the
environment variable PROXY_CALLBACK names: set here before a local Ray starts, and to be
exported before ``ray start`` on a cluster; it also ends a stream whose replica died with an
error event and ``[DONE]`` (the status was sent already).

Replicas come and go gracefully: one being replaced (a redeploy of a new version), stopped
(edgespec's Ctrl-C / SIGTERM) or scaled away (``Autoscale``) takes no new requests and finishes
those it holds, for up to ``RayOptions.drain_s``, before it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray import serve
from ray.serve import config as serve_config

from edgespec.config import is_int
from edgespec.errors import ConfigError
from edgespec.serve.config import (
    DOWNSCALE_DELAY_S,
    DRAIN_S,
    REPLICA_CPUS,
    TARGET_ONGOING,
    UPSCALE_DELAY_S,
    ServeConfig,
)

APP_NAME = "edgespec"
REPLICA_HEADER = "x-edgespec-replica"
PROXY_CALLBACK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"  # read by Ray's proxy at start
DRAIN_POLL_S = 0.5  # how often a draining replica looks whether its last request ended
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # Serve's logs, as uvicorn's are


# Autoscaling's look-back window must exceed this (Ray warns, and says it will refuse)
METRICS_INTERVAL_S = getattr(serve_config, "DEFAULT_METRICS_INTERVAL_S", 10.0)


@dataclass(frozen=True)
class Autoscale:
    """Replicas between ``min_replicas`` and ``max_replicas`` (Ray Serve's autoscaling_config),
    aiming at TARGET_ONGOING requests per replica: more after ``upscale_delay_s`` of a higher
    mean over the last ``look_back_s`` (more than Ray's metrics interval), fewer after
    ``downscale_delay_s`` of a lower one (Ray's defaults: 30 s, 600 s, 30 s)."""

    min_replicas: int
    max_replicas: int
    upscale_delay_s: float = UPSCALE_DELAY_S
    downscale_delay_s: float = DOWNSCALE_DELAY_S
    look_back_s: float = 30.0

    def __post_init__(self) -> None:
        if not (is_int(self.min_replicas) and is_int(self.max_replicas)
                and 1 <= self.min_replicas <= self.max_replicas):
            raise ConfigError(f"autoscale needs 1 <= MIN <= MAX replicas, got "
                              f"{self.min_replicas}:{self.max_replicas}")
        for name in ("upscale_delay_s", "downscale_delay_s", "look_back_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
        if self.look_back_s <= METRICS_INTERVAL_S:
            raise ConfigError(f"look_back_s must be more than Ray's metrics interval "
                              f"({METRICS_INTERVAL_S:g} s), got {self.look_back_s!r}")

    @classmethod
    def parse(cls, text: str, **delays) -> Autoscale:
        """``MIN:MAX`` as given to ``--autoscale``."""
        low, sep, high = text.partition(":")
        if not (sep and low.strip().isdigit() and high.strip().isdigit()):
            raise ConfigError(f"autoscale must be MIN:MAX replicas such as 1:4, got {text!r}")
        return cls(int(low), int(high), **delays)

    def ray_config(self) -> dict:
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": self.min_replicas,
                "target_ongoing_requests": TARGET_ONGOING,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_s}


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide: ``replicas`` copies of the app (or as many as ``autoscale`` says),
    each on ``replica_cpus`` CPUs, on the Ray cluster at ``address`` (None: a local one that
    edgespec starts and stops). ``drain_s``: how long a replica being replaced or stopped
    (a redeploy, edgespec's shutdown, scaling down) keeps answering the requests it holds,
    streams included, before Ray kills it; it takes no new ones meanwhile."""

    replicas: int = 1
    address: str | None = None
    replica_cpus: float = REPLICA_CPUS
    autoscale: Autoscale | None = None
    drain_s: float = DRAIN_S

    def __post_init__(self) -> None:
        if not (isinstance(self.drain_s, (int, float)) and self.drain_s > 0):
            raise ConfigError(f"drain_s must be a number of seconds > 0, got {self.drain_s!r}")


@serve.ingress()
class Edgespec:
    """One replica: one loaded Pipeline and the app over it."""

    def __init__(self, package: str, config: ServeConfig, threads: int, provider: str,
                 draft_provider: str | None):
        import edgespec

        target, draft = _session_configs(Path(package), threads, provider, draft_provider)
        self.pipe = edgespec.load(package, target=target, draft=draft)
        self.config = config

    def __serve_build_asgi_app__(self):
        from edgespec.serve.app import build_app

        app = build_app(self.pipe, self.config)
        context = serve.get_replica_context()
        app.add_middleware(ReplicaHeader, value=f"{context.replica_id.unique_id} {os.getpid()}")
        return app


class ReplicaHeader:
    """Say on every answer which replica served it, and leave X-Request-Id to Ray's proxy,
    which adds it to every answer (the client's id, or the one it gave the request, which
    the app echoes): once, not twice."""

    def __init__(self, app, value: str):
        self.app, self.value = app, value.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_replica(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*(h for h in message.get("headers", [])
                                        if h[0].lower() != b"x-request-id"),
                                      (REPLICA_HEADER.encode(), self.value)]
            await send(message)

        await self.app(scope, receive, send_with_replica)


def proxy_middlewares() -> list:
    """The middleware Ray's proxy runs (outermost last): what it answers itself, as OpenAI's
    errors."""
    from starlette.middleware import Middleware

    from edgespec.serve.middleware import OpenAIErrors

    return [Middleware(ReplicaFailed), Middleware(OpenAIErrors)]


REPLICA_FAILED = ("the replica serving this request failed before it finished (Ray starts "
                  "another); retry")


class ReplicaFailed:
    """In Ray's proxy: an answer its replica did not finish (the replica died, or could not
    be reached) ends in OpenAI's error shape. With no answer started, a 500 rather than
    uvicorn's plain-text one. With a stream started, an error event then ``[DONE]``, as the
    single-process server ends a stream that fails (the openai client raises APIError on it):
    Ray's proxy logs the replica's death and returns as if the answer were complete
    (``proxy_request`` in ray.serve._private.proxy: it sends nothing more once the status went
    out), so without this the client saw the chunked body end early, or a clean end without
    ``[DONE]``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, finished, stream = False, False, False

        async def send_tracked(message) -> None:
            nonlocal started, finished, stream
            if message["type"] == "http.response.start":
                started = True
                stream = any(name.lower() == b"content-type" and
                             value.startswith(b"text/event-stream")
                             for name, value in message.get("headers", []))
            elif message["type"] == "http.response.body":
                finished = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            if started and not stream:
                raise
        if finished:
            return
        from edgespec.serve.middleware import error_body

        body = error_body(REPLICA_FAILED, "server_error", code="replica_failed")
        if not started:
            from starlette.responses import JSONResponse

            await JSONResponse(body, status_code=500)(scope, receive, send)
        elif stream:
            from edgespec.serve.responses import event

            await send({"type": "http.response.body",
                        "body": (event(body) + "data: [DONE]\n\n").encode()})


def _session_configs(package: Path, threads: int, provider: str, draft_provider: str | None):
    """The library's (target, draft) settings for ``package`` with no more than ``threads``
    threads each: the library gives every core of the machine, which replicas share."""
    from edgespec.manifest import Manifest
    from edgespec.runtime.providers import default_session_configs

    manifest = Manifest.read(package)
    configs = default_session_configs(provider, draft_provider,
                                      manifest.draft.parameters if manifest.draft else 0)
    return tuple(replace(c, threads=min(c.threads, threads)) for c in configs)


def application(package: Path, config: ServeConfig, options: RayOptions, provider: str = "auto",
                draft_provider: str | None = None):
    """The bound Ray Serve application of ``options.replicas`` replicas serving ``package``."""
    scale = ({"autoscaling_config": options.autoscale.ray_config()} if options.autoscale
             else {"num_replicas": options.replicas})
    deployment = serve.deployment(
        Edgespec, name=APP_NAME, **scale,
        ray_actor_options={"num_cpus": options.replica_cpus},
        max_ongoing_requests=1 + config.queue, max_queued_requests=config.limit_concurrency,
        graceful_shutdown_timeout_s=options.drain_s,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S, logging_config=QUIET)
    threads = max(1, int(options.replica_cpus))
    return deployment.bind(str(Path(package).resolve()), config, threads, provider,
                           draft_provider)


class Cluster:
    """Ray and Serve for one ``edgespec serve``: connected (or started locally) on enter; on
    exit the application deleted, and Serve and Ray shut down when edgespec started them."""

    def __init__(self, options: RayOptions, host: str, port: int, config: ServeConfig,
                 num_cpus: int | None = None):
        self.options, self.host, self.port, self.config = options, host, port, config
        self.num_cpus = num_cpus  # a local cluster's CPUs (None: the machine's)
        self.started = False  # whether edgespec started Ray (and so stops it)
        self.serving = False  # whether Serve answered serve.start

    def __enter__(self) -> Cluster:
        self.started = self.options.address is None and not ray.is_initialized()
        if self.started:  # the proxy about to start inherits it
            os.environ.setdefault(PROXY_CALLBACK, f"{__name__}.proxy_middlewares")
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        ray.init(address=self.options.address, num_cpus=self.num_cpus if self.started else None,
                 include_dashboard=False, logging_level=logging.WARNING,
                 ignore_reinit_error=True)
        for sig, handler in handlers.items():  # Ray's core installs its own, which dumps a
            if handler is not None:  # stack and dies: the caller's cleanup would not run
                signal.signal(sig, handler)
        try:
            serve.start(http_options={"host": self.host, "port": self.port,
                                      "keep_alive_timeout_s": int(self.config.keep_alive_s)},
                        logging_config=QUIET)
            self.serving = True
        except BaseException:
            self.close()
            raise
        return self

    def run(self, app) -> None:
        """Deploy ``app`` and return once every replica answers."""
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Take the application away, its replicas drained (each finishes what it holds, up to
        ``drain_s``, while the proxy still carries its answers), then stop Serve and Ray if
        edgespec started them."""
        if not ray.is_initialized():  # closed already
            return
        try:
            if self.serving:
                serve.delete(APP_NAME)  # blocks until the replicas have stopped
        finally:
            try:
                if self.started:
                    serve.shutdown()
            finally:
                if self.started:
                    ray.shutdown()


def wait_forever() -> None:
    """Block the main thread until a signal (Ctrl-C, SIGTERM) raises in it."""
    forever = threading.Event()
    while not forever.wait(3600):
        pass
