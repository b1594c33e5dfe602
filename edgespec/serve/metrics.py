"""``GET /metrics``: the server's counters in Prometheus's text format (prometheus_client), the
figures llama-server and vLLM users scrape: requests by endpoint and status, prompt and
generated tokens, drafted and accepted tokens (acceptance = accepted / drafted), generations by
finish reason, the queue, and latency histograms (whole request, time to first token).

Each app has its own registry, so that two apps in one process (tests) count apart.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgespec.runtime.pipeline import GenerationResult
from edgespec.serve.middleware import CLIENT_GONE

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The registry and the instruments the app and the worker update."""

    def __init__(self, endpoints: set[str]):
        self.endpoints = endpoints  # labels are these paths, never a client's arbitrary path
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("edgespec_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=registry)
        self.latency = Histogram("edgespec_request_seconds", "Time to answer a request "
                                 "(to its last byte for a stream)", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.first_token = Histogram("edgespec_time_to_first_token_seconds",
                                     "From a streamed request's arrival to its first text",
                                     buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("edgespec_prompt_tokens", "Prompt tokens of generations",
                                     registry=registry)
        self.generated = Counter("edgespec_generation_tokens", "Tokens generated",
                                 registry=registry)
        self.drafted = Counter("edgespec_draft_tokens", "Tokens proposed by the drafter",
                               registry=registry)
        self.accepted = Counter("edgespec_accepted_tokens",
                                "Drafted tokens the target accepted", registry=registry)
        self.finished = Counter("edgespec_generations", "Finished generations",
                                ["finish_reason"], registry=registry)
        self.queue = Gauge("edgespec_queue", "Requests admitted, by state", ["state"],
                           registry=registry)
        self.reused = Counter("edgespec_prompt_tokens_reused", "Prompt tokens whose KV a kept "
                              "cache held, not prefilled again", registry=registry)
        self.cache_hits = Counter("edgespec_prefix_cache_hits", "Generations that started "
                                  "from a kept cache", registry=registry)
        self.cache_bytes = Gauge("edgespec_prefix_cache_bytes", "Memory the kept caches "
                                 "hold", registry=registry)

    def watch_queue(self, counts) -> None:
        """Report ``counts()["running"]`` and ``["waiting"]`` at each scrape."""
        for state in ("running", "waiting"):
            self.queue.labels(state).set_function(lambda state=state: counts()[state])

    def watch_cache(self, cache) -> None:
        """Report the kept caches' memory (a runtime.prefix_cache.PrefixCache) at each scrape."""
        self.cache_bytes.set_function(lambda: cache.nbytes)

    def record(self, result: GenerationResult, prompt_tokens: int) -> None:
        stats = result.stats
        self.prompt_tokens.inc(prompt_tokens)
        self.reused.inc(stats.prompt_tokens_reused)
        if stats.prompt_tokens_reused:
            self.cache_hits.inc()
        self.generated.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.finished.labels(stats.finish_reason or "unknown").inc()

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class RequestMetrics:
    """Count every answer by endpoint and status, and time it. A request whose client left
    before the end of its answer (a stream included) is counted under CLIENT_GONE, the
    client's doing, whatever status its answer began with or would have had."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), {"code": 500, "answered": False, "gone": False}
        path = scope["path"]
        endpoint = path if path in self.metrics.endpoints else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                status["answered"] = True
            await send(message)

        async def watched() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not status["answered"]:
                status["gone"] = True
            return message

        try:
            await self.app(scope, watched, counted)
        finally:
            code = CLIENT_GONE if status["gone"] else status["code"]
            self.metrics.requests.labels(endpoint, str(code)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
