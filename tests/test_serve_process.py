"""`edgespec serve` as a real process on a free loopback port, used through the openai client:
plain, streamed and chat completions, 8 clients at once, a dropped stream, SIGTERM."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import Served

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


def test_a_dropped_stream_cancels_its_generation(demo_server):
    before = demo_server.health()["cancelled"]
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{demo_server.url}/v1/completions", json=body) as response:
        next(response.iter_lines())  # one piece, then the client goes away
    give_up = time.monotonic() + 60  # a generation that is never cancelled fails, not hangs
    while demo_server.health()["cancelled"] == before:
        assert time.monotonic() < give_up, "the generation was not cancelled"
        time.sleep(0.02)
    health = demo_server.health()
    assert health["running"] == 0 and health["cancelled"] == before + 1
    out = demo_server.client.completions.create(model="demo", prompt=PROMPT, max_tokens=4)
    assert out.usage.completion_tokens <= 4  # the slot is free for the next request


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
            start = time.perf_counter()
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(10)
            took = time.perf_counter() - start
        assert code in (0, 143) and took < 6, (code, took, "".join(server.lines))
        assert "Traceback" not in "".join(server.lines)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health")
    finally:
        server.stop()
