"""The HTTP API in-process (Starlette's test client): every endpoint, every bad request, the
queue, cancellation, the chat template carried by export and rendered as transformers does."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import sys
import threading

import httpx
import pytest
from click.testing import CliRunner
from serve_helpers import until, with_manifest
from starlette.testclient import TestClient

import edgespec
from edgespec.cli import main
from edgespec.models import demo_package
from edgespec.serve import ServeConfig, build_app
from edgespec.serve.worker import Busy, Worker

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def demo():
    return edgespec.load(demo_package())


@pytest.fixture(scope="module")
def client(demo):
    with local(build_app(demo)) as client:
        yield client


def local(app) -> TestClient:
    """A test client that reaches the app by a loopback name, as the Host check wants."""
    return TestClient(app, base_url="http://localhost")


def complete(client, **fields):
    return client.post("/v1/completions", json={"model": "demo", "prompt": PROMPT, **fields})


def sse_payloads(response) -> list:
    """The data of each server-sent event; "[DONE]" as a string."""
    lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["demo"]
    assert client.get("/v1/models/demo").json()["id"] == "demo"
    assert client.get("/v1/models/other").status_code == 404
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["running"] == 0 and health["queue"] == 8


@pytest.mark.parametrize("settings", [
    {"temperature": 0, "max_tokens": 24},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 7, "max_tokens": 24, "draft_length": 6},
    {"temperature": 0, "max_tokens": 40, "stop": ["\n"], "schedule": "heuristic"},
    {"temperature": 0.8, "max_tokens": 24, "seed": 4, "drafter": "ngram"},
    {"temperature": 1.0, "min_p": 0.1, "max_tokens": 24, "seed": 2},
    {"temperature": 0, "max_tokens": 24, "repetition_penalty": 1.3, "presence_penalty": 0.5,
     "frequency_penalty": 0.5},
])
def test_a_completion_equals_generate_with_the_same_settings(client, demo, settings):
    out = complete(client, **settings).json()
    library = dict(settings, max_new_tokens=settings["max_tokens"])
    del library["max_tokens"]
    expected = demo.generate(PROMPT, **library)
    choice = out["choices"][0]
    assert choice["text"] == expected.text
    assert choice["finish_reason"] == ("stop" if expected.stats.finish_reason in
                                       ("eos", "stop_string") else "length")
    prompt_tokens = len(demo.encode(PROMPT))  # the user's prompt, healed or not
    assert out["usage"] == {"prompt_tokens": prompt_tokens,
                            "completion_tokens": expected.stats.new_tokens,
                            "total_tokens": prompt_tokens + expected.stats.new_tokens}
    assert out["object"] == "text_completion" and out["model"] == "demo"
    assert {"acceptance_rate", "tokens_per_target_call", "tokens_per_s"} <= set(out["edgespec"])


def test_the_library_the_cli_and_the_server_name_each_setting_alike(client, demo):
    """draft_length and drafter are the library's keywords, the server's fields and, dashed,
    the CLI's flags: the same settings on every surface."""

    def texts(library: dict, server: dict, flags: list) -> list[tuple[str, int]]:
        lib = demo.generate(PROMPT, max_new_tokens=12, schedule="fixed", **library)
        out = complete(client, max_tokens=12, schedule="fixed", **server).json()
        cli = CliRunner().invoke(main, ["generate", str(demo_package()), PROMPT, "-n", "12",
                                        "--schedule", "fixed", "--json", *flags])
        assert cli.exit_code == 0, cli.output
        cli_out = json.loads(cli.stdout)
        return [(lib.text, lib.stats.drafted), (cli_out["text"], cli_out["stats"]["drafted"]),
                (out["choices"][0]["text"], out["edgespec"]["drafted"])]

    current = texts({"draft_length": 3, "drafter": "model"},
                    {"draft_length": 3, "drafter": "model"},
                    ["--draft-length", "3", "--drafter", "model"])
    assert len(set(current)) == 1 and current[0][1] > 0
    alone = texts({"drafter": "none"}, {"drafter": "none"}, ["--drafter", "none"])
    assert len(set(alone)) == 1 and alone[0][1] == 0


def test_openai_default_is_16_tokens_and_prompts_may_be_token_ids(client, demo):
    # OpenAI's 16 tokens; sampling as the library and CLI choose it: the package's defaults,
    # else greedy (the demo sets none), so the server answers what `edgespec generate` does
    out = complete(client, seed=1).json()
    expected = demo.generate(PROMPT, max_new_tokens=16, seed=1)
    assert demo.default_sampling.greedy
    assert out["choices"][0]["text"] == expected.text
    assert out["usage"]["completion_tokens"] == expected.stats.new_tokens
    ids = demo.encode(PROMPT)
    by_ids = client.post("/v1/completions", json={"model": "demo", "prompt": [ids],
                                                  "temperature": 0, "max_tokens": 8}).json()
    # ids are taken as they are, never healed: as the text with token healing off
    assert by_ids["choices"][0]["text"] == demo.generate(PROMPT, max_new_tokens=8,
                                                         token_healing=False).text


def test_a_streamed_completion_is_the_whole_one_in_pieces(client):
    settings = {"temperature": 0.7, "seed": 3, "max_tokens": 30}
    whole = complete(client, **settings).json()
    with client.stream("POST", "/v1/completions", json={
            "model": "demo", "prompt": PROMPT, "stream": True,
            "stream_options": {"include_usage": True}, **settings}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(response)
    assert events[-1] == "[DONE]"
    *chunks, finish, usage, _ = events
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert len(chunks) > 1 and all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert finish["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert finish["edgespec"]["new_tokens"] == whole["usage"]["completion_tokens"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


BAD_COMPLETIONS = [  # body, status, param, code
    (b"{not json", 400, None, None),
    (b"[1, 2]", 400, None, None),
    (b'{"prompt": "x"}', 400, "model", None),
    (b'{"model": "demo"}', 400, "prompt", None),
    (b'{"model": "gpt-4", "prompt": "x"}', 404, "model", "model_not_found"),
    (b'{"model": "demo", "prompt": 5}', 400, "prompt", None),
    (b'{"model": "demo", "prompt": []}', 400, "prompt", None),
    (b'{"model": "demo", "prompt": [99999]}', 400, "prompt", None),
    (b'{"model": "demo", "prompt": ["a", "b"]}', 400, "prompt", "unsupported_parameter"),
    (b'{"model": "demo", "prompt": "x", "max_tokens": 0}', 400, "max_tokens", None),
    (b'{"model": "demo", "prompt": "x", "max_tokens": "16"}', 400, "max_tokens", None),
    (b'{"model": "demo", "prompt": "x", "max_tokens": 1.5}', 400, "max_tokens", None),
    (b'{"model": "demo", "prompt": "x", "temperature": -1}', 400, "temperature", None),
    (b'{"model": "demo", "prompt": "x", "temperature": 2.5}', 400, "temperature", None),
    (b'{"model": "demo", "prompt": "x", "top_p": 0}', 400, "top_p", None),
    (b'{"model": "demo", "prompt": "x", "top_k": -1}', 400, "top_k", None),
    (b'{"model": "demo", "prompt": "x", "min_p": 1.5}', 400, "min_p", None),
    (b'{"model": "demo", "prompt": "x", "presence_penalty": 2.5}', 400, "presence_penalty", None),
    (b'{"model": "demo", "prompt": "x", "repetition_penalty": 0}', 400, "repetition_penalty",
     None),
    (b'{"model": "demo", "prompt": "x", "draft_length": 65}', 400, "draft_length", None),
    (b'{"model": "demo", "prompt": "x", "schedule": "fast"}', 400, "schedule", None),
    (b'{"model": "demo", "prompt": "x", "drafter": "oracle"}', 400, "drafter", None),
    (b'{"model": "demo", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop", None),
    (b'{"model": "demo", "prompt": "x", "stop": "' + b"s" * 300 + b'"}', 400, "stop", None),
    (b'{"model": "demo", "prompt": "x", "seed": -1}', 400, "seed", None),
    (b'{"model": "demo", "prompt": "x", "stop": 3}', 400, "stop", None),
    (b'{"model": "demo", "prompt": "x", "stop": [""]}', 400, "stop", None),
    (b'{"model": "demo", "prompt": "x", "stream": "yes"}', 400, "stream", None),
    (b'{"model": "demo", "prompt": "x", "n": 2}', 400, "n", "unsupported_parameter"),
    (b'{"model": "demo", "prompt": "x", "logprobs": 2}', 400, "logprobs",
     "unsupported_parameter"),
    (b'{"model": "demo", "prompt": "x", "echo": true}', 400, "echo", "unsupported_parameter"),
    (b'{"model": "demo", "prompt": "\\ud800"}', 400, None, None),  # not UTF-8: not JSON
    (json.dumps({"model": "demo", "prompt": "x " * 600}).encode(), 400, "prompt",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("body, status, param, code", BAD_COMPLETIONS,
                         ids=[b[0][:40].decode(errors="replace") for b in BAD_COMPLETIONS])
def test_a_bad_request_is_an_openai_error_with_its_status(client, body, status, param, code):
    response = client.post("/v1/completions", content=body,
                           headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param and error["code"] == code
    assert client.get("/health").json()["running"] == 0  # and the server goes on


def test_bodies_over_the_limit_paths_and_methods(demo):
    with local(build_app(demo, ServeConfig(max_body=1000))) as client:
        big = client.post("/v1/completions", json={"model": "demo", "prompt": "x" * 2000})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        assert client.get("/v2/nothing").status_code == 404
        assert client.get("/v2/nothing").json()["error"]["code"] == "not_found"
        assert client.get("/v1/completions").status_code == 405
        assert complete(client, max_tokens=2).status_code == 200


def test_chat_without_a_template_is_a_400_that_says_so(client):
    response = client.post("/v1/chat/completions", json={
        "model": "demo", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "chat_template_missing" and "chat template" in error["message"]


def test_export_carries_the_chat_template(chat_package, checkpoints):
    from serve_helpers import CHAT_TEMPLATE

    manifest = edgespec.load(chat_package).manifest
    assert manifest.chat_template == "chat_template.jinja"
    assert (chat_package / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert manifest.special_tokens["bos_token"] == "<|endoftext|>"


@pytest.mark.parametrize("where, message", [
    ("../outside.jinja", "chat_template must be a path inside the package"),
    ("gone.jinja", "gone.jinja is missing"),
])
def test_a_chat_template_outside_the_package_or_missing_is_refused(chat_package, tmp_path,
                                                                    where, message):
    from edgespec.errors import ManifestError
    from edgespec.manifest import Manifest

    pkg = with_manifest(chat_package, tmp_path / "pkg", chat_template=where)
    shutil.copy(pkg / "chat_template.jinja", tmp_path / "outside.jinja")
    with pytest.raises(ManifestError, match=message):
        Manifest.read(pkg)


MESSAGES = [{"role": "system", "content": "Python"},  # the test pair's context: 128 tokens
            {"role": "user", "content": "Grüße: add"},
            {"role": "assistant", "content": "def add(a, b):"},
            {"role": "user", "content": [{"type": "text", "text": "and "},
                                         {"type": "text", "text": "sub"}]}]


def test_chat_renders_as_transformers_does_with_one_bos(chat_package, tmp_path):
    from transformers import AutoTokenizer

    from edgespec.runtime.chat_template import ChatTemplate

    pkg = tmp_path / "bos"  # a package whose tokenizer adds BOS to plain prompts
    with_manifest(chat_package, pkg, add_bos_token=True)
    pipe = edgespec.load(pkg)
    hf = AutoTokenizer.from_pretrained(pipe.manifest.source["target"])
    flat = [{**m, "content": "and sub"} if isinstance(m["content"], list) else m
            for m in MESSAGES]
    text = hf.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(flat, tokenize=True, add_generation_prompt=True)
    assert ChatTemplate.of_package(pkg, pipe.manifest).render(flat) == text

    with local(build_app(pipe)) as client:
        out = client.post("/v1/chat/completions", json={
            "model": "bos", "messages": MESSAGES, "temperature": 0, "max_tokens": 12}).json()
    assert "usage" in out, out
    assert out["usage"]["prompt_tokens"] == len(ids)  # the template's BOS, no second one
    assert out["object"] == "chat.completion"
    message = out["choices"][0]["message"]
    assert message == {"role": "assistant",
                       "content": pipe.generate(ids, max_new_tokens=12).text}


def test_chat_streams_deltas_and_refuses_what_its_template_refuses(chat_package):
    pipe = edgespec.load(chat_package)
    with local(build_app(pipe)) as client:
        body = {"model": "chat", "messages": MESSAGES[:2], "temperature": 0}
        whole = client.post("/v1/chat/completions", json=body).json()
        # chat's default max_tokens: the rest of the context window
        ids = client.post("/tokenize", json={"model": "chat", "messages": MESSAGES[:2]}).json()
        expected = pipe.generate(ids["tokens"], temperature=0,
                                 max_new_tokens=pipe.manifest.max_positions - ids["count"])
        assert whole["choices"][0]["message"]["content"] == expected.text
        assert whole["usage"]["completion_tokens"] == expected.stats.new_tokens
        with client.stream("POST", "/v1/chat/completions",
                           json={**body, "stream": True}) as response:
            events = sse_payloads(response)
        first, *chunks, finish, done = events
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == \
            whole["choices"][0]["message"]["content"]
        assert finish["choices"][0]["delta"] == {} and done == "[DONE]"
        assert finish["object"] == "chat.completion.chunk"

        refused = client.post("/v1/chat/completions", json={
            "model": "chat", "messages": [{"role": "tool", "content": "x"}]})
        # a tool's result, which this template has no format for: refused before it renders
        assert refused.status_code == 400 and "has no tool format" in refused.text
        for field, value in (("response_format", {"type": "xml"}),
                             ("tool_choice", "auto")):  # would change the output: refused
            refused = client.post("/v1/chat/completions", json={**body, field: value})
            assert refused.status_code == 400, field
            assert refused.json()["error"]["code"] == "unsupported_parameter"
        plain = client.post("/v1/chat/completions",
                            json={**body, "response_format": {"type": "text"}})
        assert plain.json()["choices"][0]["message"] == whole["choices"][0]["message"]
        for messages, param in (([], "messages"), ([{"role": "bob", "content": "x"}],
                                                   "messages[0].role"),
                                ([{"role": "user", "content": 1}], "messages[0].content")):
            response = client.post("/v1/chat/completions",
                                   json={"model": "chat", "messages": messages})
            assert response.status_code == 400 and response.json()["error"]["param"] == param


class Gate:
    """A TextStream stand-in that runs one round per release: a generation held open. Its
    rounds yield "x", or nothing with ``silent`` (special tokens, held-back text); like
    TextStream it ends at the round after ``cancel()``. ``ran``: set once a round has run."""

    def __init__(self, silent: bool = False):
        self.release, self.rounds, self.silent = threading.Semaphore(0), 0, silent
        self.cancelled, self.ran = threading.Event(), threading.Event()
        self.result = None

    def cancel(self):
        self.cancelled.set()

    def __iter__(self):
        while not self.cancelled.is_set():
            self.release.acquire()
            self.rounds += 1
            self.ran.set()
            if not self.silent:
                yield "x"


async def ran(gate: Gate) -> None:
    """Wait (10 s at most) until the worker thread has run one of the gate's rounds."""
    assert await asyncio.to_thread(gate.ran.wait, 10), "the generation never started"


def test_the_queue_admits_one_running_plus_queue_then_refuses():
    async def scenario():
        worker = Worker(queue=1)
        gates = [Gate(), Gate()]
        jobs = [worker.submit(g) for g in gates]
        with pytest.raises(Busy):
            worker.submit(Gate())
        assert worker.counts()["refused"] == 1
        for job in jobs:
            job.cancel()
        for g in gates:
            g.release.release()
        worker.close()
        return worker.counts()

    counts = asyncio.run(scenario())
    assert counts["cancelled"] == 2 and counts["running"] == counts["waiting"] == 0


def test_a_cancelled_job_stops_at_its_next_round():
    async def scenario():
        worker, gate = Worker(queue=0), Gate()
        job = worker.submit(gate)
        pieces = job.__aiter__()
        gate.release.release()
        assert await pieces.__anext__() == "x"
        await pieces.aclose()  # the client went away
        for _ in range(5):
            gate.release.release()
        worker.close()
        return gate.rounds, worker.counts()

    rounds, counts = asyncio.run(scenario())
    assert rounds <= 2 and counts["cancelled"] == 1  # at most the round already under way


def test_a_job_whose_rounds_make_no_text_is_still_cancelled_and_closed():
    """A client gone, or the server stopping, ends a generation whose rounds print nothing
    (e.g. special tokens after an ignored EOS) at its next round, not at the context's end."""
    async def scenario():
        worker, gate = Worker(queue=0), Gate(silent=True)
        job = worker.submit(gate)
        gate.release.release()
        await ran(gate)
        job.cancel()
        for _ in range(5):
            gate.release.release()
        worker.close()
        closing = Gate(silent=True)  # and close() alone ends a running silent generation
        second = Worker(queue=0)
        second.submit(closing)
        closing.release.release()
        await ran(closing)
        for _ in range(5):
            closing.release.release()
        second.close()
        return gate.rounds, closing.rounds, worker.counts(), second.counts()

    rounds, closed_rounds, counts, second = asyncio.run(scenario())
    assert rounds <= 2 and counts["cancelled"] == 1
    assert closed_rounds <= 2 and second["cancelled"] == 1


def test_a_cancelled_stream_ends_at_its_next_round(demo):
    stream = demo.stream(PROMPT, max_new_tokens=200, ignore_eos=True, temperature=0)
    stream.cancel()
    assert list(stream) == [] and stream.result.stats.finish_reason == "cancelled"
    assert stream.result.stats.new_tokens == 0
    stream = demo.stream(PROMPT, max_new_tokens=200, ignore_eos=True, temperature=0)
    for _ in stream:
        stream.cancel()
    assert stream.result.stats.finish_reason == "cancelled"
    assert 0 < stream.result.stats.new_tokens < 200


def test_a_full_queue_is_a_429_with_retry_after(demo):
    async def scenario():
        app = build_app(demo, ServeConfig(queue=0))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            body = {"model": "demo", "prompt": PROMPT, "temperature": 0}
            long = asyncio.create_task(http.post("/v1/completions", json={
                **body, "max_tokens": 400, "ignore_eos": True}))
            await until(lambda: app.state.server.worker.counts()["running"] == 1, "running")
            refused = await http.post("/v1/completions", json={**body, "max_tokens": 2})
            long = await long
        await app.state.server.text.close()  # no lifespan here: the child is ours to end
        return refused, long

    refused, long = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 400


def test_a_dropped_generation_ends_early_and_the_next_is_served(demo):
    async def scenario():
        app = build_app(demo)
        worker = app.state.server.worker
        stream = demo.stream(PROMPT, max_new_tokens=450, ignore_eos=True)
        job = worker.submit(stream)
        pieces = job.__aiter__()
        await pieces.__anext__()
        await pieces.aclose()
        await until(lambda: worker.counts()["cancelled"] == 1, "cancelled")
        after = await worker.submit(demo.stream(PROMPT, max_new_tokens=4,
                                                ignore_eos=True)).result()
        worker.close()
        return stream, after

    stream, after = asyncio.run(asyncio.wait_for(scenario(), timeout=60))  # a hang fails
    result = stream.result  # it never ran to its 450 tokens: it stopped at its next round
    assert result.stats.finish_reason == "cancelled" and result.stats.new_tokens < 450
    assert after.stats.new_tokens == 4 and after.stats.finish_reason == "max_new_tokens"


def test_serve_without_the_extra_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    result = CliRunner().invoke(main, ["serve"])
    assert result.exit_code == 1
    assert result.output.strip() == ('Error: edgespec serve needs the serve extra (uvicorn is '
                                      'missing): pip install "edgespec[serve]"')


def test_serve_refuses_bad_command_line_input_in_one_line(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        cases = {
            "in use": (["--port", port], "cannot listen on 127.0.0.1:"),
            "bad host": (["--host", "no-such-host.invalid"], "cannot listen on"),
            "no package": ([str(tmp_path / "missing"), "--port", 0], "is not a folder"),
        }
        for name, (args, message) in cases.items():
            result = CliRunner().invoke(main, ["serve", *map(str, args)])
            assert result.exit_code == 1, name
            lines = result.output.strip().splitlines()
            assert len(lines) == 1 and message in lines[0], (name, result.output)
    finally:
        taken.close()
