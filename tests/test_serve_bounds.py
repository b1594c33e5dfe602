"""The server's second adversarial probe: valid requests whose replies would pass the text
child's bounds (refused from their token count, the child untouched), killed children reaped,
stalled writes dropped, a client that leaves counted as its own doing, one that half-closes
answered, ambiguous framing refused, API keys checked at start, the fields that would change
an answer refused, and uvicorn's connection limit in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from serve_helpers import Served, raw, read_all, wait_until
from starlette.testclient import TestClient

import edgespec
from edgespec.models import demo_package
from edgespec.serve import build_app
from edgespec.serve.text_process import TextProcess

PROMPT = "def fibonacci(n):"
EMOJI = "🙂" * 20_000  # passes the character cap (512 x 45), tokenizes to 4 ids each


@pytest.fixture(scope="module")
def demo():
    return edgespec.load(demo_package())


@pytest.fixture(scope="module")
def client(demo):
    with TestClient(build_app(demo), base_url="http://localhost") as client:
        yield client


def error_of(response, status: int, code: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def child_pid(client) -> int:
    return client.app.state.server.text._process.pid


def test_a_prompt_of_too_many_bytes_is_refused_before_tokenizing(client, demo):
    """20,000 emoji pass the character cap, but 80,000 bytes of UTF-8 cannot fit 512 tokens
    of at most 90 bytes each (the demo's longest token string)."""
    server = client.app.state.server
    assert (server.max_prompt_chars, server.max_prompt_bytes) == (512 * 45, 512 * 90)
    pid, calls, encode = child_pid(client), [], server.text.encode

    async def counting(text):
        calls.append(len(text))
        return await encode(text)

    server.text.encode = counting
    try:
        for path, body in (("/v1/completions", {"prompt": EMOJI, "max_tokens": 2}),
                           ("/tokenize", {"prompt": EMOJI})):
            error = error_of(client.post(path, json={"model": "demo", **body}), 400,
                             "context_length_exceeded")
            assert error["param"] == "prompt" and error["message"] == (
                "the prompt has 80000 bytes of UTF-8, more than the 46080 that the context "
                "window of 512 tokens can hold; shorten it")
    finally:
        server.text.encode = encode
    assert calls == [] and child_pid(client) == pid


@pytest.mark.parametrize("prompt, partial", [
    ("x " * 11_000, True),  # long: counted on its first part, which is past the window
    ("x" * 20_000, False),  # no space to cut at: counted whole
])
def test_a_prompt_of_too_many_tokens_is_refused_by_count_and_the_child_lives(
        client, demo, prompt, partial):
    pid = child_pid(client)
    count = len(demo.encode(prompt))
    assert count > 512 and len(prompt) < 512 * 45  # within the bounds on its length
    for path, body in (("/v1/completions", {"prompt": prompt, "max_tokens": 2}),
                       ("/tokenize", {"prompt": prompt})):
        error = error_of(client.post(path, json={"model": "demo", **body}), 400,
                         "context_length_exceeded")
        assert error["param"] == "prompt"
        if partial:
            counted = int(error["message"].split("at least ")[1].split()[0])
            assert 512 < counted < count
        else:
            assert error["message"] == (f"the prompt has {count} tokens but the context "
                                        "window is 512; shorten it")
    assert child_pid(client) == pid  # refused from the count it sent, not killed
    out = client.post("/tokenize", json={"model": "demo", "prompt": PROMPT}).json()
    assert out["tokens"] == demo.encode(PROMPT) and child_pid(client) == pid


def test_a_conversation_of_too_many_tokens_is_refused_by_count_not_blamed_on_the_template(
        chat_package):
    pipe = edgespec.load(chat_package)
    with TestClient(build_app(pipe), base_url="http://localhost") as c:
        pid = child_pid(c)
        messages = [{"role": "user", "content": "🙂" * 700}]  # fits the characters, not ids
        for path in ("/v1/chat/completions", "/tokenize"):
            error = error_of(c.post(path, json={"model": "chat", "messages": messages}), 400,
                             "context_length_exceeded")
            assert error["param"] == "messages" and "template" not in error["message"]
            assert error["message"].startswith("the conversation has ")
        assert child_pid(c) == pid


def test_detokenize_takes_at_most_the_context_window(client, demo):
    pid = child_pid(client)
    ids = demo.encode("🙂" * 128)[:512]
    assert len(ids) == 512
    out = client.post("/detokenize", json={"model": "demo", "tokens": ids})
    assert out.json() == {"prompt": demo.tokenizer.decode(ids, skip_special_tokens=False)}
    error = error_of(client.post("/detokenize", json={"model": "demo", "tokens": ids + [1]}),
                     400, "context_length_exceeded")
    assert error["param"] == "tokens" and "at most 512" in error["message"]
    many = client.post("/detokenize", json={"model": "demo", "tokens": [17] * 200_000})
    error_of(many, 400, "context_length_exceeded")
    assert child_pid(client) == pid


def test_killed_children_are_reaped_not_kept(demo):
    """Each kill is waited for in the background, and then nothing of it is held."""
    app = build_app(demo)
    text: TextProcess = app.state.server.text

    async def scenario():
        processes = []
        for _ in range(30):
            await text.start()
            processes.append(text._process)
            text.kill()

        async def reaped():
            while text._reaping:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(reaped(), 30)
        await text.close()
        return processes

    processes = asyncio.run(scenario())
    assert len({p.pid for p in processes}) == 30
    assert all(p.returncode is not None for p in processes)  # waited for: no zombies
    assert not text._reaping


@pytest.mark.parametrize("field, value, param", [
    ("functions", [{"name": "f", "parameters": {}}], "functions"),
    ("function_call", "auto", "function_call"),
    ("modalities", ["text", "audio"], "modalities"),
    ("top_logprobs", 2, "top_logprobs"),
    ("messages", [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "4", "tool_call_id": "1"}], "messages[0].tool_calls"),
])
def test_fields_that_would_change_the_answer_are_refused(chat_package, field, value, param):
    pipe = edgespec.load(chat_package)
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], field: value}
    with TestClient(build_app(pipe), base_url="http://localhost") as c:
        error = error_of(c.post("/v1/chat/completions", json=body), 400,
                         "unsupported_parameter")
        assert error["param"] == param
        plain = {"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                 "modalities": ["text"], "function_call": "none", "max_tokens": 2}
        assert c.post("/v1/chat/completions", json=plain).status_code == 200


def test_an_unknown_models_name_is_not_echoed_whole(client):
    error = error_of(client.post("/tokenize", json={"model": "m" * 100_000, "prompt": "x"}),
                     404, "model_not_found")
    assert len(error["message"]) < 200 and error["message"].startswith('the model "mmm')


# Real processes: what the client does on its socket


@pytest.fixture(scope="module")
def held():
    served = Served(held=True)  # its ignore_eos generations hold until cancelled
    yield served
    served.stop()


def requests_counted(served: Served, endpoint: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{served.url}/metrics").text
    return {s.labels["status"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "edgespec_requests_total" and s.labels["endpoint"] == endpoint}


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_is_counted_as_its_own_not_as_a_503(held, stream):
    endpoint = "/v1/completions"
    before = requests_counted(held, endpoint)
    cancelled = held.health()["cancelled"]
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": stream}
    with pytest.raises(httpx.ReadTimeout):  # a client that gives up waiting
        with httpx.stream("POST", f"{held.url}{endpoint}", json=body,
                          timeout=httpx.Timeout(10, read=1)) as response:
            for _ in response.iter_lines():
                pass
    held.wait_health(lambda h: h["cancelled"] == cancelled + 1, "cancelled the generation")
    after = wait_until(lambda: (counts := requests_counted(held, endpoint)) != before and counts,
                       "counted the request")
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {
        "499": 1}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_client_looping_oversized_requests_kills_no_child_and_keeps_no_memory(held, demo):
    """Issue 27's loop: each request refused from its size or its count, the tokenizer's
    child the same all along, and the server's memory back within 20 MB of where it was."""
    too_many_ids = demo.encode("🙂" * 200)[:600]
    bodies = [("/v1/completions", {"prompt": EMOJI, "max_tokens": 2}),
              ("/tokenize", {"prompt": "x " * 11_000}),
              ("/tokenize", {"prompt": "x" * 20_000}),
              ("/detokenize", {"tokens": too_many_ids * 200})]

    def loop(rounds: int) -> set:
        with httpx.Client(timeout=60) as http:
            return {(path, http.post(f"{held.url}{path}", json={"model": "demo", **body})
                     .json()["error"]["code"]) for _ in range(rounds) for path, body in bodies}

    loop(5)  # warm: the allocator's arenas and caches at their working size
    child, before = held.text_child(), held.memory_mb()
    assert loop(100) == {(path, "context_length_exceeded") for path, _ in bodies}
    assert held.text_child() == child
    assert held.memory_mb() - before < 20


def request_bytes(body: dict, path: str = "/v1/completions") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def test_a_client_that_half_closes_after_sending_gets_its_answer(held, demo):
    with raw(held) as sock:
        sock.sendall(request_bytes({"model": "demo", "prompt": PROMPT, "max_tokens": 4,
                                    "temperature": 0}))
        sock.shutdown(socket.SHUT_WR)  # nothing more to send: the answer is still wanted
        answer = read_all(sock)  # and then the server closes
    # an interim answer first (how the server tells a half-close from a client that left)
    interim, _, answer = answer.partition(b"\r\n\r\n")
    assert interim == b"HTTP/1.1 100 Continue"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    expected = demo.generate(PROMPT, max_new_tokens=4, temperature=0).text
    assert json.loads(body)["choices"][0]["text"] == expected


def test_a_request_framed_twice_is_refused_and_its_connection_closed(held):
    """Content-Length and Transfer-Encoding both: a proxy in front may have read the body
    by the other one, so the bytes after it must not be taken as a second request."""
    body = b'{"model": "demo", "prompt": "x", "max_tokens": 1}'
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
    with raw(held) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 5\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n"
                     + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n" + smuggled)
        answer = read_all(sock)
    assert answer.count(b"HTTP/1.1 ") == 1  # one answer, then the connection closed
    head, _, error = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower()
    assert json.loads(error)["error"]["code"] == "invalid_http"
    assert "Transfer-Encoding" in json.loads(error)["error"]["message"]


def test_connections_past_the_limit_get_a_json_503_with_retry_after():
    served = Served("--limit-concurrency", "3")
    try:
        idle = [raw(served) for _ in range(3)]
        refused = wait_until(lambda: (r := httpx.get(f"{served.url}/health")).status_code == 503
                             and r, "refused a connection past the limit")
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "server_error"
        for sock in idle:
            sock.close()
        wait_until(lambda: httpx.get(f"{served.url}/health").status_code == 200,
                   "answered again once the connections closed")
    finally:
        served.stop()


def test_a_padded_api_key_is_stripped_at_start(demo):
    served = Served(env={"EDGESPEC_API_KEY": "  padded-key \t"})
    try:
        answer = httpx.post(f"{served.url}/v1/completions", headers={
            "authorization": "Bearer padded-key"}, json={
            "model": "demo", "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["text"] == demo.generate(
            PROMPT, max_new_tokens=2, temperature=0).text
    finally:
        served.stop()


@pytest.mark.parametrize("key, message", [
    ("   ", "the API key must not be empty"),
    ("clé-secrète", "the API key must be printable ASCII"),
    ("key\x01", "the API key must be printable ASCII"),
])
def test_an_api_key_a_client_cannot_send_is_refused_in_one_line(key, message):
    proc = subprocess.run([sys.executable, "-m", "edgespec", "serve", "--port", "0",
                           "--api-key", key], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {message}"), proc.stderr


def test_a_client_that_stops_reading_is_dropped_after_the_read_timeout():
    """uvicorn holds what a client does not read; past the socket's buffers the protocol
    (transport.py) gives such a client read_timeout_s, then drops it, and the app's writes stop."""
    import uvicorn

    from edgespec.serve.transport import protocol

    chunk, sent, gone = b"x" * 65536, [], threading.Event()

    async def app(scope, receive, send):

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while not gone.is_set() and len(sent) < 4096:  # 256 MB that nobody reads
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent.append(len(chunk))
        await watcher

    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=protocol(1.0), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "started")
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(sock.getsockname())
        client.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")  # and never reads
        assert gone.wait(60), f"still writing after {sum(sent)} bytes"
        assert len(sent) < 4096  # dropped long before the end
        client.close()
    finally:
        server.should_exit = True
        thread.join(10)
