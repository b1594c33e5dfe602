"""`edgespec serve` on Ray Serve (serve/ray_deploy.py), on a local Ray instance these tests
start themselves (2 CPUs, no dashboard): two replicas of the demo pair answer as the
single-process pipeline does, share the requests, survive one of them being killed, and leave
no process behind."""

from __future__ import annotations

import os
import threading
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed "
                                        "(pip install 'edgespec[ray]')")
import httpx  # noqa: E402
from openai import InternalServerError, OpenAI  # noqa: E402
from serve_helpers import Served, wait_until  # noqa: E402

import edgespec  # noqa: E402
from edgespec.models import demo_package  # noqa: E402
from edgespec.serve import ray_deploy  # noqa: E402
from edgespec.serve.config import ServeConfig  # noqa: E402

pytestmark = pytest.mark.timeout(180)  # a Ray instance and two replicas start in ~20 s here

PROMPT = "def fibonacci(n):"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Linux: /proc): Ray's GCS, raylet, workers, replicas."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":  # a zombie has ended; its parent has yet to reap it
            alive.add(pid)
    return alive


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy(pids: set[int]) -> int | None:
    """The one of ``pids`` that used 0.1 s of CPU or more over the next 0.3 s, if any."""
    before = {pid: _cpu_s(pid) for pid in pids}
    threading.Event().wait(0.3)
    return next((pid for pid in pids if _cpu_s(pid) - before[pid] >= 0.1), None)


def test_the_cli_on_ray_answers_and_sigterm_leaves_nothing_running():
    """`edgespec serve --replicas 1` starts its own Ray; SIGTERM stops Serve and Ray."""
    served = Served("--replicas", "1")
    try:
        below = _descendants(served.process.pid)
        assert below, "Ray started no processes"
        out = served.client.completions.create(model="demo", prompt=PROMPT, max_tokens=8,
                                               temperature=0)
        assert out.choices[0].text == edgespec.load(demo_package()).generate(
            PROMPT, max_new_tokens=8, temperature=0).text
    finally:
        served.stop()
    assert served.process.returncode == 128 + signal.SIGTERM
    wait_until(lambda: not _alive(below), "Ray's processes ended", seconds=20, every=0.2)


@pytest.fixture(scope="module")
def cluster():
    """Two replicas of the demo pair on a local Ray instance started for this module; once
    its tests are done, its shutdown must leave none of Ray's processes running (a failure
    here is reported as an error in the last test's teardown: the tests run in any order)."""
    config = ServeConfig()
    options = ray_deploy.RayOptions(replicas=2)
    port = _free_port()
    started = ray_deploy.Cluster(options, "127.0.0.1", port, config, num_cpus=2)
    with started:
        started.run(ray_deploy.application(demo_package(), config, options))
        started.url = f"http://127.0.0.1:{port}"
        below = _descendants(os.getpid())
        assert below, "Ray started no processes"
        yield started
    wait_until(lambda: not _alive(below), "Ray's processes ended after its shutdown",
               seconds=30, every=0.2)


def _client(cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(client: OpenAI, **settings):
    """A completion and the replica that answered it (its X-Edgespec-Replica: id and pid)."""
    raw = client.completions.with_raw_response.create(model="demo", prompt=PROMPT, **settings)
    return raw.parse(), raw.headers[ray_deploy.REPLICA_HEADER]


@pytest.mark.parametrize("settings, library", [
    ({"max_tokens": 24}, {}),
    ({"max_tokens": 40, "stop": ["\n"]}, {"stop": ("\n",)}),
    ({"max_tokens": 24, "extra_body": {"drafter": "ngram"}}, {"drafter": "ngram"}),
])
def test_greedy_answers_equal_the_single_process_pipelines(cluster, settings, library):
    out, _ = _complete(_client(cluster), temperature=0, **settings)
    expected = edgespec.load(demo_package()).generate(
        PROMPT, max_new_tokens=settings["max_tokens"], temperature=0, **library)
    assert out.choices[0].text == expected.text
    assert out.usage.completion_tokens == expected.stats.new_tokens


def _answered_by(client: OpenAI) -> set[str] | None:
    """The replicas that answered 8 requests from 4 clients at once, if both did (a replica
    killed by another test may still be starting again), and each the same text."""
    with ThreadPoolExecutor(4) as pool:
        answered = list(pool.map(lambda _: _complete(client, max_tokens=8, temperature=0),
                                 range(8)))
    assert len({out.choices[0].text for out, _ in answered}) == 1
    replicas = {replica for _, replica in answered}
    return replicas if len(replicas) == 2 else None


def test_requests_spread_over_both_replicas(cluster):
    wait_until(lambda: _answered_by(_client(cluster)), "both replicas answered", seconds=60)


def test_the_app_guards_still_answer_behind_rays_proxy(cluster):
    """Host check, JSON only and the API's error shape run in each replica."""
    wrong_host = httpx.get(f"{cluster.url}/v1/models", headers={"host": "evil.example"})
    assert wrong_host.status_code == 400
    assert wrong_host.json()["error"]["code"] == "host_not_allowed"
    not_json = httpx.post(f"{cluster.url}/v1/completions", content=b"prompt=x",
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert not_json.status_code == 415 and "error" in not_json.json()
    assert "edgespec_" in httpx.get(f"{cluster.url}/metrics").text
    given = httpx.get(f"{cluster.url}/v1/models", headers={"x-request-id": "abc-1"})
    assert given.headers.get_list("x-request-id") == ["abc-1"]  # once, the client's


def test_a_replica_killed_mid_request_fails_that_request_only(cluster):
    client = _client(cluster)
    failures = []
    with client.completions.with_streaming_response.create(
            model="demo", prompt=PROMPT, max_tokens=500, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) as response:
        pid = int(response.headers[ray_deploy.REPLICA_HEADER].split()[1])
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # generating now
        os.kill(pid, signal.SIGKILL)
        try:
            rest = list(lines)
        except Exception as e:  # noqa: BLE001  the client's own error for a cut stream
            failures.append(e)
        else:  # the stream ended early: no [DONE] from a replica that died
            assert "data: [DONE]" not in rest, "the killed replica's stream completed"
            failures.append(rest)
    assert len(failures) == 1
    # the next requests are served, by the other replica then by the one Ray restarts
    answers = [_complete(client, max_tokens=8, temperature=0) for _ in range(6)]
    assert all(out.choices[0].text for out, _ in answers)


def test_a_replica_killed_before_it_answers_gives_one_openai_error(cluster):
    """A plain (not streamed) request whose replica dies: Ray's proxy answers, and
    proxy_middlewares makes that answer OpenAI's 500."""
    client = _client(cluster)
    failed = []

    def long_request() -> None:
        try:
            client.completions.create(model="demo", prompt=PROMPT, max_tokens=500,
                                      temperature=0, extra_body={"ignore_eos": True})
        except InternalServerError as e:
            failed.append(e)

    pids = {int(replica.split()[1]) for replica in wait_until(
        lambda: _answered_by(client), "both replicas answered", seconds=60)}
    request = threading.Thread(target=long_request)
    request.start()
    # the replica generating it is the one using CPU (the router sends any other request,
    # /health included, to the idle one)
    os.kill(wait_until(lambda: _busy(pids), "a replica was generating", seconds=30),
            signal.SIGKILL)
    request.join(60)
    assert not request.is_alive() and len(failed) == 1, "the request did not fail once"
    assert failed[0].status_code == 500 and failed[0].code == "replica_failed"
    answers = [_complete(client, max_tokens=8, temperature=0) for _ in range(6)]
    assert all(out.choices[0].text for out, _ in answers)
