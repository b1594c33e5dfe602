"""What ``edgespec serve`` is told, in one frozen value: built once by the CLI (or a caller of
``build_app``), checked here, passed down."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from edgespec.config import is_int
from edgespec.errors import ConfigError

# Names under which a browser on this machine reaches a loopback server; any other Host header
# (a DNS-rebinding page's own name) is refused unless --allowed-hosts lists it.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
LOOPBACK_ADDRESSES = ("localhost", "127.0.0.1", "::1")

# Defaults of a deployment on Ray Serve (serve/ray_deploy.py's RayOptions and Autoscale), here
# so that the CLI's help shows them without importing ray. The delays are Ray Serve's own.
REPLICA_CPUS = 1.0  # CPUs Ray reserves for each replica
UPSCALE_DELAY_S = 30.0  # seconds of a higher load before a replica is added
DOWNSCALE_DELAY_S = 600.0  # seconds of a lower load before one is removed
DRAIN_S = 30.0  # seconds a replica being stopped keeps answering the requests it holds
# A replica generates one request at a time (the others wait in its queue), so the autoscaler
# aims at one ongoing request per replica: any request waiting on every replica is a reason to
# add one (Ray: desired = ceil(replicas x mean ongoing / target), between min and max).
TARGET_ONGOING = 1.0


@dataclass(frozen=True)
class ServeConfig:
    """The server's options; every limit has a default that a laptop can live with.

    model: the model's id in the API (None: the package folder's name).
    queue: requests that may wait (their prompts being tokenized, or for the running
        generation); more are answered 429.
    max_body: the largest request body in bytes (413 past it).
    max_tokens: the most tokens one request may ask for, and the default of a chat request
        (with the rest of the context window, if smaller).
    request_timeout_s: the longest one generation may run; it then ends as at max_tokens.
    read_timeout_s: the longest a client may take to send a request's headers, and again its
        body (408 past it), and to take in more of an answer once the socket's buffers are
        full (it is disconnected past it).
    keep_alive_s: how long an idle connection stays open between requests.
    limit_concurrency: connections and requests at once; past it, 503 (with Retry-After)
        before the app.
    allowed_hosts: the Host header values answered ("*": any); others get 400.
    allowed_origins: the web origins allowed to call through CORS (none: no CORS headers,
        so no page of another origin can read an answer or send JSON).
    api_key: when set, every request but GET /health needs ``Authorization: Bearer KEY``;
        printable ASCII, without whitespace at either end.
    template_timeout_s: the longest a chat template may take to render one conversation.
    tokenize_timeout_s: the longest the tokenizer may take over one prompt.
    shutdown_s: on SIGTERM / Ctrl-C, how long answers already under way may take to finish
        after their generations were cancelled.
    cache_slots: how many generations' KV caches the pipeline keeps, least recently used
        dropped first, for a request to start from the longest prefix it shares with one (a
        chat's next turn prefills only its new message; runtime/prefix_cache.py); 0: none.
    cache_mb: the most memory those kept caches may hold, in MiB (None: no cap).
    """

    model: str | None = None
    queue: int = 8
    max_body: int = 1 << 20
    max_tokens: int = 2048
    request_timeout_s: float = 600.0
    read_timeout_s: float = 15.0
    keep_alive_s: float = 5.0
    limit_concurrency: int = 64
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS
    allowed_origins: tuple[str, ...] = ()
    api_key: str | None = None
    template_timeout_s: float = 2.0
    tokenize_timeout_s: float = 10.0
    shutdown_s: float = 3.0
    cache_slots: int = 4
    cache_mb: int | None = 1024

    def __post_init__(self) -> None:
        for name, low in (("queue", 0), ("max_body", 1), ("max_tokens", 1),
                          ("limit_concurrency", 1), ("cache_slots", 0)):
            value = getattr(self, name)
            if not (is_int(value) and value >= low):
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("request_timeout_s", "read_timeout_s", "keep_alive_s",
                     "template_timeout_s", "tokenize_timeout_s", "shutdown_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.cache_mb is not None and not (is_int(self.cache_mb) and self.cache_mb >= 0):
            raise ConfigError(f"cache_mb must be None (no cap) or an integer >= 0, got "
                              f"{self.cache_mb!r}")
        if self.api_key is not None:
            check_api_key(self.api_key)
        for host in self.allowed_hosts:
            if "*" in host[1:] or (host.startswith("*") and host != "*"
                                   and not host.startswith("*.")):
                raise ConfigError(f"allowed host {host!r} must be a name, an address, "
                                  "'*.domain' or '*'")
        for origin in self.allowed_origins:
            if origin != "*" and "://" not in origin:
                raise ConfigError(f"allowed origin {origin!r} must be a scheme and host such "
                                  "as http://localhost:3000, or '*'")

    def key_matches(self, given: str) -> bool:
        """Whether ``given`` is the API key, compared in constant time."""
        return self.api_key is not None and hmac.compare_digest(given.encode(),
                                                                self.api_key.encode())


def check_api_key(key: str) -> None:
    """Refuse a key that a client could not send as it is: HTTP headers carry printable ASCII
    (the openai client refuses anything else), and a client strips the spaces around it."""
    if not key.strip():
        raise ConfigError("the API key must not be empty; leave it out to serve without one")
    if key != key.strip():
        raise ConfigError("the API key must not start or end with whitespace")
    bad = next((c for c in key if not " " <= c <= "~"), None)
    if bad is not None:
        raise ConfigError(f"the API key must be printable ASCII (it travels in an HTTP header), "
                          f"not {bad!r}")


def hosts_for(bound: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The Host header values a server bound to ``bound`` answers by default: the loopback
    names and the bound address itself (bracketed if IPv6), then ``extra``."""
    host = f"[{bound}]" if ":" in bound and not bound.startswith("[") else bound
    return tuple(dict.fromkeys((*LOOPBACK_HOSTS, host.lower(), *extra)))


def is_loopback(host: str) -> bool:
    """Whether binding to ``host`` keeps the server on this machine."""
    import ipaddress

    if host.strip("[]").lower() in LOOPBACK_ADDRESSES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
