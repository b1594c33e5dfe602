"""`edgespec serve` on Ray Serve (serve/ray_deploy.py), on a local Ray instance these tests
start themselves (3 CPUs, no dashboard): two replicas of the demo pair answer as the
single-process pipeline does, share the requests, survive one of them being killed (a stream
then ends in an error event), drain what they hold when redeployed or stopped, autoscale on
their queues, and leave no process behind.

Requests that must stay under way while a test acts are held in their replica
(tests/ray_hooks/sitecustomize.py, on the PYTHONPATH of every Python Ray starts here): a prompt
``HOLD name ...`` makes one piece, then waits until the test releases it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed "
                                        "(pip install 'edgespec[ray]')")
import httpx  # noqa: E402
from openai import APIError, InternalServerError, OpenAI  # noqa: E402
from serve_helpers import Served, wait_until  # noqa: E402

import edgespec  # noqa: E402
from edgespec.models import demo_package  # noqa: E402
from edgespec.serve import ray_deploy  # noqa: E402
from edgespec.errors import ConfigError  # noqa: E402
from edgespec.serve.config import ServeConfig  # noqa: E402

pytestmark = pytest.mark.timeout(180)  # a Ray instance and two replicas start in ~20 s here

PROMPT = "def fibonacci(n):"
HOOKS = Path(__file__).parent / "ray_hooks"
# Autoscaling decisions from metrics pushed every 0.2 s (Ray's default: 10 s), so that a test
# sees a replica come and go in seconds
FAST_METRICS = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.2",
                "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.2"}


def _hooked_env(hold_dir: Path) -> dict:
    """The environment under which Ray's Pythons hold ``HOLD name`` prompts (see above)."""
    path = os.pathsep.join(p for p in (str(HOOKS), str(Path(edgespec.__file__).parents[1]),
                                       os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "EDGESPEC_TEST_HOLD_DIR": str(hold_dir), **FAST_METRICS}


def _release(hold_dir: Path, name: str) -> None:
    (hold_dir / name).touch()


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


def _held_stream(url: str, name: str, max_tokens: int = 16):
    """A streamed completion of ``HOLD name ...`` (held in its replica after one piece): the
    replica that serves it (id and pid) and its chunks, the first one read."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.completions.with_raw_response.create(
        model="demo", prompt=f"HOLD {name} {PROMPT}", max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    chunks = iter(raw.parse())
    assert next(chunks).choices[0].text == "x"  # generating now, held
    return raw.headers[ray_deploy.REPLICA_HEADER], chunks


def test_the_cli_on_ray_answers_drains_a_stream_on_sigterm_and_leaves_nothing_running(
        tmp_path):
    """`edgespec serve --replicas 1` starts its own Ray; SIGTERM lets a stream under way
    finish (new requests are refused meanwhile), then stops Serve and Ray. Rejects a
    shutdown that stops Serve at once (serve.shutdown without serve.delete first): its proxy
    goes, the stream is cut and no 404 ever answers. (A drain too short for the stream is
    rejected by the redeploy test, which sees the replica draining.)"""
    served = Served("--replicas", "1", env=_hooked_env(tmp_path))
    try:
        below = _descendants(served.process.pid)
        assert below, "Ray started no processes"
        out = served.client.completions.create(model="demo", prompt=PROMPT, max_tokens=8,
                                               temperature=0)
        assert out.choices[0].text == edgespec.load(demo_package()).generate(
            PROMPT, max_new_tokens=8, temperature=0).text
        _, chunks = _held_stream(served.url, "sigterm")
        served.process.terminate()
        # the application is being deleted: Ray's proxy no longer routes to it
        wait_until(lambda: httpx.get(f"{served.url}/v1/models").status_code == 404,
                   "new requests were refused", seconds=30, every=0.1)
        _release(tmp_path, "sigterm")
        rest = list(chunks)  # an error event (a cut stream) raises APIError here
        assert rest[-1].choices[0].finish_reason == "length"
        served.process.wait(60)
    finally:
        served.stop()
    assert served.process.returncode == 128 + signal.SIGTERM
    assert any(line.startswith("stopping: the replicas finish") for line in served.lines)
    wait_until(lambda: not _alive(below), "Ray's processes ended", seconds=20, every=0.2)


CONFIG = ServeConfig()
OPTIONS = ray_deploy.RayOptions(replicas=2)


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hold")


@pytest.fixture(scope="module")
def cluster(hold_dir):
    """Two replicas of the demo pair on a local Ray instance started for this module (its
    Pythons hold ``HOLD`` prompts); once its tests are done, its shutdown must leave none of
    Ray's processes running (a failure here is reported as an error in the last test's
    teardown: the tests run in any order). A test that deploys something else deploys this
    again when it is done."""
    port, below = _free_port(), set()
    started = ray_deploy.Cluster(OPTIONS, "127.0.0.1", port, CONFIG, num_cpus=3)
    with pytest.MonkeyPatch.context() as env:  # what Ray's processes inherit as they start
        for name, value in _hooked_env(hold_dir).items():
            env.setenv(name, value)
        started.__enter__()
    try:
        started.run(ray_deploy.application(demo_package(), CONFIG, OPTIONS))
        started.url = f"http://127.0.0.1:{port}"
        below = _descendants(os.getpid())
        assert below, "Ray started no processes"
        yield started
    finally:
        started.close()
    wait_until(lambda: not _alive(below), "Ray's processes ended after its shutdown",
               seconds=30, every=0.2)


def _replica_states() -> dict[str, int]:
    """How many of the application's replicas are in each state (RUNNING, STOPPING, ...)."""
    app = ray.serve.status().applications.get(ray_deploy.APP_NAME)
    if app is None or ray_deploy.APP_NAME not in app.deployments:
        return {}
    return {str(getattr(state, "value", state)): count for state, count
            in app.deployments[ray_deploy.APP_NAME].replica_states.items() if count}


def _deploy(cluster, options: ray_deploy.RayOptions, config: ServeConfig = CONFIG) -> None:
    cluster.run(ray_deploy.application(demo_package(), config, options))


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


def test_a_replica_killed_mid_stream_ends_it_with_an_openai_error_event(cluster):
    """The stream's status was sent: ReplicaFailed (in Ray's proxy) ends it with an error
    event, on which the openai client raises. Rejects a proxy that lets the stream end
    silently (Ray's own: the loop below then ends without raising)."""
    replica, chunks = _held_stream(cluster.url, "killed", max_tokens=500)
    os.kill(int(replica.split()[1]), signal.SIGKILL)
    with pytest.raises(APIError) as raised:
        list(chunks)
    assert raised.value.code == "replica_failed" and "retry" in raised.value.message
    # the next requests are served, by the other replica then by the one Ray restarts
    client = _client(cluster)
    answers = [_complete(client, max_tokens=8, temperature=0) for _ in range(6)]
    assert all(out.choices[0].text for out, _ in answers)


def test_a_replica_killed_before_it_answers_gives_one_openai_error(cluster):
    """A plain (not streamed) request whose replica dies: Ray's proxy answers, and
    proxy_middlewares makes that answer OpenAI's 500."""
    client = _client(cluster)
    failed = []

    def long_request() -> None:
        try:
            # the target alone: a greedy text that loops would be copied by the text lookup
            # and done before the replica is found busy
            client.completions.create(model="demo", prompt=PROMPT, max_tokens=500,
                                      temperature=0,
                                      extra_body={"ignore_eos": True, "drafter": "none"})
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


def test_a_redeploy_drains_the_replica_that_holds_a_stream(cluster, hold_dir):
    """serve.run of a new version while a stream is held in an old replica: new replicas take
    the new requests, the old one finishes the stream, then exits. Rejects a redeploy that
    does not drain: with drain_s=0.1 the stream is cut (an error event) and this fails."""
    client = _client(cluster)
    old = wait_until(lambda: _answered_by(client), "both replicas answered", seconds=60)
    replica, chunks = _held_stream(cluster.url, "redeploy")
    assert replica in old
    new_version = replace(CONFIG, shutdown_s=CONFIG.shutdown_s + 1)  # new arguments
    # the application is built here, not in the thread: Ray's DeploymentConfig registers and
    # unregisters a module for pickling by value (process-wide state), and building one while
    # this thread's serve.status() polls read deployment configs raced (a ValueError in the
    # thread, no new version: seen once in CI)
    app = ray_deploy.application(demo_package(), new_version, OPTIONS)
    redeploy = threading.Thread(target=cluster.run, args=(app,))
    redeploy.start()
    try:
        # the old replica with the stream stops (drains), two new ones answer
        wait_until(lambda: _replica_states() == {"RUNNING": 2, "STOPPING": 1}
                   and not (_answered_by(client) or old) & old,  # None: not both yet
                   "the new version answered while the old replica drained", seconds=90,
                   every=0.2)
        assert _alive({int(replica.split()[1])}), "the draining replica exited"
    finally:
        _release(hold_dir, "redeploy")
    rest = list(chunks)  # an error event (a cut stream) raises APIError here
    assert rest[-1].choices[0].finish_reason == "length"
    redeploy.join(60)
    assert not redeploy.is_alive(), "the redeploy did not end"
    wait_until(lambda: not _alive({int(replica.split()[1])}), "the drained replica exited",
               seconds=30, every=0.2)


def test_autoscaling_adds_a_replica_for_waiting_requests_and_removes_it_when_idle(
        cluster, hold_dir):
    """--autoscale 1:2: three held requests on the one replica (one generating, two waiting:
    3 ongoing against a target of 1) bring a second; once they end, it goes again. Rejects a
    target of a replica's whole capacity (1 + queue = 9 ongoing): no second replica comes."""
    scaling = ray_deploy.Autoscale(1, 2, upscale_delay_s=0, downscale_delay_s=1,
                                   look_back_s=11)  # the shortest Ray takes
    try:
        _deploy(cluster, ray_deploy.RayOptions(autoscale=scaling))
        wait_until(lambda: _replica_states() == {"RUNNING": 1}, "one replica ran",
                   seconds=60, every=0.2)
        with ThreadPoolExecutor(3) as pool:
            held = [pool.submit(_held_stream, cluster.url, "autoscale") for _ in range(3)]
            try:
                wait_until(lambda: _replica_states().get("RUNNING") == 2,
                           "a second replica ran", seconds=60, every=0.2)
            finally:
                _release(hold_dir, "autoscale")
            for future in held:  # each finishes
                _, chunks = future.result(60)
                assert list(chunks)[-1].choices[0].finish_reason == "length"
        wait_until(lambda: _replica_states() == {"RUNNING": 1}, "back to one replica",
                   seconds=90, every=0.2)
    finally:
        _deploy(cluster, OPTIONS)


def test_the_autoscale_option_maps_onto_rays_config():
    config = ray_deploy.Autoscale.parse("2:5", downscale_delay_s=60).ray_config()
    assert config["min_replicas"] == config["initial_replicas"] == 2
    assert config["max_replicas"] == 5 and config["downscale_delay_s"] == 60
    assert config["target_ongoing_requests"] == 1  # one generation at a time per replica
    for wrong in ("3:2", "0:2", "2", "a:b"):
        with pytest.raises(ConfigError, match="autoscale"):
            ray_deploy.Autoscale.parse(wrong)
    with pytest.raises(ConfigError, match="look_back_s"):
        ray_deploy.Autoscale(1, 2, look_back_s=5)


def test_the_proxy_ends_a_cut_stream_with_an_error_event_and_done():
    """ReplicaFailed without Ray: an inner app that starts a stream and returns without
    finishing it (what Ray's proxy does when the replica dies) gets an error event and
    [DONE]; a finished stream is left alone. Rejects the earlier middleware, which added
    nothing once the status was sent."""
    async def run(finish: bool) -> list[dict]:
        async def cut(scope, receive, send):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            await send({"type": "http.response.body", "body": b"data: {}\n\n",
                        "more_body": not finish})

        sent = []

        async def send(message):
            sent.append(message)

        await ray_deploy.ReplicaFailed(cut)({"type": "http"}, None, send)
        return sent

    sent = asyncio.run(run(finish=False))
    tail = sent[-1]["body"].decode()
    assert not sent[-1].get("more_body") and tail.endswith("data: [DONE]\n\n")
    assert '"code": "replica_failed"' in tail and tail.startswith('data: {"error"')
    assert len(asyncio.run(run(finish=True))) == 2


@pytest.mark.parametrize("args, message", [
    (["--replicas", "2", "--autoscale", "1:2"], "not both"),
    (["--downscale-delay", "5"], "need --autoscale"),
    (["--autoscale", "3:1"], "1 <= MIN <= MAX"),
])
def test_the_cli_refuses_wrong_scaling_options_in_one_line(args, message):
    from click.testing import CliRunner

    from edgespec.cli.base import main

    result = CliRunner().invoke(main, ["serve", *args])
    assert result.exit_code in (1, 2) and message in result.output
    assert "Traceback" not in result.output
