"""`edgespec serve` as a real process on a free loopback port, used through the openai client:
plain, streamed and chat completions, 8 clients at once, a dropped stream, SIGTERM."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import Served

from edgespec.serve.server import EXIT_S

import edgespec
from edgespec.models import demo_package

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def demo_server():
    server = Served()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def demo():
    return edgespec.load(demo_package())


def test_plain_and_streamed_completions_through_the_openai_client(demo_server, demo):
    client = demo_server.client
    assert [m.id for m in client.models.list()] == ["demo"]
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24,
                                    temperature=0.8, seed=5)
    expected = demo.generate(PROMPT, max_new_tokens=24, temperature=0.8, seed=5)
    assert out.choices[0].text == expected.text
    assert out.usage.completion_tokens == expected.stats.new_tokens
    assert out.model_extra["edgespec"]["new_tokens"] == expected.stats.new_tokens
    stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24,
                                       temperature=0.8, seed=5, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == expected.text


def test_eight_clients_at_once_each_get_their_own_seeds_text(demo_server, demo):
    requests = [{"seed": seed, "temperature": 0.9, "max_tokens": 32, "prompt": PROMPT}
                for seed in range(8)]

    def ask(request):
        return demo_server.client.completions.create(model="demo", **request).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, requests))
    for request, text in zip(requests, texts):
        assert text == demo.generate(PROMPT, max_new_tokens=32, temperature=0.9,
                                     seed=request["seed"]).text
    assert demo_server.health()["refused"] == 0


def test_a_dropped_stream_cancels_its_generation(demo, tmp_path):
    server = Served(held=True)  # its generation holds until cancelled: only the drop ends it
    try:
        body = {"model": "demo", "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            next(response.iter_lines())  # one piece, then the client goes away
        health = server.wait_health(lambda h: h["cancelled"] == 1 and h, "cancelled")
        assert health["running"] == 0 and health["completed"] == 0
        out = server.client.completions.create(model="demo", prompt=PROMPT, max_tokens=4,
                                                temperature=0)  # the slot is free again
        assert out.choices[0].text == demo.generate(PROMPT, max_new_tokens=4,
                                                    temperature=0).text
    finally:
        server.stop()


def test_chat_through_the_openai_client_then_sigterm_ends_the_server(chat_package):
    server = Served(str(chat_package))
    try:
        messages = [{"role": "user", "content": "add"}]
        out = server.client.chat.completions.create(model="chat", messages=messages,
                                                    max_tokens=10, temperature=0)
        assert out.choices[0].message.role == "assistant"
        stream = server.client.chat.completions.create(model="chat", messages=messages,
                                                       max_tokens=10, temperature=0,
                                                       stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
        assert text == out.choices[0].message.content

        # a long stream in flight, then SIGTERM: it stops accepting and exits within seconds
        body = {"model": "chat", "messages": messages, "max_tokens": 100, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
            next(response.iter_lines())
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(EXIT_S + 10)  # a server that does not exit fails
        assert code in (0, 143), (code, "".join(server.lines))
        assert "Traceback" not in "".join(server.lines)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health")
    finally:
        server.stop()
