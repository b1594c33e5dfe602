"""`edgespec serve` as a real process against what an attacker or a careless client does over
sockets and signals: idle and dribbling connections, lying bodies, huge headers, too many
connections, SIGTERM with answers in flight or a template or tokenizer busy, the API key
through the openai client, and the lines it prints."""

from __future__ import annotations

import json
import select
import signal
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import AuthenticationError, OpenAI
from serve_helpers import Served, raw, read_all, wait_until, with_normalizer, with_template

import edgespec
from edgespec.models import demo_package
from edgespec.serve.server import EXIT_S

PROMPT = "def fibonacci(n):"
READ_TIMEOUT = 1  # seconds, for the slow-client tests


@pytest.fixture(scope="module")
def demo():
    return edgespec.load(demo_package())


def greedy(demo, max_tokens: int = 4) -> str:
    """What the server must answer to PROMPT at temperature 0."""
    return demo.generate(PROMPT, max_new_tokens=max_tokens, temperature=0).text


@pytest.fixture(scope="module")
def server():
    served = Served("--read-timeout", str(READ_TIMEOUT), "--limit-concurrency", "40")
    yield served
    served.stop()


def status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_the_serving_line_comes_once_the_socket_listens(server):
    assert server.listening
    assert server.lines[-1].startswith("serving demo at http://127.0.0.1:")


def test_an_idle_connection_is_answered_408_and_closed(server):
    with raw(server) as sock:
        status, error = status_and_error(read_all(sock))
    assert status == 408 and error["code"] == "request_timeout"
    assert error["message"] == f"the request's headers did not arrive within {READ_TIMEOUT} s"


def test_connections_dribbling_headers_are_dropped(server):
    """20 clients sending their headers a byte at a time are all closed after the read
    timeout, however long they would go on."""
    request = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 10_000
    socks = [raw(server) for _ in range(20)]
    still_open, sent = set(range(len(socks))), 0

    def dribble() -> bool:
        """A byte more on each open connection, then up to 50 ms for the server to close
        some (a closed one reads as ready); True once every connection is closed."""
        nonlocal sent
        for n in list(still_open):
            try:
                socks[n].send(request[sent:sent + 1])
            except OSError:  # the server closed it (a reset, or a broken pipe)
                still_open.discard(n)
        sent += 1
        answered, _, _ = select.select([socks[n] for n in still_open], [], [], 0.05)
        for sock in answered:  # the server writes only its 408, then closes
            still_open.discard(socks.index(sock))
        return not still_open

    try:  # the read timeout, then each connection's 408 and close
        wait_until(dribble, "closed every dribbling connection", READ_TIMEOUT + 10, every=0)
    finally:
        for sock in socks:
            sock.close()
    assert sent < len(request)  # closed before its headers could have ended
    assert server.health()["status"] == "ok"


def test_a_body_shorter_than_its_content_length_is_a_408(server):
    body = json.dumps({"model": "demo", "prompt": PROMPT}).encode()
    with raw(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body) + 100}\r\n\r\n".encode() + body)
        status, error = status_and_error(read_all(sock).split(b"\r\n0\r\n")[0])
    assert status == 408 and error["code"] == "request_timeout"


def test_huge_headers_are_a_431(server):
    with raw(server) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
                     + b"X-Big: " + b"a" * 40_000 + b"\r\n\r\n")
        status, error = status_and_error(read_all(sock))
    assert status == 431 and error["code"] == "request_header_fields_too_large"
    assert server.health()["status"] == "ok"


def test_big_prompts_are_refused_at_once_and_memory_comes_back(server, demo):
    def rss_mb() -> float:
        status = Path(f"/proc/{server.process.pid}/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    server.client.completions.create(model="demo", prompt=PROMPT, max_tokens=4)  # warm
    before = rss_mb()
    huge = {"model": "demo", "prompt": "x " * 500_000, "max_tokens": 4}  # 1 MB
    longest = {"model": "demo", "prompt": "x " * 11_000, "max_tokens": 4}  # fits the chars

    def send(body):
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        return response.status_code, response.json()["error"]["code"]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, [huge] * 16 + [longest] * 16))
    # each refused for its length, or for a full queue while others were being tokenized
    assert set(answers) <= {(400, "context_length_exceeded"), (429, "queue_full")}
    assert answers[:16] == [(400, "context_length_exceeded")] * 16  # refused before the queue
    after = server.client.completions.create(model="demo", prompt=PROMPT, max_tokens=4,
                                             temperature=0)
    assert after.choices[0].text == greedy(demo)
    assert rss_mb() - before < 100


def test_the_api_key_through_the_openai_client(demo):
    served = Served(env={"EDGESPEC_API_KEY": "sk-test"})
    try:
        client = OpenAI(base_url=f"{served.url}/v1", api_key="sk-test", max_retries=0)
        out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4,
                                        temperature=0)
        assert out.choices[0].text == greedy(demo)
        stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4,
                                           temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == greedy(demo)
        with pytest.raises(AuthenticationError):
            served.client.completions.create(model="demo", prompt=PROMPT, max_tokens=4)
        assert served.health()["status"] == "ok"
    finally:
        served.stop()


def test_listening_beyond_loopback_without_a_key_warns_in_one_line():
    served = Served("--host", "0.0.0.0")
    try:
        warnings = [line for line in served.lines if line.startswith("warning:")]
        assert len(warnings) == 1 and "without --api-key" in warnings[0]
        assert httpx.get(f"{served.url}/health").status_code == 200
    finally:
        served.stop()


def test_an_ipv6_address_is_printed_in_brackets():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    served = Served("--host", "::", host="[::1]")
    try:
        assert any("at http://[::]:" in line for line in served.lines)
        assert httpx.get(f"{served.url}/health").status_code == 200
    finally:
        served.stop()


def stop(served: Served) -> int:
    """SIGTERM, then the exit code: within EXIT_S whatever still runs (server.py), and some
    slack for a loaded machine; a server that does not exit fails the test."""
    served.process.send_signal(signal.SIGTERM)
    return served.process.wait(EXIT_S + 10)


def test_sigterm_answers_requests_in_flight_with_503_and_ends_streams():
    """One generation runs (held until the server stops), a streamed one waits behind it;
    SIGTERM then ends both, each in its own way."""
    served = Served(held=True)
    try:
        long = {"model": "demo", "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, f"{served.url}/v1/completions", json=long,
                                timeout=30)
            served.wait_health(lambda h: h["running"] == 1, "running")
            with httpx.stream("POST", f"{served.url}/v1/completions",
                              json={**long, "stream": True}, timeout=30) as response:
                served.wait_health(lambda h: h["waiting"] == 1, "queued the stream")
                code = stop(served)
                rest = [line for line in response.iter_lines() if line.startswith("data: ")]
            answer = whole.result()
        assert code == 143
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "shutting_down"
        assert rest == ["data: " + json.dumps({"error": {
            "message": "the server is stopping; retry on another instance or later",
            "type": "server_error", "param": None, "code": "shutting_down"}}), "data: [DONE]"]
        log = "".join(served.lines)
        assert "Traceback" not in log and "CancelledError" not in log, log
    finally:
        served.stop()


LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="sees the child busy in /proc")


@LINUX
def test_sigterm_exits_in_time_while_a_template_renders(chat_package, tmp_path):
    pkg = with_template(chat_package, tmp_path / "slow", "{% for i in range(10000) %}"
                        "{% for j in range(10000) %}{% endfor %}{% endfor %}")
    body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}]}
    sigterm_while_busy(Served(str(pkg)), "/v1/chat/completions", body, "rendering")


@LINUX
def test_sigterm_exits_in_time_while_a_tokenizer_is_busy(tmp_path):
    # onig backtracks on every run of a's: ~0.04 s each, half a minute for this prompt
    pkg = with_normalizer(demo_package(), tmp_path / "demo",
                          {"type": "Replace", "pattern": {"Regex": "(a+)+b"}, "content": "b"})
    body = {"model": "demo", "prompt": ("a" * 20 + " ") * 700, "max_tokens": 2}
    sigterm_while_busy(Served(str(pkg)), "/v1/completions", body, "tokenizing")


def sigterm_while_busy(served: Served, path: str, body: dict, doing: str) -> None:
    """SIGTERM once the child is busy with the request: exit 143 (within EXIT_S), the
    request answered 503 shutting_down, no traceback."""
    try:
        model = body["model"]  # a first request: the child has started and now waits
        assert httpx.post(f"{served.url}/tokenize", json={"model": model, "prompt": "hi"},
                          timeout=30).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{served.url}{path}", json=body, timeout=60)
            served.wait_health(lambda h: h["waiting"] == 1, doing)
            wait_until(served.text_child_running, f"{doing} in the child")
            code = stop(served)
            answer = answer.result()
        assert code == 143
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"
        assert "Traceback" not in "".join(served.lines)
    finally:
        served.stop()
